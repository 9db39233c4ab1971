"""What the store's protocols cost in storage requests: per save, per lease, per read, per GC.

Saves a training-like state (``--mib`` of float32 in ``--tensors`` tensors, 4 MiB
chunks) through a backend that counts every request by operation (GET, PUT, HEAD,
LIST, DELETE) and by kind of object (``chunks/``, ``versions/``, ``leases/`` ...),
in three kinds of save: ``first`` (everything new), ``unchanged`` (every chunk a
dedup hit) and ``partial`` (one tensor changed).  Runs on a local directory
(operations of the local backend; times taken in a second pass without the
counter, which makes every local write durable on its own) and, with ``--s3``, on a
moto S3 server started on loopback.  Measured, each per save of the last round
(``--repeat``, ``--s3-repeat``; from the second on, every lease request is in steady
state):

- ``save``: a plain save (``store.new_version``, no lease, not fenced);
- ``lease_save``: a save through a run lease, as torch_bridge's Checkpointer makes
  it: ``RunLease(store.objects, run).acquire()`` once (``lease_acquire``), then per
  save ``lease.check_known()`` (no request) and the writer's ``before_commit = lease``
  (claim the commit slot, check the generation, then, the record created, look for a
  withdrawal marker: docs/format.md §11.5), released at the end
  (``lease_release``); ``added.lease_per_save`` = lease_save - save;
- ``keep_last``: a lease save of a run with ``keep_last=--keep``, steady state: the
  retention the Checkpointer applies after it (``retention``) and the collection it
  triggers (``collection``, a :class:`~chunkstore.maintenance.autocollect.Collector`
  GC in its own thread);
- ``read``: a restore of a version (open, read every tensor, close) on a fresh store
  handle, with and without its read lease (``VersionReader(..., lease=...)``,
  docs/format.md §11.6); ``added.read_lease_per_read`` = the difference;
- ``gc`` / ``gc_idle``: a GC with nothing protected (``grace=0``) after removing every
  version but the one read, and an idle GC.

Requests made by the leases' heartbeat threads are counted apart (``background``, with
the seconds the phase took): they come per 10 s (run lease) or 30 s (read lease), not
per save; ``held`` holds one of each ``--idle`` seconds and counts them.  ``--compare``
adds the difference with an earlier results file where it holds the same quantities.
(protocol.json and protocol-before.json hold the layout of this script before the leases,
which benchmarks/summarize.py reads: write new runs to another file.)  The results in
benchmarks/results/protocol-leases.json come from::

    python benchmarks/bench_protocol.py --mib 64 --repeat 3 --s3 --s3-mib 32 --s3-repeat 2 \\
        --compare benchmarks/results/protocol.json --out benchmarks/results/protocol-leases.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import chunkstore
from chunkstore.backends.wrappers import RequestHook
from chunkstore.maintenance.autocollect import Collector
from chunkstore.maintenance.retention import Candidate, Policy, decide
from chunkstore.protocol.runlease import RunLease
from chunkstore.read.reader import VersionReader

REPO = Path(__file__).resolve().parent.parent
OPERATIONS = ("get", "put", "head", "list", "delete")
#: Threads whose requests come per second (heartbeats, a GC entry's renewal) or after a
#: save (the collection after retention), not in it: counted apart.
BACKGROUND = ("chunkstore-run-lease", "chunkstore-read-leases", "chunkstore-session",
              "chunkstore-gc-entry", "chunkstore-collect")
Requests = dict[str, Any]


class Counting(RequestHook):
    """Counts requests by operation and kind of object (a list counts once per call, like
    one LIST page); requests of the :data:`BACKGROUND` threads apart, by thread.  A sweep
    of temporary files (``walk``) is left out, as it was when protocol.json was recorded."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.background: dict[str, Counter[tuple[str, str]]] = {}
        self._lock = threading.Lock()

    def request(self, operation: str, key: str) -> None:
        if operation == "walk":
            return
        kind = key.split("/", 1)[0] if "/" in key else key or "(root)"
        thread = threading.current_thread().name
        with self._lock:
            if thread.startswith(BACKGROUND):
                self.background.setdefault(thread, Counter())[operation, kind] += 1
            else:
                self.counts[operation, kind] += 1

    def take(self) -> Requests:
        """The foreground requests since the last take, then forget them (and the
        background's)."""
        with self._lock:
            found, self.counts = self.counts, Counter()
            self.background = {}
        return summary(found)

    def take_background(self) -> dict[str, Requests]:
        with self._lock:
            found, self.background = self.background, {}
        return {thread: summary(counts) for thread, counts in sorted(found.items())}


