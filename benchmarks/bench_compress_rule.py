"""When compression pays on this machine: the raw-vs-compress rule, measured.

``auto`` splits a float chunk (or a delta image) into byte planes and compresses
each plane whose probe shrinks below ``PLANE_KEEP_RATIO`` of it
(:mod:`chunkstore.codecs.shuffle`).  On time alone, compressing a plane pays
when writing the bytes it removes would take longer than compressing it::

    bytes saved / W  >=  compress CPU seconds / k
    i.e.   S = bytes saved per compress CPU-second  >=  W / k

with W this disk's write+fsync rate and k the cores compressing at once (the
save's workers compress on every core while the disk writes).  A restore
pays the other way: it decodes what was compressed, and reading the bytes
compression removed from the page cache would have cost next to nothing.

For each workload the suite's states are saved with ``auto`` in this process
while every plane compression is timed in its thread's CPU time; the planes
are grouped by element size, plane (byte position, low first) and whether
they belong to a delta image, and for each group the benchmark reports S,
the rule's verdict at the W it measures in the same run, and what storing the
group raw would change per save (seconds by the rule, stored bytes).  Planes
that ``auto`` stored raw are a group of their own: what finding them
incompressible cost.  Tensors are also measured one by one (``sizes``): each
float tensor of the last state encoded alone by ``auto``, grouped by size,
since per call costs dominate small ones.
Usage::

    python -m benchmarks.bench_compress_rule --out benchmarks/results/compress_rule.json
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import chunkstore
import torch_bridge
from benchmarks.bench_collector import run_workloads
from benchmarks.trace import flatten, tensor_bytes
from chunkstore.codecs import policy, shuffle
from chunkstore.write import delta

#: bytes written and fsynced per timing of the disk (about a dense save's new bytes)
WRITE_BYTES = 64 * 1024 * 1024


class PlaneLog:
    """Times every plane compression of ``auto`` (the benchmark wraps the shuffle
    codec's plane step and the delta image step; the saves are unchanged)."""

    def __init__(self) -> None:
        self.rows: list[tuple[bool, int, int, int, int, int, int]] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._plane = shuffle._compress_plane
        self._encode = shuffle.ShuffleZstdCodec.encode
        self._image = delta.encode_image
        self.later = False

    def __enter__(self) -> PlaneLog:
        log = self

        def plane(data: np.ndarray) -> tuple[int, bytes | memoryview]:
            started = time.thread_time_ns()
            mode, body = log._plane(data)
            cpu = time.thread_time_ns() - started
            where = log._local
            with log._lock:
                log.rows.append((log.later, getattr(where, "delta", False), where.size,
                                 where.index, len(data.data), len(body), cpu, mode))
            where.index += 1
            return mode, body

        def encode(codec: Any, raw: memoryview, element_size: int) -> bytes:
            log._local.size, log._local.index = element_size, 0
            return log._encode(codec, raw, element_size)

        def image(raw: memoryview, base: Any, itemsize: int) -> Any:
            log._local.delta = True
            try:
                return log._image(raw, base, itemsize)
            finally:
                log._local.delta = False

        shuffle._compress_plane = plane
        shuffle.ShuffleZstdCodec.encode = encode
        delta.encode_image = image
        return self

    def __exit__(self, *exc: object) -> None:
        shuffle._compress_plane = self._plane
        shuffle.ShuffleZstdCodec.encode = self._encode
        delta.encode_image = self._image


def write_fsync_rate(work: Path, rounds: int = 5) -> float:
    """Median bytes per second of writing and fsyncing a new file of WRITE_BYTES."""
    data = np.random.default_rng(3).integers(0, 255, WRITE_BYTES, dtype=np.uint8)
    path = work / "fsync.bin"
    rates = []
    for _ in range(rounds):
        started = time.perf_counter()
        with open(path, "wb") as f:
            f.write(memoryview(data.data))
            f.flush()
            os.fsync(f.fileno())
        rates.append(WRITE_BYTES / (time.perf_counter() - started))
        path.unlink()
    return statistics.median(rates)


def groups(rows: list[tuple[Any, ...]], later_saves: int, rate: float, cores: int
           ) -> list[dict[str, Any]]:
    """Per group of planes of the later saves: what compressing them saved and cost."""
    sums: dict[tuple[Any, ...], list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])
    for later, is_delta, size, index, raw, stored, cpu, mode in rows:
        if not later:
            continue
        key = ("raw (probed)" if mode == 0 else "delta" if is_delta else "standalone",
               size, index if mode else "-")
        total = sums[key]
        total[0] += raw
        total[1] += stored
        total[2] += cpu
        total[3] += 1
    found = []
    for (kind, size, index), (raw, stored, cpu, count) in sorted(
            sums.items(), key=lambda item: -item[1][2]):
        seconds = cpu / 1e9
        saved = raw - stored
        speed = saved / seconds if seconds else float("inf")
        found.append({
            "planes": kind, "element_size": size, "plane": index, "count": count,
            "raw_bytes_per_save": raw / later_saves, "ratio": stored / raw if raw else 1.0,
            "cpu_s_per_save": seconds / later_saves,
            "saved_bytes_per_cpu_s": speed,
            "breakeven_write_bytes_per_s": speed * cores,
            "pays": kind != "raw (probed)" and speed * cores >= rate,
            # storing the group raw: seconds a save would gain by the rule (negative:
            # lose), and stored bytes it would add
            "raw_would_gain_s_per_save": (seconds / cores - saved / rate) / later_saves,
            "raw_would_add_bytes_per_save": saved / later_saves,
        })
    return found


