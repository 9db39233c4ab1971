"""One "machine" in the many-indexes tests: a process with its own index directory.

``python tests/machine_child.py URL INDEX_DIR OP [ARGS...] [-- OP [ARGS...]]...``; an
S3 URL uses the endpoint in ``CHUNKSTORE_TEST_S3_ENDPOINT``.  Several ops separated
by ``--`` run one after the other in this process (the machine doing several things
in a row), each opening the store afresh as a process of its own would.  Ops (each
prints one JSON line):

- ``save RUN STEP SEED``: save :func:`state` (SEED) as RUN@STEP; prints the id;
- ``rm SELECTOR``;
- ``gc GRACE_S [CLOCK_OFFSET_S]``: a GC whose clock runs CLOCK_OFFSET_S ahead;
- ``rebuild``; ``verify``;
- ``save-loop RUN SECONDS [UNTIL]``: save RUN@0, RUN@1, ... from a small pool of
  blocks (so saves deduplicate against each other and against removed
  versions), keeping the newest two; prints the ids that reported success;
- ``gc-loop SECONDS``: open the store afresh and ``gc(grace=0)`` in a loop, as
  a cron job would;
- ``rebuild-loop STOP REFUSED``: open the store afresh and rebuild its index in a
  loop until the file STOP exists, touching the file REFUSED when a rebuild is
  refused; prints each rebuild's outcome.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

import chunkstore
from chunkstore.errors import GcBusyError, SavesInProgressError

CHUNK_SIZE = 4096
POOL = 8


def state(seed: int) -> dict[str, np.ndarray]:
    """A small training state: one array unique to the seed, one shared by all seeds."""
    rng = np.random.default_rng(seed)
    shared = np.random.default_rng(10**6).standard_normal(3000).astype(np.float32)
    return {"model.own": rng.standard_normal(5000).astype(np.float32), "model.shared": shared}


def block(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 2**31, CHUNK_SIZE // 4, dtype=np.int32)


def loop_state(run: str, step: int) -> np.ndarray:
    rng = np.random.default_rng(step * 7919 + sum(map(ord, run)))
    return np.concatenate([block(int(i)) for i in rng.integers(0, POOL, 5)])


def open_store(url: str, index_dir: str) -> chunkstore.Store:
    options: dict[str, Any] = {}
    endpoint = os.environ.get("CHUNKSTORE_TEST_S3_ENDPOINT")
    if url.startswith("s3://") and endpoint:
        options = {"client_kwargs": {"endpoint_url": endpoint}}
    return chunkstore.open(url, chunk_size=None, index_dir=index_dir, storage_options=options,
                           create=True)


def save(store: chunkstore.Store, run: str, step: int, arrays: dict[str, np.ndarray]) -> str:
    with store.new_version(run, step) as version:
        for name, array in arrays.items():
            version.put(name, array)
    return version.info.id


def save_loop(url: str, index_dir: str, run: str, seconds: float, until: str | None = None
              ) -> list[str]:
    """Save for ``seconds``; with ``until``, go on (up to six times as long) until that
    file exists, so a test sees what it waits for however slow the machine is."""
    published = []
    with open_store(url, index_dir) as store:
        start = time.monotonic()
        step = 0
        while not _loop_done(time.monotonic() - start, seconds, until):
            published.append(save(store, run, step, {"w": loop_state(run, step)}))
            for info in store.versions(run)[:-2]:
                store.delete_listed(info.id)
            step += 1
    return published


def _loop_done(elapsed: float, seconds: float, until: str | None) -> bool:
    if elapsed >= 6 * seconds:
        return True
    return elapsed >= seconds and (until is None or os.path.exists(until))


def gc_loop(url: str, index_dir: str, seconds: float) -> dict[str, int]:
    deadline = time.monotonic() + seconds
    runs = deleted = 0
    while time.monotonic() < deadline:
        try:
            with open_store(url, index_dir) as store:
                result = store.gc(grace=0, session_wait=30)
        except GcBusyError:
            continue
        runs += 1
        deleted += result.chunks_deleted + result.orphans_deleted
    return {"runs": runs, "deleted": deleted}


def rebuild(store: chunkstore.Store) -> dict[str, Any]:
    try:
        return store.rebuild_index().to_json()
    except SavesInProgressError as exc:
        return {"refused": str(exc)}


def rebuild_loop(url: str, index_dir: str, stop: str, refused: str) -> list[dict[str, Any]]:
    outcomes = []
    while not os.path.exists(stop):
        with open_store(url, index_dir) as store:
            outcomes.append(rebuild(store))
        if "refused" in outcomes[-1]:
            with open(refused, "a"):
                pass
    return outcomes


def run_op(url: str, index_dir: str, op: str, args: list[str]) -> object:  # noqa: PLR0911
    if op == "rebuild-loop":
        return rebuild_loop(url, index_dir, args[0], args[1])
    if op == "save-loop":
        return save_loop(url, index_dir, args[0], float(args[1]),
                         args[2] if len(args) > 2 else None)
    if op == "gc-loop":
        return gc_loop(url, index_dir, float(args[0]))
    with open_store(url, index_dir) as store:
        if op == "save":
            return save(store, args[0], int(args[1]), state(int(args[2])))
        if op == "rm":
            return store.delete(args[0]).id
        if op == "gc":
            offset = float(args[1]) if len(args) > 1 else 0.0
            return store.gc(grace=float(args[0]), clock=lambda: time.time() + offset,
                            session_wait=30).to_json()
        if op == "rebuild":
            return rebuild(store)
        if op == "verify":
            result = store.verify()
            return {"ok": result.ok, "problems": [str(p) for p in result.problems]}
    raise SystemExit(f"unknown op {op!r}")


def split_ops(words: list[str]) -> list[list[str]]:
    """``OP ARGS -- OP ARGS ...`` -> one list per op."""
    ops: list[list[str]] = [[]]
    for word in words:
        if word == "--":
            ops.append([])
        else:
            ops[-1].append(word)
    return ops


if __name__ == "__main__":
    for op, *op_args in split_ops(sys.argv[3:]):
        print(json.dumps(run_op(sys.argv[1], sys.argv[2], op, op_args)), flush=True)
