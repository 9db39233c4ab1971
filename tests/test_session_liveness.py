"""A heartbeat that is not a finite time (NaN, inf, -inf) proves no owner alive: GC
counts such a session or index write session dead, never alive for ever."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import chunkstore
from chunkstore.objects.kinds import SESSIONS
from chunkstore.protocol.sessions import LEASE_S, list_sessions, owner_is_dead

NOT_FINITE = [float("nan"), float("inf"), float("-inf"), 10**400]


@pytest.mark.parametrize("heartbeat", NOT_FINITE, ids=["nan", "inf", "-inf", "huge-int"])
def test_an_owner_elsewhere_whose_heartbeat_is_not_finite_is_dead(heartbeat: float) -> None:
    """owner_is_dead as GC applies it to the index's write sessions, with no stored time
    to stand in: a NaN compared false with every time, so it was never dead."""
    now = time.time()
    owner = {"host": "elsewhere", "pid": 4242, "heartbeat": heartbeat, "started": now}
    assert owner_is_dead(owner, now)
    assert not owner_is_dead({**owner, "heartbeat": now}, now)


@pytest.mark.parametrize("heartbeat", [b"NaN", b"Infinity", b"1e999"])
def test_a_session_object_whose_heartbeat_is_not_finite_lives_a_lease_from_its_write(
        tmp_path: Path, heartbeat: bytes) -> None:
    """The same in the store: the object's stored time stands in, so it counts as alive
    while it may be a live save's (just written) and dead a lease after its write."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        body = (b'{"format_version": 1, "host": "elsewhere", "pid": 4242, "seen": [],'
                b' "started": 1.0, "heartbeat": ' + heartbeat + b"}")
        store.objects.put(SESSIONS, "nan", body)
        (session,) = list_sessions(store.objects)
        assert not session.dead(time.time())
        old = time.time() - LEASE_S - 60
        os.utime(tmp_path / "s" / "sessions" / "nan", (old, old))
        (session,) = list_sessions(store.objects)
        assert session.dead(time.time())


def test_a_heartbeat_in_the_future_lives_by_the_object_s_stored_time(tmp_path: Path) -> None:
    """A heartbeat ahead of the reader's clock (by any amount) proves nothing: the
    object's stored time stands in, so it counts dead a lease after its write; and a
    local process found alive keeps no silent object alive (issue 47, item 5)."""
    from chunkstore.index.lmdbindex import pid_namespace, process_start
    with chunkstore.open(tmp_path / "s", create=True) as store:
        now = time.time()
        body = (b'{"format_version": 1, "host": "elsewhere", "pid": 4242, "seen": [],'
                b' "started": 1.0, "heartbeat": ' + str(now + 60).encode() + b"}")
        store.objects.put(SESSIONS, "ahead", body)
        (session,) = list_sessions(store.objects)
        assert session.info["heartbeat_from"] == "stored time"
        assert not session.dead(time.time())
        old = time.time() - LEASE_S - 60
        os.utime(tmp_path / "s" / "sessions" / "ahead", (old, old))
        (session,) = list_sessions(store.objects)
        assert session.dead(time.time())
    import socket
    me = {"host": socket.gethostname(), "pid": os.getpid(), "pidns": pid_namespace(),
          "process_start": process_start(os.getpid())}
    from chunkstore.protocol.sessions import owner_is_silent
    assert not owner_is_silent({**me, "heartbeat": now}, now)
    assert owner_is_silent({**me, "heartbeat": now - LEASE_S - 1}, now)
    assert not owner_is_dead({**me, "heartbeat": now - LEASE_S - 1}, now)  # index sessions
