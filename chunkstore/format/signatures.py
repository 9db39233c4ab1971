"""Signature objects: who wrote a version (docs/format.md §14).

``signatures/<version id>`` holds one canonical JSON object (§4): an ECDSA signature
over the exact stored bytes of the version's commit record, the public key that
makes it, and that key's fingerprint.  The record names the root node and every node
and chunk is named by its hash, so the signature covers every byte of the version.
Pure encoding and decoding: the cryptography is :mod:`chunkstore.objects.signing`'s.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from chunkstore.errors import CorruptSignatureError, FormatVersionError
from chunkstore.format import plaindata
from chunkstore.format.digest import is_hex_digest
from chunkstore.format.manifest import is_version

SIGNATURE_FORMAT = "chunkstore.signature"
SIGNATURE_FORMAT_VERSION = 1
#: The algorithms a signature may name: ECDSA on a NIST curve with the hash the curve's
#: size calls for (as the OpenSSF model-signing tool's elliptic-curve signer pairs them).
ALGORITHMS = ("ecdsa-p256-sha256", "ecdsa-p384-sha384", "ecdsa-p521-sha512")
#: The largest signature object a reader parses: a P-521 key and signature in base64
#: with the other fields take under 700 bytes; anything larger is crafted.
MAX_SIGNATURE_BYTES = 4096
#: The largest DER public key and DER signature a reader decodes.
MAX_PUBLIC_KEY_BYTES = 512
MAX_SIGNATURE_VALUE_BYTES = 256


def key_fingerprint(public_der: bytes) -> str:
    """The fingerprint of a public key: SHA-256 of its DER SubjectPublicKeyInfo, in hex
    (what ``openssl pkey -pubin -outform DER | sha256sum`` prints)."""
    return hashlib.sha256(public_der).hexdigest()


@dataclass(frozen=True)
class Signature:
    """What ``signatures/<version>`` holds."""

    version: str
    algorithm: str
    key: str  # fingerprint of ``public_key``
    public_key: bytes  # DER SubjectPublicKeyInfo
    value: bytes  # DER ECDSA signature over the commit record's bytes

    def encode(self) -> bytes:
        return json.dumps({
            "format": SIGNATURE_FORMAT, "format_version": SIGNATURE_FORMAT_VERSION,
            "version": self.version, "algorithm": self.algorithm, "key": self.key,
            "public_key": base64.b64encode(self.public_key).decode(),
            "signature": base64.b64encode(self.value).decode(),
        }, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, version_id: str, data: bytes) -> Signature:
        """Parse and check a signature object of ``version_id``: ``CorruptSignatureError``
        for what a writer would not write, ``FormatVersionError`` for a newer one."""
        if len(data) > MAX_SIGNATURE_BYTES:
            raise CorruptSignatureError(version_id, f"{len(data)} bytes, over the"
                                        f" {MAX_SIGNATURE_BYTES} a signature object takes")
        try:
            obj = plaindata.load_json(data)
        except ValueError as exc:
            raise CorruptSignatureError(version_id, f"not valid JSON: {exc}") from None
        if not isinstance(obj, dict) or obj.get("format") != SIGNATURE_FORMAT:
            raise CorruptSignatureError(version_id, "not a signature object")
        if not is_version(obj.get("format_version"), SIGNATURE_FORMAT_VERSION):
            raise FormatVersionError(f"signature of version {version_id[:12]}",
                                     obj.get("format_version"), SIGNATURE_FORMAT_VERSION)
        try:
            return cls._from_json(version_id, obj)
        except ValueError as exc:
            raise CorruptSignatureError(version_id, str(exc)) from None

    @classmethod
    def _from_json(cls, version_id: str, obj: dict[str, Any]) -> Signature:
        if obj.get("version") != version_id:
            raise ValueError(f"it names version {str(obj.get('version'))[:16]!r}")
        algorithm = obj.get("algorithm")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        key = obj.get("key")
        if not (isinstance(key, str) and is_hex_digest(key)):
            raise ValueError(f"key is {key!r}, not a fingerprint")
        public_key = _base64(obj.get("public_key"), "public_key", MAX_PUBLIC_KEY_BYTES)
        if key_fingerprint(public_key) != key:
            raise ValueError("its key fingerprint is not that of the public key it carries")
        value = _base64(obj.get("signature"), "signature", MAX_SIGNATURE_VALUE_BYTES)
        return cls(version_id, algorithm, key, public_key, value)


def _base64(value: object, what: str, limit: int) -> bytes:
    if not isinstance(value, str) or len(value) > limit * 2:
        raise ValueError(f"{what} is not base64 of at most {limit} bytes")
    try:
        decoded = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not base64") from None
    if not 0 < len(decoded) <= limit:
        raise ValueError(f"{what} is {len(decoded)} bytes, not 1 to {limit}")
    return decoded
