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

#: Where the frozen fixtures live.
DATA_DIR = Path(__file__).resolve().parent.parent / "tests" / "data"


def fresh_fixture(name: str, force: bool) -> Path:
    """The folder the fixture ``name`` is built in: absent, or removed first where
    ``force`` (never for a committed fixture; without it an existing one stops here)."""
    out = DATA_DIR / name
    if out.exists():
        if not force:
            raise SystemExit(f"{out} exists; pass --force (never for a committed fixture)")
        shutil.rmtree(out)
    return out


def freeze(out: Path, expected: dict[str, Any], keep_index: bool = False) -> None:
    """Finish the fixture at ``out``: ``expected`` gains ``files`` (path -> BLAKE3).
    ``keep_index``: the index's tables stay (``index/data.mdb``; its lock, reserve and
    writer lock go), for a fixture that pins how a release opens an older index."""
    if not keep_index:
        shutil.rmtree(out / "index", ignore_errors=True)
    else:
        for extra in ("lock.mdb", "reserve", "writer.lock"):
            (out / "index" / extra).unlink(missing_ok=True)
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
