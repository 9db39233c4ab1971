"""tools/fresh_clone_check.py still finds in README.md what it runs (its arguments and its
extraction only: the check itself clones, installs and takes minutes)."""

from __future__ import annotations

from pathlib import Path

from tools import fresh_clone_check as fcc

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
CPU_LINE = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def test_arguments() -> None:
    args = fcc.parse_args([])
    assert (args.repo, args.rev, args.with_tests, args.keep) == (REPO, "HEAD", False, False)
    args = fcc.parse_args(["--repo", "/r", "--rev", "abc", "--with-tests", "--keep"])
    assert (args.repo, args.rev, args.with_tests, args.keep) == (Path("/r"), "abc", True, True)


def test_the_readme_holds_what_the_check_runs() -> None:
    assert [fcc.command_of(line) for line in fcc.shell_lines(README, "## Two commands")] == [
        "./dev demo", "./dev test"]
    pages = fcc.example_pages((REPO / "tests" / "test_readme.py").read_text())
    assert pages[0] == "README.md"
    assert len(fcc.python_blocks(README)) >= 2


def test_the_torch_line_is_the_readmes_own_alternative_only_where_a_wheel_folder_has_it(
        tmp_path: Path) -> None:
    lines, how = fcc.library_commands(README, "")
    assert [fcc.command_of(line) for line in lines] == [
        CPU_LINE, "pip install '.[torch]'", "./dev wheel"]
    assert "as written" in how
    alternative = fcc.find_links_alternative(README)
    version = alternative.split("==", 1)[1]
    config = f"global.find-links='{tmp_path}'\n"
    assert fcc.command_of(fcc.library_commands(README, config)[0][0]) == CPU_LINE  # no wheel
    (tmp_path / f"torch-{version}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    lines, how = fcc.library_commands(README, config)
    assert [fcc.command_of(line) for line in lines] == [
        alternative, "pip install '.[torch]'", "./dev wheel"]
    assert str(tmp_path) in how
    assert fcc.find_links(":env:.find-links='/a /b'\nglobal.cert='/c'") == ["/a", "/b"]
