"""Project rules that code review alone would not keep: no torch in the core, no pickle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "chunkstore"


def test_the_core_never_imports_torch() -> None:
    code = ("import sys, chunkstore, chunkstore.cli, chunkstore.maintenance.verify,"
            " chunkstore.maintenance.rebuild\n"
            "import chunkstore.backends.local, chunkstore.backends.fsspec_backend\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    assert out.strip() == "[]"


def test_the_library_does_not_import_the_cli_toolkit() -> None:
    """A training job that imports chunkstore to save and restore does not pay for
    click (the command line's toolkit): a progress bar imports it when it draws."""
    code = ("import sys, chunkstore, torch_bridge\n"
            "print('CLICK' if 'click' in sys.modules else 'CLEAN')\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    assert out.strip() == "CLEAN"


def test_the_cli_lists_the_torch_commands_without_importing_torch() -> None:
    code = ("import sys\nfrom chunkstore.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'CLEAN')\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    assert "demo" in out and "export" in out and "plan" in out
    assert out.strip().endswith("CLEAN")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_of_the_core_imports_pickle_or_torch() -> None:
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 10
    offenders = {str(p.relative_to(PACKAGE)): sorted(_imported_modules(p) & {
        "pickle", "cPickle", "dill", "cloudpickle", "torch", "joblib", "shelve", "marshal"})
        for p in sources}
    assert {k: v for k, v in offenders.items() if v} == {}
