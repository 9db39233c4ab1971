"""Attacks on legal holds and signed versions that the first tests missed: a dry run
that promises to remove a held version, a recovered config that forgets the store has
holds, a save that asks to be signed and returns an unsigned version, a sync that copies
a held version without saying so."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend
from chunkstore.cli import cli
from chunkstore.cli.recovery import _trust_environment
from chunkstore.errors import (
    DuplicateStepError,
    HeldVersionError,
    HoldUnconfirmedError,
    SelectorError,
)
from chunkstore.format.records import HOLDS_STORE_FORMAT_VERSION
from chunkstore.handle.holding import place_hold
from chunkstore.handle.signatures import SIGNED_BY_TRUSTED, SIGNED_BY_UNTRUSTED
from chunkstore.maintenance.drillrestore import trust_from_env
from chunkstore.objects.kinds import CHUNKS, HOLDS, SIGNATURES, TOMBSTONES, VERSIONS
from chunkstore.objects.objectstore import ObjectStore
from chunkstore.objects.signing import Trust
from chunkstore.protocol import tombstones
from chunkstore.protocol.runlease import withdraw
from tests.conftest import tree_snapshot
from tests.test_signing import keys

__all__ = ["keys"]  # test_signing's two key pairs, re-exported so pytest finds the fixture


def _save(store: chunkstore.Store, step: int, sign_with: Any = None, *,
          replace: bool = False) -> chunkstore.VersionWriter:
    with store.new_version("r", step, sign_with=sign_with, replace=replace) as v:
        v.put("w", np.full(1024, step, dtype=np.float32))
    return v


def _filled(path: Path, steps: int = 3) -> list[str]:
    with chunkstore.open(path, create=True) as store:
        return [_save(store, step).info.id for step in range(steps)]


# --- holds ----------------------------------------------------------------------------------


@pytest.mark.parametrize("purge", [False, True])
def test_rm_dry_run_refuses_a_held_version_as_rm_does(tmp_path: Path, purge: bool) -> None:
    """Broke: ``rm --dry-run`` (and ``--purge --dry-run``) answered "would remove" and
    exit 0 for a held version that ``rm`` then refuses."""
    path = tmp_path / "s"
    ids = _filled(path)
    with chunkstore.open(path) as store:
        store.hold("r@1", "audit 17")
    before = tree_snapshot(path)
    args = ["rm", str(path), "r@1", "r@2", "--dry-run", "--json"] + (["--purge"] * purge)
    answer = CliRunner().invoke(cli, args)
    assert answer.exit_code == 2, answer.output
    assert "audit 17" in answer.output and ids[1][:12] in answer.output
    assert "nothing was removed" in answer.output
    assert tree_snapshot(path) == before
    # what is not held still dry-runs
    answer = CliRunner().invoke(cli, ["rm", str(path), "r@2", "--dry-run", "--json"])
    assert answer.exit_code == 0 and json.loads(answer.stdout)["removed"][0]["id"] == ids[2]


def test_init_recover_keeps_the_holds_store_version(tmp_path: Path) -> None:
    """Broke: ``init --recover`` on a store with holds wrote format version 9 back, so a
    release that does not honour holds opened it again and could remove a held
    version."""
    path = tmp_path / "s"
    _filled(path)
    with chunkstore.open(path) as store:
        store.hold("r@1", "dispute")
    (path / "chunkstore.json").write_text("damaged")
    answer = CliRunner().invoke(cli, ["init", str(path), "--recover"])
    assert answer.exit_code == 0, answer.output
    assert f"format version {HOLDS_STORE_FORMAT_VERSION}" in answer.output
    config = json.loads((path / "chunkstore.json").read_text())
    assert config["format_version"] == HOLDS_STORE_FORMAT_VERSION
    with chunkstore.open(path) as store, pytest.raises(HeldVersionError):
        store.delete("r@1")


def test_sync_says_which_copied_versions_are_held_at_the_source(tmp_path: Path) -> None:
    """Issue 51: a hold belongs to its store; sync names each version it copies that is
    held at the source (text and JSON), and the copy is not held."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    ids = _filled(src)
    with chunkstore.open(src) as store:
        store.hold("r@1", "legal review")
    answer = CliRunner().invoke(cli, ["sync", str(src), str(dst), "--json"])
    assert answer.exit_code == 0, answer.output
    found = json.loads(answer.stdout)
    assert [h["version"] for h in found["held_at_source"]] == [ids[1]]
    assert found["held_at_source"][0]["reason"] == "legal review"
    assert not (dst / HOLDS.prefix).exists()
    src2, dst2 = tmp_path / "src2", tmp_path / "dst2"
    _filled(src2)
    with chunkstore.open(src2) as store:
        store.hold("r@2", "legal review")
    text = CliRunner().invoke(cli, ["sync", str(src2), str(dst2), "--dry-run"]).output
    assert "held at the source" in text and "legal review" in text
    assert f"chunkstore hold {dst2}" in text


