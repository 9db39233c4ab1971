"""AES-256-GCM as an encrypted restore calls it: one ``decrypt_into`` per segment.

Two questions about the opening of sealed members (chunkstore.objects.crypto), each
answered here by the ``cryptography`` package alone, without a store:

1. **Where the source lies.**  A restore decrypts members straight from the mapped pack
   (page cache, not in the CPU's caches).  ``source`` decrypts the same sealed bytes in
   1 MiB members from a buffer decrypted again and again (in cache) and from 256 MiB of
   them laid end to end (each read once per pass, as a restore reads a pack), into one
   reused output buffer, and copies the cold bytes for comparison (what reading them
   costs without decrypting).
2. **How many calls.**  Each call lets go of the GIL and takes it back.  ``calls``
   decrypts 400 MiB per worker in calls of each size, with one worker, two threads of
   one process (a restore's two read jobs) and two processes, and reports the wall time
   of each over the single worker's: 1.0 where two workers overlap fully, 2.0 where they
   take turns.

Usage::

    python -m benchmarks.bench_aead_calls \\
        --out benchmarks/results/encryption-restore-fused/aead-calls.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from chunkstore.objects.crypto import Sealer, aead_class

KEY = b"k" * 32
NONCE = b"n" * 12
CALL_BYTES = 400 << 20


def _worker(size: int) -> float:
    """Decrypt :data:`CALL_BYTES` in calls of ``size`` bytes; the seconds it took."""
    cipher = aead_class()(KEY)
    sealed = cipher.encrypt(NONCE, os.urandom(size), b"ad")
    out = memoryview(bytearray(size))
    started = time.perf_counter()
    for _ in range(CALL_BYTES // size):
        cipher.decrypt_into(NONCE, sealed, b"ad", out)
    return time.perf_counter() - started


def _wall(run: Callable[[], None]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def _two_threads(size: int) -> None:
    threads = [threading.Thread(target=_worker, args=(size,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def calls(sizes: list[int], repeat: int) -> list[dict[str, Any]]:
    rows = []
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_worker, [4096, 4096])  # started
        for size in sizes:
            one, threads, processes = [], [], []
            for _ in range(repeat):  # the three ways in turn
                one.append(_wall(lambda size=size: _worker(size)))
                threads.append(_wall(lambda size=size: _two_threads(size)))
                processes.append(_wall(lambda size=size: pool.map(_worker, [size, size])))
            best = min(one)
            rows.append({"call_bytes": size, "one_worker_s": best,
                         "one_worker_gb_s": CALL_BYTES / best / 1e9,
                         "two_threads_over_one": min(threads) / best,
                         "two_processes_over_one": min(processes) / best})
            print(rows[-1])
    return rows


def source(repeat: int) -> dict[str, Any]:
    """GB/s of opening 1 MiB members in 64 KiB segments, the sealed bytes in cache or not."""
    sealer = Sealer(b"s" * 32, members=True)
    member = bytes(sealer.seal("pack member x", os.urandom(1 << 20)))
    count = (256 << 20) // len(member)
    cold = np.empty(count * len(member), dtype=np.uint8)
    for number in range(count):
        cold[number * len(member):(number + 1) * len(member)] = np.frombuffer(member, np.uint8)
    laid = memoryview(cold.data).cast("B")
    out = memoryview(np.empty(1 << 20, dtype=np.uint8).data).cast("B")

    def opened(hot: bool) -> float:
        started = time.thread_time()
        for number in range(count):
            at = 0 if hot else number * len(member)
            sealer.open_into("pack member x", 0, member if hot else laid[at:at + len(member)],
                             out, 0)
        return count * (1 << 20) / (time.thread_time() - started) / 1e9

    def copied() -> float:
        started = time.thread_time()
        for number in range(count):
            at = number * len(member)
            out[:] = laid[at:at + (1 << 20)]
        return count * (1 << 20) / (time.thread_time() - started) / 1e9

    hot, cold_rate, copy = [], [], []
    for _ in range(repeat):
        hot.append(opened(True))
        cold_rate.append(opened(False))
        copy.append(copied())
    found = {"in_cache_gb_s": max(hot), "from_memory_gb_s": max(cold_rate),
             "copy_from_memory_gb_s": max(copy)}
    print(found)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="16384,65536,262144,1048576")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = {"command": "python -m benchmarks.bench_aead_calls " + " ".join(argv or []),
              "cpus": os.cpu_count(), "load_average_before": os.getloadavg()[0],
              "source": source(args.repeat),
              "calls": calls([int(size) for size in args.sizes.split(",")], args.repeat),
              "load_average_after": os.getloadavg()[0]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
