"""README.md's commands, run on a fresh clone (issue 48): what a new user types, as written.

    python3 tools/fresh_clone_check.py [--repo PATH] [--rev REV] [--with-tests] [--keep]

Needs python3 (3.10 or newer), git and the package index (PyPI, or what pip is
configured with).  In a new temporary directory it

1. clones the repository (default: the one this script lives in) and checks out REV
   (default HEAD): committed files only, not the working tree;
2. runs the README's "Two commands" from the clone's root: ``./dev demo`` (which sets up
   ``.venv`` from scratch) and, with ``--with-tests`` (minutes), ``./dev test``;
3. makes a fresh virtual environment outside the clone and, activated, runs the
   "As a library" install commands from the clone's root, each line as the README gives
   it (read from the clone's README.md at run time, not written here).  The one exception
   is the README's own: where pip's configuration points at a wheel folder (find-links)
   holding torch's CPU build, the README says ``pip install torch==X`` takes it from there
   instead of the CPU-index line, and that line is run instead (the script says which);
4. with the fresh environment's python, in a working directory outside the clone, runs
   every Python block that tests/test_readme.py runs (the pages its ``EXAMPLE_PAGES``
   names, extracted as it extracts them), in order, twice, as that test does (the
   training loop with ``--first-start`` the first time, then resuming at step 48), then
   ``chunkstore --help`` and ``chunkstore demo DIR/demo-store``.

Each step prints its time; the last line is PASS or FAIL.  A failing step shows the tail
of its output (the whole output is in the step's log, kept with ``--keep``).  Exit
status: 0 all passed, 1 a step failed, 2 the README no longer holds what this script
looks for.
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: The pages whose Python blocks tests/test_readme.py runs, where its EXAMPLE_PAGES
#: cannot be read (it is read from the clone's copy of that test).
DEFAULT_PAGES = ("README.md", "docs/distributed.md")
#: What the README's "Where pip is pointed at a wheel folder" sentence says to run
#: instead of its CPU-index torch line.
ALTERNATIVE = re.compile(r"`(pip install torch==[^`\s]+)`\s+takes\s+it\s+from\s+there\s+"
                         r"instead\s+of\s+the\s+first\s+line")
TAIL_LINES = 60


class ReadmeError(Exception):
    """The README (or test_readme.py) no longer holds what this script reads from it."""


class StepFailed(Exception):
    """A step exited non-zero, timed out or printed something other than expected."""


# --- what is read from the clone ------------------------------------------------------------


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a page, as tests/test_readme.py extracts them."""
    return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


def example_pages(test_readme_source: str) -> tuple[str, ...]:
    """The pages tests/test_readme.py runs the Python blocks of: its ``EXAMPLE_PAGES``."""
    for node in ast.parse(test_readme_source).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "EXAMPLE_PAGES"):
            pages = ast.literal_eval(node.value)
            if isinstance(pages, tuple) and all(isinstance(p, str) for p in pages):
                return pages
    raise ReadmeError("tests/test_readme.py has no EXAMPLE_PAGES tuple of page names")


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line, "## Two commands") up to the next
    heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    match = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^#{{1,{len(level)}}} |\Z)", text,
                      re.S | re.M)
    if match is None:
        raise ReadmeError(f"README.md has no section {heading!r}")
    return match.group(1)


def shell_lines(text: str, heading: str) -> list[str]:
    """The lines of the first ```sh block under ``heading``, each as written (comments too:
    the shell ignores them)."""
    block = re.search(r"^```sh\n(.*?)^```$", section(text, heading), re.S | re.M)
    if block is None:
        raise ReadmeError(f"README.md's section {heading!r} has no ```sh block")
    return [line.rstrip() for line in block.group(1).splitlines() if line.strip()]


def command_of(line: str) -> str:
    """A shell line without its trailing comment."""
    return line.split("#", 1)[0].strip()


def is_torch_line(line: str) -> bool:
    """The line that installs torch itself (not ``pip install '.[torch]'``)."""
    return command_of(line).split()[:3] == ["pip", "install", "torch"]


