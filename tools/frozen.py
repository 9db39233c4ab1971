"""What every frozen-fixture builder does last (tools/make_*_fixture.py): drop the
index (a cache, not part of the format), record the BLAKE3 of every stored file in the
expectations, and write them beside the fixture as ``<name>.expected.json``; and the
command line they share (``--name``, ``--force``)."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3


def freeze(out: Path, expected: dict[str, Any]) -> None:
    """Finish the fixture at ``out``: ``expected`` gains ``files`` (path -> BLAKE3)."""
    shutil.rmtree(out / "index", ignore_errors=True)
    expected["files"] = {str(p.relative_to(out)): blake3.blake3(p.read_bytes()).hexdigest()
                         for p in sorted(out.rglob("*")) if p.is_file()}
    out.with_name(f"{out.name}.expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def run_builder(build: Callable[[str, bool], Path], default_name: str, doc: str) -> None:
    """A builder's command line: ``--name`` (``default_name``) and ``--force`` (rebuild
    a fixture that exists), the first line of ``doc`` as its description; prints where
    ``build(name, force)`` put the fixture."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--name", default=default_name)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    print(build(args.name, args.force))
