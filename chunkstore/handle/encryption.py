"""Opening an encrypted store: the password, the first key of a new store, and the
object layer that seals every object (docs/format.md §13).

:func:`chunkstore.open` calls :func:`unlocked` once the config is read: an
unencrypted store keeps its plain object layer (and refuses a password given to
it); an encrypted one is unlocked with the password, or created with its master key
and first key object, and every read and write from then on goes through
:class:`~chunkstore.objects.sealed.SealedObjects`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from chunkstore.errors import (
    CorruptConfigError,
    EncryptionError,
    InvalidSettingError,
    KeyObjectError,
    NotEncryptedError,
    PasswordRequiredError,
)
from chunkstore.format.digest import ChunkIds
from chunkstore.format.records import StoreConfig
from chunkstore.objects import keys
from chunkstore.objects.crypto import Sealer, subkey
from chunkstore.objects.kinds import KEYS
from chunkstore.objects.objectstore import ObjectStore
from chunkstore.objects.sealed import SealedObjects
from chunkstore.protocol import audit

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

#: Where a password comes from when none is passed (the command line reads them too).
PASSWORD_ENV = "CHUNKSTORE_PASSWORD"
PASSWORD_FILE_ENV = "CHUNKSTORE_PASSWORD_FILE"


#: The most a password file's first line may hold (``/dev/zero`` given as one is refused
#: after this much, instead of read for ever).
MAX_PASSWORD_BYTES = 64 * 1024


def read_password_file(path: str | os.PathLike[str]) -> str:
    """The password a file holds: its first line, without the line break."""
    try:
        with Path(path).open("rb") as file:
            first = file.readline(MAX_PASSWORD_BYTES + 1)
        text = first.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidSettingError(f"cannot read the password file {os.fspath(path)!r}:"
                                  f" {exc}") from None
    if len(first) > MAX_PASSWORD_BYTES:
        raise InvalidSettingError(f"the password file {os.fspath(path)!r} holds no password:"
                                  f" its first line is over {MAX_PASSWORD_BYTES} bytes")
    return text.splitlines()[0] if text else ""


def password_from_env() -> str | None:
    """``CHUNKSTORE_PASSWORD``, else the file ``CHUNKSTORE_PASSWORD_FILE`` names, else None."""
    if os.environ.get(PASSWORD_ENV):
        return os.environ[PASSWORD_ENV]
    path = os.environ.get(PASSWORD_FILE_ENV)
    return read_password_file(path) if path else None


def first_key_id(config: StoreConfig) -> str:
    """The id of a new store's first key: the same for every process creating the store
    at once, so exactly one of them writes it (the others open the store with it)."""
    return blake3.blake3(config.identity().encode()).hexdigest(length=8)


def sealing_of(config: StoreConfig) -> int:
    """The sealing of an encrypted store (docs/format.md §13.1): 3 for version 13, 2 for
    version 12."""
    assert config.encryption is not None
    return config.encryption.sealing


def sealed(objects: ObjectStore, config: StoreConfig, master: bytes, key_id: str
           ) -> SealedObjects:
    """The object layer of the encrypted store ``config`` describes, under ``master``
    (which key object ``key_id`` opened)."""
    encryption = config.encryption
    assert encryption is not None
    sealer = Sealer(subkey(master, "objects"), encryption.segment_size,
                    salted=encryption.sealing >= 2, members=encryption.sealing >= 3)
    ids = ChunkIds(subkey(master, "chunk ids"))
    return SealedObjects(objects.backend, sealer, ids, master, key_id,
                         ids if encryption.keyed_nodes else None)


def check_password_given(url: str, create: bool, encrypt: bool, password: str | None) -> None:
    """A store opened with ``encrypt=True`` has a password (``password`` or the
    environment's), and one it creates a password that is not empty."""
    if not encrypt:
        return
    found = password if password is not None else password_from_env()
    if found is None:
        raise PasswordRequiredError(url)
    if create:
        keys.check_new_password(found)


def check_new_store(url: str, objects: ObjectStore, create: bool, encrypt: bool,
                    password: str | None) -> None:
    """Refuse, before anything is created, a password given for a store this call would
    create unencrypted (``encrypt=True`` left out)."""
    if create and not encrypt and password is not None and objects.is_empty():
        raise NotEncryptedError(url, "a password was given for it, without encrypt=True"
                                " (nothing was created)")


def clone_keys(objects: ObjectStore, source: StoreHandle | None, create: bool) -> None:
    """Make a location an encrypted copy of the store ``source``: its config and key
    objects, byte for byte, so that both share one master key (and its passwords) and
    objects copied between them by key stay valid.  An empty location gets them where
    ``create``; a copy whose making was cut short (its config, no key object) gets the
    keys it lacks; any other location is left as it is (opening it checks what it is)."""
    if source is None or not source.objects.encrypted:
        return
    config = source.objects.get_config()
    if create and objects.is_empty():
        objects.create_config(config)
    elif keys.key_ids(objects):
        return  # the usual case: a copy with its keys (or another store)
    try:
        if objects.get_config() != config:
            return
    except FileNotFoundError:
        return
    for key_id in keys.key_ids(source.objects):
        objects.put_if_absent(KEYS, key_id, keys.read_key(source.objects, key_id))


def unlocked(url: str, objects: ObjectStore, config: StoreConfig, password: str | None,
             created: bool, key_of: StoreHandle | None = None) -> ObjectStore:
    """``objects`` as the store must be read: as they are for an unencrypted store, else
    sealed under the master key ``password`` opens (``created``: this call made the
    store, which then gets its master key and first key object here), or that of
    ``key_of``, an open store this one is a copy of (the same identity and encryption:
    :func:`clone_keys`)."""
    if config.encryption is None:
        if password is not None or os.environ.get(PASSWORD_ENV) \
                or os.environ.get(PASSWORD_FILE_ENV):  # the file is not read for a plain store
            check_not_stripped(url, objects)
        if password is not None:
            raise NotEncryptedError(url)
        return objects
    source = key_of.objects if key_of is not None else None
    if isinstance(source, SealedObjects) and key_of is not None \
            and key_of.config.identity() == config.identity() \
            and key_of.config.encryption == config.encryption:
        return sealed(objects, config, source.master, source.key_id)
    password = password if password is not None else password_from_env()
    if password is None:
        raise PasswordRequiredError(url)
    if created and not keys.key_ids(objects):
        if objects.holds_objects(KEYS):
            raise KeyObjectError(url, "the store holds objects but no key object (keys/):"
                                 " its keys were deleted or not copied. Put back a copy of"
                                 " its keys/; a new key would seal under another master"
                                 " key, beside objects it cannot read. Nothing was written")
        master = keys.new_master_key()
        key_id = first_key_id(config)
        if objects.put_if_absent(KEYS, key_id, keys.wrap(master, password, config.identity(),
                                                          key_id, sealing_of(config))):
            return sealed(objects, config, master, key_id)
    master, key_id = keys.unlock(objects, url, config.identity(), password, sealing_of(config))
    return sealed(objects, config, master, key_id)


def check_not_stripped(url: str, objects: ObjectStore) -> None:
    """An unencrypted store's config over a store that holds key objects was replaced or
    damaged (by whoever can write the bucket, so that a writer holding the password
    saves in clear): refused, nothing written.  Looked at where a password is at hand
    (one listing), so plain stores opened without one pay nothing."""
    if keys.key_ids(objects):
        raise CorruptConfigError(url, "it describes an unencrypted store, but the store holds"
                                 " key objects (keys/): an encrypted store's config was"
                                 " replaced; put back a copy of its chunkstore.json (it"
                                 " holds no secret). Nothing was read or written")


def check_encrypt(url: str, config: StoreConfig, encrypt: bool) -> None:
    """``encrypt=True`` on a store that exists unencrypted cannot be honoured."""
    if encrypt and config.encryption is None:
        raise EncryptionError(url, "the store exists and is not encrypted; encryption is"
                              " chosen when a store is created: create a new store with"
                              " encrypt=True (`chunkstore init --encrypt`) and sync into it")


# --- passwords of an open store (``chunkstore key``) --------------------------------------------


def _sealed_objects(url: str, objects: ObjectStore) -> SealedObjects:
    if not isinstance(objects, SealedObjects):
        raise NotEncryptedError(url, "a key command was given")
    return objects


def list_keys(url: str, objects: ObjectStore) -> list[tuple[keys.KeyInfo, bool]]:
    """Every key object, and whether it is the one this handle was opened with."""
    sealed_objects = _sealed_objects(url, objects)
    return [(info, info.id == sealed_objects.key_id) for info in keys.list_keys(objects)]


def add_password(url: str, objects: ObjectStore, config: StoreConfig, password: str) -> str:
    """Wrap the store's master key under another password; the new key's id.  No data
    is re-encrypted: every object stays sealed under the same master key."""
    sealed_objects = _sealed_objects(url, objects)
    keys.check_new_password(password)  # refused before its audit event: nothing changes
    intent = audit.record(objects, "key-add", by_key=sealed_objects.key_id)
    key_id = keys.add_key(objects, sealed_objects.master, password, config.identity(),
                          sealing_of(config))
    audit.record_done(objects, "key-add", intent, key=key_id)
    return key_id


def change_password(url: str, objects: ObjectStore, config: StoreConfig, password: str
                    ) -> tuple[str, str]:
    """Replace the key this handle was opened with by one under ``password``: the new
    key is written first, then the old one removed (a crash between leaves both, each
    opening the store).  (new id, old id)."""
    sealed_objects = _sealed_objects(url, objects)
    old = sealed_objects.key_id
    keys.check_new_password(password)  # refused before its audit event: nothing changes
    intent = audit.record(objects, "key-passwd", by_key=old)
    new = keys.add_key(objects, sealed_objects.master, password, config.identity(),
                       sealing_of(config))
    keys.remove_key(objects, url, old)
    audit.record_done(objects, "key-passwd", intent, key=new, removed=old)
    sealed_objects.key_id = new
    return new, old


def remove_key(url: str, objects: ObjectStore, key_id: str) -> None:
    """Remove a key object (never the last)."""
    sealed_objects = _sealed_objects(url, objects)
    # Recorded once the removal is allowed (never the last intact key), before it.
    keys.remove_key(objects, url, key_id, before_delete=lambda: audit.record(
        objects, "key-remove", key=key_id, by_key=sealed_objects.key_id))
