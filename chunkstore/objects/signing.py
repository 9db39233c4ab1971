"""Signing keys: making, loading, signing and checking (docs/format.md §14).

A signing key is an ECDSA key on P-256 (default), P-384 or P-521 in PEM: the private
key PKCS#8 (optionally password-encrypted), the public key SubjectPublicKeyInfo.  The
OpenSSF model-signing tool's elliptic-curve signer takes the same files, so one key
signs versions (signature objects) and exports.  The ``cryptography`` package does the
work; where it is missing every entry point says what to install.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Union

from chunkstore.errors import MissingDependencyError, SigningKeyError
from chunkstore.format.signatures import Signature, key_fingerprint

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

#: Curves ``keygen`` makes and signers take, with the algorithm name a signature records.
CURVES = {"P-256": "ecdsa-p256-sha256", "P-384": "ecdsa-p384-sha384",
          "P-521": "ecdsa-p521-sha512"}
DEFAULT_CURVE = "P-256"
#: Where a key file's password comes from when none is given (``sign_with=PATH``,
#: ``chunkstore keygen`` without ``--password-file``).
KEY_PASSWORD_ENV = "CHUNKSTORE_KEY_PASSWORD"
#: Key files are small; anything larger is not one (bounds what loading reads).
MAX_KEY_FILE_BYTES = 64 * 1024

PrivateKeyLike = Union[str, "os.PathLike[str]", "ec.EllipticCurvePrivateKey"]
PublicKeyLike = Union[str, "os.PathLike[str]", "ec.EllipticCurvePublicKey"]


def _ec() -> None:
    """Nothing, where ``cryptography`` is installed; else what to install."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "signed versions need the `cryptography` package, which is not installed;"
            " install it with: pip install cryptography (what the [sign] extra"
            " installs)") from None


def _curve_name(key: ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey) -> str:
    name = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}.get(
        key.curve.name)
    if name is None:
        raise SigningKeyError("key", f"curve {key.curve.name} is not one of"
                              f" {', '.join(CURVES)}")
    return name


def _hash_for(curve: str) -> object:
    from cryptography.hazmat.primitives import hashes
    return {"P-256": hashes.SHA256(), "P-384": hashes.SHA384(),
            "P-521": hashes.SHA512()}[curve]


def generate_key(curve: str = DEFAULT_CURVE, password: str | None = None
                 ) -> tuple[bytes, bytes]:
    """A new key pair as (private PEM, public PEM); the private key encrypted under
    ``password`` where one is given (``BestAvailableEncryption``)."""
    _ec()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    curves: dict[str, ec.EllipticCurve] = {
        "P-256": ec.SECP256R1(), "P-384": ec.SECP384R1(), "P-521": ec.SECP521R1()}
    if curve not in curves:
        raise SigningKeyError("curve", f"{curve!r} is not one of {', '.join(CURVES)}")
    key = ec.generate_private_key(curves[curve])
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password.encode()) if password
        else serialization.NoEncryption())
    private = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8, encryption)
    return private, public_pem(key.public_key())


def signing_key(key: PrivateKeyLike) -> ec.EllipticCurvePrivateKey:
    """:func:`load_private_key` with the password from ``$CHUNKSTORE_KEY_PASSWORD``
    (what ``sign_with=`` takes: a loaded key, or a file)."""
    return load_private_key(key, os.environ.get(KEY_PASSWORD_ENV) or None)