# --- signatures -----------------------------------------------------------------------------


def test_an_identical_save_with_a_key_leaves_the_version_signed_by_it(
        tmp_path: Path, keys: dict[str, Path]) -> None:
    """Broke: saving a step again with the same content and ``sign_with`` returned the
    existing unsigned version (``existed``), which a ``require_signed`` restore then
    skips; now the existing version is signed by the key."""
    path = tmp_path / "s"
    ids = _filled(path)
    trust = Trust([keys["signer.pub"]])
    with chunkstore.open(path) as store:
        again = _save(store, 2, keys["signer"])
        assert again.existed and again.info.id == ids[2]
        assert store.signature("r@2", trust).status == SIGNED_BY_TRUSTED
        assert _save(store, 2, keys["signer"]).existed  # and again: nothing changes
        assert store.signature("r@2", trust).status == SIGNED_BY_TRUSTED


def test_an_identical_save_never_takes_over_another_keys_signature(
        tmp_path: Path, keys: dict[str, Path]) -> None:
    """A version signed by another key is not this save's: without replace it is a
    DuplicateStepError naming the other key (its signature unchanged); with replace the
    save publishes its own signed version in its place."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        first = _save(store, 5, keys["other"]).info.id
        signature = (path / SIGNATURES.key(first)).read_bytes()
        with pytest.raises(DuplicateStepError, match="signed by another key"):
            _save(store, 5, keys["signer"])
        assert (path / SIGNATURES.key(first)).read_bytes() == signature
        assert store.signature(first, Trust([keys["signer.pub"]])).status \
            == SIGNED_BY_UNTRUSTED
        mine = _save(store, 5, keys["signer"], replace=True)
        assert not mine.existed and mine.info.id != first
        assert store.signature("r@5", Trust([keys["signer.pub"]])).status \
            == SIGNED_BY_TRUSTED
        assert not (path / VERSIONS.key(first)).exists()
        assert (path / TOMBSTONES.key(first)).exists()


def test_drill_refuses_trust_without_require_signed(tmp_path: Path,
                                                     keys: dict[str, Path]) -> None:
    """Broke: ``drill --trust KEY.pub`` without ``--require-signed`` ignored the key and
    restored an unsigned version as if it had been checked; now it is a usage error
    (exit 2) before anything runs."""
    path = tmp_path / "s"
    _filled(path, steps=1)
    before = tree_snapshot(path)
    answer = CliRunner().invoke(cli, ["drill", str(path), "--trust",
                                      str(keys["signer.pub"]), "--no-record"])
    assert answer.exit_code == 2, answer.output
    assert "--require-signed" in answer.output
    assert tree_snapshot(path) == before


# --- a removal stalled while a GC and a hold run ---------------------------------------------


class _StallAfterHoldsListing(ForwardingBackend):
    """Runs ``meanwhile`` once, right after this removal's second listing of ``holds/``
    (the one after its tombstones): as if the removal were stopped there while other
    processes ran."""

    def __init__(self, inner: Any, meanwhile: Callable[[], None], *,
                 before: bool = False) -> None:
        super().__init__(inner)
        self.meanwhile: Callable[[], None] | None = meanwhile
        self.listings = 0
        self.before = before  # run it right before that listing instead

    def list(self, prefix: str = "") -> Iterator[str]:
        if prefix.startswith(HOLDS.prefix):
            self.listings += 1
        if self.before and self.listings == 2:
            self._run()
        found = list(super().list(prefix))
        if not self.before and self.listings == 2:
            self._run()
        return iter(found)

    def _run(self) -> None:
        if self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()


def test_gc_keeps_the_tombstone_of_a_removal_in_progress_so_a_hold_is_not_confirmed(
        tmp_path: Path) -> None:
    """Broke: a removal stopped after its look at holds/, a ``gc --grace 0`` (which
    deleted its tombstone: the version was still published), then a hold, which found no
    tombstone and said it was confirmed; the removal went on and removed the held
    version.  Now GC keeps the tombstone of a published version for
    LIVE_TOMBSTONE_MIN_AGE_S whatever the grace, and the hold says it is unconfirmed."""
    path = tmp_path / "s"
    ids = _filled(path)
    outcome: dict[str, Any] = {}
    with chunkstore.open(path) as store, \
            chunkstore.open(path, index_dir=str(tmp_path / "i2")) as other:
        def meanwhile() -> None:
            outcome["gc"] = other.gc(grace=0).tombstones_deleted
            with pytest.raises(HoldUnconfirmedError):
                place_hold(other, ids[1], "dispute", wait_s=0.1)
        store.objects = ObjectStore(_StallAfterHoldsListing(store.objects.backend,
                                                            meanwhile))
        store.delete("r@1")  # it listed holds/ before the hold: it may remove it
    assert outcome["gc"] == 0
    with chunkstore.open(path) as store:  # once the removal is over, GC expires it
        assert store.gc(grace=0).tombstones_deleted == 1


def test_a_removal_stalled_past_its_bound_looks_at_holds_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A removal stopped longer than MAX_REMOVAL_STALL_S after its tombstones (here
    shrunk, with the GC's minimum age, to fractions of a second) may have had them
    expired by a GC and a hold confirmed meanwhile: it stores them again and lists
    holds/ again before it withdraws or deletes anything, so the held version stays.
    (Checked: without the stall check the held version is removed.)"""
    monkeypatch.setattr(tombstones, "LIVE_TOMBSTONE_MIN_AGE_S", 0.2)
    monkeypatch.setattr(tombstones, "MAX_REMOVAL_STALL_S", 0.1)
    path = tmp_path / "s"
    ids = _filled(path)
    with chunkstore.open(path) as store, \
            chunkstore.open(path, index_dir=str(tmp_path / "i2")) as other:
        def meanwhile() -> None:
            time.sleep(0.3)
            assert other.gc(grace=0).tombstones_deleted == 2  # both still published
            other.hold(ids[1], "dispute")  # no tombstone: confirmed
        store.objects = ObjectStore(_StallAfterHoldsListing(store.objects.backend,
                                                            meanwhile))
        with pytest.raises(HeldVersionError, match="dispute") as caught:
            store.delete_many(["r@1", "r@2"])
        assert caught.value.removed == (ids[2],)
    assert (path / VERSIONS.key(ids[1])).exists()
    assert (path / HOLDS.key(ids[1])).exists()


