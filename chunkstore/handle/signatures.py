"""The signatures of published versions: storing one, and what a reader makes of it.

A signed save stores ``signatures/<version id>`` before its commit record (so a
published signed version always has its signature: a crash between the two leaves an
orphan signature, which GC removes once it is older than the grace period and names no
commit record).  A reader checks a version's signature against the keys it trusts
(:class:`~chunkstore.objects.signing.Trust`) and gets one of four verdicts:

- ``signed-by-trusted``: the signature holds for the record's exact bytes and its key
  is trusted.  Every node and chunk is named by its hash from the record's root, and
  every read checks those hashes, so what a read returns is what the key signed;
- ``signed-by-untrusted``: the signature holds, by a key not trusted;
- ``unsigned``: no signature object;
- ``bad-signature``: the object cannot be read or parsed (crafted, damaged, another
  version's), or the signature does not hold for the record's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkstore.errors import ChunkStoreError, CorruptSignatureError, IntegrityError
from chunkstore.format.records import CommitRecord
from chunkstore.format.signatures import Signature
from chunkstore.objects.kinds import SIGNATURES, VERSIONS
from chunkstore.objects.signing import Trust, sign, signature_holds
from chunkstore.protocol import audit

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

    from chunkstore.objects.objectstore import ObjectStore

SIGNED_BY_TRUSTED = "signed-by-trusted"
SIGNED_BY_UNTRUSTED = "signed-by-untrusted"
UNSIGNED = "unsigned"
BAD_SIGNATURE = "bad-signature"
#: what verify reports for a signed version whose tree or chunks fail their checks
CORRUPT = "corrupt"


@dataclass(frozen=True)
class SignatureCheck:
    """A reader's verdict on one version's signature."""

    version: str
    status: str
    #: the fingerprint of the key that signed (None: unsigned, or unreadable)
    key: str | None = None
    #: why a signature is bad
    reason: str | None = None

    @property
    def trusted(self) -> bool:
        return self.status == SIGNED_BY_TRUSTED

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "status": self.status, "key": self.key,
                "reason": self.reason}


def store_signature(objects: ObjectStore, key: ec.EllipticCurvePrivateKey,
                    version_id: str, record: bytes) -> None:
    """Store the signature of the version whose commit record is ``record``; durable at
    the next flush (the one before the commit point).  A copy found stored is an orphan
    of a save that never published this id (ECDSA signatures differ each time): replaced."""
    data = sign(key, version_id, record).encode()
    if not objects.put_if_absent_deferred(SIGNATURES, version_id, data):
        objects.put(SIGNATURES, version_id, data)


def sign_existing(objects: ObjectStore, key: ec.EllipticCurvePrivateKey,
                  version_id: str) -> bool:
    """For a signed save that found its version published already (the same step and
    content): leave that version signed by ``key``.  One unsigned, or whose signature
    object is bad, gets ``key``'s signature (durable when this returns); False, nothing
    written, where another key's signature holds for it (it is not this save's
    version).  A record removed meanwhile is left alone (True: the save returns it, as
    an unsigned save does in that race); a signature stored just after a removal
    deleted the record is an orphan, which GC sweeps."""
    try:
        record = objects.get(VERSIONS, version_id)
    except FileNotFoundError:
        return True
    decoded = CommitRecord.decode(version_id, record)  # the id's bytes (CorruptRecordError)
    check = check_signature(objects, version_id, record, Trust(key.public_key()))
    if check.status == SIGNED_BY_UNTRUSTED:
        return False
    if not check.trusted:
        # Recorded first (docs/format.md §16): signing a published version changes what
        # a require_signed restore accepts, and its publish event said unsigned.
        audit.record(objects, "sign", versions=[
            {"id": version_id, "run": decoded.run, "step": decoded.step}],
            was=check.status)
        objects.put(SIGNATURES, version_id, sign(key, version_id, record).encode())
    return True


def check_signature(objects: ObjectStore, version_id: str, record: bytes,
                    trust: Trust) -> SignatureCheck:
    """The verdict on ``version_id``'s signature, given its commit record's stored bytes
    (already checked against the id); never raises for what the store holds."""
    try:
        data = objects.get(SIGNATURES, version_id)
    except FileNotFoundError:
        return SignatureCheck(version_id, UNSIGNED)
    except IntegrityError as exc:  # a sealed object that fails authentication
        return SignatureCheck(version_id, BAD_SIGNATURE, reason=str(exc))
    try:
        signature = Signature.decode(version_id, data)
    except ChunkStoreError as exc:  # CorruptSignatureError, or a newer format
        return SignatureCheck(version_id, BAD_SIGNATURE, reason=str(exc))
    if not signature_holds(signature, record):
        return SignatureCheck(version_id, BAD_SIGNATURE, signature.key,
                              "the signature does not hold for the commit record's bytes")
    status = SIGNED_BY_TRUSTED if trust.trusts(signature) else SIGNED_BY_UNTRUSTED
    return SignatureCheck(version_id, status, signature.key)


def orphan_signatures(objects: ObjectStore, before: float) -> list[str]:
    """The signature objects stored before ``before`` (a Unix time: the grace period
    ago) whose commit record is not stored: of saves that died between the two writes,
    or of versions a removal that died between its two deletes unpublished.  Listed
    before the records, so a version published meanwhile keeps its signature; a young
    one may belong to a save about to publish, and is left alone."""
    old = [vid for vid, info in objects.infos(SIGNATURES) if info.mtime < before]
    if not old:
        return []
    published = set(objects.ids(VERSIONS))
    return [vid for vid in old if vid not in published]


def signature_bytes(objects: ObjectStore, version_id: str, record: bytes) -> bytes | None:
    """The version's signature object where it is stored, parses and holds for
    ``record``; None where none is stored; ``CorruptSignatureError`` where one is
    stored that is bad."""
    try:
        data = objects.get(SIGNATURES, version_id)
    except FileNotFoundError:
        return None
    except IntegrityError as exc:
        raise CorruptSignatureError(version_id, str(exc)) from None
    signature = Signature.decode(version_id, data)
    if not signature_holds(signature, record):
        raise CorruptSignatureError(version_id, "the signature does not hold for the"
                                    " commit record's bytes")
    return data


def copy_signature(source: ObjectStore, target: ObjectStore, version_id: str,
                   record: bytes) -> bool:
    """Copy a version's signature object, checked, ahead of its commit record (durable
    at the target's next flush); whether it has one.  A bad one in ``source`` is a
    :class:`CorruptSignatureError` and nothing is written (the copy is not published
    with a signature that does not hold); a bad one in ``target`` is replaced."""
    data = signature_bytes(source, version_id, record)
    if data is None:
        return False
    if not target.put_if_absent_deferred(SIGNATURES, version_id, data):
        try:
            found = signature_bytes(target, version_id, record)
        except ChunkStoreError:
            found = None
        if found is None:
            target.put(SIGNATURES, version_id, data)
    return True


def has_signature(objects: ObjectStore, version_id: str, record: bytes) -> bool:
    """Whether the version has a signature object that holds for ``record`` (False:
    none; ``CorruptSignatureError`` or ``FormatVersionError``: a bad or newer one)."""
    return signature_bytes(objects, version_id, record) is not None
