"""A save's lookups of its run by key, not by listing (issue 49): the run's newest
version (the parent, and what the delta learner reads), the versions of its
``RUN@STEP``, the store's newest version and its runs come from the index's orders
by run and by time (:mod:`chunkstore.index.versiontables`).  They must say what a
listing of every version says, whoever changed the index: another process on the
same index, another index reconciled, a takeover, a rebuild, a migration of an
index of the previous schema.

Every test checks the orders against a listing (:func:`assert_orders_agree`), and a
save's parent against the version it must name.  Real LMDB, real files, real
processes.  Speed is measured in benchmarks/bench_scale.py, not here.
"""

from __future__ import annotations

import logging
import random
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest

import chunkstore
from chunkstore.errors import DuplicateStepError, SelectorError
from chunkstore.index import versiontables
from chunkstore.index.lmdbindex import INDEX_SCHEMA, Index, VersionEntry
from chunkstore.objects.kinds import VERSIONS

ROOT = Path(__file__).resolve().parent.parent


def assert_orders_agree(index: Index) -> None:
    """The orders hold what ``versions`` holds, and every keyed lookup answers what a
    listing of every version answers."""
    with index.env.begin() as txn:
        assert versiontables.in_step(txn, index.versions_db,
                                     (index.versions_by_run, index.versions_by_time))
    listed = index.versions()  # every entry decoded, by time then id
    by_run: dict[str, list[VersionEntry]] = {}
    for entry in listed:
        by_run.setdefault(entry.run, []).append(entry)
    assert index.runs() == sorted(by_run)
    assert index.latest_version() == (listed[-1] if listed else None)
    assert index.newest_versions(None, 2) == listed[::-1][:2]
    assert index.version_ids() == {e.id for e in listed}
    for run, entries in by_run.items():
        ordered = sorted(entries, key=lambda e: (e.step, e.created, e.id))
        assert index.run_versions(run) == ordered
        assert index.latest_version(run) == ordered[-1]
        assert index.newest_versions(run, 3) == ordered[::-1][:3]
        for step in {e.step for e in entries}:
            assert index.run_versions(run, step) == [e for e in ordered if e.step == step]
        assert index.run_versions(run, max(e.step for e in entries) + 1) == []
    assert index.latest_version("no-such-run") is None


def arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.standard_normal(256).astype(np.float32) for i in range(4)}


def save(store: chunkstore.Store, step: int, seed: int, run: str = "r") -> chunkstore.VersionInfo:
    with store.new_version(run=run, step=step) as version:
        for name, array in arrays(seed).items():
            version.put(name, array)
    return version.info


# --- the orders themselves -------------------------------------------------------------------


def test_the_orders_answer_what_a_listing_answers_through_adds_and_removals(
        tmp_path: Path) -> None:
    """Random versions added and removed: runs whose names share a prefix (``r``, ``r1``,
    ``r.x``, ``r-``), steps at both ends of their range and repeated, times negative,
    equal and out of order."""
    rng = random.Random(49)
    index = Index(str(tmp_path / "index"))
    try:
        live: list[VersionEntry] = []
        for number in range(400):
            if live and rng.random() < 0.3:
                gone = live.pop(rng.randrange(len(live)))
                assert index.remove_version(gone.id)
            else:
                entry = VersionEntry(
                    id=f"{rng.getrandbits(256):064x}",
                    run=rng.choice(["r", "r1", "r.x", "r-", "a"]),
                    step=rng.choice([0, 1, 2, 3, 7, 2**63 - 1, rng.randrange(100)]),
                    created=rng.choice([-5.5, 0.0, 1.0, 1.0, 1e9 + rng.random(), -1e-300]),
                    root="00" * 32, parent=None, logical_bytes=0, new_bytes=0,
                    new_stored_bytes=0, meta={})
                index.add_version(entry, [], {}, [])
                live.append(entry)
            if number % 25 == 0:
                assert_orders_agree(index)
        assert_orders_agree(index)
        for entry in list(live):
            index.remove_version(entry.id)
        assert_orders_agree(index)
        assert index.runs() == [] and index.latest_version() is None
    finally:
        index.close()


def test_selectors_and_a_run_s_listing_come_from_the_orders(tmp_path: Path) -> None:
    with chunkstore.open(tmp_path / "s", create=True) as store:
        first = save(store, 5, seed=1)
        second = save(store, 3, seed=2)  # a lower step, saved later
        other = save(store, 9, seed=3, run="r1")
        assert store.latest("r").id == first.id  # step 5 is the run's newest
        assert store.resolve("r@latest").id == first.id
        assert store.resolve("r@3").id == second.id
        assert store.resolve("latest").id == other.id
        assert store.resolve(first.id[:10]).id == first.id
        assert [v.step for v in store.versions("r")] == [3, 5]
        assert store.runs() == ["r", "r1"]
        with pytest.raises(SelectorError, match="no version at step 4"):
            store.resolve("r@4")
        with pytest.raises(SelectorError, match="no versions of run"):
            store.resolve("r0@1")
        assert store.versions("r\0x") == [] and store.latest("r\0") is None
        assert store.at_step("r", -1) == store.at_step("r", 2**64) == []
        assert_orders_agree(store.index)


