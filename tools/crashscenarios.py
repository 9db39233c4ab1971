"""The operations :mod:`tools.crashstates` explores, each on a small local store:
a save (packed small tensors, a delta against the run's previous version, plain
data), the same save into a store whose ``chunks/`` is another file system, a tag
and a removal, a prune and a GC after it, a GC that deletes, and a GC that repacks.

``python -m tools.crashscenarios [STATES_PER_OPERATION]`` records each, checks its
crash states and prints what it found (the tests in tests/test_power_loss.py run
the same with a smaller budget).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np

import chunkstore
from chunkstore.backends import local
from tools.crashcheck import Expectations, describe, explore
from tools.crashstates import Content, Recorder, Recording

RUN = "r"
CHUNK = 64 * 1024
PACK = 128 * 1024
#: "1": the scenarios' stores are encrypted (docs/format.md §13), their password taken from
#: CHUNKSTORE_PASSWORD by every open, the checks' included (tests/test_encryption.py).
ENCRYPT_ENV_VAR = "CHUNKSTORE_CRASH_ENCRYPT"


def content(step: int) -> Content:
    """A step's state: a 256 KiB table changed in one row per step (a delta against
    the previous step), small tensors that change (packed), one that never does, a 192 KiB one
    that changes whole (three chunks, packed), and plain data."""
    embed = np.random.default_rng(7).standard_normal((2048, 32)).astype(np.float32)
    for k in range(1, step + 1):
        embed[k * 37 % 2048] += np.float32(k)
    rng = np.random.default_rng(100 + step)
    arrays = {"embed": embed,
              "frozen": np.arange(3000, dtype=np.float32),
              "w": rng.standard_normal((60, 60)).astype(np.float32),
              "b": rng.standard_normal(500).astype(np.float32),
              "m": rng.standard_normal(48 * 1024).astype(np.float32)}
    return arrays, {"trainer": {"step": step, "lr": 0.5 / step}}


def open_store(root: Path) -> chunkstore.Store:
    return chunkstore.open(root, create=True, chunk_size=CHUNK, pack_size=PACK, threads=2,
                           encrypt=os.environ.get(ENCRYPT_ENV_VAR) == "1")


def save(store: chunkstore.Store, step: int, recorder: Recorder | None = None) -> str:
    arrays, data = content(step)
    with store.new_version(RUN, step) as version:
        for name, array in arrays.items():
            version.put(name, array)
        for name, value in data.items():
            version.put_data(name, value)
    if recorder is not None:
        recorder.mark(f"published {version.info.id}")
    return version.info.id


def _recorder(root: Path, store: chunkstore.Store,
              devices: dict[str, int] | None = None) -> Recorder:
    """A recorder of ``store`` at ``root``, its index copies beside the store."""
    return Recorder(str(root), store.index, str(root.parent / "index-copies"), devices)


Scenario = Callable[[Path], tuple[Recording, Expectations]]


def _setup(root: Path, steps: range) -> dict[str, Content]:
    with open_store(root) as store:
        return {save(store, step): content(step) for step in steps}


def record_save(root: Path) -> tuple[Recording, Expectations]:
    """Step 2 of a run whose step 1 is stored."""
    before = _setup(root, range(1, 2))
    with open_store(root) as store, _recorder(root, store) as recorder:
        version_id = save(store, 2, recorder)
    return recorder.recording, Expectations(before, {version_id: content(2)},
                                            redo=content(2))


def record_save_two_filesystems(root: Path) -> tuple[Recording, Expectations]:
    """Step 2, as :func:`record_save`, into a store whose ``chunks/`` (its chunk
    objects and packs) is a file system of its own, as a mount or a symlink to another
    device makes it: a syncfs of the root's file system leaves the chunks unsynced."""
    before = _setup(root, range(1, 2))
    with open_store(root) as store, _recorder(root, store, {"chunks": 1}) as recorder:
        version_id = save(store, 2, recorder)
    return recorder.recording, Expectations(before, {version_id: content(2)},
                                            redo=content(2))


def record_tag_and_remove(root: Path) -> tuple[Recording, Expectations]:
    """Tag step 2 ``best``, then remove step 1."""
    before = _setup(root, range(1, 3))
    first, second = before
    with open_store(root) as store, _recorder(root, store) as recorder:
        store.tag(second, "best")
        recorder.mark("tagged best")
        recorder.mark(f"removing {first}")
        store.delete(first)
    return recorder.recording, Expectations(before, tags={"best": second})


