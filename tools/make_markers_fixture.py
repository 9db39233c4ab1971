"""Build the frozen store that pins docs/format.md §17, publication and removal markers
(``tests/data/markers-v2``: marker layout 2, a folder per 100 s; ``markers-v1``, built
before, holds layout 1's 2.8-hour folders).

A plain store through the real operations: two saves of one run (a publication marker
each) and the removal of the first (its removal marker and tombstone; no GC, so both
stay).  Times are real, so a second run writes other names: the test reads the frozen
copy back; it never rebuilds it.  Never regenerate an existing fixture after a format
change: build ``--name markers-v3``.

``markers-vN.expected.json`` records the version ids, the marker names and the BLAKE3
of every stored file.

Usage (from the repository root)::

    python tools/make_markers_fixture.py [--name markers-v2] [--force]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import chunkstore
from chunkstore.objects.kinds import PUBLISHED

# tools/ is no package: its own folder on the path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from frozen import freeze, fresh_fixture, run_builder


def build(name: str, force: bool) -> Path:
    out = fresh_fixture(name, force)
    ids = []
    with chunkstore.open(out, create=True, chunk_size=64 * 1024) as store:
        for step in (1, 2):
            with store.new_version("mk", step, meta={"note": "markers fixture"}) as v:
                v.put("w", np.arange(1000, dtype=np.float32) * step)
            ids.append(v.info.id)
        store.delete("mk@1")
        markers = sorted(store.objects.ids(PUBLISHED))
    freeze(out, {"run": "mk", "versions": ids, "removed": [ids[0]], "markers": markers})
    return out


def main() -> None:
    run_builder(build, "markers-v2", __doc__)


if __name__ == "__main__":
    main()