def find_links_alternative(readme: str) -> str:
    """The command the README gives in place of its CPU-index line where pip has a wheel
    folder: ``pip install torch==2.13.0``."""
    match = ALTERNATIVE.search(readme)
    if match is None:
        raise ReadmeError("README.md no longer says which `pip install torch==...` takes "
                          "torch's CPU build from pip's wheel folder")
    return match.group(1)


def find_links(config_list: str) -> list[str]:
    """The folders and pages ``pip config list`` names as find-links (any scope)."""
    found: list[str] = []
    for line in config_list.splitlines():
        key, _, value = line.partition("=")
        if key.rsplit(".", 1)[-1] == "find-links":
            found += value.strip().strip("'\"").split()
    return found


def cpu_wheel_folder(folders: Sequence[str], version: str) -> str | None:
    """The find-links folder holding torch ``version``'s CPU build, if any."""
    for folder in folders:
        path = folder.removeprefix("file://")
        if os.path.isdir(path) and glob.glob(os.path.join(path, f"torch-{version}+cpu-*.whl")):
            return folder
    return None


def library_commands(readme: str, pip_config: str) -> tuple[list[str], str]:
    """The "As a library" lines to run, and a sentence saying how torch is installed."""
    lines = shell_lines(readme, "### As a library")
    torch_lines = [line for line in lines if is_torch_line(line)]
    if len(torch_lines) != 1:
        raise ReadmeError(f"expected one torch line in the install block, found {torch_lines}")
    alternative = find_links_alternative(readme)
    version = alternative.split("==", 1)[1]
    folder = cpu_wheel_folder(find_links(pip_config), version)
    if folder is None:
        return lines, f"torch: the README's first line, as written: {torch_lines[0]}"
    chosen = [alternative if is_torch_line(line) else line for line in lines]
    return chosen, (f"torch: `{alternative}` (pip's find-links {folder} holds torch "
                    f"{version}+cpu; the README says that line replaces its first)")


# --- running steps ----------------------------------------------------------------------------


@dataclass
class Steps:
    """Runs commands as named steps, each timed and logged to a file of its own."""

    logs: Path
    done: list[tuple[str, float, bool]] = field(default_factory=list)

    def run(self, name: str, argv: Sequence[str], *, cwd: Path, env: dict[str, str],
            timeout: float, check: Callable[[str], str | None] | None = None) -> str:
        """Run ``argv``; its output (stdout and stderr together).  Raises StepFailed."""
        log = self.logs / f"{len(self.done) + 1:02d}.log"
        print(f"[{len(self.done) + 1:2d}] {name} ...", flush=True)
        start = time.monotonic()
        problem = None
        with log.open("w+") as out:
            proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its whole group: ./dev test's shards
                rc = proc.wait()
                problem = f"timed out after {timeout:.0f} s"
            out.seek(0)
            output = out.read()
        seconds = time.monotonic() - start
        if problem is None and rc != 0:
            problem = f"exit status {rc}"
        if problem is None and check is not None:
            problem = check(output)
        self.done.append((name, seconds, problem is None))
        print(f"     {'ok' if problem is None else 'FAILED'} in {seconds:.1f} s", flush=True)
        if problem is not None:
            tail = "\n".join(output.splitlines()[-TAIL_LINES:])
            print(f"     $ {' '.join(argv)}\n     (in {cwd})\n     {problem}; the last "
                  f"{TAIL_LINES} lines of its output ({log}):\n{tail}", flush=True)
            raise StepFailed(name)
        return output

    def summary(self) -> str:
        lines = [f"  {seconds:7.1f} s  {'ok    ' if ok else 'FAILED'}  {name}"
                 for name, seconds, ok in self.done]
        total = sum(seconds for _, seconds, _ in self.done)
        return "\n".join([*lines, f"  {total:7.1f} s  in all"])


def expect(*needles: str) -> Callable[[str], str | None]:
    """A check: the output holds every one of ``needles``."""
    def check(output: str) -> str | None:
        missing = [n for n in needles if n not in output]
        return f"its output lacks {missing}" if missing else None
    return check


