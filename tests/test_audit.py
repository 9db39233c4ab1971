"""The audit trail (chunkstore.protocol.audit, docs/format.md §16): an event for every
publish, removal, tag change, hold and release, key change and GC deletion run, stored
before the change; none missing after a SIGKILL at a save's or a removal's commit point;
damaged events listed, never fatal; pruned only by ``audit --prune-before``, which
records itself; sealed in an encrypted store; the same on the moto S3 server.

Each safety test was seen to fail with its guard broken: the publish event moved after
the commit record, and a removal's intents moved after its batches (the SIGKILL test);
a GC's intent moved after its deletions (the request-order test); audit events kept in
clear in an encrypted store (the sealing test); the JSON guard of ``decode_event``
removed (the damaged-event test: the listing crashed); a prune that deletes a newer
event (the prune test)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import chunkstore
from chunkstore.backends.wrappers import FAULT_ENV_VAR, RequestHook
from chunkstore.cli import EXIT_USAGE, cli
from chunkstore.objects.keys import TEST_KDF_ENV, list_keys
from chunkstore.objects.kinds import AUDIT, VERSIONS
from chunkstore.objects.signing import generate_key
from chunkstore.protocol.audit import MAX_EVENT_BYTES, AuditEvent, event_id_at
from tests.conftest import tree_snapshot
from tests.s3server import s3_endpoint, two_indexes

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

REPO = Path(__file__).resolve().parent.parent


def _save(store: chunkstore.Store, step: int, run: str = "r") -> str:
    with store.new_version(run, step) as version:
        version.put("w", np.arange(256, dtype=np.float32) + step)
    return version.info.id


def _ops(store: chunkstore.Store, **filters: Any) -> list[tuple[str | None, str | None]]:
    return [(e.op, e.phase) for e in store.audit(**filters)]


def _named(event: AuditEvent) -> list[str]:
    return [v["id"] for v in event.fields.get("versions", [])]


def run_cli(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def test_each_operation_records_its_events_before_it_changes_the_store(tmp_path: Path
                                                                       ) -> None:
    """Publish, tag, untag, hold, release, rm (one event for three versions), prune,
    purge and GC each leave their events, naming what they changed; a refused rm
    records nothing and changes nothing; sync records a copy in the destination and
    copies no event."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        ids = [_save(store, step) for step in range(8)]
        events = list(store.audit())
        assert [(e.op, e.phase) for e in events] == [("publish", "intent")] * 8
        assert [_named(e) for e in events] == [[vid] for vid in ids]
        assert {e.who for e in events} == {events[0].who} and "@" in str(events[0].who)
        assert all(str(e.process).startswith(f"pid {os.getpid()} ") for e in events)
        since = next(store.audit()).when
        store.tag("r@1", "best")
        store.untag("best")
        store.hold("r@0", "dispute 7")
        before = tree_snapshot(tmp_path / "s")
        with pytest.raises(chunkstore.errors.HeldVersionError):
            store.delete_many(["r@0", "r@2"])  # refused before anything changed
        assert tree_snapshot(tmp_path / "s") == before
        store.release("r@0")
        store.delete_many(["r@0", "r@1", "r@2"])
        store.prune(keep_last=3, verify=False)  # removes r@3, r@4
        store.purge("r@5", grace=0)
        store.gc(grace=0)
        assert _ops(store)[8:] == [
            ("tag", "intent"), ("untag", "intent"), ("hold", "intent"), ("release", "intent"),
            ("rm", "intent"), ("rm", "done"), ("prune", "intent"), ("prune", "done"),
            ("purge", "intent"), ("purge", "done"), ("purge-gc", "intent"),
            ("purge-gc", "done"), ("gc", "intent"), ("gc", "done")]
        trail = list(store.audit())
        rm, rm_done = trail[12], trail[13]
        assert _named(rm) == ids[:3] and rm_done.fields["intent"] == rm.id
        assert rm_done.fields["removed"] == 3
        assert trail[8].fields["tag"] == "best" and trail[10].fields["reason"] == "dispute 7"
        assert _named(trail[14]) == ids[3:5]
        gc_done = trail[-1]
        assert gc_done.fields["chunks"] > 0 and gc_done.fields["bytes"] > 0
        assert gc_done.fields["intent"] == trail[-2].id
        assert store.gc(grace=0).chunks_deleted == 0 and len(list(store.audit())) == len(trail)
        assert _ops(store, since=since)[0] == ("publish", "intent")
        with chunkstore.open(tmp_path / "copy", create=True) as copy:
            chunkstore.sync(store, copy)
            assert _ops(copy) == [("sync", "intent")] * 2
            assert [_named(e)[0] for e in copy.audit()] == ids[6:]
            assert next(copy.audit()).fields["source"] == store.url
        assert _ops(store, run="other") == []