class _BeforeCommitRecord(ForwardingBackend):
    """Runs ``meanwhile`` once, right before a save's commit record is created (its
    signature and every object durable already)."""

    def __init__(self, inner: Any, meanwhile: Callable[[], None]) -> None:
        super().__init__(inner)
        self.meanwhile: Callable[[], None] | None = meanwhile

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        if key.startswith(VERSIONS.prefix) and self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()
        return super().put_if_absent(key, data)


def test_a_sweep_at_grace_0_leaves_the_signature_of_a_save_about_to_publish(
        tmp_path: Path, keys: dict[str, Path]) -> None:
    """Broke: a ``gc --grace 0`` sweep between a signed save's signature and its commit
    record deleted the signature as an orphan, and the save published its version
    unsigned (restore(require_signed) then skips it).  A young signature is a save's
    own, as a young temporary file is: the sweep leaves those under TEMP_MIN_AGE_S."""
    path = tmp_path / "s"
    _filled(path, steps=1)
    found: dict[str, int] = {}
    with chunkstore.open(path) as store, \
            chunkstore.open(path, index_dir=str(tmp_path / "i2")) as other:
        def meanwhile() -> None:
            found["deleted"] = other.gc(grace=0, sweep=True,
                                        session_wait=0.1).signatures_deleted
        store.objects = ObjectStore(_BeforeCommitRecord(store.objects.backend, meanwhile))
        version = _save(store, 7, keys["signer"]).info.id
        assert found == {"deleted": 0}
        assert store.signature(version, Trust([keys["signer.pub"]])).status \
            == SIGNED_BY_TRUSTED


