"""GC whose cost follows the garbage (issue 49): an idle GC lists no object, no version;
the orphan sweep runs when a dead save's session shows it can find something, on
demand, and on a schedule; a live save's session is never retired.

Every store is real (files, LMDB, processes killed or stopped for real); a save
"on another machine" uses an index directory of its own, so that what it writes is
unknown to the GC's index until a sweep finds it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.backends.fsspec_backend import FsspecBackend
from chunkstore.backends.wrappers import FAULT_ENV_VAR, RequestHook
from chunkstore.cli import cli
from chunkstore.format.digest import Digest
from chunkstore.maintenance.sweep import STATE_FILE
from chunkstore.objects.kinds import CHUNKS, SESSIONS
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

ROOT = Path(__file__).resolve().parent.parent
HOUR = 3600.0
CHUNK = 4096

#: A save of run ``k`` at step 1 into ``url`` with its own index (``index_dir``): new
#: objects only (a state no other save writes).  ``CHUNKSTORE_FAULT`` kills it.
SAVER = """
import sys
import numpy as np
import chunkstore
url, index_dir = sys.argv[1:3]
with chunkstore.open(url, index_dir=index_dir) as store:
    with store.new_version(run="k", step=1) as version:
        for i in range(4):
            version.put(f"t{i}", np.random.default_rng(i + 50).standard_normal(40_000))
print("published", flush=True)
"""

#: A save that stores its session, waits for a line on its stdin, then writes and stops
#: (SIGSTOP, every thread) right before its commit record: every chunk and node it needs
#: is stored, and its session is alive.
STOPPED_SAVER = """
import os, signal, sys
import numpy as np
import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend
url, index_dir = sys.argv[1:3]
class StopBeforeCommit(ForwardingBackend):
    def put_if_absent(self, key, data):
        if key.startswith("versions/"):
            print("stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().put_if_absent(key, data)
with chunkstore.open(url, index_dir=index_dir) as store:
    store.backend = StopBeforeCommit(store.backend)
    with store.new_version(run="live", step=1) as version:
        print("session", flush=True)
        sys.stdin.readline()
        version.put("w", np.arange(200_000, dtype=np.float32) + 3)
print("published", flush=True)
"""


def objects(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for kind in ("chunks", "nodes")
            for p in (root / kind).rglob("*") if p.is_file()}


def sessions(root: Path) -> set[str]:
    return {p.name for p in (root / "sessions").iterdir()} \
        if (root / "sessions").is_dir() else set()


def save_base(root: Path, chunks: int = 8, versions: int = 1) -> None:
    """``versions`` versions of ``chunks`` unique chunk objects in all (4 KiB each)."""
    per = chunks // versions
    counter = np.arange(per * CHUNK // 8, dtype=np.uint64)
    with chunkstore.open(root, chunk_size=CHUNK, compression="none", create=True) as store:
        for v in range(versions):
            with store.new_version("base", v + 1) as version:
                version.put("w", counter + np.uint64(v * counter.size))


def run_saver(root: Path, index: Path, fault: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV_VAR}
    if fault is not None:
        env[FAULT_ENV_VAR] = fault
    return subprocess.run([sys.executable, "-c", SAVER, str(root), str(index)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120, check=False)


# --- an idle GC ------------------------------------------------------------------------------


class Counting(RequestHook):
    """Counts requests by operation and prefix; a listing also by the keys it returned
    (``list-keys``) and the S3 LIST requests those take (``list-pages``, 1,000 keys
    each).  The GC's heartbeat thread (a journal entry's renewal) is not counted."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, operation: str, key: str, n: int = 1) -> None:
        if threading.current_thread() is threading.main_thread():
            with self._lock:
                self.counts[f"{operation} {key.split('/', 1)[0]}"] += n

    def request(self, operation: str, key: str) -> None:
        if operation == "walk":
            self.count("walk", "(the whole store)")
        elif operation != "list":  # counted once read, with its keys and pages
            self.count(operation, key)

    def listed(self, prefix: str, count: int) -> None:
        self.count("list", prefix)
        self.count("list-keys", prefix, count)
        self.count("list-pages", prefix, max(1, math.ceil(count / 1000)))


