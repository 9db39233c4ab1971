"""Attacks on legal holds and signed versions that the first tests missed: a dry run
that promises to remove a held version, a recovered config that forgets the store has
holds, a save that asks to be signed and returns an unsigned version, a sync that copies
a held version without saying so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.cli import cli
from chunkstore.errors import DuplicateStepError, HeldVersionError
from chunkstore.format.records import HOLDS_STORE_FORMAT_VERSION
from chunkstore.handle.signatures import SIGNED_BY_TRUSTED, SIGNED_BY_UNTRUSTED
from chunkstore.objects.kinds import HOLDS, SIGNATURES, TOMBSTONES, VERSIONS
from chunkstore.objects.signing import Trust, generate_key
from tests.conftest import tree_snapshot


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two key pairs: ``signer`` and ``other``."""
    folder = tmp_path_factory.mktemp("keys")
    found = {}
    for name in ("signer", "other"):
        private, public = generate_key()
        (folder / name).write_bytes(private)
        (folder / f"{name}.pub").write_bytes(public)
        found[name], found[f"{name}.pub"] = folder / name, folder / f"{name}.pub"
    return found


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