def test_a_withdrawn_version_cannot_be_held(tmp_path: Path) -> None:
    """Broke: a removal killed after withdrawing a version (``@withdrawn-`` marker,
    docs/format.md §11.5) and before deleting its record left the record behind; once
    GC expired the tombstone a hold of it was confirmed, and the next index to count the
    version in deleted the held version's record.  A withdrawn version is never a
    version again: holding it is refused and no hold object stays."""
    path = tmp_path / "s"
    ids = _filled(path)
    with chunkstore.open(path) as store:
        withdraw(store.objects, "r", ids[1])  # the removal died here
        with pytest.raises(SelectorError, match="withdrawn"):
            store.hold("r@1", "evidence")
        assert not store.objects.exists(HOLDS, ids[1])


def test_a_process_that_opened_an_old_store_keeps_the_holds_version(tmp_path: Path) -> None:
    """Broke: a process that opened a store of version 8 before another placed the
    first hold (version 11) upgraded it at its first save to 9, from the config it had
    read: a release that does not honour holds could open the store again.  The stored
    config decides: it stays 11."""
    path = tmp_path / "s"
    shutil.copytree(Path(__file__).parent / "data" / "store-v8", path)
    with chunkstore.open(path, index_dir=str(tmp_path / "early")) as early, \
            chunkstore.open(path, index_dir=str(tmp_path / "holder")) as holder:
        assert early.config.format_version == 8
        holder.hold(holder.versions()[0].id, "kept")
        _save(early, 1)
    assert json.loads((path / "chunkstore.json").read_text())["format_version"] \
        == HOLDS_STORE_FORMAT_VERSION


@pytest.mark.parametrize("reason", ["audit\x1b[2J", "line one\nline two", "csi\x9b31m"])
def test_a_hold_reason_is_printable_text(tmp_path: Path, reason: str) -> None:
    """Broke: a reason (or a crafted hold object's reason, owner or process) with
    terminal control characters went raw to every `log` and `show` an operator ran.
    Placing such a hold is refused, nothing stored; a crafted object that holds one is a
    damaged hold: it still holds, and no command prints its fields."""
    path = tmp_path / "s"
    ids = _filled(path)
    answer = CliRunner().invoke(cli, ["hold", str(path), "r@1", "--reason", reason])
    assert answer.exit_code == 2 and "printable" in answer.output
    assert not (path / HOLDS.prefix).exists()
    with chunkstore.open(path) as store:
        store.hold("r@1", "placeholder")  # the store is of version 11 now
    crafted = json.loads((path / HOLDS.key(ids[1])).read_text())
    crafted.update(reason=reason, who=f"x{reason}", process=reason)
    (path / HOLDS.key(ids[1])).write_text(json.dumps(crafted))
    for command in (["log", str(path)], ["show", str(path), "r@1"],
                    ["rm", str(path), "r@1"], ["verify", str(path)]):
        output = CliRunner().invoke(cli, command).output
        assert not any(c in output for c in "\x1b\x9b") and "line two" not in output
    with chunkstore.open(path) as store:
        assert store.holds()[ids[1]].damage is not None
        with pytest.raises(HeldVersionError):
            store.delete("r@1")


