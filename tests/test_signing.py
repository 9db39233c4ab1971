"""Signed versions (docs/format.md §14): keygen, signatures over commit records, what a
reader with trusted keys reports, and that tampering, crafted signature objects, copies,
removal and GC each end where they must.  In-process (library API, CliRunner); the one
S3 test uses the shared moto server, the two SIGKILL tests a child each.

Each safety test was seen to fail with its guard removed: the fingerprint check of
``Signature.decode`` (crafted), the signature check (moved), the ``corrupt`` marking
of damaged versions in verify (tampered node, chunk), removal's delete of signatures,
sync's and repair's copy, the trust check of the Checkpointer's, the drill's and the
DCP writer's paths, the age test of the orphan sweep, the index-root comparison, and
signing before the commit record (both SIGKILL cases)."""

from __future__ import annotations

import base64
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.cli import cli
from chunkstore.errors import (
    CorruptRecordError,
    CorruptSignatureError,
    FormatVersionError,
    SigningKeyError,
)
from chunkstore.format.signatures import MAX_SIGNATURE_BYTES, Signature
from chunkstore.handle.signatures import (
    BAD_SIGNATURE,
    CORRUPT,
    SIGNED_BY_TRUSTED,
    SIGNED_BY_UNTRUSTED,
    UNSIGNED,
)
from chunkstore.objects.keys import TEST_KDF_ENV
from chunkstore.objects.kinds import SIGNATURES, VERSIONS
from chunkstore.objects.signing import fingerprint, generate_key, load_private_key
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two key pairs on disk: ``signer`` (trusted by the tests) and ``other``."""
    folder = tmp_path_factory.mktemp("keys")
    found = {}
    for name in ("signer", "other"):
        private, public = generate_key()
        (folder / name).write_bytes(private)
        (folder / f"{name}.pub").write_bytes(public)
        found[name], found[f"{name}.pub"] = folder / name, folder / f"{name}.pub"
    return found


def _save(store: chunkstore.Store, step: int, sign_with: Any = None, run: str = "r") -> str:
    with store.new_version(run, step, sign_with=sign_with) as v:
        v.put("w", np.arange(5000, dtype=np.float32) * step)
        v.put_data("meta", {"step": step})
    return v.info.id


def _verify_json(store_path: Path, *trust: Path) -> tuple[int, dict[str, Any]]:
    args = ["verify", str(store_path), "--json"]
    for key in trust:
        args += ["--trust", str(key)]
    answer = CliRunner().invoke(cli, args)
    return answer.exit_code, json.loads(answer.stdout)


def _signatures(found: dict[str, Any]) -> dict[int, str]:
    return {v["step"]: v["signature"] for v in found["versions"]}


# --- keygen -----------------------------------------------------------------------------------


def test_keygen_writes_a_private_and_public_key_and_never_overwrites(tmp_path: Path) -> None:
    path, password = tmp_path / "k", tmp_path / "pw"
    password.write_text("s3cret\n")
    runner = CliRunner()
    made = runner.invoke(cli, ["keygen", str(path), "--password-file", str(password),
                               "--curve", "P-384", "--json"])
    assert made.exit_code == 0, made.output
    answer = json.loads(made.stdout)
    assert answer["encrypted"] and answer["curve"] == "P-384"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = load_private_key(path, "s3cret")
    assert fingerprint(key) == answer["fingerprint"]
    with pytest.raises(SigningKeyError):  # encrypted: no password, no key
        load_private_key(path)
    with pytest.raises(SigningKeyError):
        load_private_key(path, "wrong")
    before = path.read_bytes(), Path(f"{path}.pub").read_bytes()
    again = runner.invoke(cli, ["keygen", str(path), "--unencrypted"])
    assert again.exit_code == 2 and "exists" in again.output
    assert (path.read_bytes(), Path(f"{path}.pub").read_bytes()) == before


def test_a_bad_key_is_a_typed_error_before_anything_is_stored(tmp_path: Path,
                                                              keys: dict[str, Path]) -> None:
    store_path = tmp_path / "s"
    with chunkstore.open(store_path, create=True) as store:
        for bad in (keys["signer.pub"], tmp_path / "missing", 42):
            with pytest.raises(SigningKeyError):
                store.new_version("r", 1, sign_with=bad)
        assert store.versions() == []
    with pytest.raises(SigningKeyError):
        chunkstore.open(store_path, trust=[tmp_path / "missing"])


# --- the four verdicts ------------------------------------------------------------------------


def test_versions_are_signed_by_trusted_untrusted_or_unsigned(tmp_path: Path,
                                                              keys: dict[str, Path]) -> None:
    store_path = tmp_path / "s"
    with chunkstore.open(store_path, create=True) as store:
        _save(store, 1, keys["signer"])
        _save(store, 2)
        _save(store, 3, load_private_key(keys["other"]))  # a loaded key signs too
    with chunkstore.open(store_path, trust=[keys["signer.pub"]]) as store:
        found = {s: store.signature(f"r@{s}") for s in (1, 2, 3)}
    assert [found[s].status for s in (1, 2, 3)] == [SIGNED_BY_TRUSTED, UNSIGNED,
                                                    SIGNED_BY_UNTRUSTED]
    assert found[1].key == fingerprint(load_private_key(keys["signer"]))
    code, answer = _verify_json(store_path, keys["signer.pub"])
    assert code == 0 and answer["ok"]
    assert _signatures(answer) == {1: SIGNED_BY_TRUSTED, 2: UNSIGNED, 3: SIGNED_BY_UNTRUSTED}
    text = CliRunner().invoke(cli, ["verify", str(store_path), "--trust",
                                    str(keys["other.pub"])])
    assert text.exit_code == 0 and "r@1" in text.output and "signed-by-untrusted" in text.output


# --- tampering ------------------------------------------------------------------------------


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("part", ["record", "node", "chunk", "signature"])
def test_a_tampered_version_is_never_reported_signed(tmp_path: Path, keys: dict[str, Path],
                                                     part: str) -> None:
    store_path = tmp_path / "s"
    with chunkstore.open(store_path, create=True) as store:
        version_id = _save(store, 1, keys["signer"])
        _save(store, 2, keys["signer"])
    target = {"record": lambda: [store_path / VERSIONS.key(version_id)],
              "signature": lambda: [store_path / SIGNATURES.key(version_id)],
              "node": lambda: sorted((store_path / "nodes").rglob("*")),
              "chunk": lambda: sorted((store_path / "chunks").rglob("*"))}[part]()
    for path in target:  # every node or chunk file: some of them are version 1's
        if path.is_file():
            _flip_middle_byte(path)
    code, answer = _verify_json(store_path, keys["signer.pub"])
    assert code == 1 and not answer["ok"]
    verdicts = _signatures(answer) if part != "record" else {
        v["id"]: v["signature"] for v in answer["versions"]}
    tampered = verdicts[1] if part != "record" else verdicts[version_id]
    assert tampered in (BAD_SIGNATURE, CORRUPT)
    if part == "signature":
        assert tampered == BAD_SIGNATURE
        assert any(p["kind"] == "bad-signature" for p in answer["problems"])
    with chunkstore.open(store_path, trust=[keys["signer.pub"]]) as store:
        if part == "record":
            with pytest.raises(CorruptRecordError):
                store.signature(version_id)
        elif part == "signature":
            assert store.signature(version_id).status == BAD_SIGNATURE


def test_a_signature_moved_to_another_version_does_not_hold(tmp_path: Path,
                                                            keys: dict[str, Path]) -> None:
    """The signature of version 1, renamed to unsigned version 2 (as it is, and with its
    ``version`` field rewritten to match): bad, never signed."""
    store_path = tmp_path / "s"
    with chunkstore.open(store_path, create=True) as store:
        one, two = _save(store, 1, keys["signer"]), _save(store, 2)
        moved = store.objects.get(SIGNATURES, one)
        store.objects.put(SIGNATURES, two, moved)
        assert chunkstore.open(store_path, trust=[keys["signer.pub"]]).signature(
            two).status == BAD_SIGNATURE
        body = json.loads(moved)
        body["version"] = two
        store.objects.put(SIGNATURES, two, json.dumps(body).encode())
    with chunkstore.open(store_path, trust=[keys["signer.pub"]]) as store:
        found = store.signature(two)
    assert found.status == BAD_SIGNATURE and "does not hold" in (found.reason or "")


def _crafted(good: bytes) -> dict[str, bytes]:
    body = json.loads(good)
    other = generate_key()[1]
    from cryptography.hazmat.primitives import serialization
    other_der = serialization.load_pem_public_key(other).public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)

    def with_(**fields: Any) -> bytes:
        return json.dumps({**body, **fields}).encode()

    return {
        "oversized": good + b" " * MAX_SIGNATURE_BYTES,
        "bad json": good[:-3],
        "not an object": b"[1, 2]",
        "wrong fingerprint": with_(key="0" * 64),
        "another key, its own fingerprint": with_(
            public_key=base64.b64encode(other_der).decode(),
            key=__import__("hashlib").sha256(other_der).hexdigest()),
        "unknown algorithm": with_(algorithm="ed25519"),
        "algorithm of another curve": with_(algorithm="ecdsa-p384-sha384"),
        "bad base64": with_(signature="not base64!"),
        "huge signature": with_(signature=base64.b64encode(b"x" * 300).decode()),
        "empty": b"",
        "newer format": with_(format_version=2),
    }


def test_a_crafted_signature_object_is_a_typed_problem_not_a_crash(
        tmp_path: Path, keys: dict[str, Path]) -> None:
    store_path = tmp_path / "s"
    with chunkstore.open(store_path, create=True) as store:
        version_id = _save(store, 1, keys["signer"])
        good = store.objects.get(SIGNATURES, version_id)
    for case, data in _crafted(good).items():
        expected = FormatVersionError if case == "newer format" else CorruptSignatureError
        if case not in ("another key, its own fingerprint", "algorithm of another curve"):
            with pytest.raises(expected):
                Signature.decode(version_id, data)
        (store_path / SIGNATURES.key(version_id)).write_bytes(data)
        with chunkstore.open(store_path, trust=[keys["signer.pub"]]) as store:
            found = store.signature(version_id)
            result = store.verify()
        assert found.status == BAD_SIGNATURE, case
        assert not result.ok and result.versions[0].signature == BAD_SIGNATURE, case


# --- restore ---------------------------------------------------------------------------------


def test_restore_require_signed_falls_back_past_unsigned_and_badly_signed(
        tmp_path: Path, keys: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    from chunkstore.errors import UntrustedVersionError
    from torch_bridge import Checkpointer
    from torch_bridge.errors import RestoreFallbackWarning

    model = torch.nn.Linear(4, 4)
    store_path = tmp_path / "s"
    for step, key in ((1, keys["signer"]), (2, None), (3, keys["other"]), (4, keys["signer"])):
        with torch.no_grad():
            model.weight.fill_(step)
        with Checkpointer(store_path, run="r", sign_with=key) as ckpt:
            ckpt.save(step, model=model)
    with chunkstore.open(store_path) as store:  # step 4's signature damaged
        path = store_path / SIGNATURES.key(store.resolve("r@4").id)
    path.write_bytes(path.read_bytes().replace(b'"signature":"', b'"signature":"AAAA'))
    fresh = torch.nn.Linear(4, 4)
    with Checkpointer(store_path, run="r", trust=[keys["signer.pub"]]) as ckpt:
        with pytest.warns(RestoreFallbackWarning) as caught:
            assert ckpt.restore(require_signed=True, model=fresh) == 1
        message = str(caught[0].message)
        assert "bad-signature" in message and "signed-by-untrusted" in message
        assert "unsigned" in message
        assert float(fresh.weight.detach()[0, 0]) == 1.0
        with pytest.raises(UntrustedVersionError):
            ckpt.restore(2, require_signed=True, model=fresh)
        assert ckpt.restore(model=fresh) == 4  # without require_signed: the newest
    with Checkpointer(store_path, run="r") as ckpt, pytest.raises(SigningKeyError):
        ckpt.restore(require_signed=True, model=fresh)


# --- copies, removal, GC --------------------------------------------------------------------


def test_sync_copies_the_signature_and_it_verifies_there(tmp_path: Path,
                                                         keys: dict[str, Path]) -> None:
    source, target = tmp_path / "a", tmp_path / "b"
    with chunkstore.open(source, create=True) as store:
        signed, unsigned = _save(store, 1, keys["signer"]), _save(store, 2)
        bad = _save(store, 3, keys["signer"])
        (source / SIGNATURES.key(bad)).write_bytes(b"{}")
    result = chunkstore.sync(source, target)
    assert [f.kind for f in result.failed] == ["bad-signature"]  # not published there
    with chunkstore.open(target, trust=[keys["signer.pub"]]) as store:
        assert store.signature(signed).status == SIGNED_BY_TRUSTED
        assert store.signature(unsigned).status == UNSIGNED
        assert [v.id for v in store.versions()] == [signed, unsigned]
        # repair puts back a signature damaged in the copy, from the source's
        (target / SIGNATURES.key(signed)).write_bytes(b"damaged")
        repaired = chunkstore.repair(store, chunkstore.open(source), [signed])
        assert [fix.kind for fix in repaired.fixed] == ["signature"]
        assert store.signature(signed).status == SIGNED_BY_TRUSTED


def test_signing_works_on_an_encrypted_store_and_the_signature_is_sealed(
        tmp_path: Path, keys: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_KDF_ENV, "1")
    store_path = tmp_path / "s"
    with chunkstore.open(store_path, create=True, encrypt=True, password="pw") as store:
        version_id = _save(store, 1, keys["signer"])
    stored = (store_path / SIGNATURES.key(version_id)).read_bytes()
    assert b"chunkstore.signature" not in stored  # sealed like every object
    with chunkstore.open(store_path, password="pw", trust=[keys["signer.pub"]]) as store:
        assert store.signature(version_id).status == SIGNED_BY_TRUSTED
        assert store.verify().versions[0].signature == SIGNED_BY_TRUSTED
    (store_path / SIGNATURES.key(version_id)).write_bytes(stored[:-1] + b"\0")
    with chunkstore.open(store_path, password="pw", trust=[keys["signer.pub"]]) as store:
        assert store.signature(version_id).status == BAD_SIGNATURE


def test_removal_deletes_the_signature_and_gc_sweeps_orphans(tmp_path: Path,
                                                             keys: dict[str, Path]) -> None:
    store_path = tmp_path / "s"
    with chunkstore.open(store_path, create=True) as store:
        one, two = _save(store, 1, keys["signer"]), _save(store, 2, keys["signer"])
        store.delete(one)
        assert not store.objects.exists(SIGNATURES, one)
        assert store.objects.exists(SIGNATURES, two)
        # an orphan (a save killed between its signature and its record), old and young
        old, young = "a" * 64, "b" * 64
        for orphan in (old, young):
            store.objects.put(SIGNATURES, orphan, store.objects.get(SIGNATURES, two))
        past = time.time() - 7200
        os.utime(store_path / SIGNATURES.key(old), (past, past))
        assert store.gc(grace="1h", sweep=True, dry_run=True).signatures_deleted == 1
        assert store.objects.exists(SIGNATURES, old)
        assert store.gc(grace="1h", sweep=True).signatures_deleted == 1
        assert not store.objects.exists(SIGNATURES, old)
        assert store.objects.exists(SIGNATURES, young)
        assert store.objects.exists(SIGNATURES, two)  # a live version's stays


@pytest.mark.s3
def test_signed_versions_on_s3(s3_endpoint: str, tmp_path: Path,
                               keys: dict[str, Path]) -> None:
    bucket = create_bucket(s3_endpoint)
    url, options = f"s3://{bucket}/ckpts", storage_options(s3_endpoint)
    try:
        with chunkstore.open(url, create=True, storage_options=options,
                             index_dir=str(tmp_path / "i1")) as store:
            one, two = _save(store, 1, keys["signer"]), _save(store, 2, keys["signer"])
        # a second index (another machine) sees the signatures, and removes one with its version
        with chunkstore.open(url, storage_options=options, index_dir=str(tmp_path / "i2"),
                             trust=[keys["signer.pub"]]) as store:
            assert store.signature(one).status == SIGNED_BY_TRUSTED
            store.delete(one)
            assert not store.objects.exists(SIGNATURES, one)
            assert [v.signature for v in store.verify().versions] == [SIGNED_BY_TRUSTED]
            assert store.signature(two).trusted
    finally:
        remove_bucket(s3_endpoint, bucket)


# --- SIGKILL at the commit point ------------------------------------------------------------

_SIGNED_SAVE = """
import sys, numpy as np, chunkstore
with chunkstore.open(sys.argv[1], create=True) as store:
    with store.new_version("r", 1, sign_with=sys.argv[2]) as v:
        v.put("w", np.arange(1000, dtype=np.float32))
