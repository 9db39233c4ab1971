"""Key objects: an encrypted store's master key, wrapped under each password
(docs/format.md §13.2), as restic's and Kopia's key files do.

1. **The master key** is 32 random bytes, made once when the store is created and
   never stored in clear; everything the store seals derives from it
   (:func:`chunkstore.objects.crypto.subkey`).
2. **A key object** ``keys/<id>`` (JSON, in clear) holds a memory-hard KDF's name,
   parameters and random salt, and the master key sealed with AES-256-GCM under the
   key the KDF derives from one password; the associated data names the store's
   identity and the key id, so a key object copied from another store or renamed opens
   nothing, and in a store of version 12 its sealing too: a config replaced to say
   another store version (version 10, so that a writer with the password would seal
   with random nonces and name nodes in clear) opens no key, and says so
   (:class:`~chunkstore.errors.CorruptConfigError`), rather than a wrong password.  The
   parameters are recorded per key, so new keys may use others later while old ones
   keep opening.
3. **Opening** tries each key object with the password (a wrong one fails every
   tag): :class:`~chunkstore.errors.WrongPasswordError` when none opens.  Adding a
   password or changing one writes a key object and (for a change) deletes the old
   one; no data is re-encrypted.  The last key is never removed.

The KDF is scrypt (``n=2**16, r=8, p=1``: Kopia's parameters, some 64 MiB and a
third of a second here).  **Test-only**: with ``CHUNKSTORE_INSECURE_TEST_KDF`` set,
new keys take ``n=2**10`` (a millisecond), so suites of many stores stay fast; a key
made so says it in its parameters, and every key opens by what it records.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from chunkstore.errors import (
    CorruptConfigError,
    CorruptObjectError,
    InvalidSettingError,
    KeyObjectError,
    WrongPasswordError,
)
from chunkstore.format import plaindata
from chunkstore.objects.crypto import KEY_SIZE, NONCE_SIZE, aead_class, fresh_bytes
from chunkstore.objects.kinds import KEYS
from chunkstore.objects.objectstore import ObjectStore

KEY_FORMAT = "chunkstore.key"
KEY_FORMAT_VERSION = 1
#: scrypt's cost for new keys (Kopia's defaults), and the bounds a reader accepts
#: before it allocates (n * r * 128 bytes of memory).
SCRYPT = {"n": 2**16, "r": 8, "p": 1}
INSECURE_TEST_SCRYPT = {"n": 2**10, "r": 8, "p": 1}
TEST_KDF_ENV = "CHUNKSTORE_INSECURE_TEST_KDF"
MAX_SCRYPT_MEMORY = 1 << 30
#: scrypt's time grows with ``128 n r p`` (the memory times the passes): bounded
#: together, so that a crafted key object costs an opener seconds, not minutes (new
#: keys' cost is 2^26, a 32nd of it).
MAX_SCRYPT_WORK = 1 << 31
MAX_KEY_OBJECT_BYTES = 64 * 1024
SALT_SIZE = 32


@dataclass(frozen=True)
class KeyInfo:
    """A key object as ``chunkstore key list`` shows it (never the key itself)."""

    id: str
    created: float
    kdf: str
    parameters: dict[str, int]


def new_master_key() -> bytes:
    return fresh_bytes(KEY_SIZE)


def _scrypt_parameters() -> dict[str, int]:
    return dict(INSECURE_TEST_SCRYPT if os.environ.get(TEST_KDF_ENV) else SCRYPT)


def _derive(password: str, salt: bytes, parameters: dict[str, int]) -> bytes:
    aead_class()  # the package is there, or what to install
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt
    return Scrypt(salt=salt, length=KEY_SIZE, n=parameters["n"], r=parameters["r"],
                  p=parameters["p"]).derive(password.encode("utf-8"))


#: The sealings of encrypted stores (docs/format.md §13.1), and the store versions of each.
SEALINGS = (1, 2, 3)
SEALING_VERSIONS = {1: "10 or 11", 2: "12", 3: "13"}


def _associated(identity: str, key_id: str, sealing: int) -> bytes:
    """What a key object's sealed master key is bound to: the store (its identity and,
    from sealing 2, store version 12, its sealing) and the key's id."""
    bound = f"chunkstore key\0{identity}\0{key_id}"
    return (bound if sealing < 2 else f"{bound}\0sealing {sealing}").encode()


class OtherSealingError(Exception):
    """A key object opens with the password, but bound to another sealing than the
    config's: the config was replaced (:func:`unlock` says so with the store's url)."""