def idle_gc_requests(root: Path) -> tuple[Counter[str], chunkstore.GcResult]:
    """The requests of a GC with nothing to do, on a store that had some work before:
    a version removed and collected (the run after that is idle again)."""
    with chunkstore.open(root) as store:
        store.gc(grace=0)  # the index's first GC: its first sweep
        store.delete("base@1")
        assert store.gc(grace=0).chunks_deleted > 0
        plain = store.backend
        counting = Counting(plain)
        store.backend = counting
        try:
            result = store.gc(grace=0)
        finally:
            store.backend = plain
        return counting.counts, result


def test_an_idle_gc_makes_the_same_requests_at_1k_and_10k_objects(tmp_path: Path) -> None:
    """1,000 objects in 2 versions and 10,000 in 20: the idle GC after a collection
    makes the same requests, lists the same (few) keys, and lists no object, no version,
    no moved record and walks nothing."""
    found = {}
    for chunks, versions in ((1000, 2), (10_000, 20)):
        root = tmp_path / f"s{chunks}"
        save_base(root, chunks, versions)
        counts, result = idle_gc_requests(root)
        assert not result.swept and result.sweep_reason == "not due", result
        assert result.chunks_deleted + result.nodes_deleted + result.orphans_deleted == 0
        assert result.versions_considered == versions - 1
        found[chunks] = counts
    assert found[1000] == found[10_000], found
    listed = {key.split(" ", 1)[1] for key in found[1000] if key.startswith("list ")}
    assert not listed & {"chunks", "nodes", "versions", "moved", "tags", ""}, listed
    assert not any(key.startswith("walk") for key in found[1000])
    # What is listed: the journal's one finished entry (the collection's, kept for other
    # indexes to learn from; docs/format.md 11.2), twice (the sync, the prune).
    assert {key: n for key, n in found[1000].items() if key.startswith("list-keys") and n} \
        == {"list-keys gc": 2}, found[1000]
    # Five listings (sessions/, removed/, gc/ twice, readers/), and the prune of the
    # collection's journal entry behind a horizon marker (two reads, a put, a delete).
    assert sum(n for key, n in found[1000].items()
               if not key.startswith(("list-keys", "list-pages"))) <= 10, found[1000]


# --- the orphans of killed saves ---------------------------------------------------------------


@pytest.mark.parametrize("index", ["another-index", "the-same-index"])
def test_a_killed_saves_orphans_go_with_the_gc_that_finds_its_dead_session(
        tmp_path: Path, index: str) -> None:
    """A save SIGKILLed right before its commit record (every chunk and node stored):
    the next GC (grace 0) finds its session dead, sweeps, deletes every object it wrote
    and its session object; the run after it does not sweep again."""
    root = tmp_path / "store"
    save_base(root)
    gc_index = root / "index"
    with chunkstore.open(root) as store:
        assert store.gc(grace=0).swept  # this index's first sweep: the schedule is met
        assert not store.gc(grace=0).swept
    before = objects(root)
    saver_index = tmp_path / "elsewhere" if index == "another-index" else gc_index
    killed = run_saver(root, saver_index, "kill-before-put:versions/:0")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = objects(root) - before
    assert left and len(sessions(root)) == 1
    with chunkstore.open(root) as store:
        result = store.gc(grace=0)
        assert result.swept, result
        assert result.sweep_reason.startswith("1 dead save session")
        assert result.dead_sessions == 1 and result.sessions_retired == 1
        freed = result.orphans_deleted + result.chunks_deleted + result.nodes_deleted
        assert freed == len(left)
        assert objects(root) == before
        assert sessions(root) == set()
        again = store.gc(grace=0)
        assert not again.swept and again.dead_sessions == 0
        assert store.verify().ok
        assert [f"{v.run}@{v.step}" for v in store.versions()] == ["base@1"]


def test_a_dead_sessions_leftovers_are_swept_once_past_the_grace_period(
        tmp_path: Path) -> None:
    """With a grace period the GC that finds the dead session cannot delete what it
    wrote yet: it remembers when it saw it dead (beside its index) and says when the
    sweep is due; the first GC past that sweeps it up, whatever the schedule."""
    root = tmp_path / "store"
    save_base(root)
    with chunkstore.open(root) as store:
        store.gc(grace="1h")  # the first sweep: the schedule is met for a day
    before = objects(root)
    killed = run_saver(root, tmp_path / "elsewhere", "kill-before-put:nodes/:0")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = objects(root) - before
    assert left
    with chunkstore.open(root) as store:
        seen_at = time.time()
        first = store.gc(grace="1h")
        assert not first.swept and first.dead_sessions == 1, first
        assert first.next_sweep_due == pytest.approx(seen_at + HOUR, abs=30)
        state = json.loads((root / "index" / STATE_FILE).read_text())
        assert list(state["dead_since"]) == list(sessions(root))
        # Later, as a new process: what was remembered counts, not when it is seen now.
    with chunkstore.open(root) as store:
        assert not store.gc(grace="1h", clock=lambda: time.time() + 0.5 * HOUR).swept
        result = store.gc(grace="1h", clock=lambda: time.time() + 2 * HOUR)
        assert result.swept and result.sweep_reason.startswith("1 dead save session")
        assert result.orphans_deleted == len(left) and result.sessions_retired == 1
        assert objects(root) == before and sessions(root) == set()
        assert store.verify().ok