"""


@pytest.mark.parametrize("fault", ["kill-before-put", "kill-after-put"])
def test_a_save_killed_at_its_commit_record_is_unpublished_or_signed(
        tmp_path: Path, keys: dict[str, Path], fault: str) -> None:
    """Killed as the commit record is stored: before it, nothing is published (the
    signature is an orphan GC removes); after it, the version is published signed."""
    import subprocess
    import sys
    store_path = tmp_path / "s"
    env = {**os.environ, "CHUNKSTORE_FAULT": f"{fault}:versions/:0",
           "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", _SIGNED_SAVE, str(store_path),
                           str(keys["signer"])], env=env, timeout=120, check=False)
    assert done.returncode == -9
    with chunkstore.open(store_path, trust=[keys["signer.pub"]]) as store:
        signatures = list(store.objects.ids(SIGNATURES))
        assert len(signatures) == 1  # stored before the record, in either case
        if fault == "kill-after-put":
            assert store.signature("r@1").status == SIGNED_BY_TRUSTED
        else:
            assert store.versions() == []
            past = time.time() - 7200
            os.utime(store_path / SIGNATURES.key(signatures[0]), (past, past))
            assert store.gc(grace="1h", sweep=True).signatures_deleted == 1


# --- the frozen fixture (tools/make_signed_fixture.py) ------------------------------------

FIXTURE = Path(__file__).parent / "data" / "signed-v1"


def test_the_signed_fixture_reads_back_with_its_verdicts(tmp_path: Path) -> None:
    import shutil

    import blake3
    expected = json.loads(FIXTURE.with_name("signed-v1.expected.json").read_text())
    files = {str(p.relative_to(FIXTURE)): blake3.blake3(p.read_bytes()).hexdigest()
             for p in sorted(FIXTURE.rglob("*")) if p.is_file()}
    assert files == expected["files"]  # frozen: never rewritten
    copy = tmp_path / "s"
    shutil.copytree(FIXTURE, copy)
    with chunkstore.open(copy, trust=[FIXTURE.with_name(expected["trusted"])]) as store:
        result = store.verify()
        for version in expected["versions"]:
            found = store.signature(version["id"])
            assert found.status == version["verdict"]
            if version["verdict"] != UNSIGNED:
                data = (copy / SIGNATURES.key(version["id"])).read_bytes()
                signature = Signature.decode(version["id"], data)
                assert json.loads(data)["format_version"] == expected["signature_format_version"]
                assert signature.key == found.key
                assert signature.key in expected["fingerprints"].values()
    assert result.ok
    assert [v.signature for v in result.versions] == [
        v["verdict"] for v in expected["versions"]]


def test_drill_require_signed_fails_an_unsigned_target_and_falls_back(
        tmp_path: Path, keys: dict[str, Path]) -> None:
    store_path = tmp_path / "s"
    with chunkstore.open(store_path, create=True) as store:
        signed = _save(store, 1, keys["signer"])
        _save(store, 2)
    runner = CliRunner()
    usage = runner.invoke(cli, ["drill", str(store_path), "--require-signed"])
    assert usage.exit_code == 2 and "--trust" in usage.output
    answer = runner.invoke(cli, ["drill", str(store_path), "--require-signed", "--trust",
                                 str(keys["signer.pub"]), "--materialize", "numpy",
                                 "--no-record", "--json"])
    assert answer.exit_code == 5, answer.output  # the target did not restore
    record = json.loads(answer.stdout)
    assert record["restore"]["version"] == signed  # fell back to the signed version
    assert "UntrustedVersionError" in json.dumps(record)
    plain = runner.invoke(cli, ["drill", str(store_path), "--materialize", "numpy",
                                "--no-record"])
    assert plain.exit_code == 0, plain.output


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_the_dcp_writer_signs_the_version_it_publishes(tmp_path: Path,
                                                       keys: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from torch_bridge.dcp import ChunkStoreWriter
    url = str(tmp_path / "s")
    dcp.save({"w": torch.ones(3, 4)}, storage_writer=ChunkStoreWriter(
        url, run="r", step=1, sign_with=keys["signer"]))
    dcp.save({"w": torch.zeros(3, 4)}, storage_writer=ChunkStoreWriter(url, run="r", step=2))
    with chunkstore.open(url, trust=[keys["signer.pub"]]) as store:
        assert store.signature("r@1").status == SIGNED_BY_TRUSTED
        assert store.signature("r@2").status == UNSIGNED
    with pytest.raises(SigningKeyError):  # before anything is saved
        ChunkStoreWriter(url, run="r", step=3, sign_with=keys["signer.pub"])


def test_an_index_that_names_another_root_is_no_signed_version(
        tmp_path: Path, keys: dict[str, Path]) -> None:
    """The local index (a cache anyone with the directory can edit) says signed version 1
    has version 2's root: a reader would follow the index's root, which is not what the
    key signed, so the version is not signed-by-trusted."""
    import dataclasses
    store_path = tmp_path / "s"
    with chunkstore.open(store_path, create=True, trust=[keys["signer.pub"]]) as store:
        one, two = _save(store, 1, keys["signer"]), _save(store, 2)
        entry = store.index.version(one)
        other = store.index.version(two)
        assert entry is not None and other is not None
        store.index.remove_version(one)
        store.index.add_version(dataclasses.replace(entry, root=other.root), [], {}, [])
        found = store.signature(one)
    assert found.status == BAD_SIGNATURE and "index" in (found.reason or "")


def test_the_mirror_of_a_signed_save_is_signed(tmp_path: Path, keys: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    from torch_bridge import Checkpointer
    model = torch.nn.Linear(2, 2)
    with Checkpointer(tmp_path / "local", run="r", sign_with=keys["signer"],
                      mirror=tmp_path / "mirror") as ckpt:
        info = ckpt.save(1, model=model)
        assert info is not None
        ckpt.wait(mirror=True)
    with chunkstore.open(tmp_path / "mirror", trust=[keys["signer.pub"]]) as mirror:
        assert mirror.signature(info.id).status == SIGNED_BY_TRUSTED
