"""Build the frozen store that pins docs/format.md §14, signature objects
(``tests/data/signed-v1``).

Three versions of one run in a plain store: step 1 signed by the fixture's P-256 key,
step 2 unsigned, step 3 signed by the fixture's P-384 key.  The keys are derived from a
fixed seed (test keys: never sign anything else with them) and their public halves are
written beside the store (``signed-v1.p256.pub``, ``signed-v1.p384.pub``).  ECDSA
signatures are randomized, so a second run writes other signature bytes: the test
reads the frozen copy back and checks each verdict; it never rebuilds it.  Never
regenerate an existing fixture after a format change: build ``--name signed-v2``.

``signed-v1.expected.json`` records each version's id, step and verdict with the P-256
key trusted, the fingerprints, and the BLAKE3 of every stored file.

Usage (from the repository root)::

    python tools/make_signed_fixture.py [--name signed-v1] [--force]
"""

from __future__ import annotations

import sys
from pathlib import Path

import blake3
import numpy as np
from cryptography.hazmat.primitives.asymmetric import ec

import chunkstore
from chunkstore.objects.signing import fingerprint, public_pem

# tools/ is no package: its own folder on the path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from frozen import freeze, fresh_fixture, run_builder

SEED = b"chunkstore signed fixture v1"


def fixture_key(curve: ec.EllipticCurve, label: bytes) -> ec.EllipticCurvePrivateKey:
    secret = int.from_bytes(blake3.blake3(SEED + label).digest(length=64), "big")
    order = {"secp256r1": 2**256, "secp384r1": 2**384}[curve.name]
    return ec.derive_private_key(secret % (order - 2**32) + 1, curve)


def build(name: str, force: bool) -> Path:
    out = fresh_fixture(name, force)
    p256, p384 = fixture_key(ec.SECP256R1(), b"p256"), fixture_key(ec.SECP384R1(), b"p384")
    versions = []
    with chunkstore.open(out, create=True, chunk_size=64 * 1024) as store:
        for step, key, verdict in ((1, p256, "signed-by-trusted"), (2, None, "unsigned"),
                                   (3, p384, "signed-by-untrusted")):
            with store.new_version("sig", step, meta={"note": "signature fixture"},
                                   sign_with=key) as v:
                v.put("w", np.arange(1000, dtype=np.float32) * step)
            versions.append({"id": v.info.id, "step": step, "verdict": verdict})
    for label, key in (("p256", p256), ("p384", p384)):
        (out.parent / f"{name}.{label}.pub").write_bytes(public_pem(key.public_key()))
    freeze(out, {"run": "sig", "versions": versions, "trusted": f"{name}.p256.pub",
                 "fingerprints": {"p256": fingerprint(p256), "p384": fingerprint(p384)},
                 "signature_format_version": 1})
    return out


def main() -> None:
    run_builder(build, "signed-v1", __doc__)


if __name__ == "__main__":
    main()
