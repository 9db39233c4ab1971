"""A handle's copies of its last save's chunks, the bases of the run's next delta save
(chunkstore.handle.basecopies): used only for the base they copy, never read back, within
their budget, and every version reads back exact whatever the handle saw in between."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend
from chunkstore.format.chunkobj import HEADER
from chunkstore.format.digest import Digest
from chunkstore.handle.basecopies import BaseCopies
from chunkstore.objects.kinds import CHUNKS
from tests.test_delta import CHUNK, DIM, ROWS, save, shard, sparse_states


class CountingBackend(ForwardingBackend):
    """Counts whole-object reads of chunk objects."""

    def __init__(self, inner: chunkstore.Store) -> None:
        super().__init__(inner.backend)
        self.chunk_reads: list[str] = []

    def get(self, key: str) -> bytes:
        if key.startswith("chunks/"):
            self.chunk_reads.append(key)
        return self.inner.get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if key.startswith("chunks/"):
            self.chunk_reads.append(key)
        return self.inner.get_range(key, start, length)


def tables(seed: int = 0) -> Iterator[np.ndarray]:
    """An embedding table of which each state changes a few rows of every chunk."""
    return sparse_states(seed, rows=12)


def open_store(path: Path, **kwargs: object) -> chunkstore.Store:
    return chunkstore.open(path, chunk_size=CHUNK, delta_depth=3, **kwargs, create=True)  # type: ignore[arg-type]


def chains(store: chunkstore.Store, version_id: str) -> list[tuple[Digest, ...]]:
    only = shard(store, version_id)
    return [only.chain(i) for i in range(len(only.chunks))]


@pytest.mark.parametrize("budget", [None, 0])
def test_a_handles_next_delta_save_reads_no_base_back(tmp_path: Path,
                                                      budget: int | None) -> None:
    """With copies (the default) a loop's delta saves read no chunk object once the
    handle continues its own run (its first save copies nothing, so its second reads
    its bases back once); with them off (budget 0) each delta's base is read back, and
    both store the same deltas."""
    store = open_store(tmp_path / "s")
    if budget is not None:
        store.base_copies.budget = budget
    counting = CountingBackend(store)
    store.backend = counting
    states = tables()
    kept = {}
    later: list[str] = []  # the reads of saves 2 and 3
    for step in range(4):
        if step == 2:
            later, counting.chunk_reads = counting.chunk_reads, later
        table = next(states)
        kept[save(store, step, table)] = table
    deltas = sum(1 for version_id in kept for chain in chains(store, version_id) if chain)
    assert deltas >= 3 * 3  # saves 1-3: (nearly) every chunk a delta
    if budget is None:
        assert counting.chunk_reads == [] and later, (counting.chunk_reads, later)
    else:
        assert len(counting.chunk_reads) + len(later) >= deltas
    for version_id, table in kept.items():
        np.testing.assert_array_equal(store.open_version(version_id).get("emb"), table)
    assert store.verify().ok
    store.close()


def test_copies_hold_exactly_the_bytes_of_their_digest(tmp_path: Path) -> None:
    with open_store(tmp_path / "s") as store:
        states = tables()
        for step in range(3):
            save(store, step, next(states))
        (held,) = store.base_copies._runs.values()
        copies = [(digest, copy) for digest, copy, _ in held.left.values() if copy is not None]
        assert len(copies) == ROWS * DIM * 4 // CHUNK
        assert all(Digest.of(copy) == digest for digest, copy in copies)


def test_copies_serve_only_the_version_that_made_them(tmp_path: Path) -> None:
    """The handle saves r@0, then r@1 (its copies are now of r@1's chunks), removes r@1
    and saves r@2 on top of r@0: r@2's bases are r@0's chunks, read from the store,
    never r@1's copies; every version reads back exact."""
    with open_store(tmp_path / "s") as store:
        states = tables()
        first, second = next(states), next(states)
        kept = {save(store, 0, first): first}
        store.delete(save(store, 1, second))
        third = first.copy()
        third[:, 0] += np.float32(0.25)
        last = save(store, 2, third)
        kept[last] = third
        assert all(chains(store, last))  # every chunk a delta against r@0's
        store.base_cache.clear()
        for version_id, table in kept.items():
            np.testing.assert_array_equal(store.open_version(version_id).get("emb"), table)
        assert store.verify().ok


def test_a_small_budget_bounds_the_copies_and_saves_stay_exact(tmp_path: Path) -> None:
    with open_store(tmp_path / "s") as store:
        store.base_copies.budget = 2 * CHUNK  # half the table's chunks
        states = tables()
        kept = {}
        for step in range(5):
            table = next(states)
            kept[save(store, step, table)] = table
            assert store.base_copies.held() <= 2 * CHUNK
        assert store.base_copies.held() == 2 * CHUNK
        for version_id, table in kept.items():
            np.testing.assert_array_equal(store.open_version(version_id).get("emb"), table)
        assert store.verify().ok


def test_an_aborted_save_leaves_the_next_one_exact(tmp_path: Path) -> None:
    with open_store(tmp_path / "s") as store:
        states = tables()
        table = next(states)
        kept = {save(store, 0, table): table}
        writer = store.new_version(run="r", step=1)
        writer.put("emb", next(states))  # takes (and gives back) the copies of r@0
        writer.abort()
        for step in (2, 3):
            table = next(states)
            kept[save(store, step, table)] = table
        assert all(chains(store, version_id) for version_id in list(kept)[1:])
        for version_id, table in kept.items():
            np.testing.assert_array_equal(store.open_version(version_id).get("emb"), table)
        assert store.verify().ok


def test_a_copy_stands_in_for_its_base_only_not_for_what_is_stored(tmp_path: Path) -> None:
    """A base object damaged after its save is not read by the handle's next save of the
    run (the copy stands in, as a deduplicated chunk is trusted), and verify reports
    both the damaged version and the one whose delta needs it.  (The run's first save
    on the handle copies nothing: the copies are made by its second.)"""
    with open_store(tmp_path / "s") as store:
        states = tables()
        save(store, 0, next(states))
        first = save(store, 1, next(states))
        listed = store.open_version(first).entry("emb").shards[0]  # type: ignore[union-attr]
        location = listed.location(0)  # the base is packed (chunk format 5) or an object
        path = Path(store.url) / CHUNKS.key(listed.chunks[0] if location is None
                                           else location.pack)
        data = bytearray(path.read_bytes())
        last = -1 if location is None else HEADER.size + location.offset + location.length - 1
        data[last] ^= 0xFF  # the last payload byte of the base's object
        path.write_bytes(bytes(data))
        second = save(store, 2, next(states))
        assert chains(store, second)[0]  # a delta on the damaged base, as dedup would
        result = store.verify()
        damaged = {problem.version for problem in result.problems}
        assert {first, second} <= damaged, result.problems


def accounted(copies: BaseCopies) -> int:
    """Bytes of the buffers the handle holds between saves: runs' copies and spares."""
    return (sum(len(c) for run in copies._runs.values() for c in run.buffers())
            + sum(map(len, copies._spare)))


def test_the_budget_counts_exactly_the_buffers_held_whatever_the_saves_did(
        tmp_path: Path) -> None:
    """After commits, an abort, a writer dropped unfinished, a removed latest version,
    and a tensor that changes shape or goes away, what is counted is what is held."""
    with open_store(tmp_path / "s") as store:
        copies = store.base_copies
        states = tables()
        for step in range(2):
            save(store, step, next(states))
        assert copies.held() == accounted(copies) > 0
        writer = store.new_version(run="r", step=2)
        writer.put("emb", next(states))
        writer.abort()
        assert copies.held() == accounted(copies)
        writer = store.new_version(run="r", step=3)
        writer.put("emb", next(states))
        writer._flush_small()
        for pending in writer._tensors.values():
            for future in pending.futures:
                future.result()
        del writer, pending, future  # dropped without commit or abort
        gc.collect()
        assert copies.held() == accounted(copies)
        save(store, 4, next(states))
        store.delete(save(store, 5, next(states)))
        save(store, 6, next(states))
        assert copies.held() == accounted(copies)
        with store.new_version(run="r", step=7) as version:  # a new shape; "emb" gone
            version.put("other", next(states).reshape(DIM, ROWS))
        assert copies.held() == accounted(copies)
        assert store.verify().ok


def test_a_run_saved_long_ago_gives_its_copies_up_to_the_run_saving_now(
        tmp_path: Path) -> None:
    """With room for one run's copies (and the copies a save makes while it holds its
    parent's), a second run's delta saves take them over (the first run's next save
    reads its bases back) and, from its third save on (its first copies nothing, its
    second reads its bases back), read no base themselves."""
    store = open_store(tmp_path / "s")
    store.base_copies.budget = 2 * ROWS * DIM * 4
    counting = CountingBackend(store)
    store.backend = counting
    first, second = tables(1), tables(2)
    for step in range(3):
        save(store, step, next(first), run="a")
    for step in range(4):
        if step == 2:
            counting.chunk_reads.clear()
        save(store, step, next(second), run="b")
    assert counting.chunk_reads == []
    assert list(store.base_copies._runs) == ["b"]
    assert store.verify().ok
    store.close()


def test_an_array_changed_during_its_save_does_not_reach_the_next_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """put()'s contract broken (the caller changes the array while it is hashed): the
    chunk is hashed and written from the copy, so the copy the next save encodes
    against is the stored chunk, and the next version reads back exact."""
    with open_store(tmp_path / "s") as store:
        states = tables()
        save(store, 0, next(states))
        table = next(states)
        real = Digest.of.__func__  # type: ignore[attr-defined]

        def of(cls: type[Digest], data: bytes | memoryview) -> Digest:
            table[:] += np.float32(1)
            return real(cls, data)  # type: ignore[no-any-return]

        monkeypatch.setattr(Digest, "of", classmethod(of))
        save(store, 1, table)
        monkeypatch.undo()
        last = next(states)
        version_id = save(store, 2, last)
        assert any(chains(store, version_id))
        store.base_cache.clear()
        np.testing.assert_array_equal(store.open_version(version_id).get("emb"), last)
        assert store.verify().ok


def test_a_save_on_a_version_the_handle_did_not_save_copies_nothing(tmp_path: Path) -> None:
    """A handle's first save of a run (a new run, a resumed one on a fresh handle, a
    one-shot process) copies no chunk; only a save continuing the handle's own run does,
    and every version reads back exact either way."""
    states = tables()
    kept = {}
    with open_store(tmp_path / "s") as store:
        table = next(states)
        kept[save(store, 0, table)] = table
        assert store.base_copies.held() == 0
        table = next(states)
        kept[save(store, 1, table)] = table
        assert store.base_copies.held() > 0  # continuing its own run: copies kept
    with open_store(tmp_path / "s") as resumed:  # another process resuming the run
        table = next(states)
        kept[save(resumed, 2, table)] = table
        assert resumed.base_copies.held() == 0
        assert all(chains(resumed, list(kept)[-1]))  # deltas all the same, bases read back
        for version_id, expected in kept.items():
            np.testing.assert_array_equal(resumed.open_version(version_id).get("emb"), expected)
        assert resumed.verify().ok


def test_a_run_holding_no_copies_keeps_its_place_when_another_needs_room(
        tmp_path: Path) -> None:
    """Room is made by giving up the copies of the run saved longest ago that holds
    any: a run whose last save made none (its first) keeps its place, so its next save
    still continues its run and copies."""
    with open_store(tmp_path / "s") as store:
        store.base_copies.budget = CHUNK  # room for one copy: the next run's saves evict
        first, second = tables(1), tables(2)
        save(store, 0, next(first), run="a")
        save(store, 0, next(second), run="b")  # b's first save: no copies, a place
        save(store, 1, next(first), run="a")  # a continues: copies, over the budget
        assert "b" in store.base_copies._runs
        assert store.verify().ok