def public_pem(key: ec.EllipticCurvePublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.public_bytes(serialization.Encoding.PEM,
                            serialization.PublicFormat.SubjectPublicKeyInfo)


def public_der(key: ec.EllipticCurvePublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.public_bytes(serialization.Encoding.DER,
                            serialization.PublicFormat.SubjectPublicKeyInfo)


def fingerprint(key: ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey) -> str:
    """The fingerprint a signature object records for ``key`` (of its public half)."""
    from cryptography.hazmat.primitives.asymmetric import ec
    public = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    return key_fingerprint(public_der(public))


def _read_key_file(path: str | os.PathLike[str]) -> bytes:
    try:
        with Path(path).open("rb") as file:
            data = file.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise SigningKeyError(os.fspath(path), f"cannot read the key file: {exc}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise SigningKeyError(os.fspath(path), f"over {MAX_KEY_FILE_BYTES} bytes: not a key")
    return data


def load_private_key(key: PrivateKeyLike, password: str | None = None, *,
                     password_from: str = f"--password-file, ${KEY_PASSWORD_ENV}"
                     ) -> ec.EllipticCurvePrivateKey:
    """A signing key: ``key`` itself when it is a loaded ECDSA private key, else the PEM
    file it names (decrypted with ``password`` where it is encrypted).  A file that is
    no such key, or a wrong or missing password, is a :class:`SigningKeyError`;
    ``password_from`` is where the caller takes a key's password from, for its hint."""
    _ec()
    from cryptography.hazmat.primitives.asymmetric import ec
    if isinstance(key, ec.EllipticCurvePrivateKey):
        _curve_name(key)
        return key
    if not isinstance(key, (str, os.PathLike)):
        raise SigningKeyError("sign_with", f"a {type(key).__name__} is neither a key file"
                              " path nor an ECDSA private key")
    from cryptography.hazmat.primitives import serialization
    what = os.fspath(key)
    try:
        loaded = serialization.load_pem_private_key(
            _read_key_file(key), password.encode() if password else None)
    except TypeError as exc:  # encrypted without a password, or a password for a plain key
        raise SigningKeyError(what, f"{exc}: give the key's password ({password_from})"
                              if "encrypted" in str(exc) else str(exc)) from None
    except ValueError as exc:
        raise SigningKeyError(what, "not a PEM private key, or a wrong password"
                              f" ({exc})") from None
    if not isinstance(loaded, ec.EllipticCurvePrivateKey):
        raise SigningKeyError(what, f"a {type(loaded).__name__}, not an ECDSA key"
                              " (make one with `chunkstore keygen`)")
    _curve_name(loaded)
    return loaded


def load_public_key(key: PublicKeyLike) -> ec.EllipticCurvePublicKey:
    """A trusted key: ``key`` itself when it is a loaded ECDSA public key (a private
    key's public half), else the PEM file it names (a private key file gives its
    public half, unless it is encrypted)."""
    _ec()
    from cryptography.hazmat.primitives.asymmetric import ec
    if isinstance(key, ec.EllipticCurvePrivateKey):
        key = key.public_key()
    if isinstance(key, ec.EllipticCurvePublicKey):
        _curve_name(key)
        return key
    if not isinstance(key, (str, os.PathLike)):
        raise SigningKeyError("trust", f"a {type(key).__name__} is neither a key file path"
                              " nor an ECDSA public key")
    from cryptography.hazmat.primitives import serialization
    data = _read_key_file(key)
    try:
        loaded: object = serialization.load_pem_public_key(data)
    except ValueError:
        try:
            loaded = serialization.load_pem_private_key(data, None).public_key()
        except (TypeError, ValueError):
            raise SigningKeyError(os.fspath(key), "not a PEM public key (the .pub file"
                                  " `chunkstore keygen` wrote)") from None
    if not isinstance(loaded, ec.EllipticCurvePublicKey):
        raise SigningKeyError(os.fspath(key), f"a {type(loaded).__name__}, not an ECDSA"
                              " key")
    _curve_name(loaded)
    return loaded


def sign(key: ec.EllipticCurvePrivateKey, version_id: str, record: bytes) -> Signature:
    """The signature object of the version whose commit record is ``record``."""
    from cryptography.hazmat.primitives.asymmetric import ec
    curve = _curve_name(key)
    value = key.sign(record, ec.ECDSA(_hash_for(curve)))  # type: ignore[arg-type]
    public = public_der(key.public_key())
    return Signature(version_id, CURVES[curve], key_fingerprint(public), public, value)


def signature_holds(signature: Signature, record: bytes) -> bool:
    """Whether ``signature`` is a valid signature of ``record`` by the key it carries
    (whose fingerprint decoding checked); says nothing about trust."""
    _ec()
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    try:
        key = serialization.load_der_public_key(signature.public_key)
    except (ValueError, TypeError):
        return False
    if not isinstance(key, ec.EllipticCurvePublicKey):
        return False
    try:
        curve = _curve_name(key)
    except SigningKeyError:
        return False
    if CURVES[curve] != signature.algorithm:
        return False
    try:
        key.verify(signature.value, record, ec.ECDSA(_hash_for(curve)))  # type: ignore[arg-type]
    except InvalidSignature:
        return False
    return True


class Trust:
    """The keys whose signatures a reader trusts, by fingerprint."""

    def __init__(self, keys: Iterable[PublicKeyLike] | PublicKeyLike = ()) -> None:
        if isinstance(keys, (str, os.PathLike)) or not isinstance(keys, Iterable):
            keys = [keys]  # one key file or key, not a list of them
        loaded = [load_public_key(key) for key in keys]
        self.fingerprints = frozenset(fingerprint(key) for key in loaded)

    def __bool__(self) -> bool:
        return bool(self.fingerprints)

    def plus(self, key: PublicKeyLike | None) -> Trust:
        """These keys and ``key`` (None: these)."""
        if key is None:
            return self
        trust = Trust()
        trust.fingerprints = self.fingerprints | {fingerprint(load_public_key(key))}
        return trust

    def trusts(self, signature: Signature) -> bool:
        return signature.key in self.fingerprints