def summary(counts: Counter[tuple[str, str]]) -> Requests:
    """``{operation: n, ..., "total": n, "by_kind": {kind: {operation: n}}}`` (zeros left
    out; a difference may hold negative counts)."""
    out: Requests = {op: n for op in OPERATIONS
                     if (n := sum(c for (o, _), c in counts.items() if o == op))}
    out["total"] = sum(counts.values())
    by_kind: dict[str, dict[str, int]] = {}
    for (operation, kind), n in sorted(counts.items(), key=lambda item: item[0][::-1]):
        if n:
            by_kind.setdefault(kind, {})[operation] = n
    out["by_kind"] = by_kind
    return out


def counts_of(requests: Requests) -> Counter[tuple[str, str]]:
    return Counter({(op, kind): n for kind, ops in requests["by_kind"].items()
                    for op, n in ops.items()})


def difference(more: Requests, less: Requests) -> Requests:
    """``more - less`` per operation and per kind."""
    counts = counts_of(more)
    counts.subtract(counts_of(less))
    return summary(counts)


def make_state(mib: int, tensors: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    per = mib * (1 << 20) // 4 // tensors
    return {f"layer{i}.w": rng.standard_normal(per, dtype=np.float32) for i in range(tensors)}


def save(store: chunkstore.Store, run: str, step: int, state: dict[str, np.ndarray],
         lease: RunLease | None = None) -> float:
    """One save, through ``lease`` as the Checkpointer makes it (what this process knows
    of the lease, then the commit claims its slot and checks the store); its seconds."""
    start = time.perf_counter()
    if lease is not None:
        lease.check_known()
    with store.new_version(run, step) as version:
        version.before_commit = lease
        for name, array in state.items():
            version.put(name, array)
    return time.perf_counter() - start


def saves(store: chunkstore.Store, counting: Counting, run: str, lease: RunLease | None,
          mib: int, tensors: int, repeat: int, seed: int) -> dict[str, Any]:
    """``repeat`` rounds of first / unchanged / partial saves of ``run`` (states of their
    own, from ``seed``: nothing dedups against another run); median seconds, and the
    requests of the last round's."""
    base = make_state(mib, tensors, seed)
    times: dict[str, list[float]] = {"first": [], "unchanged": [], "partial": []}
    requests: dict[str, Requests] = {}
    start, step = time.perf_counter(), 0
    for r in range(repeat):
        first = make_state(mib, tensors, seed + 100 + r)
        partial = {**first, "layer0.w": base["layer0.w"] + r}
        for kind, state in (("first", first), ("unchanged", first), ("partial", partial)):
            counting.take()
            times[kind].append(save(store, run, step, state, lease))
            requests[kind] = counting.take()  # the last round's stay
            step += 1
    return {"save_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
            "requests_per_save": requests,
            "background": counting.take_background(),
            "seconds": round(time.perf_counter() - start, 2)}


#: A way of saving: (run, step, state) -> seconds.
SaveWay = Callable[[str, int, dict[str, np.ndarray]], float]


def alternated_saves(counting: Counting, ways: dict[str, tuple[int, SaveWay]], mib: int,
                     tensors: int, repeat: int) -> dict[str, Any]:
    """Two ways of saving compared: ``repeat`` rounds, in each every kind of save
    (``first``: everything new, ``unchanged``: every chunk a dedup hit, ``partial``: one
    tensor changed) made each way in turn, so that both meet the same machine state.
    ``ways`` maps a way's name (the run it saves) to its states' seed and its save
    (run, step, state -> seconds).  Per way the median seconds and the last round's
    requests; ``added``: the second way's less the first's."""
    times: dict[str, dict[str, list[float]]] = {way: {} for way in ways}
    requests: dict[str, dict[str, Any]] = {way: {} for way in ways}
    step = 0
    for r in range(repeat):
        for way, (seed, save_one) in ways.items():
            base = make_state(mib, tensors, seed + 100 + r)
            partial = {**base, "layer0.w": base["layer0.w"] + 1}
            for kind, state in (("first", base), ("unchanged", base), ("partial", partial)):
                counting.take()
                times[way].setdefault(kind, []).append(save_one(way, step, state))
                requests[way][kind] = counting.take()
                step += 1
    out: dict[str, Any] = {way: {"save_s": {k: round(statistics.median(v), 4)
                                            for k, v in kinds.items()},
                                 "requests_per_save": requests[way]}
                           for way, kinds in times.items()}
    less, more = ways
    out["added"] = {kind: {
        "seconds": round(out[more]["save_s"][kind] - out[less]["save_s"][kind], 4),
        "ratio": round(out[more]["save_s"][kind] / out[less]["save_s"][kind], 3),
        "requests": difference(requests[more][kind], requests[less][kind])}
        for kind in times[less]}
    return out


def retain(store: chunkstore.Store, run: str, keep: int) -> int:
    """The Checkpointer's retention after a save (keep_last, min_previous=1, tags pinned)."""
    versions = store.versions(run)
    decision = decide([Candidate(v.id, v.step, v.created, v.meta) for v in versions],
                      Policy(keep_last=keep, min_previous=1), time.time())
    pinned = set(store.tags().values())
    return sum(store.delete_listed(v.id) for v in versions
               if v.id in decision.drop and v.id not in pinned)


def keep_last(store: chunkstore.Store, counting: Counting, mib: int, tensors: int,
              keep: int) -> dict[str, Any]:
    """Lease saves of a run with ``keep_last=keep``, one tensor changed each time,
    each followed by retention and the collection it triggers; the last save's requests."""
    run, lease, collector = "bench-keep", None, Collector(store)
    base = make_state(mib, tensors, 2000)
    out: dict[str, Any] = {"keep": keep}
    try:
        lease = RunLease(store.objects, run, purpose="bench")
        lease.acquire()
        for step in range(keep + 3):
            state = {**base, "layer0.w": base["layer0.w"] + step}
            counting.take()
            save(store, run, step, state, lease)
            out["save"] = counting.take()
            out["removed"] = retain(store, run, keep)
            out["retention"] = counting.take()
            collector.trigger()
            collector.wait_idle()
            out["collection"] = counting.take_background()
            out["after_collection"] = counting.take()  # nothing: the collection's own thread
    finally:
        collector.close()
        if lease is not None:
            lease.release()
    result = collector.last_result
    out["collection_deleted"] = None if result is None else (
        result.chunks_deleted + result.orphans_deleted + result.nodes_deleted)
    return out


def read(opened: Callable[..., Any], counting_on: bool, selector: str, *, lease: bool) -> Requests:
    """A restore of ``selector`` on a fresh handle (cold caches): open, every tensor, close."""
    with opened() as store:
        counting = Counting(store.backend)
        if counting_on:
            store.backend = counting
        info = store.resolve(selector)
        counting.take()
        reader = VersionReader(store, info, lease=lease)
        out: Requests = {"open": counting.take()}
        for name in reader.names():
            reader.get(name)
        out["read"] = counting.take()
        reader.close()
        out["close"] = counting.take()
    out["total"] = summary(sum((counts_of(part) for part in out.values()), Counter()))
    return out


def lease_saves(store: chunkstore.Store, counting: Counting, mib: int, tensors: int,
                repeat: int) -> dict[str, Any]:
    """The run lease taken, saves through it (as :func:`saves`), and released."""
    counting.take()
    lease = RunLease(store.objects, "bench-lease", purpose="bench")
    lease.acquire()
    out = {"lease_acquire": counting.take()}
    out["lease_save"] = saves(store, counting, "bench-lease", lease, mib, tensors, repeat,
                              1000)
    counting.take()
    lease.release()
    out["lease_release"] = counting.take()
    return out


def collect_all_but(store: chunkstore.Store, counting: Counting, keep: str) -> dict[str, Any]:
    """Every version but ``keep`` removed, a GC with nothing protected, and an idle one."""
    for info in store.versions():
        if info.id != keep:
            store.delete(info.id)
    counting.take()
    result = store.gc(grace=0)
    out: dict[str, Any] = {"gc_deleted": result.chunks_deleted + result.orphans_deleted
                           + result.nodes_deleted, "gc": counting.take()}
    store.gc(grace=0)
    out["gc_idle"] = counting.take()
    return out


def held(store: chunkstore.Store, counting: Counting, selector: str,
         seconds: float) -> dict[str, Any]:
    """A run lease and a read lease of ``selector`` held ``seconds`` with nothing else
    going on: their heartbeats' requests, and per minute."""
    lease = RunLease(store.objects, "bench-held", purpose="bench")
    lease.acquire()
    reader = VersionReader(store, store.resolve(selector))
    try:
        counting.take()
        time.sleep(seconds)
        found = counting.take_background()
    finally:
        reader.close()
        lease.release()
    return {"seconds": seconds, "background": found,
            "per_minute": {thread: round(n["total"] * 60 / seconds, 1)
                           for thread, n in found.items()}}


def measure(url: str, options: dict[str, Any], index_dir: str, mib: int, tensors: int,
            repeat: int, keep: int, idle: float, *, count: bool) -> dict[str, Any]:
    """Every measurement on one store (see the module docstring).  Without ``count`` only
    the save times mean anything."""
    opened = functools.partial(chunkstore.open, url, compression="none", index_dir=index_dir,
                               storage_options=options)
    out: dict[str, Any] = {"mib": mib}
    with opened(create=True) as store:
        counting = Counting(store.backend)
        if count:
            store.backend = counting
        out["save"] = saves(store, counting, "bench", None, mib, tensors, repeat, 0)
        out.update(lease_saves(store, counting, mib, tensors, repeat))
        out["keep_last"] = keep_last(store, counting, mib, tensors, keep)
        latest = store.latest("bench")
        assert latest is not None
        target = latest.id
        out.update(collect_all_but(store, counting, target))
        if idle > 0:
            out["held"] = held(store, counting, target, idle)
    out["read"] = {"no_lease": read(opened, count, target, lease=False),
                   "lease": read(opened, count, target, lease=True)}
    out["added"] = added(out)
    return out


def added(out: dict[str, Any]) -> dict[str, Any]:
    """What the leases add: per save (lease_save - save, by kind of save) and per read."""
    plain, leased = out["save"]["requests_per_save"], out["lease_save"]["requests_per_save"]
    reads = out["read"]
    return {"lease_per_save": {kind: difference(leased[kind], plain[kind]) for kind in plain},
            "read_lease_per_read": {part: difference(reads["lease"][part],
                                                     reads["no_lease"][part])
                                    for part in ("open", "read", "close", "total")}}


def compare(report: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
    """Plain saves and GCs against an earlier results file (its S3 requests; same sizes
    only), and its code revision."""
    out: dict[str, Any] = {"file_code": previous.get("code"), "command": previous.get("command")}
    old, new = previous.get("s3", {}), report.get("s3", {})
    if not old or not new or old.get("mib") != new.get("mib") or previous.get(
            "tensors") != report.get("tensors"):
        out["note"] = "no S3 run of the same size in both: nothing compared"
        return out
    strip = {"by_kind"}
    plain = new["save"]["requests_per_save"]
    out["save_then_now"] = {
        kind: {"then": old["requests_per_save"][kind],
               "now": {k: v for k, v in plain[kind].items() if k not in strip}}
        for kind in plain if kind in old.get("requests_per_save", {})}
    out["gc_idle_then_now"] = {"then": old.get("gc_idle_requests"),
                               "now": {k: v for k, v in new["gc_idle"].items()
                                       if k not in strip}}
    return out


@contextlib.contextmanager
def moto() -> Iterator[str]:
    sys.path.insert(0, str(REPO))
    from tests.s3server import _moto_server, create_bucket

    with _moto_server() as endpoint:
        yield f"s3://{create_bucket(endpoint)}/bench|{endpoint}"


def code_revision() -> dict[str, Any]:
    """The commit measured, and the files of the packages changed since (others' work in
    progress in this tree is measured too)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], check=False,
                              capture_output=True, text=True).stdout
    changed = [line[3:] for line in git("status", "--porcelain", "--", "chunkstore",
                                        "torch_bridge").splitlines()]
    return {"code": git("rev-parse", "--short", "HEAD").strip(), "uncommitted": changed}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of saves (local)")
    parser.add_argument("--keep", type=int, default=2, help="keep_last of the keep_last run")
    parser.add_argument("--idle", type=float, default=31.0,
                        help="seconds to hold a run lease and a read lease idle (0: skip)")
    parser.add_argument("--s3", action="store_true", help="also measure on a moto S3 server")
    parser.add_argument("--s3-mib", type=int, default=32)
    parser.add_argument("--s3-repeat", type=int, default=2)
    parser.add_argument("--compare", type=Path, help="an earlier results file")
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def main() -> None:
    args = parse()
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ.setdefault(name, value)
    report: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), **code_revision(),
                              "machine": platform.node(), "mib": args.mib,
                              "tensors": args.tensors}
    with tempfile.TemporaryDirectory() as tmp:
        local = functools.partial(measure, options={}, mib=args.mib, tensors=args.tensors,
                                  repeat=args.repeat, keep=args.keep)
        report["local"] = local(str(Path(tmp) / "store"), index_dir=str(Path(tmp) / "index"),
                                idle=args.idle, count=True)
        timed = local(str(Path(tmp) / "timed"), index_dir=str(Path(tmp) / "timed-index"),
                      idle=0, count=False)
        if args.s3:
            with moto() as spec:
                url, endpoint = spec.split("|")
                report["s3"] = measure(url, {"client_kwargs": {"endpoint_url": endpoint}},
                                       str(Path(tmp) / "s3-index"), args.s3_mib, args.tensors,
                                       args.s3_repeat, args.keep, args.idle, count=True)
    report["local"]["save_s_uncounted"] = {"save": timed["save"]["save_s"],
                                           "lease_save": timed["lease_save"]["save_s"]}
    if args.compare:
        report["vs_previous"] = compare(report, json.loads(args.compare.read_text()))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
