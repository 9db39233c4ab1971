"""Legal holds: no removal path removes a held version, from any index, on any backend
(chunkstore.protocol.holds); damaged hold objects hold; releasing makes it removable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend
from chunkstore.cli import cli
from chunkstore.errors import (
    CorruptConfigError,
    FormatVersionError,
    HeldVersionError,
    HeldVersionWarning,
    HoldUnconfirmedError,
    InvalidInputError,
    SelectorError,
)
from chunkstore.format.records import HOLDS_STORE_FORMAT_VERSION, StoreConfig
from chunkstore.handle.holding import place_hold, upgrade_for_holds
from chunkstore.objects.kinds import HOLDS, TOMBSTONES, VERSIONS
from chunkstore.objects.objectstore import ObjectStore
from chunkstore.protocol.holds import MAX_HOLD_BYTES, store_hold
from chunkstore.protocol.tombstones import write_tombstone
from tests.conftest import tree_snapshot
from tests.s3server import s3_endpoint, two_indexes

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

REPO = Path(__file__).resolve().parent.parent


def _save(store: chunkstore.Store, step: int, run: str = "r") -> str:
    with store.new_version(run, step) as v:
        v.put("w", np.full(2048, step, dtype=np.float32))
    return v.info.id


def _filled(path: Path, steps: int = 4, **options: Any) -> list[str]:
    with chunkstore.open(path, create=True, **options) as store:
        return [_save(store, step) for step in range(steps)]


def _steps(store: chunkstore.Store) -> list[int]:
    return [v.step for v in store.versions()]


# --- every removal path ----------------------------------------------------------------------


def test_rm_refuses_a_held_version_naming_the_reason_and_changes_nothing(tmp_path: Path
                                                                        ) -> None:
    path = tmp_path / "s"
    ids = _filled(path)
    with chunkstore.open(path) as store:
        store.tag("r@2", "best")
        hold = store.hold("r@1", "audit 17")
        assert store.config.format_version == HOLDS_STORE_FORMAT_VERSION
        before = tree_snapshot(path / HOLDS.prefix) | tree_snapshot(path / VERSIONS.prefix)
        for force in (False, True):  # --force drops tags, never holds
            with pytest.raises(HeldVersionError, match="audit 17") as caught:
                store.delete_many(["r@1", "r@2", "r@3"], force=force)
            assert caught.value.holds == {ids[1]: "audit 17"} and not caught.value.removed
        assert not (path / TOMBSTONES.prefix).exists()  # no tombstone: nothing written
        assert tree_snapshot(path / HOLDS.prefix) | tree_snapshot(path / VERSIONS.prefix) \
            == before
        assert store.tags() == {"best": ids[2]} and _steps(store) == [0, 1, 2, 3]
        assert (hold.who or "").count("@") == 1 and hold.process and hold.when
        result = CliRunner().invoke(cli, ["rm", str(path), "r@1"])
        assert result.exit_code == 2 and "audit 17" in result.output
        assert store.release("r@1").reason == "audit 17"
        store.delete("r@1")
        assert _steps(store) == [0, 2, 3] and store.holds() == {}


def test_prune_and_a_replacement_leave_a_held_version_and_name_it(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _filled(path, 6)
    with chunkstore.open(path) as store:
        store.hold("r@1", "dispute 42")
        dry = store.prune(keep_last=1, verify=False, dry_run=True)
        assert [h.reason for h in dry.held] == ["dispute 42"]
        result = store.prune(keep_last=1, verify=False)
        assert [v.step for v in result.removed] == [0, 2, 3]
        assert [h.reason for h in result.held] == ["dispute 42"]
        assert any("dispute 42" in w for w in result.warnings)
        assert _steps(store) == [1, 4, 5]
        out = CliRunner().invoke(cli, ["prune", str(path), "--keep-last", "1", "--json"])
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout)["held"][0]["reason"] == "dispute 42"
        assert "dispute 42" in out.stderr
        with store.new_version("r", 1, replace=True) as v:  # the held one stays
            v.put("w", np.zeros(3, dtype=np.float32))
        assert sorted(_steps(store)) == [1, 1, 4, 5]


def test_a_second_process_with_its_own_index_sees_the_hold(tmp_path: Path) -> None:
    """The hold is placed by another process, through an index of its own, while this
    handle is open (its index never heard of it): rm and prune here honour it."""
    path = tmp_path / "s"
    _filled(path)
    with chunkstore.open(path) as store:
        assert store.resolve("r@1")  # this index is warm before the hold exists
        child = ("import chunkstore, sys\n"
                 "with chunkstore.open(sys.argv[1], index_dir=sys.argv[2]) as s:\n"
                 "    print(s.hold('r@1', 'held elsewhere').version_id)\n")
        done = subprocess.run([sys.executable, "-c", child, str(path), str(tmp_path / "i2")],
                              cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr
        held_id = done.stdout.split()[-1]
        with pytest.raises(HeldVersionError, match="held elsewhere"):
            store.delete("r@1")
        assert store.prune(keep_last=1, verify=False).held[0].version_id == held_id
        assert held_id in {v.id for v in store.versions()}


def test_checkpointer_keep_last_skips_a_held_version_with_a_warning(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from torch_bridge import Checkpointer

    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(str(tmp_path / "s"), run="r", keep_last=1, async_save=False)
    for step in range(2):
        ckpt.save(step, model=model)
    ckpt.store.hold("r@0", "keep for the paper")
    for step in (2, 3):
        with pytest.warns(HeldVersionWarning, match="keep for the paper"):
            ckpt.save(step, model=model)
    assert _steps(ckpt.store) == [0, 2, 3]
    ckpt.close()


def test_a_mirrors_keep_last_skips_a_held_version_with_a_warning(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from torch_bridge.tiers.mirror import MirrorTier

    path = tmp_path / "mirror"
    _filled(path)
    with chunkstore.open(path) as mirror:
        mirror.hold("r@0", "mirror copy kept")
        tier = MirrorTier(mirror, run="r", keep_last=1, options=None, timeout=1.0,
                          local=lambda: mirror)
        with pytest.warns(HeldVersionWarning, match="mirror copy kept"):
            tier.apply_retention()
        assert _steps(mirror) == [0, 2, 3]


def test_gc_at_grace_0_keeps_all_a_held_version_needs(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _filled(path)
    with chunkstore.open(path) as store:
        store.hold("r@0", "kept")
        store.delete_listed_many([v for v in store.versions() if v.step != 0])
        assert store.gc(grace=0).chunks_deleted > 0
        assert store.open_version("r@0").get("w")[0] == 0
        assert store.verify().ok


def test_on_s3_a_hold_from_one_index_stops_removals_through_another(s3_endpoint: str,
                                                                     tmp_path: Path) -> None:
    with two_indexes(s3_endpoint, tmp_path) as (a, b):
        for step in range(4):
            _save(a, step)
        b.reconcile()
        a.hold("r@1", "s3 hold")
        with pytest.raises(HeldVersionError, match="s3 hold"):
            b.delete("r@1")
        assert b.prune(keep_last=1, verify=False).held[0].reason == "s3 hold"
        assert [v.step for v in b.versions()] == [1, 2, 3]
        b.release("r@1")
        b.delete("r@1")
        a.reconcile()
        assert _steps(a) == [2, 3]


# --- the race: a hold and a removal at once ----------------------------------------------------


class _HoldAfterTombstones(ForwardingBackend):
    """Another process stores a hold of ``version_id`` right after this removal's first
    tombstone is stored: after the removal's first look at ``holds/``, before its second."""

    def __init__(self, inner: Any, other: chunkstore.Store, version_id: str) -> None:
        super().__init__(inner)
        self.other, self.version_id = other, version_id
        self.lock = threading.Lock()  # a removal stores its tombstones from several threads

    def _after(self, key: str) -> None:
        if not key.startswith(TOMBSTONES.prefix):
            return
        with self.lock:
            version_id, self.version_id = self.version_id, ""
            if version_id:
                upgrade_for_holds(self.other)
                store_hold(self.other.objects, version_id, "placed mid-removal")

    def put(self, key: str, data: bytes | memoryview) -> None:
        super().put(key, data)
        self._after(key)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        stored = super().put_if_absent(key, data)
        self._after(key)
        return stored