def check_new_password(password: str) -> None:
    """A new key's password is not empty (an empty password file, ``/dev/null``)."""
    if not password:
        raise InvalidSettingError("the password is empty: an encrypted store's key needs a"
                                  " password (check the password file or variable)")


def wrap(master: bytes, password: str, identity: str, key_id: str, sealing: int = 1
         ) -> bytes:
    """The key object ``keys/<key_id>`` of the store ``identity`` names (sealed with
    ``sealing``), which opens ``master`` with ``password``."""
    check_new_password(password)
    parameters, salt, nonce = _scrypt_parameters(), fresh_bytes(SALT_SIZE), \
        fresh_bytes(NONCE_SIZE)
    sealed = aead_class()(_derive(password, salt, parameters)).encrypt(
        nonce, master, _associated(identity, key_id, sealing))
    return json.dumps({
        "format": KEY_FORMAT, "format_version": KEY_FORMAT_VERSION, "created": time.time(),
        "kdf": {"name": "scrypt", **parameters, "salt": salt.hex()},
        "cipher": "aes-256-gcm", "nonce": nonce.hex(), "master_key": sealed.hex(),
    }, sort_keys=True, separators=(",", ":")).encode()


def _field(body: dict[str, Any], name: str, low: int, high: int) -> int:
    value = body.get(name)
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], not {value!r}")
    return value


def _parse(key_id: str, data: bytes) -> tuple[dict[str, Any], dict[str, int], bytes, bytes,
                                             bytes]:
    """The body, scrypt parameters, salt, nonce and sealed master key of a key object,
    every field bounded (:class:`CorruptObjectError` otherwise)."""
    try:
        if len(data) > MAX_KEY_OBJECT_BYTES:
            raise ValueError(f"{len(data)} bytes, more than any key object")
        body = plaindata.load_json(data)
        if not isinstance(body, dict) or body.get("format") != KEY_FORMAT \
                or body.get("format_version") != KEY_FORMAT_VERSION:
            raise ValueError("not a key object of a format this release reads")
        kdf = body.get("kdf")
        if not isinstance(kdf, dict) or kdf.get("name") != "scrypt" \
                or body.get("cipher") != "aes-256-gcm":
            raise ValueError("names a KDF or cipher this release does not know")
        parameters = {"n": _field(kdf, "n", 2, 1 << 24), "r": _field(kdf, "r", 1, 64),
                      "p": _field(kdf, "p", 1, 64)}
        memory = 128 * parameters["n"] * parameters["r"]
        if parameters["n"] & (parameters["n"] - 1) or memory > MAX_SCRYPT_MEMORY \
                or memory * parameters["p"] > MAX_SCRYPT_WORK:
            raise ValueError("scrypt parameters out of bounds")
        salt, nonce, sealed = (bytes.fromhex(str(value)) for value in (
            kdf.get("salt"), body.get("nonce"), body.get("master_key")))
        if len(nonce) != NONCE_SIZE or len(sealed) != KEY_SIZE + 16 or not salt:
            raise ValueError("a nonce, salt or sealed key of the wrong size")
    except (ValueError, TypeError) as exc:
        raise CorruptObjectError("key", key_id, str(exc)) from None
    return body, parameters, salt, nonce, sealed


def unwrap(key_id: str, data: bytes, password: str, identity: str, sealing: int = 1
           ) -> bytes | None:
    """The master key the key object opens with ``password`` in a store of ``sealing``;
    None where it does not; :class:`OtherSealingError` where it opens bound to the
    other sealing (the same derived key: no second scrypt)."""
    _, parameters, salt, nonce, sealed = _parse(key_id, data)
    cipher = aead_class()(_derive(password, salt, parameters))
    for bound in (sealing, *(other for other in SEALINGS if other != sealing)):
        try:
            master = cipher.decrypt(nonce, sealed, _associated(identity, key_id, bound))
        except Exception:  # InvalidTag: another password (or another store's key object)
            continue
        if bound != sealing:
            raise OtherSealingError(bound)
        return master
    return None


def read_key(objects: ObjectStore, key_id: str) -> bytes:
    """A key object's bytes, at most one more than any key object holds (so that a huge
    object planted in keys/ costs an opener 64 KiB, not its size)."""
    return objects.get_range(KEYS, key_id, 0, MAX_KEY_OBJECT_BYTES + 1)


def key_ids(objects: ObjectStore) -> list[str]:
    return list(objects.ids(KEYS))