# --- what others change between two saves -----------------------------------------------------

#: Another process on the same store and index: ``save STEP SEED`` or ``rm SELECTOR``;
#: prints the id it saved or removed.
OTHER = """
import sys
import numpy as np
import chunkstore
from tests.test_version_lookups import save
store = chunkstore.open(sys.argv[1], **({"index_dir": sys.argv[2]} if sys.argv[2] != "-" else {}))
if sys.argv[3] == "save":
    print(save(store, int(sys.argv[4]), int(sys.argv[5])).id)
else:
    print(store.delete(sys.argv[4]).id)
store.close()
"""


def other_process(url: Path, *args: object, index: str = "-") -> str:
    done = subprocess.run([sys.executable, "-c", OTHER, str(url), index, *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_versions_another_process_adds_or_removes_between_two_saves_are_seen(
        tmp_path: Path) -> None:
    """One index, two processes: this handle's next save names the other process's
    version as its parent, no longer names one the other process removed, and finds the
    other process's RUN@STEP."""
    url = tmp_path / "s"
    with chunkstore.open(url, create=True) as store:
        save(store, 1, seed=1)
        added = other_process(url, "save", 2, 2)
        assert store.latest("r").id == added
        third = save(store, 3, seed=3)
        assert third.parent == added
        assert other_process(url, "rm", "r@3") == third.id
        assert store.at_step("r", 3) == []
        fourth = save(store, 4, seed=4)
        assert fourth.parent == added
        fifth = other_process(url, "save", 5, 5)
        with pytest.raises(DuplicateStepError):
            save(store, 5, seed=6)
        with store.new_version(run="r", step=5) as version:  # the same content: no new one
            for name, array in arrays(5).items():
                version.put(name, array)
        assert version.existed and version.info.id == fifth
        assert [v.step for v in store.versions("r")] == [1, 2, 4, 5]
        assert_orders_agree(store.index)


def test_versions_another_index_adds_or_removes_are_seen_once_reconciled(
        tmp_path: Path) -> None:
    """Two indexes on one store (another machine's, a private one): what the other index
    did is counted in and out by ``reconcile`` (as every open and GC does), through the
    index methods that keep the orders; a step the other index removed is no longer in
    the way of a save of the same step, reconciled or not."""
    url = tmp_path / "s"
    with chunkstore.open(url, create=True, index_dir=str(tmp_path / "mine")) as store:
        save(store, 1, seed=1)
        second = save(store, 2, seed=2)
        theirs = str(tmp_path / "theirs")
        added = other_process(url, "save", 3, 3, index=theirs)
        assert other_process(url, "rm", "r@2", index=theirs) == second.id
        store.reconcile()
        assert store.latest("r").id == added
        assert store.at_step("r", 2) == []
        with pytest.raises(SelectorError):
            store.resolve("r@2")
        fourth = save(store, 4, seed=4)
        assert fourth.parent == added
        assert other_process(url, "rm", "r@4", index=theirs) == fourth.id
        again = save(store, 4, seed=5)  # other content: not refused, the old one is gone
        assert [v.id for v in store.at_step("r", 4)] == [again.id]
        assert again.parent == added
        assert not store.objects.exists(VERSIONS, fourth.id)
        assert_orders_agree(store.index)


#: Holds run "r" on its own index: saves step 1, then one more step per line read.
HOLDER = """
import sys, torch
import chunkstore
from torch_bridge import Checkpointer
store = chunkstore.open(sys.argv[1], index_dir=sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
ckpt = Checkpointer(store, run="r")
for step, _ in enumerate(sys.stdin, start=1):
    with torch.no_grad():
        model.weight.add_(1.0)
    print(ckpt.save(step, model=model).id, flush=True)
ckpt.close()
"""


@pytest.mark.parametrize("async_save", [False, True])
def test_a_takeover_saves_on_top_of_the_run_s_newest_version(tmp_path: Path,
                                                              async_save: bool) -> None:
    """A job on another index saves steps 1-3; a taker whose index saw none of them takes
    the run over: its first save's parent is step 3, its steps follow the job's."""
    url = tmp_path / "s"
    taker_store = chunkstore.open(url, create=True, index_dir=str(tmp_path / "taker"))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(url), str(tmp_path / "job")],
                              cwd=ROOT, text=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert holder.stdin is not None and holder.stdout is not None
        ids = []
        for _ in range(3):
            holder.stdin.write("save\n")
            holder.stdin.flush()
            ids.append(holder.stdout.readline().strip())
        assert all(ids), holder.stderr.read() if holder.stderr else ""
        assert taker_store.latest("r") is None  # its index has not heard of them
        import torch  # here: OTHER's processes import this module and need no torch

        from torch_bridge import Checkpointer
        model = torch.nn.Linear(4, 2)
        with Checkpointer(taker_store, run="r", takeover=True, async_save=async_save) as ckpt:
            ckpt.save(4, model=model)
            info = ckpt.wait()
            assert info is not None and info.parent == ids[-1]
            assert ckpt.all_steps() == [1, 2, 3, 4]
            assert taker_store.resolve("r@3").id == ids[-1]
            assert_orders_agree(taker_store.index)
    finally:
        holder.communicate(timeout=120)  # its stdin closed: it stops (and loses its run)
        taker_store.close()


# --- rebuilt and migrated indexes --------------------------------------------------------------


def test_a_rebuilt_index_has_the_orders_of_what_the_store_holds(tmp_path: Path) -> None:
    """A rebuild (a scratch index swapped in) after versions were added and removed behind
    this index's back: the orders are the store's, and the next save's parent too."""
    url = tmp_path / "s"
    with chunkstore.open(url, create=True) as store:
        save(store, 1, seed=1, run="q")
        save(store, 1, seed=2)
        second = save(store, 2, seed=3)
        added = other_process(url, "save", 3, 4, index=str(tmp_path / "other"))
        store.objects.delete(VERSIONS, second.id)  # gone behind the index's back
        store.rebuild_index()
        assert_orders_agree(store.index)
        assert [v.step for v in store.versions("r")] == [1, 3]
        assert save(store, 4, seed=5).parent == added
        assert_orders_agree(store.index)


def _as_schema_3(index_path: str, stale: bool) -> None:
    """Make the index one of schema 3: its orders gone (``stale``: left with a key of a
    version it no longer holds, as a release of schema 4 left them before a downgrade)."""
    env = lmdb.open(index_path, max_dbs=32)
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"3", db=env.open_db(b"meta", txn=txn))
        for name in (b"versions_by_run", b"versions_by_time"):
            table = env.open_db(name, txn=txn)
            if stale:
                txn.drop(table, delete=False)
                txn.put(versiontables.by_run_key("r", 99, 0.0, "f" * 64), b"", db=table)
            else:
                txn.drop(table, delete=True)
    env.close()