def test_checkpointer_keep_last_records_its_removal(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from torch_bridge import Checkpointer
    model = torch.nn.Linear(4, 2)
    ckpt = Checkpointer(tmp_path / "s", run="job", keep_last=1, async_save=False)
    for step in range(4):
        ckpt.save(step, model=model)
    ckpt.close()
    with chunkstore.open(tmp_path / "s") as store:
        ops = _ops(store, run="job")
    assert ops[:2] == [("publish", "intent")] * 2 and ("keep_last", "intent") in ops


class _Requests(RequestHook):
    """The order of the requests a store makes: (operation, key)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.log: list[tuple[str, str]] = []

    def request(self, operation: str, key: str) -> None:
        self.log.append((operation, key))

    def first(self, operation: str, prefix: str) -> int:
        return next(i for i, (op, key) in enumerate(self.log)
                    if op == operation and key.startswith(prefix))


def test_each_event_is_stored_before_the_change_it_announces(tmp_path: Path) -> None:
    """The request order: a save's event before its commit record, a removal's before
    its first tombstone and record deletion, a GC's before its first deletion."""
    with chunkstore.open(tmp_path / "s", create=True) as store:
        requests = _Requests(store.backend)
        store.backend = requests
        _save(store, 0)
        assert requests.first("put", "audit/") < requests.first("put", "versions/")
        requests.log.clear()
        store.delete("r@0")
        event = requests.first("put", "audit/")
        assert event < requests.first("put", "removed/")
        assert event < requests.first("delete_many", "versions/")
        requests.log.clear()
        store.gc(grace=0)
        assert requests.first("put", "audit/") < min(
            i for i, (op, key) in enumerate(requests.log)
            if op.startswith("delete") and key.startswith(("chunks/", "nodes/")))


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", json.dumps({
    "format": "chunkstore.audit", "format_version": 99}).encode(), b"x" * (MAX_EVENT_BYTES + 1),
    json.dumps({"format": "chunkstore.audit", "format_version": 1, "op": 3}).encode()])
def test_a_damaged_event_is_listed_as_damaged_and_never_stops_the_listing(
        tmp_path: Path, body: bytes) -> None:
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        _save(store, 0)
        store.objects.put(AUDIT, event_id_at(0) + "-00000000", body)  # the oldest
        _save(store, 1)
    listed = run_cli("audit", str(path), "--json")
    assert listed.exit_code == 0, listed.output
    events = json.loads(listed.output)["events"]
    assert [e["op"] for e in events] == [None, "publish", "publish"]
    assert events[0]["damage"] and events[1]["damage"] is None
    text = run_cli("audit", str(path), "--run", "r")
    assert text.exit_code == 0 and "DAMAGED" in text.output  # a damaged one may be r's
    assert text.output.count("publish") == 2


