"""The index write transactions of a save (each commits with a sync of the index file,
so their number is a cost every save pays), and the safety of what was merged.

Counted by LMDB itself: ``env.info()["last_txnid"]`` moves by one per committed write
transaction (one that changed nothing commits nothing), from any code path."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

import chunkstore
from chunkstore.index.lmdbindex import CHUNK, ChunkState
from chunkstore.objects.kinds import CHUNKS

#: A save of the scale benchmark's shape (benchmarks/bench_scale.py): 20 small tensors,
#: one changed per save: its session stored with the claims of its small chunks, the
#: last pack claimed with the nodes, the count-in.
SAVE_TRANSACTIONS = 3


def small_state(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {f"t{i}": rng.standard_normal(1024).astype(np.float32) for i in range(20)}
    arrays[f"t{step % 20}"] += step
    return arrays


def committed(store: chunkstore.Store) -> int:
    return int(store.index.env.info()["last_txnid"])


def test_a_save_makes_three_index_write_transactions(tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "store", create=True) as store:
        made = []
        for step in range(4):
            before = committed(store)
            with store.new_version(run="r", step=step) as version:
                for name, array in small_state(step).items():
                    version.put(name, array)
                version.put_data("trainer", {"step": step})
            made.append(committed(store) - before)
        assert max(made[1:]) <= SAVE_TRANSACTIONS, made  # the first one makes the run's
        assert store.verify().ok
        for step in range(4):
            read = store.open_version(f"r@{step}")
            assert all(np.array_equal(read.get(n), a) for n, a in small_state(step).items())


def test_a_save_that_claims_nothing_stores_no_session(tmp_path: Path) -> None:
    """A deferred session is stored only with a claim: a save given up before any leaves
    nothing in the index for GC to expire, and no transaction."""
    with chunkstore.open(tmp_path / "store", create=True) as store:
        before = committed(store)
        version = store.new_version(run="r", step=1)
        version.put("w", np.zeros(16, np.float32))  # small: claimed with its batch, at commit
        version.abort()
        assert committed(store) == before
        assert store.index.list_sessions() == {}


def test_the_last_pack_claimed_with_the_nodes_resurrects_a_condemned_copy(
        tmp_path: Path) -> None:
    """The last pack a commit seals is claimed in the nodes' transaction: a copy of it
    GC condemned (and, as a power cut can leave it, already unlinked) is claimed back
    before the version's record is stored, so GC's re-check before deleting says no, and
    the pack is written again, not trusted."""
    store_path = tmp_path / "store"
    with chunkstore.open(store_path, create=True) as store:
        arrays = small_state(1)
        with store.new_version(run="r", step=1) as first:
            for name, array in arrays.items():
                first.put(name, array)
        (pack,) = store.index.version_refs(first.info.id)  # every small tensor in one pack
        store.delete(first.info.id)
        before = time.time() + 3600
        assert store.index.condemn(CHUNK, [pack], before) == [pack]
        (store_path / CHUNKS.key(pack)).unlink()
        checked = []

        def gc_rechecks() -> None:  # every object durable, the record not yet stored
            record = store.index.chunk(pack)
            assert record is not None and record.state == ChunkState.WRITING
            assert store.index.start_delete(CHUNK, pack, before) is None
            checked.append(pack)

        with store.new_version(run="r", step=2) as second:
            second.before_commit = gc_rechecks
            for name, array in arrays.items():  # the same members in the same order
                second.put(name, array)
        assert checked == [pack]
        assert store.index.version_refs(second.info.id) == [pack]  # the same pack, again
        assert (store_path / CHUNKS.key(pack)).exists()
        assert store.gc(grace=0).chunks_deleted == 0
        assert store.verify().ok
        read = store.open_version("r@2")
        assert all(np.array_equal(read.get(n), a) for n, a in arrays.items())
