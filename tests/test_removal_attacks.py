"""Attacks on removal in bulk (chunkstore/handle/removal.py, issue 49): damaged inputs,
a failing peer, a GC beside it, a taker's walk beside it.

Real files, a real LMDB index, real subprocesses; the run leases are the real
:class:`RunLease`; a file that refuses its unlink is made immutable (``chattr +i``: root
included).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import chunkstore
from chunkstore.errors import InvalidInputError
from chunkstore.objects.kinds import TOMBSTONES, VERSIONS
from chunkstore.protocol.runlease import RunLease
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options
from tests.test_bulk_removal import removed_behind_a_paused_walk

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN = "r"


def _arrays(step: int, run: str = RUN) -> dict[str, np.ndarray]:
    return {"w": np.full(256, step + 1000 * len(run), dtype=np.float32),
            "base": np.arange(512, dtype=np.int32)}


def _save(store: chunkstore.Store, step: int, lease: RunLease | None = None,
          run: str = RUN) -> chunkstore.VersionInfo:
    writer = store.new_version(run, step)
    if lease is not None:  # a save as the Checkpointer makes it: claim, check, commit
        writer.before_commit = lease
    for name, array in _arrays(step, run).items():
        writer.put(name, array)
    return writer.commit()


def _loads(store: chunkstore.Store, version_id: str) -> None:
    reader = store.open_version(version_id)
    for name, expected in _arrays(reader.info.step, reader.info.run).items():
        assert reader.get(name).tobytes() == expected.tobytes(), (version_id[:12], name)


def _verified(store: chunkstore.Store) -> None:
    verified = store.verify()  # refcounts included
    assert verified.ok, [p.to_json() for p in verified.problems]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSTORE_FAULT")}
    return subprocess.run([sys.executable, "-m", "chunkstore", *args], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          check=False)


def test_a_taker_does_not_republish_a_version_a_grace_0_gc_collected(tmp_path: Path) -> None:
    """The schedule of test_bulk_removal's taker test, with ``gc --grace 0`` between the
    removal and the walk: the GC deletes r@1's tombstone (expired at once) and the
    objects only r@1 reached.  The walk must still roll nothing forward: a record put
    back then names objects that are gone."""
    store = chunkstore.open(str(tmp_path / "s"), create=True)
    try:
        with removed_behind_a_paused_walk(store, _save) as (taker, version):
            result = store.gc(grace=0)
            # r@1's own nodes; its chunk shares a pack with what r@2's intent (slot 3,
            # the next walk publishes it) reaches, which the GC keeps.
            assert result.nodes_deleted > 0 and not result.index_disagreements
            taker._roll_forward(2)  # the walk, from its read of slot 2 on
            assert not store.objects.exists(VERSIONS, version.id)
            assert taker.head is None
        store.reconcile()
        assert store.versions(RUN) == []
        _verified(store)
    finally:
        store.close()


def _filled(path: Path, runs: tuple[str, ...] = (RUN,), steps: int = 6) -> dict[str, list[str]]:
    with chunkstore.open(path, create=True) as store:
        return {run: [_save(store, step, run=run).id for step in range(1, steps + 1)]
                for run in runs}


def _consistent(path: Path, kept: list[str], *, index_dir: str | None = None) -> None:
    """Every kept version is published, listed, loads; the index's refcounts verify; a
    GC with grace 0 keeps every kept version whole."""
    with chunkstore.open(path, index_dir=index_dir) as store:
        stored = set(store.stored_version_ids())
        assert set(kept) <= stored
        listed = {v.id for run in {store.resolve(vid).run for vid in kept}
                  for v in store.versions(run)}
        assert set(kept) <= listed
        for vid in kept:
            _loads(store, vid)
        _verified(store)
        store.gc(grace=0)
        for vid in kept:
            _loads(store, vid)
        _verified(store)


def test_rm_of_one_version_named_three_ways_and_of_several_runs_counts_each_once(
        tmp_path: Path) -> None:
    """``rm`` naming r@2 by its id, by RUN@STEP and by a tag (--force), beside versions of
    two other runs: each is removed once (the JSON answer lists each once), the index's
    refcounts stay right (verify), and every other version loads."""
    path = tmp_path / "s"
    ids = _filled(path, ("r", "q", "pp"))
    with chunkstore.open(path) as store:
        store.tag(ids["r"][1], "best")
    done = _cli("rm", str(path), ids["r"][1], "r@2", "best", ids["q"][0], "pp@3", "q@1",
                "--force", "--json")
    assert done.returncode == 0, done.stderr
    removed = [v["id"] for v in json.loads(done.stdout)["removed"]]
    assert removed == [ids["r"][1], ids["q"][0], ids["pp"][2]]
    with chunkstore.open(path) as store:
        assert store.tags() == {} and store.stored_tags() == {}
        assert all(store.objects.exists(TOMBSTONES, vid) for vid in removed)
        assert not set(removed) & set(store.stored_version_ids())
    _consistent(path, [vid for run in ids.values() for vid in run if vid not in removed])


def _record_file(path: Path, version_id: str) -> Path:
    found = [p for p in path.rglob(f"*{version_id}*") if "versions" in p.parts]
    assert len(found) == 1, found
    return found[0]


@pytest.fixture
def immutable() -> Iterator[Callable[[Path], None]]:
    """``chattr +i`` a file (its unlink then fails, EPERM, root included); undone after."""
    if shutil.which("chattr") is None:
        pytest.skip("no chattr")
    made: list[Path] = []

    def make(path: Path) -> None:
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True,
                          check=False).returncode:
            pytest.skip("this filesystem has no immutable files")
        made.append(path)

    yield make
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)


def test_rm_whose_unlink_fails_reports_the_failure_and_a_rerun_finishes(
        tmp_path: Path, immutable: Callable[[Path], None]) -> None:
    """One commit record of the five removed refuses its unlink (EPERM): ``rm`` exits
    non-zero with no JSON answer of success; the versions whose records went are not
    listed by a new process's index, the one still there is, every kept version loads,
    refcounts verify; once the file is writable again, rm of the same selectors
    finishes."""
    path = tmp_path / "s"
    ids = _filled(path, steps=8)[RUN]
    stuck = _record_file(path, ids[2])
    immutable(stuck)
    failed = _cli("rm", str(path), *ids[:5], "--json")
    assert failed.returncode not in (0, 2), (failed.returncode, failed.stdout, failed.stderr)
    assert "Operation not permitted" in failed.stderr, failed.stderr
    assert '"removed"' not in failed.stdout
    with chunkstore.open(path) as store:
        # The bulk delete promises no order: the unlinks not yet started when one failed
        # may not have happened.  Every version still there is published and listed.
        stored = set(store.stored_version_ids())
        assert ids[2] in stored and set(ids[5:]) <= stored
        assert {v.id for v in store.versions(RUN)} == stored
        assert all(store.objects.exists(TOMBSTONES, vid) for vid in ids[:5])
    left = [vid for vid in ids[:5] if vid in stored]
    _consistent(path, [*ids[5:], *left])
    subprocess.run(["chattr", "-i", str(stuck)], check=True)
    if len(left) < 5:  # removed already, and their tombstones gone with _consistent's
        assert _cli("rm", str(path), *ids[:5]).returncode == 2  # GC: nothing names them
    finished = _cli("rm", str(path), *left)
    assert finished.returncode == 0, finished.stderr
    with chunkstore.open(path) as store:
        assert [v.id for v in store.versions(RUN)] == ids[5:]
    _consistent(path, ids[5:])


def test_rm_run_again_reports_what_was_removed_already_and_changes_nothing(
        tmp_path: Path) -> None:
    """``rm`` run a second time (by RUN@STEP, full id and id prefix): exit 0, each
    version reported as already removed (JSON ``already_removed``), nothing changed; a
    rerun beside a version still published removes that one; a selector that names
    nothing stays a bad selector, as does a removed version once a GC deleted its
    tombstone (nothing in the store remembers it)."""
    from click.testing import CliRunner

    from chunkstore.cli import cli
    path = tmp_path / "s"
    ids = _filled(path, steps=4)[RUN]
    runner = CliRunner()

    def rm(*args: str) -> tuple[int, str]:
        answer = runner.invoke(cli, ["rm", str(path), *args])
        return answer.exit_code, answer.output

    assert rm("r@1", ids[1])[0] == 0
    before = {p: p.stat().st_mtime_ns for p in path.rglob("*") if "index" not in p.parts}
    code, out = rm("r@1", ids[1], ids[1][:8], "--json")
    assert code == 0, out
    answer = json.loads(out)
    assert answer["removed"] == []
    assert [(r["id"], r["step"]) for r in answer["already_removed"]] == [(ids[0], 1), (ids[1], 2)]
    assert {p: p.stat().st_mtime_ns for p in path.rglob("*") if "index" not in p.parts} == before
    code, out = rm("r@2", "r@3")
    assert code == 0 and f"already removed {ids[1][:12]} (r@2)" in out and "removed " in out, out
    assert rm("r@9")[0] == 2
    with chunkstore.open(path) as store:
        assert [v.id for v in store.versions(RUN)] == [ids[3]]
        store.gc(grace=0)  # deletes the tombstones
    code, out = rm("r@1")
    assert code == 2 and "no version" in out, out
    assert "already removed" in runner.invoke(cli, ["rm", "--help"]).output
    _consistent(path, [ids[3]])


def test_a_gc_keeps_the_tombstone_an_rm_run_again_rewrote_while_it_ran(
        tmp_path: Path) -> None:
    """An rm killed between r@1's tombstone and its record's delete, over an hour ago:
    the GC judges that tombstone expired (its version still published); while the GC
    runs, the rm run again (another machine's index) rewrites the tombstone, fresh, and
    deletes the record.  The GC must not delete the fresh tombstone it never judged: it
    is what keeps r@1's tree for the grace period, and what a hold placed now looks for
    (docs/format.md §11.3, §15.2).  Before, it deleted it by the id it had judged."""
    from chunkstore.backends.wrappers import RequestHook

    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        first, second = _save(store, 1), _save(store, 2)
        store.objects.put(TOMBSTONES, first.id, json.dumps({  # as the killed rm left it
            "format_version": 1, "version": first.id, "root": first.root.hex, "run": RUN,
            "step": 1, "removed": time.time() - 7200}, sort_keys=True).encode())

        class RerunOnceTheMarkReadTheTombstones(RequestHook):
            def listed(self, prefix: str, count: int) -> None:
                if prefix == TOMBSTONES.prefix and not rerun:
                    with chunkstore.open(path, index_dir=str(tmp_path / "other")) as other:
                        other.delete(first.id)
                    rerun.append(first.id)

        rerun: list[str] = []
        store.backend = RerunOnceTheMarkReadTheTombstones(store.backend)
        store.gc(grace="1h")
        assert rerun == [first.id]
        assert store.objects.exists(TOMBSTONES, first.id)
    with chunkstore.open(path) as store:
        store.gc(grace="1h")  # r@1 was removed just now: its tombstone stays
        assert store.objects.exists(TOMBSTONES, first.id)
        assert [v.id for v in store.versions(RUN)] == [second.id]
        assert store.verify().ok
    _consistent(path, [second.id])


def test_verify_on_a_handle_whose_index_lags_reports_only_what_a_fresh_open_would(
        tmp_path: Path) -> None:
    """Two handles in one process: one on the store's index, one on an index of its own
    (another machine's, or a private one); the first removes r@2 and saves r@4.  The
    second's verify counts them out and in first (what opening the store does), so it
    reports no refcount mismatch; before, it took its index's lag for damage ('run
    chunkstore index rebuild').  Two handles on one index (shared) verify clean too."""
    path = tmp_path / "s"
    ids = _filled(path, steps=3)[RUN]
    with chunkstore.open(path) as first, chunkstore.open(path) as same, \
            chunkstore.open(path, index_dir=str(tmp_path / "other")) as lagging:
        assert lagging.verify(read_data=False).ok
        first.delete(ids[1])
        saved = _save(first, 4)
        for handle in (same, lagging):
            _verified(handle)
            assert [v.id for v in handle.versions(RUN)] == [ids[0], ids[2], saved.id]


def test_rm_dry_run_tells_what_rm_does_when_another_index_tagged_the_version(
        tmp_path: Path) -> None:
    """A tag made through a second index (another machine's) that this one has not seen:
    ``rm --dry-run`` must refuse as ``rm`` does, not say it would remove the version;
    and ``rm`` refuses, removing nothing."""
    path = tmp_path / "s"
    ids = _filled(path, steps=3)[RUN]
    with chunkstore.open(path) as store:  # the default index knows every version
        assert len(store.versions(RUN)) == 3
    with chunkstore.open(path, index_dir=str(tmp_path / "other-index")) as other:
        other.tag(ids[0], "best")
    dry = _cli("rm", str(path), ids[0], ids[1], "--dry-run", "--json")
    real = _cli("rm", str(path), ids[0], ids[1], "--json")
    assert real.returncode == 2, (real.returncode, real.stdout, real.stderr)
    assert "best" in real.stderr
    assert (dry.returncode, dry.stdout) == (real.returncode, real.stdout), dry.stdout
    with chunkstore.open(path) as store:
        assert sorted(store.stored_version_ids()) == sorted(ids)
        assert not any(store.objects.exists(TOMBSTONES, vid) for vid in ids)


_CHILD = """
import os, sys, time, traceback
import chunkstore
from tests.test_removal_attacks import _save
path, role, index = sys.argv[1], sys.argv[2], sys.argv[3] or None
saved = path + ".saved"  # the saver's last save returned
try:
    with chunkstore.open(path, index_dir=index) as store:
        if role == "save":
            for step in range(1, 25):
                _save(store, step)
                time.sleep(0.03)
            open(saved, "w").close()
        elif role == "prune":
            # for as long as the saves go on (however slow a busy machine makes either),
            # then once more
            removed, last = 0, False
            while not last:
                last = os.path.exists(saved)
                removed += len(store.prune(keep_last=3).removed)
                time.sleep(0.03)
            print(removed)
        else:
            for _ in range(8):
                store.gc(grace=0, session_wait=30.0)
                time.sleep(0.05)
except Exception:
    traceback.print_exc()
    sys.exit(1)
"""


def test_prunes_on_two_indexes_beside_saves_and_grace_0_gcs_keep_every_kept_version(
        tmp_path: Path) -> None:
    """A process saving steps 1-24 of the run; two processes pruning it to the newest
    three, each through an index of its own (two machines); two ``gc --grace 0`` loops,
    one per index; all at once.  Every process finishes without an error; the newest
    three steps are published; every published version loads, on both indexes, whose
    refcounts verify; a GC after it all deletes nothing they need."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        _save(store, 0)
    other = str(tmp_path / "other-index")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSTORE_FAULT")}
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, str(path), role, index],
                                 cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
                for role, index in (("save", ""), ("prune", ""), ("prune", other),
                                    ("gc", ""), ("gc", other))]
    pruned = 0
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-3000:]
        pruned += int(out) if out.strip() else 0
    assert pruned >= 22  # steps 0-21, each by one prune or both, while the saves ran
    for index in (None, other):
        with chunkstore.open(path, index_dir=index) as store:
            store.reconcile()
            published = store.stored_version_ids()
            steps = sorted(store.resolve(vid).step for vid in published)
            assert steps[-3:] == [22, 23, 24], steps
        _consistent(path, list(published), index_dir=index)


def test_a_prune_whose_newest_version_another_prune_removed_goes_on(tmp_path: Path) -> None:
    """Two prunes on two indexes: one lists the run, the other removes its newest version,
    then the first verifies the newest to keep.  The version is gone, neither kept nor
    failed; it raised SelectorError out of prune (found by the concurrent prunes above)."""
    from chunkstore.maintenance.retention import _verified_newest

    with chunkstore.open(tmp_path / "s", create=True) as store:
        for step in range(4):
            _save(store, step)
        listed = store.versions("r")
        store.delete(listed[-1].id)  # since the listing, by another prune
        failed: list[str] = []
        assert _verified_newest(store, listed, 2, failed) == [listed[-2].id, listed[-3].id]
        assert failed == []


_STOPPED_PRUNE = """
import os, signal, sys
import chunkstore
from chunkstore.backends.wrappers import RequestHook

class StopAtTheRecords(RequestHook):
    def request(self, operation, key):
        if operation == "delete_many" and key.startswith("versions/"):
            os.kill(os.getpid(), signal.SIGSTOP)  # the tombstones are durable, the records not gone

with chunkstore.open(sys.argv[1]) as store:
    store.backend = store.objects.backend = StopAtTheRecords(store.objects.backend)
    print(len(store.prune(keep_last=2).removed))
"""


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_a_prune_stopped_before_its_record_deletes_beside_a_grace_0_gc_and_a_save(
        tmp_path: Path) -> None:
    """SIGSTOP a prune once its tombstones are durable and before its bulk delete; meanwhile
    ``gc --grace 0`` (the tombstones already expired: the versions are still published,
    and kept whole through their records) and a save of the run; SIGCONT: the prune
    finishes, exits 0 and says how many it removed; every kept version loads, refcounts
    verify, and the prune run again removes nothing."""
    path = tmp_path / "s"
    ids = _filled(path, steps=6)[RUN]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSTORE_FAULT")}
    child = subprocess.Popen([sys.executable, "-c", _STOPPED_PRUNE, str(path)], cwd=REPO_ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if _stopped(child.pid) or child.poll() is not None:
                break
            time.sleep(0.05)
        assert _stopped(child.pid), child.communicate()
        with chunkstore.open(path) as store:
            assert sorted(store.stored_version_ids()) == sorted(ids)
            assert all(store.objects.exists(TOMBSTONES, vid) for vid in ids[:4])
            store.gc(grace=0)
            for vid in ids:
                _loads(store, vid)
            saved = _save(store, 7).id
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert out.strip() == "4"
    with chunkstore.open(path) as store:
        assert sorted(store.stored_version_ids()) == sorted([*ids[4:], saved])
    _consistent(path, [*ids[4:], saved])
    again = _cli("prune", str(path), "--keep-last", "3", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["removed"] == [], again.stdout


def test_delete_many_given_one_string_is_a_typed_error_that_removes_nothing(
        tmp_path: Path) -> None:
    """``delete_many("best")`` would iterate the letters of a string: one-letter tags
    ``b``, ``e``, ``s``, ``t`` would name versions to remove.  A string is refused, with
    the call to use instead, before anything is removed."""
    path = tmp_path / "s"
    ids = _filled(path, steps=4)[RUN]
    with chunkstore.open(path) as store:
        for tag, vid in zip("best", ids, strict=True):
            store.tag(vid, tag)
        with pytest.raises(InvalidInputError, match=r"delete\('best'"):
            store.delete_many("best", force=True)
        assert sorted(store.stored_version_ids()) == sorted(ids)
        assert store.stored_tags() == dict(zip("best", ids, strict=True))


def test_a_version_removed_and_collected_while_a_reader_has_it_open_reads_back(
        tmp_path: Path) -> None:
    """A reader opened r@2; r@2 is removed in a prune of many, and ``gc --grace 0`` runs
    (its tombstone expired at once): the reader's lease keeps what it reads, which reads
    back whole; once the reader closes, a GC deletes it."""
    path = tmp_path / "s"
    ids = _filled(path, steps=5)[RUN]
    with chunkstore.open(path) as store:
        reader = store.open_version(ids[1])
        assert [v.id for v in store.prune(keep_last=2).removed] == ids[:3]
        store.gc(grace=0)
        for name, expected in _arrays(2).items():
            assert reader.get(name).tobytes() == expected.tobytes(), name
        reader.close()
        assert store.gc(grace=0).chunks_deleted > 0
    _consistent(path, ids[3:])


def test_prune_dry_run_names_exactly_what_the_prune_removes(tmp_path: Path) -> None:
    """Two runs, a tag, keep-last and keep-every: the dry run's JSON names the versions
    the real prune then removes, and changes nothing itself."""
    path = tmp_path / "s"
    ids = _filled(path, ("r", "q"), steps=9)
    with chunkstore.open(path) as store:
        store.tag(ids["q"][0], "first")
    policy = ("--keep-last", "2", "--keep-every", "4", "--json")
    dry = _cli("prune", str(path), *policy, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    with chunkstore.open(path) as store:
        assert len(store.stored_version_ids()) == 18
        assert not any(store.objects.exists(TOMBSTONES, vid)
                       for run in ids.values() for vid in run)
    real = _cli("prune", str(path), *policy)
    assert real.returncode == 0, real.stderr
    said = sorted(v["id"] for v in json.loads(dry.stdout)["removed"])
    done = sorted(v["id"] for v in json.loads(real.stdout)["removed"])
    assert said == done and len(done) == 11, (said, done)  # r: 6, q: 5 (q@1 tagged)
    with chunkstore.open(path) as store:
        assert not set(done) & set(store.stored_version_ids())
    _consistent(path, [vid for run in ids.values() for vid in run if vid not in done])


def test_a_prune_whose_unlink_fails_is_no_success_and_a_rerun_finishes(
        tmp_path: Path, immutable: Callable[[Path], None]) -> None:
    """``prune`` (in bulk) where one record refuses its unlink: a non-zero exit naming the
    error and no JSON answer; kept versions whole; the same prune run again, once the
    file can go, finishes."""
    path = tmp_path / "s"
    ids = _filled(path, steps=8)[RUN]
    stuck = _record_file(path, ids[1])
    immutable(stuck)
    failed = _cli("prune", str(path), "--keep-last", "3", "--json")
    assert failed.returncode not in (0, 2), (failed.returncode, failed.stdout, failed.stderr)
    assert "Operation not permitted" in failed.stderr and '"removed"' not in failed.stdout
    _consistent(path, ids[5:])
    subprocess.run(["chattr", "-i", str(stuck)], check=True)
    finished = _cli("prune", str(path), "--keep-last", "3", "--json")
    assert finished.returncode == 0, finished.stderr
    with chunkstore.open(path) as store:
        assert [v.id for v in store.versions(RUN)] == ids[5:]
    _consistent(path, ids[5:])


_KILLED_BEFORE_ITS_RECORD = """
import sys, chunkstore
from chunkstore.protocol.runlease import RunLease
from tests.test_removal_attacks import _save
store = chunkstore.open(sys.argv[1])
lease = RunLease(store.objects, "r")
lease.acquire()
_save(store, 1, lease)
_save(store, 2, lease)  # killed after its claim and check, before its record's PUT
"""


def test_a_takeover_after_a_gc_rolls_forward_no_intent_whose_objects_are_gone(
        tmp_path: Path) -> None:
    """A writer killed after its claim, before its record's PUT; a GC with grace 0 (its
    session dead, its objects orphans past the grace period); then a takeover, whose
    walk rolls the intent forward: the GC kept the intent's tree (docs/format.md §11.5),
    so the version published loads and verifies.  Before, the GC deleted it and the walk
    created a record naming objects that were gone."""
    path = tmp_path / "s"
    chunkstore.open(path, create=True).close()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CHUNKSTORE_FAULT")},
           "CHUNKSTORE_FAULT": "kill-before-put:versions/:1"}
    killed = subprocess.run([sys.executable, "-c", _KILLED_BEFORE_ITS_RECORD, str(path)],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with chunkstore.open(path) as store:
        (first,) = store.versions(RUN)
        store.gc(grace=0)
        taker = RunLease(store.objects, RUN)
        taker.acquire(takeover=True)
        try:
            assert taker.head is not None and taker.head != first.id
            assert sorted(store.stored_version_ids()) == sorted([first.id, taker.head])
        finally:
            taker.release()
    with chunkstore.open(path) as store:  # a fresh index counts the record in
        assert [v.id for v in store.versions(RUN)] == [first.id, taker.head]
        _loads(store, taker.head)
        _verified(store)


def test_a_removed_version_whose_intent_is_the_highest_slot_is_collected(
        tmp_path: Path) -> None:
    """GC keeps the tree of every intent in the commit slots but not of a withdrawn
    version: ``rm RUN@latest`` of a run whose writer released it, then a GC with grace
    0, frees what only that version held (else it stayed until the next takeover)."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        lease = RunLease(store.objects, RUN)
        lease.acquire()
        try:
            first, latest = _save(store, 1, lease), _save(store, 2, lease)
        finally:
            lease.release()
        store.delete(latest.id)
        assert store.gc(grace=0).chunks_deleted > 0
        assert [v.id for v in store.versions(RUN)] == [first.id]
        _verified(store)


def test_crafted_commit_slots_keep_nothing_and_stop_no_gc(tmp_path: Path) -> None:
    """Slots that are not JSON, not an object, or hold an intent whose record does not
    hash to its id, and the intent of a version removed since (withdrawn): GC (grace 0)
    skips them, warns nothing, and still collects the removed version's data."""
    from chunkstore.errors import LeaseSetAsideWarning
    from chunkstore.objects.kinds import LEASES
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        first, second = _save(store, 1), _save(store, 2)
        record = store.objects.get(VERSIONS, second.id).decode()
        for number, body in enumerate([b"\xff not json", b"[1, 2]", json.dumps(
                {"format_version": 1, "version": second.id, "record": record}).encode(),
                json.dumps({"format_version": 1, "version": "0" * 64,
                            "record": record.replace(second.root.hex, "1" * 64)}).encode()],
                start=90):
            store.objects.put(LEASES, f"{RUN}@slot-{number:012d}", body)
        with pytest.warns(LeaseSetAsideWarning):  # the removal's look at the slots
            store.delete(second.id)  # withdraws r@2: its intent is in slot 92
        assert store.gc(grace=0).chunks_deleted > 0  # warns nothing (warnings are errors)
    _consistent(path, [first.id])


def test_a_bulk_delete_whose_s3_server_is_down_is_a_typed_error_of_a_readable_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A DeleteObjects of 1,000 records to an S3 endpoint where nothing listens (a closed
    loopback port): :class:`BackendUnavailableError`, naming the first key and how many
    more, not every key of the batch (77 KB of message before)."""
    from chunkstore.errors import BackendUnavailableError
    from tests.s3server import unreachable_backend
    backend = unreachable_backend(monkeypatch)
    keys = [f"versions/{i:064x}" for i in range(1000)]
    with pytest.raises(BackendUnavailableError) as caught:
        backend.delete_many(keys)
    assert f"{keys[0]} and 999 more" in str(caught.value)
    assert len(str(caught.value)) < 2000, len(str(caught.value))


@pytest.fixture
def s3_url(s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[str]:
    monkeypatch.setenv("CHUNKSTORE_CACHE_DIR", str(tmp_path / "cache"))  # the indexes
    bucket = create_bucket(s3_endpoint)
    try:
        yield f"s3://{bucket}/ckpts"
    finally:
        remove_bucket(s3_endpoint, bucket)


def test_on_s3_a_gc_keeps_the_intent_of_a_commit_that_never_put_its_record(
        s3_endpoint: str, s3_url: str) -> None:
    """On the moto server, in process: r@2's save claims its slot and then its record's
    PUT fails (its writer gives up: its session ends, its objects are orphans); gc
    --grace 0 sweeps; a takeover rolls r@2 forward, whole (docs/format.md §11.5)."""
    from chunkstore.backends.wrappers import RequestHook

    class NoRecord(RequestHook):
        def request(self, operation: str, key: str) -> None:
            if operation == "put" and key.startswith(VERSIONS.prefix):
                raise OSError("the record's PUT fails")

    options = storage_options(s3_endpoint)
    with chunkstore.open(s3_url, create=True, storage_options=options) as store:
        owner = RunLease(store.objects, RUN)
        owner.acquire()
        try:
            first = _save(store, 1, owner)
            inner = store.objects.backend
            store.backend = store.objects.backend = NoRecord(inner)
            with pytest.raises(OSError):
                _save(store, 2, owner)
            store.backend = store.objects.backend = inner
            assert store.gc(grace=0).swept
            taker = RunLease(store.objects, RUN)
            taker.acquire(takeover=True)
            taker.release()
        finally:
            owner.release()
        assert taker.head is not None and taker.head != first.id
    with chunkstore.open(s3_url, storage_options=options) as store:
        assert [v.step for v in store.versions(RUN)] == [1, 2]
        _loads(store, taker.head)
        _verified(store)


@pytest.mark.parametrize("fault", [  # two of the kills in ./dev test-slow (CI runs both)
    pytest.param("kill-before-put:removed/:5", marks=pytest.mark.slow_job),
    "kill-after-put:removed/:11",
    pytest.param("kill-after-delete:versions/:11", marks=pytest.mark.slow_job), None,
])
def test_a_prune_on_s3_killed_at_each_step_leaves_every_kept_version_whole(
        s3_endpoint: str, s3_url: str, tmp_path: Path, fault: str | None) -> None:
    """On the moto server: a prune of 12 versions of 16 (one DeleteObjects) killed among
    its tombstones, after the last of them, or after its last record delete (before its
    index): every version still published loads, its refcounts verify, and the prune run
    again finishes, leaving the newest four."""
    options = storage_options(s3_endpoint)
    with chunkstore.open(s3_url, create=True, storage_options=options) as store:
        ids = [_save(store, step).id for step in range(1, 17)]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CHUNKSTORE_FAULT")},
           "AWS_ENDPOINT_URL": s3_endpoint}
    prune = [sys.executable, "-m", "chunkstore", "prune", s3_url, "--keep-last", "4"]
    done = subprocess.run(prune, env={**env, "CHUNKSTORE_FAULT": fault} if fault else env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
                          check=False)
    assert done.returncode == (-signal.SIGKILL if fault else 0), done.stderr
    with chunkstore.open(s3_url, storage_options=options) as store:
        published = set(store.stored_version_ids())
        assert set(ids[12:]) <= published
        assert {v.id for v in store.versions(RUN)} == published
        for vid in published:
            _loads(store, vid)
        _verified(store)
        assert all(store.objects.exists(TOMBSTONES, vid) for vid in set(ids) - published)
    again = subprocess.run(prune, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=180, check=False)
    assert again.returncode == 0, again.stderr
    with chunkstore.open(s3_url, storage_options=options) as store:
        assert [v.id for v in store.versions(RUN)] == ids[12:]
        store.gc(grace=0)
        for vid in ids[12:]:
            _loads(store, vid)
        _verified(store)


def test_a_prune_of_several_batches_of_several_runs_counts_each_version_out_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of three versions (1,000 in use): a prune of 11 versions of three runs
    takes four batches, each its own tombstones, withdrawals, bulk delete and index
    transaction; refcounts verify and every kept version loads."""
    from chunkstore.handle import removal
    monkeypatch.setattr(removal, "DELETE_BATCH", 3)
    path = tmp_path / "s"
    ids = _filled(path, ("r", "q", "pp"), steps=6)
    with chunkstore.open(path) as store:
        store.tag(ids["pp"][0], "first")
        removed = [v.id for v in store.prune(keep_last=2).removed]
        assert sorted(removed) == sorted(ids["r"][:4] + ids["q"][:4] + ids["pp"][1:4])
        _verified(store)
    _consistent(path, [vid for run in ids.values() for vid in run if vid not in removed])


@pytest.mark.parametrize("damage", ["not json", "not an object", "no time"])
def test_a_tombstone_whose_time_cannot_be_read_ages_from_its_write(tmp_path: Path,
                                                                   damage: str) -> None:
    """A tombstone whose removal time cannot be read counted as removed at each read: it
    never aged, so no GC deleted it, and one that still named its root kept its
    version's data for good.  It now counts from its object's last write: a GC with
    grace 0 deletes it, and the removed version's data with it."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        first, second = _save(store, 1), _save(store, 2)
        store.delete(first.id)
        body = {"not json": b"\xff not json", "not an object": b"[1, 2]",
                "no time": json.dumps({"format_version": 1, "version": first.id,
                                       "root": first.root.hex, "removed": "yesterday"}
                                      ).encode()}[damage]
        store.objects.put(TOMBSTONES, first.id, body)
        time.sleep(0.05)  # written before the GC starts, as by an earlier removal
        collected = store.gc(grace=0)
        assert collected.tombstones_deleted == 1, collected
        assert collected.chunks_deleted + collected.nodes_deleted > 0, collected
        assert not store.objects.exists(TOMBSTONES, first.id)
    _consistent(path, [second.id])
