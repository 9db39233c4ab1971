"""GC time on a store of many chunks when a small fraction became garbage.

Builds a store of ``--chunks`` chunks (``--versions`` versions of unique
4 KiB chunks, so every version owns its chunks), unpublishes enough versions
to make ``--garbage`` of the chunks unreferenced, and times:

* ``gc_idle``: a GC run with nothing to delete (the fixed cost: reconcile,
  sessions, candidates from the zero-refcount table, orphan sweep);
* ``gc_dry_run``: the dry run after the deletions (mark included);
* ``gc``: the real run, deleting the garbage (files and directory fsyncs);
* ``gc_no_sweep``: an idle run without the orphan sweep (no listing);
* ``repack``: a second store of small tensors (packed), ``--packed-versions``
  versions of 256 tensors of 4 KiB, tensor i changed every i mod 4 + 1 saves;
  all but every fourth version are unpublished, and a GC repacks the packs
  that became mostly garbage (time, packs repacked, bytes copied, the store's
  bytes before and after, and every kept version read back).

Usage::

    python benchmarks/bench_gc.py --chunks 100000 --garbage 0.01 --out benchmarks/results/gc.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import chunkstore

CHUNK = 4096


def build(root: Path, chunks: int, versions: int) -> list[str]:
    per_version = chunks // versions
    ids = []
    counter = np.arange(per_version * CHUNK // 8, dtype=np.uint64)
    with chunkstore.open(root, chunk_size=CHUNK, compression="none", create=True) as store:
        for v in range(versions):
            with store.new_version("bench", v) as writer:
                # unique bytes per chunk: a counter offset by the version
                writer.put("w", counter + np.uint64(v) * np.uint64(counter.size))
            ids.append(writer.info.id)
    return ids


def packed_state(version: int) -> dict[str, np.ndarray]:
    """Tensor i holds the values of the last version that changed it (every i % 4 + 1)."""
    return {f"t{i}": np.random.default_rng(1000 * i + version - version % (i % 4 + 1))
            .integers(0, 2**31, CHUNK // 4, dtype=np.int32) for i in range(256)}


def repack_bench(root: Path, versions: int) -> dict[str, Any]:
    with chunkstore.open(root, chunk_size=64 * 1024, compression="none", create=True) as store:
        ids = []
        for v in range(versions):
            with store.new_version("packed", v) as writer:
                for name, array in packed_state(v).items():
                    writer.put(name, array)
            ids.append(writer.info.id)
        kept = {v: vid for v, vid in enumerate(ids) if v % 4 == 3}
        for v, vid in enumerate(ids):
            if v not in kept:
                store.delete(vid)
        before = tree_bytes(root)
        store.index.sync()
        shutil.copytree(root, root.with_name("no-repack"))
        with chunkstore.open(root.with_name("no-repack"), create=True) as other:
            other.gc(grace=0, repack_unused=None)
        no_repack = tree_bytes(root.with_name("no-repack"))
        dry = store.gc(grace=0, dry_run=True)
        seconds, result = timed(store, grace=0)
        after = tree_bytes(root)
        for v, vid in kept.items():
            reader = store.open_version(vid)
            for name, array in packed_state(v).items():
                assert reader.get(name).tobytes() == array.tobytes(), (v, name)
        return {"versions": versions, "versions_kept": len(kept),
                "live_packs_before": dry.live_packs,
                "pack_garbage_bytes_before": dry.pack_garbage_bytes,
                "gc_s": round(seconds, 3), "packs_repacked": result.packs_repacked,
                "repack_bytes_copied": result.repack_bytes_copied,
                "repack_bytes_written": result.repack_bytes_written,
                "store_bytes_before": before, "store_bytes_after": after,
                "store_bytes_after_gc_without_repacking": no_repack,
                "kept_versions_read_back": True}


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*")
               if p.is_file() and p.relative_to(root).parts[0] in ("chunks", "nodes"))


def timed(store: chunkstore.Store, **kwargs: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = store.gc(**kwargs)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--versions", type=int, default=100)
    parser.add_argument("--garbage", type=float, default=0.01)
    parser.add_argument("--out", default="benchmarks/results/gc.json")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--packed-versions", type=int, default=40)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="cs-gc-", dir=args.workdir))
    try:
        root = workdir / "store"
        start = time.perf_counter()
        ids = build(root, args.chunks, args.versions)
        build_s = time.perf_counter() - start
        with chunkstore.open(root, create=True) as store:
            idle_s, _ = timed(store, grace=0)
            idle_no_sweep_s, _ = timed(store, grace=0, sweep=False)
            drop = max(1, round(len(ids) * args.garbage))
            for vid in ids[:drop]:
                store.delete(vid)
            dry_s, dry = timed(store, grace=0, dry_run=True)
            gc_s, result = timed(store, grace=0)
            assert result.chunks_deleted == dry.chunks_deleted
            verify_start = time.perf_counter()
            ok = store.verify(read_data=False).ok
            verify_s = time.perf_counter() - verify_start
            chunks_left = store.index.count(b"c")
        report = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform()},
            "chunks": args.chunks, "versions": args.versions, "garbage_fraction": args.garbage,
            "build_s": round(build_s, 2),
            "gc_idle_s": round(idle_s, 3), "gc_idle_no_sweep_s": round(idle_no_sweep_s, 3),
            "gc_dry_run_s": round(dry_s, 3), "gc_s": round(gc_s, 3),
            "chunks_deleted": result.chunks_deleted, "nodes_deleted": result.nodes_deleted,
            "bytes_freed": result.bytes_freed, "chunks_left": chunks_left,
            "verify_quick_s": round(verify_s, 3), "verify_ok": ok,
            "repack": repack_bench(workdir / "packed", args.packed_versions),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
