"""Build the frozen store whose index was written by a release of index schema 4
(``tests/data/index-v4``), which pins how this release brings an older index to its
own schema in place (chunkstore/index/lmdbindex.py, ``_migrate``; docs/format.md, the
index): the store's objects and ``index/data.mdb`` as that release left them.

Three saves of one run share one tensor (its chunks are counted by all three) and
change another.  Run it with the code of that release first on the path, e.g. a
worktree of 0c143a3::

    PYTHONPATH=/path/to/checkout-0c143a3 python tools/make_index_fixture.py [--name index-v4]

``index-v4.expected.json`` records the schema, the index's id, the version ids and
the BLAKE3 of every stored file.  The index is otherwise a cache, left out of every
other fixture (tools/frozen.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import chunkstore
from chunkstore.index.lmdbindex import INDEX_SCHEMA

# tools/ is no package: its own folder on the path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from frozen import freeze, fresh_fixture, run_builder


def build(name: str, force: bool) -> Path:
    out = fresh_fixture(name, force)
    shared = np.arange(20_000, dtype=np.float32)
    ids = []
    with chunkstore.open(out, create=True, chunk_size=64 * 1024) as store:
        for step in (1, 2, 3):
            with store.new_version("ix", step, meta={"note": "index fixture"}) as v:
                v.put("shared", shared)
                v.put("w", np.arange(1000, dtype=np.float32) * step)
            ids.append(v.info.id)
        index_id = store.index.identity()
    freeze(out, {"index_schema": INDEX_SCHEMA, "index_id": index_id, "run": "ix",
                 "versions": ids}, keep_index=True)
    return out


def main() -> None:
    run_builder(build, "index-v4", __doc__)


if __name__ == "__main__":
    main()
