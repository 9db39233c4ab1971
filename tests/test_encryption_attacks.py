"""Attacks on encrypted stores (docs/format.md §13), each on real stores and real files:
crafted and damaged key objects, a config stripped of its encryption, empty passwords,
segments spliced between two writes of one name, names that reveal plain data, and
what the local index and error messages hold.

Each safety test was broken once (see the commit that adds it) and seen to fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import chunkstore
from chunkstore.backends.wrappers import FAULT_ENV_VAR, RequestHook
from chunkstore.cli import cli
from chunkstore.errors import (
    CorruptConfigError,
    CorruptObjectError,
    CorruptTagError,
    GcAbortedError,
    IntegrityError,
    InvalidSettingError,
    KeyObjectError,
    WrongPasswordError,
)
from chunkstore.handle import encryption
from chunkstore.objects import keys
from chunkstore.objects.crypto import SEGMENT_OVERHEAD, SEGMENT_SIZE, subkey
from chunkstore.objects.kinds import NODES, TAGS, VERSIONS
from chunkstore.objects.sealed import SealedObjects
from tests.conftest import tree_snapshot
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here

PASSWORD = "correct horse battery staple"


@pytest.fixture(autouse=True)
def _fast_kdf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(keys.TEST_KDF_ENV, "1")  # the documented test-only scrypt cost
    for name in ("CHUNKSTORE_PASSWORD", "CHUNKSTORE_PASSWORD_FILE", "CHUNKSTORE_NEW_PASSWORD"):
        monkeypatch.delenv(name, raising=False)


def _save(store: chunkstore.Store, step: int, secret: str = "trainer state") -> None:
    with store.new_version(run="r", step=step) as version:
        version.put("w", np.arange(50_000, dtype=np.float32) + step)
        version.put_data("trainer", {"step": step, "note": secret})


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "s"
    with chunkstore.open(path, create=True, encrypt=True, password=PASSWORD) as opened:
        _save(opened, 1)
    return path


def _key_object(path: Path, key_id: str, **kdf: Any) -> Path:
    """A key object ``keys/<key_id>`` copied from the store's first key, with its KDF
    parameters changed (what anyone who can write the bucket can do)."""
    first = sorted((path / "keys").iterdir())[0]
    body = json.loads(first.read_bytes())
    body["kdf"].update(kdf)
    target = path / "keys" / key_id
    target.write_bytes(json.dumps(body).encode())
    return target


def _reads_back(path: Path, password: str = PASSWORD) -> None:
    with chunkstore.open(path, password=password) as opened:
        assert opened.open_version("r@1").get_data("trainer")["step"] == 1
        assert opened.verify().ok


# --- key objects ------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "n=2^40", "p=64"])
def test_a_damaged_or_crafted_key_object_locks_no_one_out(store: Path, damage: str) -> None:
    """A key object that does not parse, or whose KDF is out of bounds, sorted before
    the good one: the password still opens the store (the damaged key is skipped, not
    derived: p=64 at 1 GiB would take minutes), and a wrong password is still
    WrongPasswordError, naming the damaged key."""
    key_id = "0000000000000000"
    if damage == "garbage":
        (store / "keys" / key_id).write_bytes(b"\x00not a key object")
    elif damage == "n=2^40":
        _key_object(store, key_id, n=2**40)
    else:
        _key_object(store, key_id, n=2**20, r=8, p=64)
    _reads_back(store)
    with pytest.raises(WrongPasswordError, match=f"damaged.*{key_id}"):
        chunkstore.open(store, password="wrong")


def test_a_store_whose_every_key_is_damaged_says_so_not_wrong_password(store: Path) -> None:
    """Damage is not a wrong password: with no key object that parses, the error says to
    put keys/ back (KeyObjectError), whatever the password; nothing changes."""
    for key in (store / "keys").iterdir():
        key.write_bytes(key.read_bytes()[:-40])
    before = tree_snapshot(store)
    for password in (PASSWORD, "wrong"):
        with pytest.raises(KeyObjectError, match="every key object is damaged"):
            chunkstore.open(store, password=password)
    assert tree_snapshot(store) == before


def test_kdf_work_is_bounded_before_deriving(store: Path) -> None:
    """scrypt's time grows with n * r * p: each bound alone (n up to 2^24, r and p up
    to 64, memory up to 1 GiB) let a crafted key cost 64 derivations of 1 GiB."""
    for kdf, refused in (({"n": 2**20, "r": 8, "p": 64}, True),
                         ({"n": 2**40}, True), ({"n": 1}, True), ({"n": 3}, True),
                         ({"n": 2**16, "r": 8, "p": 1}, False),
                         ({"n": 2**20, "r": 8, "p": 1}, False)):
        data = _key_object(store, "1111111111111111", **kdf).read_bytes()
        if refused:
            with pytest.raises(CorruptObjectError):
                keys.unwrap("1111111111111111", data, PASSWORD, "x")
        else:
            assert keys._parse("1111111111111111", data)[1] == {"r": 8, "p": 1, **kdf}


def test_removing_a_key_never_leaves_only_damaged_ones(store: Path) -> None:
    """Two key objects, one of them damaged: removing the good one (or changing its
    password to none) would leave a store no password opens; refused, nothing changed."""
    (store / "keys" / "0000000000000000").write_bytes(b"{}")
    with chunkstore.open(store, password=PASSWORD) as opened:
        before = tree_snapshot(store / "keys")
        objects = opened.objects
        assert isinstance(objects, SealedObjects)
        with pytest.raises(KeyObjectError, match="damaged"):
            encryption.remove_key(opened.url, objects, objects.key_id)
        assert tree_snapshot(store / "keys") == before
        encryption.remove_key(opened.url, objects, "0000000000000000")  # the damaged one: fine
    _reads_back(store)


@pytest.mark.parametrize("how", ["api", "cli-init", "cli-add", "cli-passwd"])
def test_an_empty_password_makes_no_key(tmp_path: Path, store: Path, how: str) -> None:
    """An empty password (an empty --password-file, /dev/null, password="") would wrap
    the master key under scrypt of nothing: refused, nothing created or changed."""
    empty = tmp_path / "empty"
    empty.write_text("")
    if how == "api":
        with pytest.raises(InvalidSettingError, match="empty"):
            chunkstore.open(tmp_path / "new", create=True, encrypt=True, password="")
        assert not (tmp_path / "new").exists() or not any((tmp_path / "new").rglob("keys/*"))
        return
    before = tree_snapshot(store)
    if how == "cli-init":
        args = ["--password-file", str(empty), "init", "--encrypt", str(tmp_path / "new")]
    else:
        args = ["key", "add" if how == "cli-add" else "passwd", str(store),
                "--new-password-file", str(empty)]
    result = CliRunner().invoke(cli, args, env={"CHUNKSTORE_PASSWORD": PASSWORD})
    assert result.exit_code != 0, result.output
    assert "empty" in result.output
    assert not any((tmp_path / "new").rglob("keys/*"))
    assert tree_snapshot(store) == before


# --- the config ----------------------------------------------------------------------------


def _strip_encryption(path: Path, version: int) -> None:
    config = json.loads((path / "chunkstore.json").read_bytes())
    del config["encryption"]
    config["format_version"] = version
    (path / "chunkstore.json").write_text(json.dumps(config))


def test_a_config_stripped_of_its_encryption_is_refused_not_written_in_clear(
        store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone who can write the bucket rewrites chunkstore.json as a plain store's. A
    job that holds the password (CHUNKSTORE_PASSWORD) and opens the store must not save
    its checkpoint in clear beside the sealed ones: the key objects say the store is
    encrypted, so the config is damaged (CorruptConfigError), and nothing is written."""
    _strip_encryption(store, 9)
    monkeypatch.setenv("CHUNKSTORE_PASSWORD", PASSWORD)
    before = tree_snapshot(store)
    with pytest.raises(CorruptConfigError, match="key objects"):
        with chunkstore.open(store) as opened:
            _save(opened, 2, secret="PLAINTEXT-SECRET")
    assert tree_snapshot(store) == before
    with pytest.raises(CorruptConfigError, match="key objects"):
        chunkstore.open(store, password=PASSWORD)


