"""A user's first day: a typo in a path or a run name never passes silently, and
reading never creates a store."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import chunkstore
from chunkstore.errors import NoStoreError, NotAStoreError

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from torch_bridge import Checkpointer, RunNotFoundWarning  # noqa: E402


def _model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 4))


def test_opening_a_path_that_holds_nothing_creates_nothing(tmp_path: Path) -> None:
    """chunkstore.open("nothere/").open_version("latest") made a store by reading it."""
    missing = tmp_path / "nothere"
    with pytest.raises(NoStoreError, match=r"no store at .*nothere: the directory does not"
                       r" exist") as raised:
        chunkstore.open(missing).open_version("latest")
    assert raised.value.url == str(missing)
    assert not missing.exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoStoreError, match="nothing is stored there"):
        chunkstore.open(tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a store")
    with pytest.raises(NotAStoreError, match=r"no chunkstore\.json") as other:
        chunkstore.open(tmp_path / "other")
    assert not isinstance(other.value, NoStoreError)
    with chunkstore.open(missing, create=True) as store:  # creating is asked for by name
        assert store.versions() == []
    with chunkstore.open(missing) as store:
        assert store.versions() == []


def test_a_restore_from_a_mistyped_path_says_there_is_no_store(tmp_path: Path) -> None:
    """Checkpointer("ref-stroe/", run="mine").restore(...) returned None without a word
    and created the directory: training started over."""
    model = _model()
    with Checkpointer(tmp_path / "ref-store", run="mine") as ckpt:
        ckpt.save(1, model=model)
    typo = tmp_path / "ref-stroe"
    with Checkpointer(typo, run="mine") as ckpt:
        with pytest.raises(NoStoreError, match=r"no store at .*ref-stroe.*nothing was"
                           r" restored.*missing_ok=True") as raised:
            ckpt.restore(model=model)
        assert raised.value.url == str(typo)
        assert ckpt.all_steps() == [] and ckpt.latest_step() is None
    assert not typo.exists()


def test_missing_ok_is_a_quiet_first_start_and_the_first_save_creates_the_store(
        tmp_path: Path) -> None:
    model = _model()
    path = tmp_path / "ckpts"
    with Checkpointer(path, run="mine") as ckpt, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.restore(model=model, missing_ok=True) is None
        assert not path.exists()
        ckpt.save(3, model=model)
        assert (path / "chunkstore.json").is_file()
        assert ckpt.restore(model=_model(1)) == 3
    with Checkpointer(path, run="other") as other, warnings.catch_warnings():
        warnings.simplefilter("error")  # a new run of a shared store, on purpose: quiet
        assert other.restore(model=model, missing_ok=True) is None
    with Checkpointer(path, run="mien") as typo:
        with pytest.warns(RunNotFoundWarning, match="run 'mien' has no version .* 'mine'"):
            assert typo.restore(model=model) is None


def test_a_store_created_elsewhere_after_the_checkpointer_is_found(tmp_path: Path) -> None:
    model = _model()
    path = tmp_path / "ckpts"
    reader = Checkpointer(path, run="mine")
    with Checkpointer(path, run="mine") as writer:
        writer.save(5, model=model)
    assert reader.restore(model=_model(1)) == 5
    reader.close()


def test_cli_read_commands_say_no_store_and_create_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "nothere"
    for command in (["log"], ["show", "latest"], ["report"], ["verify"], ["gc"]):
        proc = subprocess.run([sys.executable, "-m", "chunkstore", command[0], str(missing),
                               *command[1:]], capture_output=True, text=True, check=False)
        assert proc.returncode == 2, (command, proc.stderr)
        assert f"no store at {missing}" in proc.stderr, (command, proc.stderr)
        assert not missing.exists()


def _readme_training_loop() -> str:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", readme, re.S | re.M)
    return next(block for block in blocks if "from torch_bridge import Checkpointer" in block)


def _run_loop(code: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (cwd / "train.py").write_text(code)
    return subprocess.run([sys.executable, "train.py", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=240, check=False)


def test_the_readme_loop_keeps_its_typo_protection_on(tmp_path: Path) -> None:
    """The README's loop passed missing_ok=True on every start: a mistyped path or run
    name printed "starting at step 0" and trained from scratch into a new store or run.
    Only its `--first-start` may find nothing; any other start that does stops.  (Its
    first start and its restart, which resumes, tests/test_readme.py runs as written.)"""
    code = _readme_training_loop()
    fresh = _run_loop(code, tmp_path)
    assert fresh.returncode != 0, fresh.stdout
    assert "NoStoreError: no store at ckpts" in fresh.stderr, fresh.stderr
    assert "starting at step" not in fresh.stdout
    assert not (tmp_path / "ckpts").exists()
    assert 'run="exp1"' in code
    with Checkpointer(tmp_path / "ckpts", run="exp1") as first:  # what a first start left
        first.save(48, model=_model())
    typo = _run_loop(code.replace('run="exp1"', 'run="exp2"'), tmp_path)
    assert typo.returncode != 0, typo.stdout
    assert "RunNotFoundWarning" in typo.stderr and "'exp1'" in typo.stderr, typo.stderr
    assert "nothing to resume from" in typo.stderr
    assert "starting at step" not in typo.stdout
    with chunkstore.open(tmp_path / "ckpts") as store:
        assert {info.run for info in store.versions()} == {"exp1"}


def test_the_demos_next_steps_export_into_the_demos_folder() -> None:
    """`./dev demo` suggested `export demo-store demo@latest model.safetensors`, which
    wrote into the repository's root (git then showed it as a new file)."""
    dev = (Path(__file__).resolve().parent.parent / "dev").read_text()
    export = next(line for line in dev.splitlines() if "export $store" in line)
    out = export.split('"')[1].split()[-1]
    assert out.startswith("$store/") and out.endswith(".safetensors"), export
    assert "/demo-store/" in (Path(__file__).resolve().parent.parent / ".gitignore").read_text()
