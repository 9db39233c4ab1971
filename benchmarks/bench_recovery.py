"""Recovery: how long a restore takes from each tier, against the plain formats, how fast
a version travels to object storage, and what a mirror costs the training pause.

Everything runs in one go on one machine, against a moto S3 server started here on
127.0.0.1 (the same server CI uses; it keeps objects in memory, so S3 figures are
an HTTP round trip per object, not a real network).  Each measured restore is a
fresh process, so figures include interpreter start and imports:

- ``chunkstore drill`` of the local tier and of the mirror on S3 (a fresh cache
  directory: the index is rebuilt from S3, as on a new node), its phases as the drill
  reports them (startup, discovery, download, validation, materialization);
- ``torch.load`` of a ``torch.save`` file of the same tensors, and DCP's load of a
  ``dcp.save`` directory, each in a fresh process;
- ``chunkstore.sync`` of the version to S3 against an s3fs ``put`` of the
  ``torch.save`` file (the same bytes, or about);
- the training pause of ``Checkpointer(async_save=True)`` with and without a mirror
  (median of the saves after the first, alternating the two).

Usage::

    python -m benchmarks.bench_recovery --size-mib 1024 --repeat 3 \
        --out benchmarks/results/recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import chunkstore
from torch_bridge import Checkpointer

ROOT = Path(__file__).resolve().parent.parent
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
TORCH_LOAD = """
import sys, time, torch
t = time.perf_counter()
state = torch.load(sys.argv[1], weights_only=True)
print(time.perf_counter() - t)
"""
DCP_LOAD = """
import sys, time, torch
import torch.distributed.checkpoint as dcp
shapes = {k: tuple(v) for k, v in __import__("json").loads(sys.argv[2]).items()}
t = time.perf_counter()
state = {k: torch.empty(s) for k, s in shapes.items()}
dcp.load(state, checkpoint_id=sys.argv[1])
print(time.perf_counter() - t)
"""


def make_state(size_mib: int, version: int = 0) -> dict[str, torch.Tensor]:
    """float32 tensors of 64 MiB (the last one smaller) adding up to ``size_mib``."""
    g = torch.Generator().manual_seed(version)
    state, left, i = {}, size_mib << 20, 0
    while left > 0:
        n = min(left, 64 << 20) // 4
        state[f"layer{i}.weight"] = torch.randn(n, generator=g)
        left -= n * 4
        i += 1
    return state


@contextmanager
def moto_server() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wall(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    return time.perf_counter() - started, done.stdout


def drill(url: str, env: dict[str, str]) -> dict[str, Any]:
    seconds, out = wall([sys.executable, "-m", "chunkstore", "drill", url, "--json",
                         "--no-record", "--materialize", "torch"], env)
    doc = json.loads(out)
    return {"wall_s": seconds, "recovery_s": doc["recovery_seconds"], "phases": doc["phases"],
            "bytes": doc["bytes_downloaded"], "ok": doc["ok"]}


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:  # noqa: PLR0915 - one benchmark, step by step
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pause-saves", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/recovery.json")
    args = parser.parse_args()
    os.environ.update({k: os.environ.get(k, v) for k, v in CREDENTIALS.items()})
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    state = make_state(args.size_mib)
    nbytes = sum(t.numel() * 4 for t in state.values())
    result: dict[str, Any] = {"machine": platform.node(), "cpus": os.cpu_count(),
                              "size_bytes": nbytes, "repeat": args.repeat,
                              "command": " ".join(["python -m benchmarks.bench_recovery",
                                                   *sys.argv[1:]])}
    try:
        with moto_server() as endpoint:
            import s3fs

            fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            fs.mkdir(bucket)
            options = {"client_kwargs": {"endpoint_url": endpoint}}
            local = work / "local"
            with Checkpointer(local, run="bench") as ckpt:
                ckpt.save(1, state=state)
            file = work / "state.pt"
            torch.save(state, file)
            dcp_dir = work / "dcp"
            import torch.distributed.checkpoint as dcp

            dcp.save(dict(state), checkpoint_id=str(dcp_dir))
            # Travel to S3: sync of the version against a put of the torch.save file.
            url = f"s3://{bucket}/ckpts"
            started = time.perf_counter()
            synced = chunkstore.sync(local, url, dst_options=options)
            sync_s = time.perf_counter() - started
            started = time.perf_counter()
            fs.put(str(file), f"{bucket}/state.pt")
            put_s = time.perf_counter() - started
            result["travel"] = {"sync_s": sync_s, "sync_bytes": synced.bytes_copied,
                                "sync_gbps": synced.bytes_copied / sync_s / 1e9,
                                "s3fs_put_s": put_s, "put_bytes": file.stat().st_size,
                                "put_gbps": file.stat().st_size / put_s / 1e9,
                                "sync_over_put": sync_s / put_s}
            # Restores, each in a fresh process, alternating.
            shapes = json.dumps({k: list(v.shape) for k, v in state.items()})
            runs: dict[str, list[dict[str, Any]]] = {"local": [], "mirror": [],
                                                      "torch_load": [], "dcp_load": []}
            for i in range(args.repeat):
                env = dict(os.environ)
                runs["local"].append(drill(str(local), env))
                env_s3 = {**env, "CHUNKSTORE_STORAGE_OPTIONS": json.dumps(options),
                          "CHUNKSTORE_CACHE_DIR": str(work / f"cache-{i}")}
                runs["mirror"].append(drill(url, env_s3))
                seconds, out = wall([sys.executable, "-c", TORCH_LOAD, str(file)])
                runs["torch_load"].append({"wall_s": seconds, "load_s": float(out)})
                seconds, out = wall([sys.executable, "-c", DCP_LOAD, str(dcp_dir), shapes])
                runs["dcp_load"].append({"wall_s": seconds, "load_s": float(out)})
            torch_wall = median_of(runs["torch_load"], "wall_s")
            result["restore"] = {
                name: {"runs": rs, "median_wall_s": median_of(rs, "wall_s"),
                       "wall_over_torch_load": median_of(rs, "wall_s") / torch_wall}
                for name, rs in runs.items()}
            # The training pause with a mirror and without (async saves, alternating).
            pauses: dict[str, list[float]] = {"no_mirror": [], "mirror": []}
            with Checkpointer(work / "p-plain", run="p", async_save=True) as plain, \
                    Checkpointer(work / "p-tiered", run="p", async_save=True,
                                 mirror=chunkstore.open(f"s3://{bucket}/pause", create=True,
                                                        storage_options=options)) as tiered:
                for step in range(1, args.pause_saves + 1):
                    changed = {k: v + step for k, v in state.items()}
                    for name, ckpt in (("no_mirror", plain), ("mirror", tiered)):
                        started = time.perf_counter()
                        ckpt.save(step, state=changed)
                        pauses[name].append(time.perf_counter() - started)
                        ckpt.wait()
                tiered.wait(mirror=True)
            result["pause"] = {name: {"seconds": values,
                                      "median_after_first": statistics.median(values[1:])}
                               for name, values in pauses.items()}
            result["pause"]["mirror_over_no_mirror"] = (
                result["pause"]["mirror"]["median_after_first"]
                / result["pause"]["no_mirror"]["median_after_first"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"travel": result["travel"],
                      "restore": {k: {"median_wall_s": v["median_wall_s"],
                                      "wall_over_torch_load": v["wall_over_torch_load"]}
                                  for k, v in result["restore"].items()},
                      "pause": {k: v for k, v in result["pause"].items()
                                if not isinstance(v, dict)} | {
                          k: v["median_after_first"] for k, v in result["pause"].items()
                          if isinstance(v, dict)}}, indent=2))


if __name__ == "__main__":
    main()
