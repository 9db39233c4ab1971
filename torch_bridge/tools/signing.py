"""Signing an export artifact directory in the OpenSSF model-signing format.

The signature is what ``model_signing sign key`` writes: a Sigstore bundle
(``model.sig``) whose DSSE envelope holds an in-toto statement listing every file of
the directory with its SHA-256, signed with an ECDSA key (P-256, P-384 or P-521,
PEM).  ``model_signing verify key --signature DIR/model.sig --public_key KEY.pub DIR``
checks it.  SHA-256, not BLAKE3: model-signing 1.1's ``verify key`` command hashes
with SHA-256 whatever the signature says, so a BLAKE3 signature would verify only
through its Python API.

The key is loaded here first (:func:`load_signing_key`), so that a wrong password,
a key of another type or an unreadable file is a
:class:`~chunkstore.errors.SigningKeyError` before anything is read or written;
model-signing then loads it again from its path (its public API takes a path).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkstore.errors import MissingDependencyError, SigningKeyError
from chunkstore.objects.signing import load_private_key

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

#: The signature file inside the artifact (model-signing's default name); it is the
#: one file the signature does not cover.
SIGNATURE_FILE = "model.sig"
SIGNATURE_HASH = "sha256"
SIGNATURE_FORMAT = ("OpenSSF model-signing 1.x: Sigstore bundle v0.3, DSSE envelope,"
                    " in-toto statement of every file's digest")
CURVES = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}
INSTALL = "pip install 'model-signing>=1.1.1,<1.2' pyOpenSSL"


def require_model_signing() -> None:
    """Fail early, before anything is read, where model-signing cannot be imported."""
    try:
        import model_signing.signing  # noqa: F401  (imports pyOpenSSL, which it omits
    except ImportError as exc:        # from its own requirements)
        raise MissingDependencyError(
            f"`chunkstore export --sign` needs model-signing ({exc.name} is not importable;"
            f" the [sign] extra installs it); install it with: {INSTALL}") from None


def load_signing_key(path: str | os.PathLike[str],
                     password: str | None = None) -> ec.EllipticCurvePrivateKey:
    """The ECDSA private key (P-256, P-384 or P-521) in the PEM file at ``path``, as
    signed versions load it (:func:`chunkstore.objects.signing.load_private_key`);
    anything else is a :class:`~chunkstore.errors.SigningKeyError` that says what to do."""
    return load_private_key(path, password,
                            password_from="--key-password-file or $CHUNKSTORE_KEY_PASSWORD")


def public_key_sha256(key: ec.EllipticCurvePrivateKey) -> str:
    """The SHA-256 of the public key's PEM: the key hint model-signing records."""
    from cryptography.hazmat.primitives import serialization

    pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def signature_description(key: ec.EllipticCurvePrivateKey) -> dict[str, Any]:
    """What the lineage file says of the signature that will cover it."""
    return {"file": SIGNATURE_FILE, "format": SIGNATURE_FORMAT, "hash": SIGNATURE_HASH,
            "curve": CURVES[key.curve.name], "public_key_sha256": public_key_sha256(key)}


def sign_directory(directory: Path, key_path: str | os.PathLike[str], password: str | None,
                   key: ec.EllipticCurvePrivateKey) -> Path:
    """Sign every file of ``directory`` (but the signature) into ``directory/model.sig``,
    with the key at ``key_path``, which :func:`load_signing_key` loaded as ``key``."""
    # As Any: model-signing's Config classes are untyped (mypy --strict refuses the calls).
    hashing: Any = importlib.import_module("model_signing.hashing")
    signing: Any = importlib.import_module("model_signing.signing")
    hashing_config = hashing.Config().use_file_serialization(
        hashing_algorithm=SIGNATURE_HASH).set_ignored_paths(paths=[SIGNATURE_FILE])
    # model-signing 1.1 hands the password to cryptography as it is, which wants bytes.
    secret: Any = password.encode() if password else None
    signature = directory / SIGNATURE_FILE
    signing.Config().use_elliptic_key_signer(
        private_key=Path(key_path), password=secret).set_hashing_config(
        hashing_config).sign(directory, signature)
    # model-signing read the key file again: the signature must be by the key the
    # lineage names (a key file replaced in between would make the two disagree).
    hint = json.loads(signature.read_text())["verificationMaterial"]["publicKey"]["hint"]
    if hint != public_key_sha256(key):
        raise SigningKeyError(os.fspath(key_path), "the key file changed while the export"
                              " was signed; export again")
    return signature