def base_environment() -> dict[str, str]:
    """This process's environment as a fresh shell's: no virtual environment active (a
    PATH entry inside one is dropped), no PYTHONPATH, no CHUNKSTORE_ settings.  pip's own
    settings (PIP_*: find-links, index) stay, as the machine's configuration."""
    env = {key: value for key, value in os.environ.items()
           if key not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONWARNINGS"}
           and not key.startswith("CHUNKSTORE_")}
    path = [entry for entry in env.get("PATH", "").split(os.pathsep)
            if entry and not (Path(entry).parent / "pyvenv.cfg").exists()]
    env["PATH"] = os.pathsep.join(path)
    return env


def activated(env: dict[str, str], venv: Path) -> dict[str, str]:
    """``env`` after ``source VENV/bin/activate``."""
    return {**env, "VIRTUAL_ENV": str(venv),
            "PATH": os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])}


# --- the check ------------------------------------------------------------------------------

#: The fresh environment imports both packages from its own site-packages (not the clone).
IMPORTS = """
import os, sys
import chunkstore, torch, torch_bridge
from chunkstore.codecs import native
prefix = os.path.realpath(sys.prefix)
for module in (chunkstore, torch_bridge):
    assert os.path.realpath(module.__file__).startswith(prefix), module.__file__
print("chunkstore", chunkstore.__file__, "native", native.NATIVE, "torch", torch.__version__)
"""