def unlock(objects: ObjectStore, url: str, identity: str, password: str, sealing: int = 1
           ) -> tuple[bytes, str]:
    """The master key and the id of the key object ``password`` opens in a store of
    ``sealing``.  A key object that does not parse or whose KDF is out of bounds is
    skipped (never derived), so that one damaged or crafted key locks no password out;
    one bound to the other sealing refuses the config (:class:`CorruptConfigError`)."""
    ids, damaged = key_ids(objects), list[str]()
    if not ids:
        raise KeyObjectError(url, "the store is encrypted but holds no key object (keys/):"
                             " if it holds data, its keys were deleted or not copied: put"
                             " back a copy of its keys/; if its creation was interrupted"
                             " before its first key, it holds nothing: remove it and create"
                             " it again")
    for key_id in ids:
        try:
            data = read_key(objects, key_id)
        except FileNotFoundError:
            continue  # removed meanwhile
        try:
            master = unwrap(key_id, data, password, identity, sealing)
        except CorruptObjectError:
            damaged.append(key_id)
            continue
        except OtherSealingError as exc:
            raise CorruptConfigError(url, (
                f"it says store version {SEALING_VERSIONS[sealing]}, but key {key_id}"
                f" opens with this password bound to a store of sealing {exc.args[0]}"
                f" (version {SEALING_VERSIONS[exc.args[0]]}): its chunkstore.json was"
                " replaced; put back a copy of it (it holds no secret). Nothing was read"
                " or written")) from None
        if master is not None:
            return master, key_id
    if damaged and len(damaged) == len(ids):
        raise KeyObjectError(url, f"every key object is damaged ({', '.join(damaged)}: it"
                             " does not parse, or its KDF is out of bounds), so no password"
                             " can be tried: put back a copy of the store's keys/")
    raise WrongPasswordError(url, len(ids), damaged)


def add_key(objects: ObjectStore, master: bytes, password: str, identity: str,
            sealing: int = 1) -> str:
    """Write a key object that opens ``master`` with ``password`` (in a store of
    ``sealing``); its id."""
    key_id = fresh_bytes(8).hex()
    if not objects.put_if_absent(KEYS, key_id, wrap(master, password, identity, key_id,
                                                    sealing)):
        raise KeyObjectError(objects.backend.url, f"key {key_id} exists (a random id met"
                             " twice); try again")
    return key_id


def remove_key(objects: ObjectStore, url: str, key_id: str,
               before_delete: Callable[[], object] | None = None) -> None:
    """Delete a key object; never the last one, nor one that is not there.
    ``before_delete`` runs once the removal is allowed, before anything changes (its
    audit event)."""
    ids = key_ids(objects)
    if key_id not in ids:
        raise KeyObjectError(url, f"no key {key_id!r}; `chunkstore key list` shows the"
                             f" store's keys ({', '.join(ids)})")
    if len(ids) == 1:
        raise KeyObjectError(url, f"key {key_id} is the store's last key: removing it would"
                             " leave no password that opens the store; add another first"
                             " (`chunkstore key add`)")
    if not any(_intact(objects, other) for other in ids if other != key_id):
        raise KeyObjectError(url, f"every key but {key_id} is damaged (does not parse):"
                             " removing it would leave no password that opens the store;"
                             " add another first (`chunkstore key add`)")
    data = read_key(objects, key_id)
    if before_delete is not None:
        before_delete()
    objects.delete(KEYS, key_id)
    # A removal elsewhere between the look above and the delete (two `key remove` of
    # the two last keys at once) would leave none: look again, and put it back.
    if not any(_intact(objects, other) for other in key_ids(objects)):
        objects.put_if_absent(KEYS, key_id, data)
        raise KeyObjectError(url, f"the store's other keys were removed meanwhile: key"
                             f" {key_id} is kept (it is the last); nothing else changed")


def _intact(objects: ObjectStore, key_id: str) -> bool:
    try:
        _parse(key_id, read_key(objects, key_id))
    except (CorruptObjectError, FileNotFoundError):
        return False
    return True


def list_keys(objects: ObjectStore) -> Iterator[KeyInfo]:
    for key_id in key_ids(objects):
        try:
            body, parameters, _, _, _ = _parse(key_id, read_key(objects, key_id))
        except FileNotFoundError:
            continue
        created = body.get("created")
        yield KeyInfo(key_id, float(created) if isinstance(created, (int, float)) else 0.0,
                      "scrypt", parameters)