def test_a_dry_run_says_it_would_sweep_and_records_nothing(tmp_path: Path) -> None:
    """``gc --dry-run`` takes the same decision (dead session: would sweep, would delete
    its objects) and changes nothing: no object, no session, no record."""
    root = tmp_path / "store"
    save_base(root)
    with chunkstore.open(root) as store:
        store.gc(grace=0)
    before = objects(root)
    killed = run_saver(root, tmp_path / "elsewhere", "kill-before-put:versions/:0")
    assert killed.returncode == -signal.SIGKILL
    left = objects(root) - before
    state = (root / "index" / STATE_FILE).read_bytes()
    with chunkstore.open(root) as store:
        dry = store.gc(grace=0, dry_run=True)
        assert dry.swept and dry.sweep_reason.startswith("1 dead save session")
        assert dry.orphans_deleted == len(left) and dry.sessions_retired == 0
        assert objects(root) - before == left and len(sessions(root)) == 1
        assert (root / "index" / STATE_FILE).read_bytes() == state
        real = store.gc(grace=0)
        assert real.orphans_deleted == dry.orphans_deleted
        assert (real.swept, real.sweep_reason) == (dry.swept, dry.sweep_reason)


# --- on demand and on schedule, from the command line ------------------------------------------


def cli_gc(root: Path, *args: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["gc", str(root), "--grace", "1h", "--json", *args],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out: dict[str, Any] = json.loads(result.output)
    return out


def test_gc_json_says_whether_it_swept_why_and_when_the_next_is_due(tmp_path: Path) -> None:
    """An object no index and no session knows (written behind the store's back two
    hours ago): the default gc leaves it until the scheduled sweep, ``--sweep`` takes
    it now (``--dry-run --sweep`` says so and keeps it), ``--no-sweep`` never."""
    root = tmp_path / "store"
    save_base(root)
    first = cli_gc(root)
    assert first["swept"] and first["sweep_reason"] == "no complete sweep recorded for" \
        " this index"
    assert first["next_sweep_due"] == pytest.approx(first["last_sweep"] + 24 * HOUR)
    stray = root / CHUNKS.key(Digest.of(b"written behind the store's back"))
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"CSCK-stray")
    old = time.time() - 2 * HOUR
    os.utime(stray, (old, old))
    idle = cli_gc(root)
    assert (idle["swept"], idle["sweep_reason"], idle["orphans_deleted"]) == (
        False, "not due", 0)
    assert idle["next_sweep_due"] == first["next_sweep_due"] and stray.exists()
    assert not cli_gc(root, "--no-sweep")["swept"]
    dry = cli_gc(root, "--dry-run", "--sweep")
    assert (dry["swept"], dry["sweep_reason"], dry["orphans_deleted"]) == (
        True, "asked for (--sweep)", 1)
    assert dry["last_sweep"] == first["last_sweep"] and stray.exists()
    forced = cli_gc(root, "--sweep")
    assert forced["swept"] and forced["orphans_deleted"] == 1 and not stray.exists()
    assert forced["last_sweep"] > first["last_sweep"]
    text = CliRunner().invoke(cli, ["gc", str(root)], catch_exceptions=False).output
    assert "orphan sweep: no sweep (not due); next due in 23h59m" in text or \
        "orphan sweep: no sweep (not due); next due in 1d" in text, text


# --- retiring dead sessions never retires a live one ----------------------------------------


