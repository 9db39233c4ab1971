"""No single object stops the store: a save session or GC journal entry that cannot be
read, or whose owner cannot be alive, blocks GC, ``index rebuild`` and saves for a
lease at most (its stored time stands in for a heartbeat no live owner writes).

Each case runs on a local store and on the S3 server, every operation in a process
of its own with its own index directory (tests/machine_child.py), with a lease of a
few seconds so that aging out takes seconds.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import chunkstore
from chunkstore.index.lmdbindex import pid_namespace, process_start
from chunkstore.objects.kinds import JOURNAL, SESSIONS
from chunkstore.protocol.journal import FENCED, JournalEntry, new_entry_id, read_entry
from chunkstore.protocol.sessions import LEASE_S, list_sessions, owner_is_dead
from tests.machine_child import state
from tests.s3server import s3_endpoint
from tests.test_many_indexes import Cluster, cluster

__all__ = ["cluster", "s3_endpoint"]  # the fixtures, re-exported so pytest finds them here

LEASE = 3.0  # seconds, in the processes each case runs


def _short_lease(cluster: Cluster) -> None:
    cluster.env["CHUNKSTORE_SESSION_LEASE"] = str(LEASE)


def _age_past_the_lease() -> None:
    time.sleep(LEASE + 1.0)


def test_sessions_that_cannot_be_believed_block_gc_and_rebuild_for_a_lease_at_most(
        cluster: Cluster) -> None:
    """A session object a power cut left empty, one of another host whose heartbeat is
    years ahead, and one whose heartbeat is not finite: once their objects are older
    than the lease, a GC deletes without waiting and ``index rebuild`` runs.  (They
    counted as alive for ever: every GC waited out its session wait and deleted
    nothing, and rebuild refused.)"""
    _short_lease(cluster)
    first = cluster.run("a", "save", "a", 1, 1)
    cluster.run("a", "rm", first)
    future = time.time() + 10 * 365 * 86400
    planted = {
        "empty": b"",
        "future": json.dumps({"format_version": 1, "host": "elsewhere", "pid": 4242,
                              "started": future, "heartbeat": future, "seen": []}).encode(),
        "infinite": b'{"format_version": 1, "host": "elsewhere", "pid": 4242,'
                    b' "started": 1e999, "heartbeat": 1e999, "seen": []}',
    }
    with cluster.open("t") as store:
        for name, body in planted.items():
            store.objects.put(SESSIONS, f"{name}-{uuid.uuid4().hex}", body)
    _age_past_the_lease()
    began = time.monotonic()
    result = cluster.run("b", "gc", 0)  # waits up to 30 s for live sessions
    assert time.monotonic() - began < 20
    assert result["deferred"] == 0 and result["sessions_waited_for"] == 0
    assert result["chunks_deleted"] + result["orphans_deleted"] > 0
    assert "refused" not in cluster.run("c", "rebuild")
    later = cluster.run("a", "save", "a", 2, 1)  # a@1's bytes again: written anew
    cluster.assert_all_whole("d", {later: state(1)})


def _planted_entry(store: chunkstore.Store, owner: dict[str, object],
                   version_id: str) -> str:
    """A fenced GC journal entry naming every chunk of a version, as no GC writes it."""
    entry = JournalEntry(new_entry_id(), FENCED, {**owner, "created": time.time()},
                         frozenset(store.index.version_refs(version_id)))
    store.objects.put(JOURNAL, entry.id, entry.encode())
    return entry.id


def test_fences_whose_owners_cannot_be_alive_never_stop_a_save(cluster: Cluster) -> None:
    """Fenced entries naming a version's chunks, one owned by pid 1 of this host with no
    start time to tell it from init, one by another host with a heartbeat years ahead:
    once their objects are older than the lease, a save of the same bytes writes them
    itself and publishes.  (Each save waited 600 s and failed, save after save; either
    entry alone keeps the save waiting while its owner is believed.)"""
    _short_lease(cluster)
    first = cluster.run("a", "save", "a", 1, 1)
    owners: list[dict[str, object]] = [
        {"host": socket.gethostname(), "pid": 1, "pidns": pid_namespace(),
         "heartbeat": time.time()},
        {"host": "elsewhere", "pid": 4242, "heartbeat": time.time() + 10 * 365 * 86400}]
    with cluster.open("t") as store:
        for owner in owners:
            _planted_entry(store, owner, first)
    _age_past_the_lease()
    began = time.monotonic()
    again = cluster.run("b", "save", "b", 1, 1)
    assert time.monotonic() - began < 60
    cluster.assert_all_whole("c", {first: state(1), again: state(1)})


def test_a_fence_is_waited_for_while_its_owner_may_be_alive(tmp_path: Path) -> None:
    """The other side: the same entries, their objects written just now, are still
    active (a GC elsewhere may be deleting those chunks), and an entry of a live
    process of this host is active whatever its age."""
    now = time.time()
    pid_1 = {"host": socket.gethostname(), "pid": 1, "pidns": pid_namespace(),
             "heartbeat": now}
    assert not owner_is_dead(pid_1, now)
    assert owner_is_dead({**pid_1, "heartbeat": now - LEASE_S - 1}, now)  # was: never
    me = {"host": socket.gethostname(), "pid": os.getpid(), "pidns": pid_namespace(),
          "process_start": process_start(os.getpid()), "heartbeat": now - 10 * LEASE_S}
    assert not owner_is_dead(me, now)
    with chunkstore.open(tmp_path / "s", create=True) as store:
        with store.new_version("r", 1) as version:
            version.put("w", state(1)["model.own"])
        entry_id = _planted_entry(store, {"host": "elsewhere", "pid": 7,
                                          "heartbeat": now + 10 * 365 * 86400},
                                  version.info.id)
        entry = read_entry(store.objects, entry_id)
        assert entry is not None and entry.active(time.time())  # stored a moment ago
        assert entry.info["heartbeat_from"] == "stored time"
        store.objects.put(SESSIONS, "empty", b"")
        (session,) = list_sessions(store.objects)
        assert not session.dead(time.time())  # written a moment ago: maybe a live save


def test_a_gc_that_deferred_says_so_and_exits_4(tmp_path: Path) -> None:
    """A save in progress (this process's session) outlasts --session-wait: gc deletes
    nothing, says it deferred, and exits 4 (it printed "freed 0 B" and exited 0)."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        with store.new_version("r", 1) as version:
            version.put("w", state(1)["model.own"])
        store.delete("r@1")
        me = {"format_version": 1, "host": socket.gethostname(), "pid": os.getpid(),
              "pidns": pid_namespace(), "process_start": process_start(os.getpid()),
              "started": time.time(), "heartbeat": time.time(), "seen": []}
        store.objects.put(SESSIONS, uuid.uuid4().hex, json.dumps(me).encode())
    done = subprocess.run([sys.executable, "-m", "chunkstore", "gc", str(path), "--grace",
                           "0", "--session-wait", "0.5"], capture_output=True, text=True,
                          check=False, timeout=120)
    assert done.returncode == 4, done.stderr
    assert re.search(r"deferred: \d+ objects?, for 1 save in progress", done.stdout)
    assert "nothing was deleted; run gc again" in done.stderr
