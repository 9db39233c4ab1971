"""A saving process for the crash tests: ``python tests/crash_child.py STORE FIRST [LAST]``.

Saves run ``crash`` at steps FIRST..LAST (forever without LAST), each with
:func:`make_state`, and prints ``saved <step> <version id>`` once a save has
returned.  The parent kills it (or ``CHUNKSTORE_FAULT`` makes it kill
itself) and then checks the store against :func:`make_state`.
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any

import numpy as np

import chunkstore

RUN = "crash"
#: Worker threads of the saving store: bounds how many writes are in flight at a kill.
THREADS = 4


def make_state(step: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and plain data saved at ``step``: deterministic, several chunks each.

    ``model.frozen`` is the same at every step (a dedup hit after the first
    save); ``model.embed`` changes in one row per step (a delta against
    the previous step's chunk); the rest changes, so every save writes new
    chunks and nodes.
    """
    frozen = np.random.default_rng(0).standard_normal(40_000).astype(np.float32)
    embed = np.random.default_rng(7).standard_normal((2000, 32)).astype(np.float32)
    for k in range(1, step + 1):
        embed[k * 37 % 2000] += np.float32(k)
    rng = np.random.default_rng(1000 + step)
    arrays = {
        "model.frozen": frozen,
        "model.embed": embed,
        "model.w": rng.standard_normal((200, 200)).astype(np.float32),
        "optim.m": rng.standard_normal(30_000),
        "optim.count": np.arange(50_000, dtype=np.int32) * step,
    }
    data = {"step": step, "lr": 0.1 / (step + 1), "history": (step, "x", b"\x00\xff")}
    return arrays, data


def save(store: chunkstore.Store, step: int) -> chunkstore.VersionInfo:
    arrays, data = make_state(step)
    with store.new_version(run=RUN, step=step, meta={"step": step}) as version:
        for name, array in arrays.items():
            version.put(name, array)
        version.put_data("trainer", data)
    return version.info


#: The tree layout's node size for the saves (tests/test_crash.py sets it).
NODE_SIZE_ENV_VAR = "CHUNKSTORE_TEST_NODE_SIZE"
#: "1": the saves pack their delta chunks (Store.pack_delta_chunks) into packs of
#: PACK_SIZE bytes, several per save; else every chunk is an object of its own.
PACK_DELTAS_ENV_VAR = "CHUNKSTORE_TEST_PACK_DELTAS"
PACK_SIZE = 128 * 1024


def open_store(path: str, node_size: int = 0) -> chunkstore.Store:
    """The store as the crash tests' saves use it (packing as the environment says)."""
    packed = os.environ.get(PACK_DELTAS_ENV_VAR) == "1"
    store = chunkstore.open(path, threads=THREADS, node_size=node_size, pack_size=PACK_SIZE,
                            create=True)
    store.pack_delta_chunks = packed
    return store


def main(argv: list[str]) -> None:
    path, first = argv[0], int(argv[1])
    steps = range(first, int(argv[2]) + 1) if len(argv) > 2 else itertools.count(first)
    # node_size 0 unless the test says: a node per branch of the names, so a save writes
    # several nodes and the tests can kill it between two of them.
    node_size = int(os.environ.get(NODE_SIZE_ENV_VAR, "0"))
    with open_store(path, node_size) as store:
        for step in steps:
            info = save(store, step)
            print(f"saved {step} {info.id}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
