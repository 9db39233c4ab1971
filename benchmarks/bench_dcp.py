"""torch.distributed.checkpoint: DCP's FileSystemWriter against chunkstore's ChunkStoreWriter.

The state is a frozen-base fine-tune at world size W (gloo ranks on this
machine): a base weight sharded by rows over the ranks (a DTensor, unchanged
between saves) plus a small trainable head replicated on every rank with its
Adam moments (changed before every save).  Each system saves ``--versions``
versions with ``dcp.save``, then one more with ``dcp.async_save`` (its
pause: until ``async_save`` returns), then loads the newest version at the
same world size.  Reported per system and world size: bytes stored after
the versions (every file of the checkpoint directories, or of the store but
its index), median save time (rank 0, from a barrier to the save's return),
the async pause and the load time.  Usage::

    python benchmarks/bench_dcp.py --mib 32 --versions 10 --worlds 1 2 4 \\
        --out benchmarks/results/dcp.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import chunkstore
from torch_bridge.dcp import ChunkStoreReader, ChunkStoreWriter

SYSTEMS = ("dcp-filesystem", "chunkstore")
HEAD_FRACTION = 0.02  # of the base's parameters, trained (and saved with Adam moments)


def _state(mib: int, world: int, version: int) -> dict[str, Any]:
    """The rank's state at ``version``: its rows of the base, the head and its moments."""
    rank = dist.get_rank()
    width = 1024
    rows = max(world, round(mib * (1 << 20) / 4 / width / world) * world)
    base = torch.randn(rows // world, width, generator=torch.Generator().manual_seed(rank))
    mesh = init_device_mesh("cpu", (world,))
    head = max(1, int(rows * HEAD_FRACTION))
    g = torch.Generator().manual_seed(1000 + version)
    trained = {name: torch.randn(head, width, generator=g) for name in ("w", "m", "v")}
    return {"base": DTensor.from_local(base, mesh, [Shard(0)], run_check=False),
            "head": trained["w"], "optim": {"exp_avg": trained["m"],
                                            "exp_avg_sq": trained["v"], "step": version}}


def _writer(system: str, root: Path, version: int) -> Any:
    if system == "chunkstore":
        return ChunkStoreWriter(root / "store", run="bench", step=version)
    return dcp.FileSystemWriter(root / f"v{version}")


def _reader(system: str, root: Path, version: int) -> Any:
    if system == "chunkstore":
        return ChunkStoreReader(root / "store", "bench@latest")
    return dcp.FileSystemReader(root / f"v{version}")


def _timed(save: Any) -> float:
    dist.barrier()
    started = time.perf_counter()
    save()
    return time.perf_counter() - started


def _rank(rank: int, world: int, port: int, system: str, root: str, mib: int,
          versions: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    path = Path(root)
    saves = [_timed(lambda v=v: dcp.save(_state(mib, world, v),
                                         storage_writer=_writer(system, path, v)))
             for v in range(1, versions + 1)]
    last = versions + 1
    state = _state(mib, world, last)
    dist.barrier()
    started = time.perf_counter()
    pending = dcp.async_save(state, storage_writer=_writer(system, path, last))
    pause = time.perf_counter() - started
    pending.result()
    target = _state(mib, world, 0)
    load = _timed(lambda: dcp.load(target, storage_reader=_reader(system, path, last)))
    if rank == 0:
        Path(out).write_text(json.dumps({"saves_s": saves, "async_pause_s": pause,
                                         "load_s": load}))
    dist.destroy_process_group()


def _stored_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*")
               if p.is_file() and "index" not in p.relative_to(root).parts)


def run_one(system: str, world: int, mib: int, versions: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"bench-dcp-{system}-"))
    try:
        if system == "chunkstore":
            chunkstore.open(root / "store").close()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out = root / "rank0.json"
        ctx = mp.get_context("forkserver")
        ranks = [ctx.Process(target=_rank, args=(r, world, port, system, str(root), mib,
                                                 versions, str(out))) for r in range(world)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        if any(p.exitcode for p in ranks):
            raise RuntimeError(f"{system} at world size {world}: a rank failed")
        timings = json.loads(out.read_text())
        out.unlink()
        return {"system": system, "world": world, "stored_bytes": _stored_bytes(root),
                "save_s_median": statistics.median(timings["saves_s"]),
                "first_save_s": timings["saves_s"][0], **timings}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=32, help="size of the base weight")
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    results = []
    for world in args.worlds:
        for system in SYSTEMS:
            result = run_one(system, world, args.mib, args.versions)
            print(f"world {world} {system:15s} stored {result['stored_bytes'] / 2**20:8.1f}"
                  f" MiB  save {result['save_s_median']:.3f} s  pause"
                  f" {result['async_pause_s']:.3f} s  load {result['load_s']:.3f} s",
                  file=sys.stderr)
            results.append(result)
    by = {(r["world"], r["system"]): r for r in results}
    ratios = {str(w): {"stored": by[w, "chunkstore"]["stored_bytes"]
                       / by[w, "dcp-filesystem"]["stored_bytes"],
                       "save_time": by[w, "chunkstore"]["save_s_median"]
                       / by[w, "dcp-filesystem"]["save_s_median"]} for w in args.worlds}
    report = {"command": " ".join(["python", "benchmarks/bench_dcp.py", *argv]), "mib": args.mib,
              "versions": args.versions + 1, "machine": {"cpus": os.cpu_count(),
                                                         "python": platform.python_version(),
                                                         "torch": torch.__version__},
              "created": time.time(), "results": results,
              "chunkstore_over_dcp": ratios}
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