def test_a_hold_stored_after_the_removal_began_stops_it(tmp_path: Path) -> None:
    """The removal lists holds/ again once its tombstones are durable: a hold stored
    before then is seen.  (Checked: without that second listing this test fails, the
    held version is removed.)"""
    path = tmp_path / "s"
    ids = _filled(path)
    with chunkstore.open(path) as store, \
            chunkstore.open(path, index_dir=str(tmp_path / "i2")) as other:
        store.objects = ObjectStore(_HoldAfterTombstones(store.objects.backend, other, ids[1]))
        with pytest.raises(HeldVersionError, match="placed mid-removal") as caught:
            store.delete_many(["r@1", "r@2"])
        assert caught.value.removed == (ids[2],)
        assert _steps(store) == [0, 1, 3]
        assert (path / VERSIONS.key(ids[1])).exists()


def test_a_hold_that_meets_a_removal_in_progress_says_it_is_unconfirmed(tmp_path: Path
                                                                       ) -> None:
    """A removal stored its tombstone and listed holds/ before the hold: the hold cannot
    be confirmed while the record stands and is kept; once the removal deletes the
    record, holding says the version is gone and keeps no hold object."""
    path = tmp_path / "s"
    ids = _filled(path)
    with chunkstore.open(path) as store:
        info = store.resolve("r@1")
        write_tombstone(store.objects, info.id, info.root, info.run, info.step)
        with pytest.raises(HoldUnconfirmedError):
            place_hold(store, "r@1", "too late?", wait_s=0.2)
        assert store.objects.exists(HOLDS, ids[1])  # stored: it stops every later removal
        store.release("r@1")
        # the removal in progress finishes while the hold waits
        finish = threading.Timer(0.2, store.objects.delete, (VERSIONS, ids[1]))
        finish.start()
        with pytest.raises(SelectorError, match="nothing is held"):
            place_hold(store, "r@1", "too late", wait_s=30)
        finish.join()
        assert not store.objects.exists(HOLDS, ids[1])


