"""What every frozen-fixture builder does last (tools/make_*_fixture.py): drop the
index (a cache, not part of the format), record the BLAKE3 of every stored file in the
expectations, and write them beside the fixture as ``<name>.expected.json``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import blake3


def freeze(out: Path, expected: dict[str, Any]) -> None:
    """Finish the fixture at ``out``: ``expected`` gains ``files`` (path -> BLAKE3)."""
    shutil.rmtree(out / "index", ignore_errors=True)
    expected["files"] = {str(p.relative_to(out)): blake3.blake3(p.read_bytes()).hexdigest()
                         for p in sorted(out.rglob("*")) if p.is_file()}
    out.with_name(f"{out.name}.expected.json").write_text(json.dumps(expected, indent=1) + "\n")