def sizes(state: dict[str, Any], rate: float, cores: int) -> list[dict[str, Any]]:
    """Each float tensor of ``state`` encoded by ``auto`` (best of 3, thread CPU time),
    grouped by size up to the next power of two."""
    sums: dict[int, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0, 0])
    for tensor in flatten(state).values():
        if not tensor.is_floating_point() or not tensor.numel():
            continue
        raw = tensor_bytes(tensor)
        dtype = str(tensor.dtype).removeprefix("torch.")
        best = float("inf")
        for _ in range(3):
            started = time.thread_time_ns()
            _, payload = policy.encode_with_policy("auto", raw, dtype, tensor.element_size())
            best = min(best, (time.thread_time_ns() - started) / 1e9)
        total = sums[1 << max(0, (len(raw) - 1).bit_length())]
        total[0] += len(raw)
        total[1] += len(payload)
        total[2] += best
        total[3] += 1
    found = []
    for size, (raw_bytes, stored, seconds, count) in sorted(sums.items()):
        speed = (raw_bytes - stored) / seconds if seconds else 0.0
        found.append({"up_to_bytes": size, "tensors": int(count), "raw_bytes": raw_bytes,
                      "ratio": stored / raw_bytes, "cpu_s": seconds,
                      "cpu_us_per_tensor": seconds / count * 1e6,
                      "saved_bytes_per_cpu_s": speed,
                      "breakeven_write_bytes_per_s": speed * cores,
                      "pays": speed * cores >= rate})
    return found


def measure(workload: str, states: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    rate = write_fsync_rate(work)
    cores = os.cpu_count() or 1
    store = chunkstore.open(work / workload, compression="auto", create=True)
    walls = []
    try:
        with PlaneLog() as log:
            for step, state in enumerate(states):
                log.later = step > 0
                started = time.perf_counter()
                torch_bridge.save(store, state, run="r", step=step)
                walls.append(time.perf_counter() - started)
        stored = store.stats().physical_bytes
    finally:
        store.close()
        shutil.rmtree(work / workload, ignore_errors=True)
    later = len(states) - 1
    found = groups(log.rows, later, rate, cores)
    compressed = [g for g in found if g["planes"] != "raw (probed)"]
    failing = [g for g in compressed if not g["pays"]]
    return {
        "write_fsync_bytes_per_s": rate, "cores": cores,
        "threshold_saved_bytes_per_cpu_s": rate / cores,
        "save_median_s": statistics.median(walls[1:]), "stored_bytes": stored,
        "compress_cpu_s_per_save": sum(g["cpu_s_per_save"] for g in found),
        "probing_cpu_s_per_save": sum(g["cpu_s_per_save"] for g in found
                                      if g["planes"] == "raw (probed)"),
        "paying_share_of_compress_cpu":
            sum(g["cpu_s_per_save"] for g in compressed if g["pays"])
            / max(1e-12, sum(g["cpu_s_per_save"] for g in compressed)),
        # what the rule predicts for storing every group that fails it raw
        "rule_gain_s_per_save": sum(g["raw_would_gain_s_per_save"] for g in failing),
        "rule_adds_bytes_per_save": sum(g["raw_would_add_bytes_per_save"] for g in failing),
        "groups": found,
        "sizes": sizes(states[-1], rate, cores),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="dense,mixed-precision,frozen,lora")
    parser.add_argument("--states", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/compress_rule.json")
    args = parser.parse_args(argv)
    run_workloads(args.workloads, args.states, measure, {"states": args.states}, args.out,
                  "cs-compress-rule-")


if __name__ == "__main__":
    main()