# --- damaged and crafted hold objects hold -------------------------------------------------


@pytest.mark.parametrize("body", [b"{not json", b"x" * (MAX_HOLD_BYTES + 1),
                                  b" " * (MAX_HOLD_BYTES + 5000),  # not read at all
                                  b'{"format":"chunkstore.hold","format_version":2}',
                                  b'{"format":"chunkstore.hold","format_version":1,'
                                  b'"version":"00","reason":"r","who":"u@h","when":1,'
                                  b'"process":"p"}', b""])
def test_a_damaged_hold_object_holds_and_verify_names_it(tmp_path: Path, body: bytes) -> None:
    path = tmp_path / "s"
    ids = _filled(path)
    with chunkstore.open(path) as store:
        store.objects.put(HOLDS, ids[1], body)
        with pytest.raises(HeldVersionError, match="damaged"):
            store.delete("r@1")
        assert store.prune(keep_last=1, verify=False).held[0].damage
        assert 1 in _steps(store)
        result = store.verify()
        assert not result.ok
        assert [(p.kind, p.object_key) for p in result.problems] == [
            ("corrupt-hold", HOLDS.key(ids[1]))]
        log = CliRunner().invoke(cli, ["log", str(path), "--json"])
        assert [v["held"] for v in json.loads(log.stdout)["versions"]] == [
            False, False, True]  # newest first: step 0 was pruned
        store.release(ids[1])
        store.delete("r@1")


def test_bad_reasons_are_refused_and_change_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _filled(path, 1)
    with chunkstore.open(path) as store:
        before = tree_snapshot(path)
        for reason in ("", "   ", "x" * 2001, None, "\ud800"):
            with pytest.raises(InvalidInputError):
                store.hold("r@0", reason)  # type: ignore[arg-type]
        with pytest.raises(SelectorError):
            store.hold("r@9", "no such step")
        with pytest.raises(SelectorError, match="not held"):
            store.release("r@0")
        assert tree_snapshot(path) == before


# --- the format ----------------------------------------------------------------------------------


@pytest.fixture
def encrypted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    pytest.importorskip("cryptography")
    monkeypatch.setenv("CHUNKSTORE_PASSWORD", "pw-for-holds")
    path = tmp_path / "enc"
    _filled(path, 2, encrypt=True)
    yield path