def test_a_plain_store_opens_beside_a_password_file_variable_it_cannot_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The look for key objects a password in the environment brings reads no file: a
    plain store opens with CHUNKSTORE_PASSWORD_FILE naming one that is not there."""
    chunkstore.open(tmp_path / "plain", create=True).close()
    monkeypatch.setenv("CHUNKSTORE_PASSWORD_FILE", str(tmp_path / "not-there"))
    chunkstore.open(tmp_path / "plain").close()


@pytest.mark.parametrize("claimed", [10, 11, 12])
def test_a_config_downgraded_below_13_is_refused_not_written_with_an_older_sealing(
        store: Path, claimed: int) -> None:
    """Someone who can write the bucket rewrites a version-13 store's config as version
    10 (or 11, held), so that a writer with the password would seal with random nonces
    and name nodes in clear, or as 12, so that it would seal packs whole where readers
    open members on their own: the key objects are bound to sealing 3, so the config is
    refused as replaced (CorruptConfigError, not a wrong password), and nothing is
    written; put back, the store reads."""
    original = (store / "chunkstore.json").read_bytes()
    config = json.loads(original)
    assert config["format_version"] == 13
    (store / "chunkstore.json").write_text(json.dumps({**config, "format_version": claimed}))
    before = tree_snapshot(store)
    for password in (PASSWORD, "wrong"):
        with pytest.raises(CorruptConfigError if password == PASSWORD
                           else WrongPasswordError, match="replaced" if password ==
                           PASSWORD else "password"):
            with chunkstore.open(store, password=password) as opened:
                _save(opened, 2, secret="SEALED-WITH-SEALING-1")
    assert tree_snapshot(store) == before
    (store / "chunkstore.json").write_bytes(original)
    _reads_back(store)


def test_a_version_10_store_s_config_raised_to_12_is_refused(tmp_path: Path) -> None:
    """The other way: encrypted-v1 (version 10) with a config that says 12 opens no key
    bound to sealing 2; its key opens bound to sealing 1, so the config was replaced."""
    fixture = Path(__file__).resolve().parent / "data" / "encrypted-v1"
    path = tmp_path / "v1"
    shutil.copytree(fixture, path)
    password = json.loads(fixture.with_name("encrypted-v1.expected.json").read_text()
                          )["password"]
    config = json.loads((path / "chunkstore.json").read_bytes())
    (path / "chunkstore.json").write_text(json.dumps({**config, "format_version": 12}))
    before = tree_snapshot(path)
    with pytest.raises(CorruptConfigError, match="sealing 1"):
        chunkstore.open(path, password=password)
    assert tree_snapshot(path) == before


def test_a_version_10_config_without_encryption_is_damaged(store: Path) -> None:
    _strip_encryption(store, 10)
    with pytest.raises(CorruptConfigError):
        chunkstore.open(store, password=PASSWORD)


# --- sealing --------------------------------------------------------------------------------


@pytest.mark.parametrize("read", ["whole", "range"])
def test_segments_of_two_writes_of_one_name_do_not_splice(store: Path, read: str) -> None:
    """Store version 12 (docs/format.md §13.3): every segment's nonce carries its write's
    salt, so the head of one write of a tag followed by the rest of another fails, read
    whole or by a range across the seam; each write alone still reads."""
    with chunkstore.open(store, password=PASSWORD) as opened:
        objects = opened.objects
        assert opened.config.format_version == 13
        first, second = b"A" * (2 * SEGMENT_SIZE + 10), b"B" * (2 * SEGMENT_SIZE + 10)
        objects.put(TAGS, "spliced", first)
        old = (store / TAGS.key("spliced")).read_bytes()
        objects.put(TAGS, "spliced", second)
        new = (store / TAGS.key("spliced")).read_bytes()
        step = SEGMENT_SIZE + SEGMENT_OVERHEAD
        for head, tail in ((new, old), (old, new)):
            (store / TAGS.key("spliced")).write_bytes(head[:step] + tail[step:])
            with pytest.raises(CorruptTagError, match="another write"):
                mixed = objects.get(TAGS, "spliced") if read == "whole" else \
                    objects.get_range(TAGS, "spliced", SEGMENT_SIZE - 5, 10)
                assert mixed in (first, second), "a plaintext never written"
        for whole, plain in ((old, first), (new, second)):
            (store / TAGS.key("spliced")).write_bytes(whole)
            assert objects.get(TAGS, "spliced") == plain


def test_object_names_tell_nothing_about_plain_data(tmp_path: Path) -> None:
    """Store version 12 (§13.4): node ids are keyed like chunk ids, so a node of plain
    data alone ({'step': 4}) is not named as in a plain store, where a guess of it could
    be confirmed by listing the bucket."""
    def names(path: Path) -> set[str]:
        return {str(p.relative_to(path)) for p in path.rglob("*")
                if p.is_file() and "index" not in p.parts and p.name != "chunkstore.json"}

    for path, kwargs in ((tmp_path / "enc", {"encrypt": True, "password": PASSWORD}),
                         (tmp_path / "plain", {})):
        with chunkstore.open(path, create=True, **kwargs) as opened:
            with opened.new_version(run="r", step=1) as version:
                version.put_data("trainer", {"step": 4})
    assert not names(tmp_path / "enc") & names(tmp_path / "plain")
    with chunkstore.open(tmp_path / "enc", password=PASSWORD) as opened:
        assert opened.open_version("r@1").get_data("trainer") == {"step": 4}
        assert opened.verify().ok


# --- what stays on the machine ---------------------------------------------------------------


def test_the_local_index_and_errors_hold_no_key_and_no_password(store: Path) -> None:
    """The index is a cache of decrypted records (documented): it must hold no password,
    no master key nor subkey, and no tensor byte; errors never name the password."""
    with chunkstore.open(store, password=PASSWORD) as opened:
        objects = opened.objects
        assert isinstance(objects, SealedObjects)
        secrets = [PASSWORD.encode(), objects.master, subkey(objects.master, "objects"),
                   subkey(objects.master, "chunk ids"),
                   (np.arange(50_000, dtype=np.float32) + 1).tobytes()[4096:4160],
                   b"trainer state"]  # a plain data value (the index holds records' meta)
        assert PASSWORD not in repr(opened) and PASSWORD not in repr(objects)
    index = b"".join(p.read_bytes() for p in (store / "index").rglob("*") if p.is_file())
    assert index  # the index is there, and read
    for secret in secrets:
        assert secret not in index and secret.hex().encode() not in index
    for attempt in ("wrong " + PASSWORD, PASSWORD[:-1]):
        with pytest.raises(WrongPasswordError) as caught:
            chunkstore.open(store, password=attempt)
        assert attempt not in str(caught.value) and attempt not in repr(caught.value.args)
    os.environ.pop("CHUNKSTORE_PASSWORD", None)


class _RemovesFirst(RequestHook):
    """Before this handle deletes a key, another handle removes another key (the two
    ``chunkstore key remove`` of the last two keys at once, in their worst order)."""

    def __init__(self, inner: Any, other: chunkstore.Store, other_key: str) -> None:
        super().__init__(inner)
        self.other, self.other_key = other, other_key

    def request(self, operation: str, key: str) -> None:
        if operation == "delete" and key.startswith("keys/") and self.other_key:
            other_key, self.other_key = self.other_key, ""
            encryption.remove_key(self.other.url, self.other.objects, other_key)


def test_two_removals_at_once_never_leave_no_key(store: Path) -> None:
    second = "second password"
    with chunkstore.open(store, password=PASSWORD) as first:
        objects = first.objects
        assert isinstance(objects, SealedObjects)
        encryption.add_password(first.url, objects, first.config, second)
        first_key = objects.key_id
    with chunkstore.open(store, password=second) as other, \
            chunkstore.open(store, password=PASSWORD) as opened:
        assert isinstance(other.objects, SealedObjects)
        second_key = other.objects.key_id
        opened.objects.backend = _RemovesFirst(opened.objects.backend, other, first_key)
        with pytest.raises(KeyObjectError, match="meanwhile"):
            encryption.remove_key(opened.url, opened.objects, second_key)
    assert [p.name for p in (store / "keys").iterdir()] == [second_key]
    _reads_back(store, second)


# --- damaged objects: verify, restore, sync and repair -------------------------------------


def _chunk_files(path: Path) -> set[Path]:
    return {p for p in (path / "chunks").rglob("*") if p.is_file()}


def _victims(path: Path, store: chunkstore.Store, old: set[Path] = frozenset()
             ) -> dict[str, Path]:
    """The largest chunk not in ``old`` and the newest version's root node and record."""
    latest = store.latest("r")
    assert latest is not None
    chunks = sorted(_chunk_files(path) - old, key=lambda p: p.stat().st_size)
    return {"chunk": chunks[-1], "node": path / NODES.key(latest.root),
            "record": path / VERSIONS.key(latest.id)}