@dataclass
class Check:
    args: argparse.Namespace
    root: Path
    steps: Steps

    @property
    def clone(self) -> Path:
        return self.root / "clone"

    def run(self) -> None:
        base = base_environment()
        if self.args.no_pip_cache:
            base["PIP_NO_CACHE_DIR"] = "1"
        self.clone_repository(base)
        readme = (self.clone / "README.md").read_text()
        self.two_commands(readme, base)
        venv = self.root / "venv"
        self.steps.run(f"{self.args.python} -m venv {venv}",
                       [self.args.python, "-m", "venv", str(venv)],
                       cwd=self.root, env=base, timeout=300)
        fresh = activated(base, venv)
        self.install(readme, fresh, venv)
        self.examples(fresh, venv)

    def clone_repository(self, env: dict[str, str]) -> None:
        repo = self.args.repo
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify",
                              f"{self.args.rev}^{{commit}}"], check=True, text=True,
                             capture_output=True).stdout.strip()
        self.steps.run(f"git clone {repo} (at {sha[:12]})",
                       ["git", "clone", "--quiet", str(repo), str(self.clone)],
                       cwd=self.root, env=env, timeout=600)
        subject = self.steps.run(f"git checkout --detach {sha[:12]}", [
            "bash", "-c", f"git checkout --quiet --detach {sha} && git log -1 --format=%s"],
            cwd=self.clone, env=env, timeout=120)
        print(f"     {sha[:12]} {subject.strip()[:100]}")

    def two_commands(self, readme: str, env: dict[str, str]) -> None:
        lines = shell_lines(readme, "## Two commands")
        for wanted in ("./dev demo", "./dev test"):
            if wanted not in [command_of(line) for line in lines]:
                raise ReadmeError(f"README.md's two commands no longer include {wanted!r}")
        for line in lines:
            command = command_of(line)
            if command == "./dev test" and not self.args.with_tests:
                print(f"     (skipped: {command}; --with-tests runs it)")
                continue
            check = expect("Try next") if command == "./dev demo" else None
            self.steps.run(command, ["bash", "-c", line], cwd=self.clone, env=env,
                           timeout=3600, check=check)
            if command == "./dev demo" and not (self.clone / "demo-store" /
                                                "chunkstore.json").exists():
                raise StepFailed("./dev demo left no ./demo-store")

    def install(self, readme: str, env: dict[str, str], venv: Path) -> None:
        config = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "config", "list"],
                                env=env, text=True, capture_output=True, check=True).stdout
        lines, how = library_commands(readme, config)
        print(f"     {how}")
        for line in lines:
            self.steps.run(f"(venv) {line}", ["bash", "-euo", "pipefail", "-c", line],
                           cwd=self.clone, env=env, timeout=3600)
            if command_of(line) == "./dev wheel":
                wheels = sorted((self.clone / "dist").glob("chunkstore_ckpt-*.whl"))
                if not wheels:
                    raise StepFailed("./dev wheel wrote no dist/chunkstore_ckpt-*.whl")
                print(f"     built {wheels[-1].relative_to(self.clone)}")

    def examples(self, env: dict[str, str], venv: Path) -> None:
        python = str(venv / "bin" / "python")
        work = self.root / "work"
        work.mkdir()
        out = self.steps.run("the fresh environment imports its own chunkstore",
                             [python, "-c", IMPORTS], cwd=work, env=env, timeout=300)
        print(f"     {out.strip().splitlines()[-1]}")
        pages = example_pages((self.clone / "tests" / "test_readme.py").read_text())
        blocks = [(page, number, code) for page in pages
                  for number, code in enumerate(python_blocks((self.clone / page).read_text()),
                                                1)]
        print(f"     {len(blocks)} Python blocks from {', '.join(pages)}")
        script = work / "example.py"
        block_env = {**env, "PYTHONWARNINGS": "error"}
        for round_ in (1, 2):
            for page, number, code in blocks:
                script.write_text(code)
                args = ["--first-start"] if round_ == 1 and "--first-start" in code else []
                check = None
                if "starting at step" in code:
                    check = expect(f"starting at step {0 if round_ == 1 else 48}")
                self.steps.run(f"round {round_}: {page} block {number} {' '.join(args)}".strip(),
                               [python, str(script), *args], cwd=work, env=block_env,
                               timeout=240, check=check)
        command = str(venv / "bin" / "chunkstore")
        self.steps.run("chunkstore --help", [command, "--help"], cwd=work, env=env,
                       timeout=120, check=expect("Usage: chunkstore"))
        store = self.root / "demo-store"
        self.steps.run(f"chunkstore demo {store}", [command, "demo", str(store)], cwd=work,
                       env=env, timeout=1800)
        if not (store / "chunkstore.json").exists():
            raise StepFailed(f"chunkstore demo left no store in {store}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    here = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(
        description="Run README.md's install and example commands on a fresh clone.")
    parser.add_argument("--repo", type=Path, default=here,
                        help="the repository to clone (default: the one this script is in)")
    parser.add_argument("--rev", default="HEAD", help="the commit to check out (default HEAD)")
    parser.add_argument("--with-tests", action="store_true",
                        help="also run `./dev test` (the whole suite: minutes)")
    parser.add_argument("--python", default="python3",
                        help="the interpreter that makes the fresh environment (python3)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary directory (clone, environments, logs)")
    parser.add_argument("--no-pip-cache", action="store_true",
                        help="PIP_NO_CACHE_DIR=1: every package downloaded again")
    parser.add_argument("--tmp", type=Path, default=None,
                        help="where the temporary directory goes (default: the system's)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="chunkstore-fresh-", dir=args.tmp))
    (root / "logs").mkdir()
    steps = Steps(root / "logs")
    print(f"fresh-clone check of {args.repo} in {root}", flush=True)
    status, verdict = 1, "FAIL"
    start = time.monotonic()
    try:
        Check(args, root, steps).run()
        status, verdict = 0, "PASS"
    except StepFailed as failed:
        verdict = f"FAIL ({failed})"
    except ReadmeError as error:
        print(f"     {error}")
        status, verdict = 2, f"FAIL (README: {error})"
    except subprocess.CalledProcessError as error:
        print(f"     {error}\n{error.stderr}")
        verdict = f"FAIL ({' '.join(map(str, error.cmd))})"
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\nsteps:\n{steps.summary()}")
    if args.keep:
        print(f"kept: {root}")
    print(f"{verdict} in {time.monotonic() - start:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