@pytest.mark.parametrize("made", ["new", "encrypted-v1"])
def test_the_first_hold_keeps_an_encrypted_store_s_sealing(
        encrypted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made: str) -> None:
    """A new encrypted store (version 13) stays 13 with holds; one of version 10 (the
    frozen encrypted-v1) becomes 11, keeping its encryption and its sealing."""
    selector, before, after = "r@0", 13, 13
    if made != "new":
        encrypted, selector, before, after = tmp_path / made, "enc@1", 10, 11
        shutil.copytree(REPO / "tests" / "data" / made, encrypted)
        expected = json.loads((REPO / "tests" / "data" / f"{made}.expected.json").read_text())
        monkeypatch.setenv("CHUNKSTORE_PASSWORD", expected["password"])
    config = json.loads((encrypted / "chunkstore.json").read_bytes())
    assert config["format_version"] == before
    with chunkstore.open(encrypted) as store:
        store.hold(selector, "sealed hold")
        assert b"sealed hold" not in (encrypted / HOLDS.key(store.resolve(selector).id)
                                      ).read_bytes()
    upgraded = json.loads((encrypted / "chunkstore.json").read_bytes())
    assert upgraded == {**config, "format_version": after}
    with chunkstore.open(encrypted) as store:
        assert store.config.encryption is not None
        assert store.config.encryption.sealing == (3 if made == "new" else 1)
        assert [h.reason for h in store.holds().values()] == ["sealed hold"]
        with pytest.raises(HeldVersionError, match="sealed hold"):
            store.delete(selector)
        assert store.verify().ok
        held_id = store.resolve(selector).id
        store.backend.put(HOLDS.key(held_id), b"not sealed by the key")  # forged in clear
        with pytest.raises(HeldVersionError, match="damaged"):
            store.delete(selector)
        assert [p.kind for p in store.verify().problems] == ["corrupt-hold"]


def test_store_version_11_is_read_plain_or_encrypted_12_13_only_encrypted_14_refused() -> None:
    plain = {"format": "chunkstore", "format_version": 11, "chunk_size": 4096,
             "compression": "auto", "created": 1.0, "delta_depth": 3}
    config = StoreConfig.decode("x", json.dumps(plain).encode())
    assert config.encryption is None and config.format_version == 11
    assert json.loads(config.encode()) == plain
    for encrypted_only in (12, 13):
        with pytest.raises(CorruptConfigError, match="encryption is None"):
            StoreConfig.decode("x", json.dumps({**plain, "format_version": encrypted_only}
                                               ).encode())
    with pytest.raises(FormatVersionError):
        StoreConfig.decode("x", json.dumps({**plain, "format_version": 14}).encode())


# --- the commands ---------------------------------------------------------------------------


def test_hold_release_log_and_show_in_json(tmp_path: Path) -> None:
    path = tmp_path / "s"
    ids = _filled(path, 2)
    runner = CliRunner()
    held = runner.invoke(cli, ["hold", str(path), "r@0", "--reason", "case 9", "--json"])
    assert held.exit_code == 0, held.output
    body = json.loads(held.stdout)
    assert body["hold"]["reason"] == "case 9" and body["version"]["id"] == ids[0]
    show = json.loads(runner.invoke(cli, ["show", str(path), "r@0", "--json"]).stdout)
    assert show["version"]["held"] is True and show["version"]["hold"]["reason"] == "case 9"
    text = runner.invoke(cli, ["log", str(path)]).output
    assert "HELD" in text and "case 9" in text
    assert "held" in runner.invoke(cli, ["show", str(path), "r@0"]).output
    released = runner.invoke(cli, ["release", str(path), "r@0", "--json"])
    assert json.loads(released.stdout)["hold"]["reason"] == "case 9"
    assert runner.invoke(cli, ["release", str(path), "r@0"]).exit_code == 2
    for command in ("hold", "release"):
        assert "Examples:" in runner.invoke(cli, [command, "--help"]).output
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log = json.loads(runner.invoke(cli, ["log", str(path), "--json"]).stdout)
    assert [v["held"] for v in log["versions"]] == [False, False]
