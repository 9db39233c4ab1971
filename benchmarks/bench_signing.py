"""What signing a version costs (docs/format.md §14): per save, per check, per removal.

Saves the state of benchmarks/bench_protocol.py (``--mib`` of float32 in ``--tensors``
tensors) as ``first`` (everything new), ``unchanged`` (every chunk a dedup hit) and
``partial`` (one tensor changed) saves, each kind once plain and once signed
(``sign_with=``, an ECDSA P-256 key loaded once), alternating plain and signed in every
round so that both meet the same machine state; reports the median seconds of each and
the requests of the last round's saves (bench_protocol's ``Counting``, by operation and
kind of object), with ``added`` = signed - plain.  Then what a reader pays: the
requests of ``Store.signature`` for one version, of ``verify`` with and without a
trusted key, and of removing a signed version.  Locally and, with ``--s3``, on a moto
S3 server on loopback.  The result in benchmarks/results/signing.json comes from::

    python benchmarks/bench_signing.py --mib 32 --repeat 5 --s3 --s3-mib 8 --s3-repeat 3 \\
        --out benchmarks/results/signing.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import chunkstore
from chunkstore.objects.signing import Trust, generate_key, load_private_key, sign

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_protocol import (
    Counting,
    alternated_saves,
    code_revision,
    difference,
    moto,
)


def save(store: chunkstore.Store, run: str, step: int, state: dict[str, np.ndarray],
         key: Any) -> float:
    start = time.perf_counter()
    with store.new_version(run, step, sign_with=key) as version:
        for name, array in state.items():
            version.put(name, array)
    return time.perf_counter() - start


def saves(store: chunkstore.Store, counting: Counting, key: Any, mib: int, tensors: int,
          repeat: int) -> dict[str, Any]:
    """Plain (run ``plain``) and signed (run ``signed``) saves alternated
    (bench_protocol.alternated_saves)."""
    return alternated_saves(counting, {
        "plain": (0, lambda run, step, state: save(store, run, step, state, None)),
        "signed": (50, lambda run, step, state: save(store, run, step, state, key))},
        mib, tensors, repeat)


def reading(store: chunkstore.Store, counting: Counting, public: Path) -> dict[str, Any]:
    """Requests of a signature check, of verify with and without a trusted key, and of
    removing a signed version (with its signature)."""
    signed = store.latest("signed")
    assert signed is not None
    store.trust = Trust([public])
    counting.take()
    status = store.signature(signed.id).status
    out: dict[str, Any] = {"status": status, "signature_check": counting.take()}
    for label, trusted in (("verify_quick_plain", False), ("verify_quick_trusted", True)):
        store.trust = Trust([public] if trusted else [])
        counting.take()
        store.verify(signed.id, read_data=False)
        out[label] = counting.take()
    out["verify_added_per_version"] = difference(out["verify_quick_trusted"],
                                                 out["verify_quick_plain"])
    counting.take()
    store.delete(signed.id)
    out["remove_signed"] = counting.take()
    return out


def micro(key: Any, count: int = 200) -> dict[str, float]:
    """Microseconds to sign and to check one commit record (about 400 bytes)."""
    from chunkstore.objects.signing import signature_holds
    record = b'{"created":1800000000.0,"format":"chunkstore.version"' + b"x" * 350 + b"}"
    start = time.perf_counter()
    signatures = [sign(key, "a" * 64, record) for _ in range(count)]
    signed = time.perf_counter()
    assert all(signature_holds(s, record) for s in signatures)
    checked = time.perf_counter()
    return {"sign_us": round((signed - start) / count * 1e6, 1),
            "check_us": round((checked - signed) / count * 1e6, 1)}


def measure(url: str, options: dict[str, Any], index_dir: str, key_path: Path, mib: int,
            tensors: int, repeat: int) -> dict[str, Any]:
    key = load_private_key(key_path)
    opened = functools.partial(chunkstore.open, url, compression="none", index_dir=index_dir,
                               storage_options=options)
    with opened(create=True) as store:
        counting = Counting(store.backend)
        store.backend = counting
        out = {"mib": mib, **saves(store, counting, key, mib, tensors, repeat)}
        out["reading"] = reading(store, counting, Path(f"{key_path}.pub"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--s3", action="store_true")
    parser.add_argument("--s3-mib", type=int, default=8)
    parser.add_argument("--s3-repeat", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ.setdefault(name, value)
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]), **code_revision(),
        "machine": platform.node(), "tensors": args.tensors,
        "note": "2-core machine shared with four other sessions: compare signed with plain"
                " within one run (alternated per round), not across runs"}
    with tempfile.TemporaryDirectory() as tmp:
        key_path = Path(tmp) / "key"
        private, public = generate_key()
        key_path.write_bytes(private)
        Path(f"{key_path}.pub").write_bytes(public)
        report["micro"] = micro(load_private_key(key_path))
        report["local"] = measure(str(Path(tmp) / "store"), {}, str(Path(tmp) / "index"),
                                  key_path, args.mib, args.tensors, args.repeat)
        if args.s3:
            with moto() as spec:
                url, endpoint = spec.split("|")
                report["s3"] = measure(url, {"client_kwargs": {"endpoint_url": endpoint}},
                                       str(Path(tmp) / "s3-index"), key_path, args.s3_mib,
                                       args.tensors, args.s3_repeat)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
