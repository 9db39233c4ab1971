"""The README runs as written: every Python block executes (the README's, then those of the
docs pages it sends readers to for the rest), the CLI synopsis matches ``--help``, every
docs link resolves and every headline figure is one of docs/performance.md's."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import pytest

from chunkstore.cli import cli

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
#: The pages whose Python blocks run, in this order: the README, then the pages its
#: sections moved to (docs/s3.md and docs/recovery.md hold fragments that need a server or
#: an S3 bucket, not examples to run).
EXAMPLE_PAGES = ("README.md", "docs/distributed.md")
#: Pages that took whole sections of the README: each must be linked from it.
MOVED_PAGES = ("docs/distributed.md", "docs/guarantees.md", "docs/performance.md")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


PYTHON_BLOCKS = [code for page in EXAMPLE_PAGES
                 for code in _python_blocks((REPO / page).read_text())]
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _run(code: str, cwd: Path, *args: str) -> str:
    """Run ``code`` as a script in ``cwd`` with ``args``, as a user pasting it would; its
    stdout."""
    script = cwd / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    done = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"README block failed:\n{code}\n{done.stderr[-3000:]}"
    return done.stdout


def test_readme_has_the_examples() -> None:
    own = _python_blocks(README)
    assert len(own) >= 2
    assert any("import chunkstore" in block for block in own)
    assert any("from torch_bridge import" in block for block in own)
    assert any("ChunkStoreWriter" in block for block in PYTHON_BLOCKS)  # docs/distributed.md


def test_the_pages_the_readme_links_exist() -> None:
    """Every docs/ page the README links exists (with the section a link names), and
    every page that took a README section is linked from it."""
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", README)
    for page, anchor in links:
        assert (REPO / page).is_file(), page
        if anchor:
            headings = re.findall(r"^#+ (.*)$", (REPO / page).read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                     for h in headings}
            assert anchor in slugs, (page, anchor)
    assert set(MOVED_PAGES) <= {page for page, _ in links}


#: A figure: a decimal (0.049, 1.71x, 1.0-1.6x) or a span of milliseconds (83-629 ms).
FIGURE = re.compile(r"\d+\.\d+(?:-\d+\.\d+)?x?|\d+-\d+ ms")


def test_every_headline_figure_is_one_of_the_performance_page() -> None:
    """The README's figures are the measured ones: each appears in docs/performance.md,
    whose tables benchmarks/summarize.py writes from the results files."""
    section = README.split("## Performance", 1)[1].split("\n## ", 1)[0]
    performance = (REPO / "docs" / "performance.md").read_text()
    figures = FIGURE.findall(section)
    assert len(figures) >= 5
    assert [f for f in figures if f not in performance] == []


@pytest.mark.slow_job  # about 42 s of the suite's wall: ./dev test-slow (and CI) runs it
def test_the_python_blocks_run_in_order_in_one_directory_and_again() -> None:
    """As a user does: every block in order in one directory, then every block again (a
    resume example is run twice; the blocks share a directory).  The training loop
    starts at step 0 with the README's `--first-start`, and on the second run, without
    it, restores step 48 with nothing left to do."""
    assert "`python train.py --first-start`" in README and "then `python train.py`" in README
    blocks = [code for code in PYTHON_BLOCKS if HAS_TORCH or "torch" not in code]
    with tempfile.TemporaryDirectory() as directory:
        for round_ in ("first", "second"):
            for code in blocks:
                args = ("--first-start",) if round_ == "first" and "--first-start" in code else ()
                out = _run(code, Path(directory), *args)
                if "starting at step" in code:
                    expected = 0 if round_ == "first" else 48
                    assert f"starting at step {expected}" in out, (round_, out)


# --- the synopsis of the "Command line" section -------------------------------------------

OPTION = re.compile(r"(?<![\w-])(--?[a-z][a-z-]*)")


def _synopsis() -> dict[str, set[str]]:
    """Command path ("gc", "index rebuild") -> the options its synopsis lines name."""
    section = README.split("## Command line", 1)[1]
    block = section.split("```", 2)[1]
    commands: dict[str, set[str]] = {}
    current = ""
    for line in block.splitlines():
        if line.startswith("chunkstore "):
            words = line.split()[1:]
            current = words[0]
            group = cli.get_command(click.Context(cli), current)
            if isinstance(group, click.Group):
                current = f"{current} {words[1]}"
            commands[current] = set()
        if current:
            commands[current] |= set(OPTION.findall(line))
    return commands


def _commands() -> dict[str, click.Command]:
    found: dict[str, click.Command] = {}
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        command = cli.get_command(ctx, name)
        assert command is not None, name
        if command.hidden:  # internal (drill-restore, the process a drill starts)
            continue
        if isinstance(command, click.Group):
            sub_ctx = click.Context(command, parent=ctx)
            for sub in command.list_commands(sub_ctx):
                sub_command = command.get_command(sub_ctx, sub)
                assert sub_command is not None
                found[f"{name} {sub}"] = sub_command
        else:
            found[name] = command
    return found


def test_synopsis_lists_every_command() -> None:
    assert set(_synopsis()) == set(_commands())


@pytest.mark.parametrize("name", sorted(_commands()))
def test_synopsis_matches_help(name: str) -> None:
    """Every option ``--help`` shows appears in the synopsis, and no other."""
    written = _synopsis()[name]
    options = [p for p in _commands()[name].params
               if isinstance(p, click.Option) and not p.hidden and "--help" not in p.opts]
    missing = [p.opts[0] for p in options if not written & {*p.opts, *p.secondary_opts}]
    known = {opt for p in options for opt in (*p.opts, *p.secondary_opts)}
    assert not missing, f"README synopsis of `chunkstore {name}` lacks {missing}"
    assert written <= known, f"README names options `chunkstore {name}` lacks: {written - known}"