def test_repair_signs_a_copy_made_before_its_version_was_signed(
        tmp_path: Path, keys: dict[str, Path]) -> None:
    """A version synced unsigned and signed in SRC afterwards (a signed save of the same
    content) is "already there" for sync, whose idle runs list nothing more; ``repair
    DST --from SRC`` copies the signature DST lacks, checked (docs/format.md §14)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    ids = _filled(src)
    assert CliRunner().invoke(cli, ["sync", str(src), str(dst)]).exit_code == 0
    with chunkstore.open(src) as store:
        assert _save(store, 2, keys["signer"]).existed  # ids[2] signed now
    answer = CliRunner().invoke(cli, ["repair", str(dst), "--from", str(src)])
    assert answer.exit_code == 0, answer.output
    with chunkstore.open(dst) as store:
        assert store.signature(ids[2], Trust([keys["signer.pub"]])).trusted


def test_drill_hands_its_restore_process_key_paths_holding_a_path_separator(
        tmp_path: Path, keys: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Broke: the trusted key files went to the restore process joined by ``:``, so a
    key under a folder named ``a:b`` (a legal name) split into two paths that are no
    keys, and the drill's restore process failed.  The child now gets them back whole."""
    folder = tmp_path / "keys:v2"
    folder.mkdir()
    shutil.copy(keys["signer.pub"], folder / "signer.pub")
    environment = _trust_environment(True, (str(folder / "signer.pub"),
                                            str(keys["other.pub"])))
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    trust = trust_from_env()
    assert trust is not None
    assert trust.fingerprints == Trust([keys["signer.pub"], keys["other.pub"]]).fingerprints


def test_rm_grace_without_purge_is_a_usage_error(tmp_path: Path) -> None:
    """Broke: ``rm STORE SEL --grace 0`` (meant with --purge) removed the version and
    ignored --grace without a word; now a usage error, nothing removed."""
    path = tmp_path / "s"
    _filled(path, steps=2)
    before = tree_snapshot(path)
    answer = CliRunner().invoke(cli, ["rm", str(path), "r@1", "--grace", "0"])
    assert answer.exit_code == 2 and "--purge" in answer.output
    assert tree_snapshot(path) == before


def test_a_purge_that_meets_a_hold_purges_what_it_removed(tmp_path: Path) -> None:
    """Broke: a version held while ``rm --purge`` ran (after its first look at holds/)
    was left, as it must be, but the HeldVersionError ended the purge before its GC: the
    versions it did remove were removed, not purged, and no purge could name them
    again.  Now their data is deleted, then the error names the hold."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True) as store:
        for step in (1, 2):
            with store.new_version("r", step) as v:
                v.put("w", np.random.default_rng(step).random(4096))
        ids = [store.resolve(f"r@{step}").id for step in (1, 2)]  # r@1 is held below
        chunks = {step: set(store.index.version_refs(ids[step - 1])) for step in (1, 2)}
    with chunkstore.open(path) as store, \
            chunkstore.open(path, index_dir=str(tmp_path / "i2")) as other:
        def meanwhile() -> None:
            with pytest.raises(HoldUnconfirmedError):  # the purge's tombstone is there
                place_hold(other, ids[0], "dispute", wait_s=0.05)
        store.objects = ObjectStore(_StallAfterHoldsListing(store.objects.backend,
                                                            meanwhile, before=True))
        with pytest.raises(HeldVersionError, match="dispute") as caught:
            store.purge(["r@1", "r@2"], session_wait=0.1)
        assert caught.value.removed == (ids[1],)
    assert chunks[2] - chunks[1]
    assert all(not (path / CHUNKS.key(d)).exists() for d in chunks[2] - chunks[1])
    assert all((path / CHUNKS.key(d)).exists() for d in chunks[1])
    assert (path / VERSIONS.key(ids[0])).exists()
