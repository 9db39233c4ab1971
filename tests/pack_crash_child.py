"""A saving process for the packed crash tests:
``python tests/pack_crash_child.py STORE FIRST LAST``.

Saves run ``crash`` at steps FIRST..LAST with :func:`make_state`: many small
tensors, most unchanged between steps (members reused from older packs), some
changed, with a small pack size so that each save writes several packs.
``CHUNKSTORE_FAULT`` makes it kill itself at a chosen write.
"""

from __future__ import annotations

import sys

import numpy as np

import chunkstore

RUN = "crash"
PACK_SIZE = 16 * 1024


def make_state(step: int) -> dict[str, np.ndarray]:
    """60 small tensors of 1-4 KiB: 40 fixed, 20 changed every step, and one big one."""
    state: dict[str, np.ndarray] = {
        f"fixed.{i}": np.random.default_rng(i).standard_normal(256 + 8 * i).astype(np.float32)
        for i in range(40)}
    rng = np.random.default_rng(1000 + step)
    state.update({f"moving.{i}": rng.integers(0, 2**31, 300 + i, dtype=np.int32)
                  for i in range(20)})
    state["big"] = np.arange(100_000, dtype=np.float32) * step  # an object of its own
    return state


def main(argv: list[str]) -> None:
    path, first, last = argv[0], int(argv[1]), int(argv[2])
    with chunkstore.open(path, chunk_size=64 * 1024, threads=4, pack_size=PACK_SIZE,
                         create=True) as store:
        for step in range(first, last + 1):
            with store.new_version(run=RUN, step=step, meta={"step": step}) as version:
                for name, array in make_state(step).items():
                    version.put(name, array)
            print(f"saved {step} {version.info.id}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