@pytest.mark.parametrize("victim", ["chunk", "node", "record"])
@pytest.mark.parametrize("cut", [0, 5, SEGMENT_OVERHEAD])
def test_an_object_cut_short_is_corruption_never_data(store: Path, victim: str,
                                                      cut: int) -> None:
    """An object truncated to nothing, to less than a nonce, or to a bare nonce and tag
    (what a ranged read of its first segment meets): verify names it with its version,
    a read raises an integrity error, and the version before still reads."""
    with chunkstore.open(store, password=PASSWORD) as opened:
        old = _chunk_files(store)
        _save(opened, 2)
        target = _victims(store, opened, old)[victim]
        newest = opened.latest("r")
        assert newest is not None
    target.write_bytes(target.read_bytes()[:cut])
    with chunkstore.open(store, password=PASSWORD) as opened:
        result = opened.verify()
        assert not result.ok
        assert {p.version for p in result.problems} == {newest.id}, result.problems
        if victim != "record":
            with pytest.raises(IntegrityError):
                reader = opened.open_version("r@2")
                reader.get("w")
                reader.get_data("trainer")
        assert opened.open_version("r@1").get_data("trainer")["step"] == 1


def test_repair_between_encrypted_copies_heals_tampered_objects(tmp_path: Path,
                                                                store: Path) -> None:
    """A copy (sync: one master key) with a flipped chunk, an emptied node and a commit
    record from another version's bytes is repaired from the source: it verifies and
    reads back; sync from a source with a tampered chunk copies no garbage."""
    copy = tmp_path / "copy"
    with chunkstore.open(store, password=PASSWORD) as source:
        _save(source, 2)
        chunkstore.sync(source, copy)
        victims = _victims(copy, source)
    data = bytearray(victims["chunk"].read_bytes())
    data[len(data) // 2] ^= 1
    victims["chunk"].write_bytes(bytes(data))
    victims["node"].write_bytes(b"")
    other = next(p for p in (copy / "versions").iterdir() if p != victims["record"])
    victims["record"].write_bytes(other.read_bytes())
    with chunkstore.open(copy, password=PASSWORD) as damaged, \
            chunkstore.open(store, password=PASSWORD) as source:
        assert not damaged.verify().ok
        result = chunkstore.repair(damaged, source)
        assert result.ok, result.to_json()
        # exactly the three: a node whole in the copy is not taken for damage (node ids
        # are keyed in a store of version 12; checked as plain, every node would be)
        assert sorted(f.digest for f in result.fixed) == sorted(
            victim.name for victim in victims.values()), \
            result.to_json()
        assert damaged.verify().ok
        assert damaged.open_version("r@2").get_data("trainer")["step"] == 2
    # the source damaged: a sync into a new copy copies nothing it cannot authenticate
    source_chunk = store / victims["chunk"].relative_to(copy)
    data = bytearray(source_chunk.read_bytes())
    data[len(data) // 2] ^= 1
    source_chunk.write_bytes(bytes(data))
    with chunkstore.open(store, password=PASSWORD) as source, \
            contextlib.suppress(IntegrityError):
        chunkstore.sync(source, tmp_path / "copy2")
    with chunkstore.open(tmp_path / "copy2", password=PASSWORD) as copied:
        assert copied.verify().ok  # whatever it published, it holds whole
        for info in copied.versions():
            copied.open_version(info.id).get("w")


def test_no_command_line_option_takes_a_password_itself() -> None:
    """A password on the command line is in ``ps`` and shell history: every option that
    names a password takes a file."""
    def options(command: Any) -> Any:
        yield from command.params
        for sub in getattr(command, "commands", {}).values():
            yield from options(sub)

    for param in options(cli):
        for name in param.opts:
            if "password" in name:
                assert name.endswith("-file"), name


# --- key commands killed, and on S3 -----------------------------------------------------------


@pytest.mark.parametrize("fault", ["kill-before-put:keys/:0", "kill-after-put:keys/:0",
                                   "kill-before-delete:keys/:0", "kill-after-delete:keys/:0"])
@pytest.mark.parametrize("command", ["add", "passwd"])
def test_a_key_command_killed_at_each_step_leaves_a_key_that_opens(
        store: Path, tmp_path: Path, command: str, fault: str) -> None:
    """``chunkstore key add|passwd`` in a real process, SIGKILLed before and after its
    write and its delete: the old password or the new one opens the store (never none),
    and every key object left parses."""
    new = tmp_path / "new"
    new.write_text("a new password\n")
    env = {**os.environ, "CHUNKSTORE_PASSWORD": PASSWORD, FAULT_ENV_VAR: fault,
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "chunkstore", "key", command, str(store),
                           "--new-password-file", str(new)], env=env, capture_output=True,
                          timeout=120, check=False)
    killed = done.returncode == -signal.SIGKILL
    assert killed or (done.returncode == 0 and "delete" in fault
                      and command == "add"), done.stderr.decode()
    opens = []
    for password in (PASSWORD, "a new password"):
        try:
            _reads_back(store, password)
            opens.append(password)
        except WrongPasswordError:
            pass
    assert opens, "no password opens the store"
    for key in (store / "keys").iterdir():
        keys._parse(key.name, key.read_bytes())
    assert PASSWORD.encode() not in done.stdout + done.stderr


@pytest.mark.s3
def test_crafted_keys_and_a_stripped_config_on_s3(s3_endpoint: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """On the S3 server: a garbage key object sorted first locks no one out, and a
    config rewritten as a plain store's is refused to a job holding the password."""
    monkeypatch.setenv("CHUNKSTORE_CACHE_DIR", str(tmp_path / "cache"))
    bucket = create_bucket(s3_endpoint)
    url, options = f"s3://{bucket}/ckpts", storage_options(s3_endpoint)
    try:
        with chunkstore.open(url, create=True, encrypt=True, password=PASSWORD,
                             storage_options=options) as opened:
            _save(opened, 1)
            backend = opened.objects.backend
            backend.put("keys/0000000000000000", b"\x00garbage")
            config = json.loads(backend.get("chunkstore.json"))
        with chunkstore.open(url, password=PASSWORD, storage_options=options) as opened:
            assert opened.open_version("r@1").get_data("trainer")["step"] == 1
            del config["encryption"]
            config["format_version"] = 9
            opened.objects.backend.put("chunkstore.json", json.dumps(config).encode())
        monkeypatch.setenv("CHUNKSTORE_PASSWORD", PASSWORD)
        with pytest.raises(CorruptConfigError, match="key objects"):
            chunkstore.open(url, storage_options=options)
    finally:
        remove_bucket(s3_endpoint, bucket)


def test_objects_of_another_store_with_the_same_password_do_not_splice(tmp_path: Path) -> None:
    """Two stores made apart with one password have two master keys: a tag, a commit
    record or a key object copied from one into the other opens nothing there, and is
    named as damage (never read as the other store's data)."""
    a, b = tmp_path / "a", tmp_path / "b"
    for path in (a, b):
        with chunkstore.open(path, create=True, encrypt=True, password=PASSWORD) as opened:
            _save(opened, 1)
            opened.tag("r@1", "best")
    (a / "tags" / "best").write_bytes((b / "tags" / "best").read_bytes())
    record = next((b / "versions").iterdir())
    (a / "versions" / record.name).write_bytes(record.read_bytes())
    key = next((b / "keys").iterdir())
    (a / "keys" / ("f" * 16)).write_bytes(key.read_bytes())
    with chunkstore.open(a, password=PASSWORD, index_dir=str(tmp_path / "fresh")) as opened:
        assert isinstance(opened.objects, SealedObjects)
        assert opened.objects.key_id != "f" * 16
        with pytest.raises(IntegrityError):
            opened.objects.get(TAGS, "best")
        with pytest.raises(IntegrityError):
            opened.objects.get(VERSIONS, record.name)
        assert not opened.verify().ok
    with chunkstore.open(a, password=PASSWORD) as opened:  # its own index knew the tag
        assert opened.stored_tags()["best"] == opened.resolve("r@1").id


def test_a_pack_cut_at_a_segment_boundary_fails_its_members(tmp_path: Path) -> None:
    """A pack cut after its first segment: members past the cut are damage (a ranged
    read meets the end of the object before its last, short, segment), never short
    data; verify names the version."""
    path = tmp_path / "s"
    rng = np.random.default_rng(1)
    tensors = [rng.standard_normal(4096).astype(np.float32) for _ in range(40)]  # 16 KiB
    with chunkstore.open(path, create=True, encrypt=True, password=PASSWORD,
                         pack_size=256 * 1024) as opened:
        with opened.new_version(run="r", step=1) as version:
            for i in range(40):
                version.put(f"t{i}", tensors[i])
    packs = [p for p in _chunk_files(path) if p.stat().st_size > 3 * SEGMENT_SIZE]
    assert packs
    step = SEGMENT_SIZE + SEGMENT_OVERHEAD
    for pack in packs:
        pack.write_bytes(pack.read_bytes()[:step])
    with chunkstore.open(path, password=PASSWORD) as opened:
        assert not opened.verify().ok
        reader = opened.open_version("r@1")
        failed = 0
        for i in range(40):
            try:
                np.testing.assert_array_equal(reader.get(f"t{i}"), tensors[i])
            except IntegrityError:
                failed += 1
        assert failed


@pytest.mark.parametrize("encrypt", [True, False])
def test_a_damaged_moved_record_is_reported_and_stops_gc(tmp_path: Path,
                                                                encrypt: bool) -> None:
    """A moved record (a repacked pack's forwarding record) that fails: verify reports it
    and GC deletes nothing (GcAbortedError), as for one that does not parse in a plain
    store; versions still read."""
    path = tmp_path / "s"
    kwargs: dict[str, Any] = {"encrypt": True, "password": PASSWORD} if encrypt else {}
    with chunkstore.open(path, create=True, **kwargs) as opened:
        _save(opened, 1)
    (path / "moved").mkdir(exist_ok=True)
    (path / "moved" / ("ab" * 32)).write_bytes(b"\x01" * 80)
    with chunkstore.open(path, password=PASSWORD if encrypt else None) as opened:
        result = opened.verify()
        assert any("moved record" in p.message for p in result.problems), result.problems
        with pytest.raises(GcAbortedError, match="moved record"):
            opened.gc(grace=0)
        assert opened.open_version("r@1").get_data("trainer")["step"] == 1


@pytest.mark.parametrize("victim", ["leases/r", "removed/{r@2}", "sessions/s1", "readers/x1",
                                    "drills/d1", "gc/{journal}", "tags/best", "moved/{pack}"])
def test_a_protocol_object_that_fails_is_typed_damage_everywhere(tmp_path: Path,
                                                                 victim: str) -> None:
    """An object of each mutable kind that fails authentication (garbage under its
    name, or a flipped byte in a real one): opening, listing, verify, a save, a
    restore and GC each succeed or raise a typed error (ChunkStoreError), never another
    exception; published versions still read."""
    path = tmp_path / "s"
    with chunkstore.open(path, create=True, encrypt=True, password=PASSWORD) as opened:
        for step in (1, 2):
            _save(opened, step)
        opened.tag("r@2", "best")
        opened.delete("r@1")
        opened.gc(grace=0)
        name = victim.format(**{"r@2": opened.resolve("r@2").id, "pack": "cd" * 32,
                                "journal": "x"})
    if name == "gc/x":
        target = next(p for p in (path / "gc").iterdir())
    else:
        target = path / name
        target.parent.mkdir(exist_ok=True)
    data = bytearray(target.read_bytes() if target.exists() else os.urandom(200))
    data[len(data) // 2] ^= 1
    target.write_bytes(bytes(data))

    def typed(step: Any) -> None:
        with contextlib.suppress(chunkstore.errors.ChunkStoreError):
            step()

    with chunkstore.open(path, password=PASSWORD) as opened:
        typed(opened.versions)
        typed(opened.verify)
        typed(lambda: _save(opened, 3))
        typed(lambda: opened.gc(grace=0))
        assert opened.open_version("r@2").get_data("trainer")["step"] == 2
    with chunkstore.open(path, password=PASSWORD, index_dir=str(tmp_path / "fresh")) as opened:
        assert opened.open_version("r@2").get_data("trainer")["step"] == 2


def test_a_store_whose_keys_are_lost_is_never_keyed_again(store: Path) -> None:
    """keys/ deleted (by whoever can write the bucket, or lost in a copy): an open that
    may create (create=True, encrypt=True, as Checkpointer and init do) made a new
    master key and saved under it beside objects it cannot read. Refused, nothing
    written; once keys/ is back the store reads. A creation interrupted before its
    first key (the config alone) is still finished by such an open."""
    saved = {p.name: p.read_bytes() for p in (store / "keys").iterdir()}
    for name in saved:
        (store / "keys" / name).unlink()
    before = tree_snapshot(store)
    for create in (True, False):
        with pytest.raises(KeyObjectError, match=r"(?i)put back a copy of its keys/"):
            chunkstore.open(store, create=create, encrypt=create, password=PASSWORD)
    assert tree_snapshot(store) == before
    for name, data in saved.items():
        (store / "keys" / name).write_bytes(data)
    _reads_back(store)
    interrupted = store.parent / "interrupted"
    interrupted.mkdir()
    (interrupted / "chunkstore.json").write_bytes((store / "chunkstore.json").read_bytes())
    with chunkstore.open(interrupted, create=True, encrypt=True, password=PASSWORD) as opened:
        _save(opened, 1)
    _reads_back(interrupted)


def test_a_mirror_made_plain_beforehand_gets_nothing_in_clear(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """The tiered Checkpointer's mirror location, made a plain store beforehand (by
    whoever can write the bucket): mirroring the encrypted local tier into it is refused
    (the stores name chunks apart), so no version reaches it in clear; the local tier
    keeps every save."""
    torch = pytest.importorskip("torch")
    from torch_bridge import Checkpointer
    monkeypatch.setenv("CHUNKSTORE_PASSWORD", PASSWORD)
    chunkstore.open(tmp_path / "local", create=True, encrypt=True).close()
    with monkeypatch.context() as plain:
        plain.delenv("CHUNKSTORE_PASSWORD")
        chunkstore.open(tmp_path / "mirror", create=True).close()
    model = torch.nn.Linear(64, 64)
    with pytest.warns(RuntimeWarning, match="is not encrypted"), \
            Checkpointer(tmp_path / "local", run="r", mirror=str(tmp_path / "mirror")) as ckpt:
        for step in (1, 2):
            ckpt.save(step, model=model)
        with contextlib.suppress(chunkstore.errors.ChunkStoreError, TimeoutError):
            ckpt.wait(mirror=True, timeout=60)
    with chunkstore.open(tmp_path / "local") as local:
        assert [v.step for v in local.versions()] == [1, 2]
    monkeypatch.delenv("CHUNKSTORE_PASSWORD")
    with chunkstore.open(tmp_path / "mirror") as mirror:
        assert mirror.versions() == []
    assert not [p for p in (tmp_path / "mirror").rglob("*")
                if p.is_file() and p.parts[-2] in ("versions", "nodes")]


def test_a_huge_object_in_keys_is_read_no_further_than_a_key(store: Path) -> None:
    """A 512 MiB object planted in keys/ (sorted first): opening reads at most a key
    object's bound of it, not the whole (measured as the peak of Python's allocations)."""
    with (store / "keys" / "0000000000000000").open("wb") as planted:
        planted.truncate(512 << 20)  # sparse: no disk used
    tracemalloc.start()
    try:
        _reads_back(store)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 128 << 20, peak


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_a_password_file_without_end_is_refused_not_read_for_ever(store: Path) -> None:
    """``--password-file /dev/zero`` (or any file without a line break in its first
    64 KiB): a typed refusal in a real process, not a read that never ends."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSTORE_PASSWORD")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-m", "chunkstore", "--password-file", "/dev/zero",
                           "log", str(store)], env=env, capture_output=True, timeout=60,
                          check=False)
    assert done.returncode != 0
    assert b"over 65536 bytes" in done.stderr, done.stderr


@pytest.mark.parametrize("fault", ["kill-after-put:chunkstore.json:0",
                                   "kill-after-put:keys/:0"])
def test_a_sync_killed_while_it_makes_the_encrypted_copy_finishes_it_next_time(
        store: Path, tmp_path: Path, fault: str) -> None:
    """``chunkstore sync`` into a new location SIGKILLed after the copy's config (the
    next sync wrote the versions into a copy no password opened), or after its first
    key object: the next sync completes the copy, which opens with the password of each
    key object it holds (every one of the source's, or the first copied) and reads back."""
    with chunkstore.open(store, password=PASSWORD) as opened:
        encryption.add_password(opened.url, opened.objects, opened.config, "second password")
    copy = tmp_path / "copy"
    env = {**os.environ, "CHUNKSTORE_PASSWORD": PASSWORD, FAULT_ENV_VAR: fault,
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "chunkstore", "sync", str(store), str(copy)],
                          env=env, capture_output=True, timeout=120, check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    with chunkstore.open(store, password=PASSWORD) as source:
        chunkstore.sync(source, copy)
    copied = sorted(p.name for p in (copy / "keys").iterdir())
    assert copied == sorted(p.name for p in (store / "keys").iterdir()) or len(copied) == 1
    opens = []
    for password in (PASSWORD, "second password"):
        with contextlib.suppress(WrongPasswordError):
            _reads_back(copy, password)
            opens.append(password)
    assert len(opens) == len(copied)


@pytest.mark.parametrize("victim", ["record", "node"])
def test_gc_with_a_fresh_index_never_collects_what_a_failing_object_hides(
        store: Path, tmp_path: Path, victim: str) -> None:
    """A commit record or root node that fails authentication, met by a GC on a fresh
    index (another machine): GC deletes none of that version's objects (it stops, or
    keeps them), so once the object is put back the version reads whole."""
    with chunkstore.open(store, password=PASSWORD) as opened:
        old = _chunk_files(store)
        _save(opened, 2)
        target = _victims(store, opened, old)[victim]
    original = target.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 1
    target.write_bytes(bytes(data))
    with chunkstore.open(store, password=PASSWORD, index_dir=str(tmp_path / "fresh")) as opened:
        with contextlib.suppress(chunkstore.errors.ChunkStoreError):
            opened.gc(grace=0)
    target.write_bytes(original)
    with chunkstore.open(store, password=PASSWORD, index_dir=str(tmp_path / "again")) as opened:
        reader = opened.open_version("r@2")
        np.testing.assert_array_equal(reader.get("w"), np.arange(50_000, dtype=np.float32) + 2)
        assert opened.verify().ok