def test_prune_before_deletes_older_events_and_records_itself(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        _save(store, 0)
        _save(store, 1)
        (old, newer) = list(store.audit())
        cut = (old.when + newer.when) / 2  # type: ignore[operator]
    bad = run_cli("audit", str(path), "--prune-before", "yesterday-ish")
    assert bad.exit_code == EXIT_USAGE and "bad time" in bad.output
    iso = dt.datetime.fromtimestamp(cut, dt.timezone.utc).isoformat()
    pruned = run_cli("audit", str(path), "--prune-before", iso, "--json")
    assert pruned.exit_code == 0, pruned.output
    assert json.loads(pruned.output)["pruned"] == 1
    with chunkstore.open(path) as store:
        trail = list(store.audit())
        assert trail[0].id == newer.id
        assert trail[-1].op == "audit-prune" and trail[-1].fields["count"] == 1
        assert trail[-1].fields["first"] == old.id
        store.gc(grace=0, sweep=True)  # GC never deletes an event
        assert [e.id for e in store.audit()] == [e.id for e in trail]


def _crafted(**fields: Any) -> bytes:
    body = {"format": "chunkstore.audit", "format_version": 1, "op": "publish",
            "phase": "intent", "when": 1.0e9, "who": "a@b", "process": "pid 1 x", **fields}
    return json.dumps(body).encode()


def test_a_crafted_event_neither_writes_to_the_terminal_nor_lies_in_the_listing(
        tmp_path: Path) -> None:
    """Whoever can write the bucket can forge events (docs/format.md §16.2), but not
    make ``audit`` print escape sequences or line breaks (they print as ``?``), not give
    an event another id or a clean bill in ``--json``, and not stop the listing with a
    time no clock can print (1e300, 1e400: infinity), nor list itself out of time
    order (its id and ``when`` disagree, or its key is no event id).  Broken: without the printable
    guard the escapes reach the output; without the reserved-field check the forged id
    is listed; without the time check the text listing raised OverflowError; without
    the id check the last two are listed as sound; with every int ``bytes`` given to
    format_size the listing raised OverflowError again."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        _save(store, 0)
        crafted = {
            event_id_at(1) + "-00000001": _crafted(
                when=1.0, who="\x1b[2Jroot@prod", tag="\x1b]0;x\x07",
                process="pid 1\nfake line\x9b31m"),
            event_id_at(2) + "-00000002": _crafted(when=2.0,
                                                   id="20261205T000000.000000Z-00000000"),
            event_id_at(3) + "-00000003": _crafted(when=3.0, damage=None),
            event_id_at(4) + "-00000004": _crafted(when=1e300),
            event_id_at(5) + "-00000005": b'{"format":"chunkstore.audit","format_version":1,'
            b'"op":"gc","phase":"done","when":1e400,"who":"a@b","process":"p"}',
            # listed among 1970's events, it says it is of 2001
            event_id_at(6) + "-00000006": _crafted(),
            # a byte count no float holds: format_size raised OverflowError
            event_id_at(7) + "-00000007": _crafted(when=7.0, op="gc", bytes=10**400),
            # a key no writer makes: it sorts after every event, so no prune deletes it
            "zz-forever": _crafted(when=6.0)}
        for event_id, body in crafted.items():
            store.objects.put(AUDIT, event_id, body)
    text = run_cli("audit", str(path))
    assert text.exit_code == 0, text.output
    lines = text.output.splitlines()
    assert len(lines) == 9 and all(line.isprintable() for line in lines), lines
    assert "?[2Jroot@prod" in lines[0] and "bytes=1000000" in lines[6]
    listed = run_cli("audit", str(path), "--json")
    events = json.loads(listed.output)["events"]
    assert [e["id"] for e in events[:7]] + [events[8]["id"]] == list(crafted)
    assert [bool(e["damage"]) for e in events] == [False, True, True, True, True, True,
                                                   False, False, True]


def test_a_time_outside_years_1000_to_9999_keeps_its_place_in_key_order(tmp_path: Path
                                                                          ) -> None:
    """``--since`` and ``--prune-before`` before the year 1000: strftime wrote the year
    in three digits, an id that sorts after every event of this millennium, so
    ``--prune-before 0999-01-01`` deleted the whole trail and ``--since`` listed none.
    Broken: without the clamp in event_id_at both asserts fail."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        _save(store, 0)
    listed = run_cli("audit", str(path), "--since", "0999-01-01", "--json")
    assert len(json.loads(listed.output)["events"]) == 1
    assert event_id_at(-1e12) <= event_id_at(0) < event_id_at(1) < event_id_at(1e15)
    pruned = run_cli("audit", str(path), "--prune-before", "0999-01-01", "--json")
    assert pruned.exit_code == 0 and json.loads(pruned.output)["pruned"] == 0
    with chunkstore.open(path) as store:
        assert _ops(store) == [("publish", "intent"), ("audit-prune", "intent")]


def test_prune_before_a_future_time_is_refused(tmp_path: Path) -> None:
    """``--prune-before 2062-01-01`` (a typo of 2026) deleted every event, those of the
    operations running at the time included.  A time after now is a usage error that
    changes nothing.  Broken: without the check the store's tree changes."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        _save(store, 0)
    before = tree_snapshot(path)
    refused = run_cli("audit", str(path), "--prune-before", "2062-01-01")
    assert refused.exit_code == EXIT_USAGE and "future" in refused.output, refused.output
    assert tree_snapshot(path) == before


def test_who_is_the_process_owner_not_what_its_environment_says(tmp_path: Path) -> None:
    """``who`` came from getpass.getuser(), which believes $LOGNAME and $USER: any
    process recorded whatever name it was started with.  It is now the name of the
    process's user id.  Broken: with getuser() the event names "ceo"."""
    import pwd
    path = tmp_path / "s"
    chunkstore.open(path, create=True).close()
    env = {**os.environ, "LOGNAME": "ceo", "USER": "ceo", "LNAME": "ceo", "USERNAME": "ceo"}
    code = ("import sys, numpy as np, chunkstore\n"
            "with chunkstore.open(sys.argv[1]) as s, s.new_version('r', 0) as v:\n"
            "    v.put('w', np.zeros(4))\n")
    subprocess.run([sys.executable, "-c", code, str(path)], env=env, cwd=REPO, check=True,
                   timeout=120)
    with chunkstore.open(path) as store:
        who = next(store.audit()).who
    assert str(who).split("@")[0] == pwd.getpwuid(os.getuid()).pw_name != "ceo"


def test_repair_records_what_it_rewrites_and_a_dry_or_idle_repair_records_nothing(
        tmp_path: Path) -> None:
    """``repair`` rewrites commit records and signature objects (a copy made before its
    version was signed gets the signature this way, docs/format.md §14): each changes
    what a restore accepts, and it was recorded nowhere.  Broken: without the repair's
    events the first assert after the repair fails."""
    path, mirror = tmp_path / "s", tmp_path / "m"
    with chunkstore.open(path, create=True) as store:
        ids = [_save(store, step) for step in range(2)]
    assert chunkstore.sync(path, mirror).ok
    with chunkstore.open(path) as store:
        record = bytearray(store.objects.get(VERSIONS, ids[1]))
        record[len(record) // 2] ^= 0x04
        store.objects.put(VERSIONS, ids[1], bytes(record))
        trail = _ops(store)
    assert chunkstore.repair(path, mirror, dry_run=True).fixed  # would fix
    with chunkstore.open(path) as store:
        assert _ops(store) == trail
    assert chunkstore.repair(path, mirror).ok
    with chunkstore.open(path) as store:
        events = list(store.audit())
        assert [(e.op, e.phase) for e in events[len(trail):]] == [
            ("repair", "intent"), ("repair", "done")]
        intent, done = events[len(trail):]
        assert intent.fields["source"] == chunkstore.open(mirror).url
        assert done.fields["intent"] == intent.id and done.fields["fixed"] == 1
        assert done.fields["records"] == 1 and _named(done) == [ids[1]]
    assert chunkstore.repair(path, mirror).ok  # nothing to fix: nothing recorded
    with chunkstore.open(path) as store:
        assert len(list(store.audit())) == len(trail) + 2


def test_a_removals_done_event_names_every_tag_it_deleted(tmp_path: Path) -> None:
    """A version whose commit record cannot be read is removed with its tags, force or
    not; its done event said ``tags_removed: []`` while the tag was gone.  Broken: with
    ``tags_removed`` the tags of readable versions only, the test fails."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        vid = _save(store, 0)
        store.tag("r@0", "shipped")
        record = bytearray(store.objects.get(VERSIONS, vid))
        record[len(record) // 2] ^= 0x04
        store.objects.put(VERSIONS, vid, bytes(record))
    with chunkstore.open(path, index_dir=str(tmp_path / "fresh")) as store:
        store.delete(vid)
        assert "shipped" not in store.stored_tags()
        done = list(store.audit())[-1]
        assert (done.op, done.phase) == ("rm", "done")
        assert done.fields["tags_removed"] == ["shipped"] and done.fields["removed"] == 1


def test_a_signed_save_that_signs_an_existing_version_records_it(tmp_path: Path) -> None:
    """A signed save of a version published unsigned (same step, same content) signs
    that version (docs/format.md §14): its restores under ``require_signed`` change,
    and the trail said only ``publish, signed: false``.  Broken: without the event
    in sign_existing the test fails."""
    private = generate_key()[0]
    (tmp_path / "k").write_bytes(private)
    with chunkstore.open(tmp_path / "s", create=True) as store:
        vid = _save(store, 0)
        with store.new_version("r", 0, sign_with=str(tmp_path / "k")) as version:
            version.put("w", np.arange(256, dtype=np.float32))
        assert version.info.id == vid
        events = list(store.audit())
        assert [(e.op, e.phase) for e in events] == [("publish", "intent"), ("sign", "intent")]
        assert _named(events[1]) == [vid] and events[0].fields["signed"] is False
        with store.new_version("r", 0, sign_with=str(tmp_path / "k")) as version:
            version.put("w", np.arange(256, dtype=np.float32))  # signed already: nothing
        assert len(list(store.audit())) == 2


def test_a_tag_event_names_the_version_the_stored_tag_named(tmp_path: Path) -> None:
    """``previous`` was the tag as this process's index last saw it: a tag moved or
    deleted by a process whose index had not seen another's tag said ``previous:
    null`` (nothing overwritten) while it overwrote or deleted a tag naming a version.
    Broken: with the index's view the test fails."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        ids = [_save(store, step) for step in range(3)]
    with chunkstore.open(path, index_dir=str(tmp_path / "b")) as late, \
            chunkstore.open(path) as store:
        store.tag("r@1", "best")
        late.tag("r@2", "best")  # its index has not read the tag yet
        late.untag("best")
        tag, untag = list(late.audit())[-2:]
        assert (tag.op, tag.fields["previous"]) == ("tag", ids[1])
        assert (untag.op, untag.fields["previous"]) == ("untag", ids[2])


def _killed(path: Path, code: str, fault: str) -> None:
    env = {**os.environ, FAULT_ENV_VAR: fault}
    child = subprocess.run([sys.executable, "-c", code, str(path)], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == -9, child.stderr


SAVE_CODE = """
import sys, numpy as np, chunkstore
store = chunkstore.open(sys.argv[1])
with store.new_version("r", 5) as version:
    version.put("w", np.arange(256, dtype=np.float32) * 5)
"""
RM_CODE = """
import sys, chunkstore
chunkstore.open(sys.argv[1]).delete_many(["r@0", "r@1"])
"""


def test_a_sigkill_right_after_a_commit_point_leaves_the_intent_event(tmp_path: Path) -> None:
    """SIGKILL just after a save's commit record, then just after a removal's commit
    records were deleted: the version published and the versions removed are each named
    by an intent event; the killed removal has no done event (it did not finish)."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        for step in range(2):
            _save(store, step)
    _killed(path, SAVE_CODE, "kill-after-put:versions/:0")
    with chunkstore.open(path) as store:
        published = store.resolve("r@5").id
        assert _named(list(store.audit())[-1]) == [published]
        removed = [store.resolve("r@0").id, store.resolve("r@1").id]
    _killed(path, RM_CODE, "kill-after-delete:versions/:0")
    with chunkstore.open(path) as store:
        assert len(store.versions()) == 2  # killed after the first record's delete
        last = list(store.audit())[-1]
        assert (last.op, last.phase) == ("rm", "intent") and _named(last) == removed


@pytest.fixture
def _fast_kdf(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cryptography")
    monkeypatch.setenv(TEST_KDF_ENV, "1")
    for name in ("CHUNKSTORE_PASSWORD", "CHUNKSTORE_PASSWORD_FILE",
                 "CHUNKSTORE_NEW_PASSWORD"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("_fast_kdf")
def test_key_changes_are_recorded_and_an_encrypted_stores_events_are_sealed(
        tmp_path: Path) -> None:
    path = tmp_path / "s"
    with chunkstore.open(path, create=True, encrypt=True, password="first") as store:
        _save(store, 0, run="secret-run")
    assert run_cli("key", "add", str(path), env={"CHUNKSTORE_PASSWORD": "first",
                                                  "CHUNKSTORE_NEW_PASSWORD": "second"}
                   ).exit_code == 0
    assert run_cli("key", "passwd", str(path), env={"CHUNKSTORE_PASSWORD": "second",
                                                     "CHUNKSTORE_NEW_PASSWORD": "third"}
                   ).exit_code == 0
    with chunkstore.open(path, password="third") as store:
        other = next(k.id for k in list_keys(store.objects) if k.id != store.objects.key_id)
    assert run_cli("key", "remove", str(path), other,
                   env={"CHUNKSTORE_PASSWORD": "third"}).exit_code == 0
    listed = run_cli("audit", str(path), "--json", env={"CHUNKSTORE_PASSWORD": "third"})
    events = json.loads(listed.output)["events"]
    assert [(e["op"], e["phase"]) for e in events] == [
        ("publish", "intent"), ("key-add", "intent"), ("key-add", "done"),
        ("key-passwd", "intent"), ("key-passwd", "done"), ("key-remove", "intent")]
    assert events[-1]["key"] == other
    for event_file in (path / "audit").iterdir():  # sealed: nothing of it in clear
        raw = event_file.read_bytes()
        assert b"chunkstore.audit" not in raw and b"secret-run" not in raw
    forged = path / "audit" / (event_id_at(0) + "-00000000")
    forged.write_bytes(b'{"format":"chunkstore.audit"}')  # not sealed: fails to open
    listed = run_cli("audit", str(path), env={"CHUNKSTORE_PASSWORD": "third"})
    assert listed.exit_code == 0 and listed.output.splitlines()[0].count("DAMAGED") == 1


def test_a_refused_key_removal_records_nothing(tmp_path: Path) -> None:
    """``key remove`` of a key whose every other key is damaged is refused (it would
    lock everyone out): the refusal stored a key-remove intent first.  Broken: with
    the event before the checks the store's tree changes."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True, encrypt=True, password="first") as store:
        first = store.objects.key_id
    assert run_cli("key", "add", str(path), env={"CHUNKSTORE_PASSWORD": "first",
                                                  "CHUNKSTORE_NEW_PASSWORD": "second"}
                   ).exit_code == 0
    second = next(p for p in (path / "keys").iterdir() if p.name != first)
    second.write_bytes(b"damaged")
    before = tree_snapshot(path)
    refused = CliRunner().invoke(cli, ["key", "remove", str(path), first],
                                 env={"CHUNKSTORE_PASSWORD": "first"})
    assert refused.exit_code != 0 and "damaged" in refused.output, refused.output
    assert tree_snapshot(path) == before


def test_on_s3_events_are_written_listed_and_pruned(s3_endpoint: str, tmp_path: Path
                                                    ) -> None:
    with two_indexes(s3_endpoint, tmp_path) as (a, b):
        first = _save(a, 0)
        _save(a, 1)
        b.reconcile()
        b.delete("r@0")  # through another index
        assert _ops(a) == [("publish", "intent")] * 2 + [("rm", "intent"),
                                                         ("rm", "done")]
        assert _named(list(a.audit())[2]) == [first]
        later = list(a.audit())[1].when
        result = a.prune_audit(later)  # type: ignore[arg-type]
        assert len(result.pruned) == 1
        assert [e.op for e in b.audit()] == ["publish", "rm", "rm", "audit-prune"]


# --- the frozen fixture (tools/make_audit_fixture.py) ---------------------------------------

FIXTURE = Path(__file__).parent / "data" / "audit-v1"


def test_the_audit_fixture_reads_back_in_canonical_json(tmp_path: Path) -> None:
    """The frozen events decode to what was recorded; each object is canonical JSON
    (sorted keys, no spaces), so its bytes are pinned; the store verifies."""
    import shutil

    import blake3
    expected = json.loads(FIXTURE.with_name("audit-v1.expected.json").read_text())
    files = {str(p.relative_to(FIXTURE)): blake3.blake3(p.read_bytes()).hexdigest()
             for p in sorted(FIXTURE.rglob("*")) if p.is_file()}
    assert files == expected["files"]  # frozen: never rewritten
    for entry in expected["events"]:
        data = (FIXTURE / AUDIT.key(entry["id"])).read_bytes()
        body = json.loads(data)
        assert json.dumps(body, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False).encode() == data
        assert body["format_version"] == expected["audit_format_version"]
    copy = tmp_path / "s"
    shutil.copytree(FIXTURE, copy)
    with chunkstore.open(copy) as store:
        trail = list(store.audit())
        assert [{"id": e.id, "op": e.op, "phase": e.phase} for e in trail] == expected["events"]
        assert {(e.who, e.process) for e in trail} == {(expected["who"], expected["process"])}
        assert _named(trail[0]) == expected["versions"][:1]
        assert _named(trail[3]) == expected["versions"][:1]  # the rm
        assert store.verify().ok
