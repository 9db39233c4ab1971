"""What the many-indexes protocol costs: storage requests per save and per GC, save time.

Saves a training-like state (``--mib`` of float32 in ``--tensors`` tensors,
4 MiB chunks) through a backend that counts every request, in three kinds of
save: ``first`` (everything new), ``unchanged`` (every chunk a dedup hit)
and ``partial`` (one tensor in ten changed); then removes a version and runs
a GC with nothing protected (``grace=0``), and an idle GC.  Runs on a local
directory and, with ``--s3``, on a moto S3 server started on loopback.

Run it once with the code to measure and once with the code before the
protocol (``PYTHONPATH=<old checkout>``) to compare; each run writes one
JSON file::

    python benchmarks/bench_protocol.py --out benchmarks/results/protocol.json --s3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import chunkstore
from chunkstore.backends.wrappers import ForwardingBackend

REPO = Path(__file__).resolve().parent.parent


class Counting(ForwardingBackend):
    """Counts requests by operation (list counts once per call, like one LIST page)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.counts: Counter[str] = Counter()

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.counts["put"] += 1
        super().put(key, data)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        self.counts["put"] += 1
        return super().put_if_absent(key, data)

    def get(self, key: str) -> bytes:
        self.counts["get"] += 1
        return super().get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.counts["get"] += 1
        return super().get_range(key, start, length)

    def read_into(self, key: str, start: int, buffer: memoryview) -> int:
        self.counts["get"] += 1
        return super().read_into(key, start, buffer)

    def stat(self, key: str) -> Any:
        self.counts["head"] += 1
        return super().stat(key)

    def exists(self, key: str) -> bool:
        self.counts["head"] += 1
        return super().exists(key)

    def delete(self, key: str) -> bool:
        self.counts["delete"] += 1
        return super().delete(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        self.counts["list"] += 1
        return super().list(prefix)

    def list_info(self, prefix: str = "") -> Iterator[Any]:
        self.counts["list"] += 1
        return self.inner.list_info(prefix)

    def take(self) -> dict[str, int]:
        found = dict(self.counts)
        found["total"] = sum(self.counts.values())
        self.counts.clear()
        return found


def make_state(mib: int, tensors: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    per = mib * (1 << 20) // 4 // tensors
    return {f"layer{i}.w": rng.standard_normal(per, dtype=np.float32) for i in range(tensors)}


def save(store: chunkstore.Store, step: int, state: dict[str, np.ndarray]) -> tuple[float, str]:
    start = time.perf_counter()
    with store.new_version("bench", step) as version:
        for name, array in state.items():
            version.put(name, array)
    return time.perf_counter() - start, version.info.id


def measure(url: str, options: dict[str, Any], index_dir: str, mib: int, tensors: int,
            repeat: int, *, count: bool) -> dict[str, Any]:
    """Save times, and with ``count`` the requests (the counting wrapper makes every
    local write durable on its own, so local times are taken without it)."""
    with chunkstore.open(url, compression="none", index_dir=index_dir,
                         storage_options=options, create=True) as store:
        counting = Counting(store.backend)
        if count:
            store.backend = counting
        base = make_state(mib, tensors, 0)
        out: dict[str, Any] = {}
        kinds: dict[str, list[float]] = {"first": [], "unchanged": [], "partial": []}
        requests: dict[str, dict[str, int]] = {}
        step = 0
        for r in range(repeat):
            first = make_state(mib, tensors, 100 + r)
            for kind, state in (("first", first), ("unchanged", first),
                                ("partial", {**first, "layer0.w": base["layer0.w"] + r})):
                counting.take()
                seconds, _ = save(store, step, state)
                step += 1
                kinds[kind].append(seconds)
                requests[kind] = counting.take()
        out["save_s"] = {k: round(statistics.median(v), 4) for k, v in kinds.items()}
        if count:
            out["requests_per_save"] = requests
        for info in store.versions()[:-1]:
            store.delete(info.id)
        counting.take()
        result = store.gc(grace=0)
        out["gc_deleted"] = result.chunks_deleted + result.orphans_deleted + result.nodes_deleted
        if count:
            out["gc_requests"] = counting.take()
            store.gc(grace=0)
            out["gc_idle_requests"] = counting.take()
    return out


@contextlib.contextmanager
def moto() -> Iterator[str]:
    sys.path.insert(0, str(REPO))
    from tests.s3server import _moto_server, create_bucket

    with _moto_server() as endpoint:
        yield f"s3://{create_bucket(endpoint)}/bench|{endpoint}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--s3", action="store_true", help="also measure on a moto S3 server")
    parser.add_argument("--s3-mib", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import os

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ.setdefault(name, value)
    revision = subprocess.run(["git", "-C", str(Path(chunkstore.__file__).parent), "rev-parse",
                               "--short", "HEAD"], check=False, capture_output=True,
                              text=True).stdout.strip()
    report: dict[str, Any] = {"command": " ".join(sys.argv), "code": revision,
                              "machine": platform.node(), "mib": args.mib,
                              "tensors": args.tensors}
    with tempfile.TemporaryDirectory() as tmp:
        report["local"] = measure(str(Path(tmp) / "store"), {}, str(Path(tmp) / "index"),
                                  args.mib, args.tensors, args.repeat, count=False)
        if args.s3:
            with moto() as spec:
                url, endpoint = spec.split("|")
                report["s3"] = measure(url, {"client_kwargs": {"endpoint_url": endpoint}},
                                       str(Path(tmp) / "s3-index"), args.s3_mib, args.tensors,
                                       1, count=True)
                report["s3"]["mib"] = args.s3_mib
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