@pytest.mark.parametrize("stale", [False, True])
def test_an_index_of_schema_3_gets_its_orders_where_it_is_opened(tmp_path: Path,
                                                                  stale: bool) -> None:
    url = tmp_path / "s"
    with chunkstore.open(url, create=True) as store:
        for step in (1, 2, 3):
            save(store, step, seed=step)
        newest = save(store, 10, seed=10, run="q")
        index_path = store.index.path
    _as_schema_3(index_path, stale)
    with chunkstore.open(url) as store:
        assert not store.index.needs_rebuild
        with store.index.env.begin(db=store.index.meta) as txn:
            assert int(txn.get(b"schema")) == INDEX_SCHEMA == 5
        assert_orders_agree(store.index)
        assert store.latest().id == newest.id
        assert [v.step for v in store.versions("r")] == [1, 2, 3]
        fourth = save(store, 4, seed=4)
        assert fourth.parent == store.resolve("r@3").id
        assert_orders_agree(store.index)


def test_orders_an_older_release_left_behind_are_not_trusted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A release that knows only ``versions`` writes into the index (it rebuilt it under
    its own schema): the open index answers from a listing, with a warning, and the
    next open migrates it again."""
    url = tmp_path / "s"
    with chunkstore.open(url, create=True) as store:
        save(store, 1, seed=1)
        path = store.index.path
    index = Index(path)
    try:
        later = VersionEntry("e" * 64, "r", 2, 2e9, "00" * 32, None, 0, 0, 0, {})
        with index.env.begin(write=True) as txn:  # as the older release counts one in
            txn.put(later.id.encode(), later.to_json(), db=index.versions_db)
            txn.put(b"schema", b"3", db=index.meta)
        with caplog.at_level(logging.WARNING, logger="chunkstore.index.lmdbindex"):
            assert index.latest_version("r") == later
            assert index.run_versions("r", 2) == [later]
            assert index.runs() == ["r"]
        assert "older release" in caplog.text
    finally:
        index.close()
    index = Index(path)
    try:
        assert_orders_agree(index)
        assert index.latest_version("r") == later
    finally:
        index.close()
