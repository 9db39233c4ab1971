"""What the audit trail costs (docs/format.md §16): per save, per removal, per listing.

Saves the state of benchmarks/bench_protocol.py (``--mib`` of float32 in ``--tensors``
tensors) as ``first`` (everything new), ``unchanged`` (every chunk a dedup hit) and
``partial`` (one tensor changed) saves, each kind once with the audit trail switched off
(``chunkstore.protocol.audit.record`` replaced by a no-op in this process: the baseline
only a benchmark can have) and once as shipped, alternating in every round so that both
meet the same machine state; reports the median seconds of each and the requests of the
last round's saves (bench_protocol's ``Counting``, by operation and kind of object), with
``added`` = audited - unaudited.  Then the requests of removing 1 and 100 versions in one
``rm`` audited, and the seconds and requests of ``audit`` listing the trail.  Locally
and, with ``--s3``, on a moto S3 server on loopback.  The result in
benchmarks/results/audit.json comes from::

    python benchmarks/bench_audit.py --mib 32 --repeat 5 --s3 --s3-mib 8 --s3-repeat 7 \\
        --out benchmarks/results/audit.json
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import chunkstore
from chunkstore.protocol import audit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_protocol import (
    Counting,
    alternated_saves,
    code_revision,
    make_state,
    moto,
    save,
)


@contextmanager
def trail(on: bool) -> Iterator[None]:
    """The audit trail as shipped, or (``on`` False) switched off for a baseline."""
    shipped = audit.record
    if not on:
        audit.record = lambda *args, **kwargs: "off"  # type: ignore[assignment]
    try:
        yield
    finally:
        audit.record = shipped  # type: ignore[assignment]


def saves(store: chunkstore.Store, counting: Counting, mib: int, tensors: int,
          repeat: int) -> dict[str, Any]:
    """Saves with the trail switched off (run ``unaudited``) and as shipped (run
    ``audited``) alternated (bench_protocol.alternated_saves)."""
    def saved(on: bool) -> Callable[[str, int, dict[str, Any]], float]:
        def save_one(run: str, step: int, state: dict[str, Any]) -> float:
            with trail(on):
                return save(store, run, step, state)
        return save_one
    return alternated_saves(counting, {"unaudited": (0, saved(False)),
                                       "audited": (50, saved(True))}, mib, tensors, repeat)


def removals_and_listing(store: chunkstore.Store, counting: Counting) -> dict[str, Any]:
    """Requests of an audited ``rm`` of 1 and of 100 versions, and what listing the
    trail costs."""
    small = make_state(1, 1, 7)
    ids = []
    for step in range(101):
        with store.new_version("removed", step) as version:
            version.put("w", small["layer0.w"] + step)
        ids.append(version.info.id)
    out: dict[str, Any] = {}
    for label, chosen in (("rm_1", ids[:1]), ("rm_100", ids[1:])):
        counting.take()
        store.delete_many(chosen)
        out[label] = counting.take()
    counting.take()
    start = time.perf_counter()
    events = list(store.audit())
    out["audit_list"] = {"events": len(events),
                         "seconds": round(time.perf_counter() - start, 4),
                         "requests": counting.take()}
    return out


def measure(url: str, options: dict[str, Any], index_dir: str, mib: int, tensors: int,
            repeat: int) -> dict[str, Any]:
    opened = functools.partial(chunkstore.open, url, compression="none", index_dir=index_dir,
                               storage_options=options)
    with opened(create=True) as store:
        counting = Counting(store.backend)
        store.backend = counting
        out = {"mib": mib, **saves(store, counting, mib, tensors, repeat)}
        out.update(removals_and_listing(store, counting))
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
        "note": "2-core machine shared with four other sessions: compare audited with"
                " unaudited within one run (alternated per round), not across runs"}
    with tempfile.TemporaryDirectory() as tmp:
        report["local"] = measure(str(Path(tmp) / "store"), {}, str(Path(tmp) / "index"),
                                  args.mib, args.tensors, args.repeat)
        if args.s3:
            with moto() as spec:
                url, endpoint = spec.split("|")
                report["s3"] = measure(url, {"client_kwargs": {"endpoint_url": endpoint}},
                                       str(Path(tmp) / "s3-index"), args.s3_mib,
                                       args.tensors, args.s3_repeat)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