def test_a_sweep_retires_dead_sessions_only_and_a_live_saves_objects_stay(
        tmp_path: Path) -> None:
    """A save killed after storing its session (dead, wrote nothing) and a save on
    another index, seen by the same GCs, that writes afterwards and stops before its
    commit record (alive).  A sweep for the dead session retires it and only it; a
    later forced sweep, with the live save's objects past the grace period and unknown
    to its index, waits for that save and deletes nothing; the save, continued,
    publishes a version that reads back whole."""
    root = tmp_path / "store"
    save_base(root)
    with chunkstore.open(root) as store:
        store.gc(grace=0)
    dead = run_saver(root, tmp_path / "dead-index", "kill-after-put:sessions/:0")
    assert dead.returncode == -signal.SIGKILL
    (dead_session,) = sessions(root)
    live = subprocess.Popen([sys.executable, "-c", STOPPED_SAVER, str(root),
                             str(tmp_path / "live-index")], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert live.stdin is not None and live.stdout is not None
        assert live.stdout.readline().strip() == "session"
        live_session = sessions(root) - {dead_session}
        assert len(live_session) == 1
        with chunkstore.open(root) as store:
            seen_at = time.time()
            first = store.gc(grace="1h")  # both seen now; the dead one is not ready yet
            assert first.dead_sessions == 1 and not first.swept, first
        time.sleep(1.5)
        live.stdin.write("go\n")
        live.stdin.flush()
        assert live.stdout.readline().strip() == "stopping"
        deadline = time.monotonic() + 30
        while Path(f"/proc/{live.pid}/stat").read_text().split()[2] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        written = objects(root)
        with chunkstore.open(root) as store:
            # The grace period ends between the sightings and the live save's writes: the
            # dead session is ready, the live one's objects are young.
            frozen = seen_at + 0.5 + HOUR
            result = store.gc(grace="1h", clock=lambda: frozen)
            assert result.swept and result.sessions_retired == 1, result
            assert sessions(root) == live_session
            assert objects(root) == written
            later = store.gc(grace="1h", sweep=True, session_wait=1,
                             clock=lambda: time.time() + 2 * HOUR)
            assert later.orphans_deleted == 0 and objects(root) == written, later
            assert later.deferred > 0 and later.sessions_waited_for == 1, later
            assert later.last_sweep == result.last_sweep  # deferred: not complete
    finally:
        live.send_signal(signal.SIGCONT)
        out, err = live.communicate(input="go\n", timeout=60)
    assert live.returncode == 0 and "published" in out, err
    with chunkstore.open(root) as store:
        assert store.verify().ok
        np.testing.assert_array_equal(store.open_version("live@1").get("w"),
                                      np.arange(200_000, dtype=np.float32) + 3)
        assert sessions(root) == set()
        assert not store.objects.exists(SESSIONS, dead_session)


# --- a sweep on S3, page by page -------------------------------------------------------------


@pytest.mark.s3
def test_an_s3_sweep_lists_page_by_page_and_finds_orphans_on_every_page(
        s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full sweep on the moto server, listing in pages of 2 keys (S3 sends 1,000):
    orphans on every page of the chunk listing are each found and deleted, what the
    version reaches stays, and the sweep reads the whole listing (FsspecBackend._pages
    streams it, the sweep keeps only the orphans)."""
    monkeypatch.setattr(FsspecBackend, "list_page_keys", 2)
    bucket = create_bucket(s3_endpoint)
    try:
        with chunkstore.open(f"s3://{bucket}/store", storage_options=storage_options(
                s3_endpoint), index_dir=str(tmp_path / "index"), chunk_size=CHUNK,
                compression="none", create=True) as store:
            with store.new_version("base", 1) as version:
                version.put("w", np.arange(9 * CHUNK // 8, dtype=np.uint64))
            store.gc(grace=0)  # this index's first sweep
            kept = set(store.backend.list("chunks/"))
            orphans = {CHUNKS.key(Digest(bytes([first]) * 32))
                       for first in (0, 0x40, 0x80, 0xC0, 0xFF)}
            for key in orphans:
                store.backend.put(key, b"left by a save on another machine")
            listing = sorted(kept | orphans)
            pages = {listing.index(key) // 2 for key in orphans}
            assert len(pages) > 2 and pages == set(range(-(-len(listing) // 2)))
            plain = store.backend
            counting = Counting(plain)
            store.backend = counting
            try:
                result = store.gc(grace=0, sweep=True)
            finally:
                store.backend = plain
            assert result.swept and result.orphans_deleted == len(orphans), result
            assert set(store.backend.list("chunks/")) == kept
            assert counting.counts["list-keys chunks"] == len(listing)
            assert store.verify().ok
    finally:
        remove_bucket(s3_endpoint, bucket)
