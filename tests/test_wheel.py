"""chunkstore as a library, as README.md's "As a library" installs it: `./dev wheel` builds
a wheel that installs into a fresh environment and works there (both packages, the
`chunkstore` command), and no hint anywhere names a package that no index serves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
#: PyTorch's CPU build, which the README installs first: plain `pip install torch` (or a
#: `[torch]` extra on a machine without torch) takes the CUDA build, about 3 GB.
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"

#: What the fresh environment runs: both packages from the wheel (not from this checkout,
#: whose editable install the dev environment holds), the command line, torch_bridge's
#: commands and a save and restore through the Checkpointer.
CHECK = """
import os, sys, tempfile
import chunkstore, torch_bridge
from chunkstore.codecs import native
prefix = os.path.realpath(sys.prefix)
for module in (chunkstore, torch_bridge):
    assert os.path.realpath(module.__file__).startswith(prefix), module.__file__
import torch
from torch_bridge import Checkpointer
model = torch.nn.Linear(4, 2)
with tempfile.TemporaryDirectory() as where, Checkpointer(where + "/ckpts", run="w") as ckpt:
    ckpt.save(1, model=model)
    assert ckpt.restore(model=torch.nn.Linear(4, 2)) == 1
print("native", native.NATIVE)
"""


def _fresh_environment(root: Path, wheel: Path) -> Path:
    """A new virtual environment holding the wheel alone, then given the dev environment's
    packages (torch's CPU build among them) behind its own, so nothing is downloaded."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=120)
    python = root / "bin" / "python"
    # The wheel alone (--no-deps, --no-index): nothing is resolved or downloaded, and the
    # dev environment, not visible yet, is left alone.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--quiet", "--disable-pip-version-check", "--no-deps", "--no-index",
                    str(wheel)], check=True, timeout=300)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True, text=True,
                          timeout=60).stdout.strip()
    # A path in a .pth file joins sys.path after the environment's own site-packages, and
    # the .pth files in it are not run: the dev environment's editable install of this
    # checkout stays out, its dependencies come in.
    (Path(site) / "dev_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.mark.slow_job  # pip building and installing a wheel: packaging, ./dev test-slow
def test_dev_wheel_installs_into_a_fresh_environment(tmp_path: Path) -> None:
    out = tmp_path / "dist"
    env = {**os.environ, "CHUNKSTORE_VENV": sys.prefix}
    built = subprocess.run(["bash", str(REPO / "dev"), "wheel", str(out)], env=env,
                           capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr
    wheels = list(out.glob("chunkstore_ckpt-*.whl"))
    assert len(wheels) == 1, wheels
    assert CPU_TORCH in built.stderr and f"pip install '{wheels[0]}[torch]'" in built.stderr
    python = _fresh_environment(tmp_path / "fresh", wheels[0])
    clean = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    checked = subprocess.run([str(python), "-c", CHECK], cwd=tmp_path, env=clean,
                             capture_output=True, text=True, timeout=240, check=False)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.split()[-2] == "native"
    command = python.parent / "chunkstore"
    helped = subprocess.run([str(command), "--help"], cwd=tmp_path, env=clean,
                            capture_output=True, text=True, timeout=120, check=False)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("Usage: chunkstore")
    planned = subprocess.run([str(command), "plan", "--save-seconds", "2", "--mtbf", "6"],
                             cwd=tmp_path, env=clean, capture_output=True, text=True,
                             timeout=120, check=False)
    assert planned.returncode == 0 and "save every" in planned.stdout, planned.stderr


def test_the_readme_installs_with_commands_that_work() -> None:
    """The library section installs from a clone or from `./dev wheel`'s wheel, CPU torch
    first; the name on the package index ("chunkstore") is another project."""
    section = README.split("### As a library", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert CPU_TORCH in commands
    assert "pip install '.[torch]'" in commands
    assert "./dev wheel" in commands
    assert commands.index(CPU_TORCH) < commands.index("pip install '.[torch]'")


#: What no index serves: the distribution's name as a thing to install.
UNSERVED = re.compile(r"pip install '?chunkstore-ckpt|chunkstore-ckpt\[")


def test_no_hint_names_a_package_no_index_serves() -> None:
    """Error hints and docs said `pip install 'chunkstore-ckpt[export]'`, which fails on
    every machine: this project is on no package index."""
    places = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for package in ("chunkstore", "torch_bridge"):
        places += sorted((REPO / package).rglob("*.py"))
    found = [f"{path.relative_to(REPO)}: {match}" for path in places
             for match in UNSERVED.findall(path.read_text())]
    assert found == []