def record_gc(root: Path) -> tuple[Recording, Expectations]:
    """A GC that deletes what a removed step 1 alone needed (no repacking)."""
    before = _setup(root, range(1, 3))
    first = next(iter(before))
    with open_store(root) as store:
        store.delete(first)
    del before[first]
    with open_store(root) as store, _recorder(root, store) as recorder:
        result = store.gc(grace=0, repack_unused=None)
    assert result.chunks_deleted + result.nodes_deleted > 0, result
    return recorder.recording, Expectations(before)


def record_repack(root: Path) -> tuple[Recording, Expectations]:
    """A GC that repacks: steps 1-3 stored, 1 and 2 removed, their packs mostly garbage."""
    before = _setup(root, range(1, 4))
    first, second, _ = before
    with open_store(root) as store:
        store.delete(first)
        store.delete(second)
        store.gc(grace=0, repack_unused=None)  # the deletions alone, outside the recording
    del before[first], before[second]
    with open_store(root) as store, _recorder(root, store) as recorder:
        result = store.gc(grace=0, repack_unused=0.01)
    assert result.packs_repacked > 0, result
    return recorder.recording, Expectations(before)


def record_prune_and_gc(root: Path) -> tuple[Recording, Expectations]:
    """A prune of steps 1-3 of five (in bulk: the tombstones synced together, the
    records unlinked from threads, one directory fsync), then a GC that deletes what
    they alone needed: a record whose unlink a cut undid names objects gone."""
    before = _setup(root, range(1, 6))
    removed = list(before)[:3]
    with open_store(root) as store, _recorder(root, store) as recorder:
        for version_id in removed:
            recorder.mark(f"removing {version_id}")
        result = store.prune(keep_last=2)
        assert [v.id for v in result.removed] == removed, result
        recorder.mark("pruned")
        collected = store.gc(grace=0, repack_unused=None)
    assert collected.chunks_deleted + collected.nodes_deleted > 0, collected
    return recorder.recording, Expectations(before)


class _Abandoned(Exception):
    pass


def record_mixed_sync_save(root: Path) -> tuple[Recording, Expectations]:
    """Two writers of step 2's content: one batching its syncs (the default) gives up
    after writing its objects (they wait for a syncfs that never comes); the other,
    fsyncing object by object (``CHUNKSTORE_LOCAL_SYNC=file``, or a kernel before
    5.8), finds them stored, reuses them and publishes."""
    before = _setup(root, range(1, 2))
    arrays, data = content(2)
    with open_store(root) as store, _recorder(root, store) as recorder:
        store.pack_delta_chunks = False  # its chunks are objects, written as it goes
        with contextlib.suppress(_Abandoned), store.new_version(RUN, 2) as version:
            for name, array in arrays.items():
                version.put(name, array)
            version.put_data("trainer", data["trainer"])
            store.executor.submit(lambda: None).result()
            raise _Abandoned
        with mock.patch.dict(os.environ, {local.SYNC_ENV_VAR: "file"}), \
                chunkstore.open(root, chunk_size=CHUNK, pack_size=PACK, threads=2,
                                index_dir=str(root.parent / "other-index")) as other:
            assert not other.objects.backend.batch_sync  # type: ignore[attr-defined]
            other.pack_delta_chunks = False  # the same chunk objects: found stored
            version_id = save(other, 2, recorder)
    return recorder.recording, Expectations(before, {version_id: content(2)})


SCENARIOS: dict[str, Scenario] = {"save": record_save,
                                  "two-filesystem save":
                                  record_save_two_filesystems,
                                  "tag+rm": record_tag_and_remove,
                                  "prune+gc": record_prune_and_gc,
                                  "gc": record_gc, "repack": record_repack,
                                  "mixed-sync save": record_mixed_sync_save}


def main(argv: list[str]) -> int:
    limit = int(argv[0]) if argv else None
    found = 0
    for name, scenario in SCENARIOS.items():
        with tempfile.TemporaryDirectory() as tmp:
            recording, expectations = scenario(Path(tmp) / "store")
            report = explore(name, recording, expectations, Path(tmp) / "states",
                             limit=limit)
        print(report.summary())
        for state, problems in report.failures:
            found += 1
            print("  ", describe(recording, state))
            for problem in problems[:4]:
                print("     ", problem)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

