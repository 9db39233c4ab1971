"""What ``chunkstore export --sign`` adds to an export (issue 51's signed export).

A store holding one Checkpointer version of an MLP (weights of ``--mib`` MiB, float32,
with Adam's state beside them, which the export strips) is exported three ways, each
``--repeat`` times, in this process (the store opened once, torch imported):

- ``plain``: ``export_safetensors`` (a safetensors file, as before);
- ``lineage``: ``export_artifact`` unsigned (the directory, lineage.json, fsyncs);
- ``signed``: ``export_artifact(sign_with=KEY)`` (P-256): model-signing hashes each
  file with SHA-256 and signs the statement.

and as a user runs it, ``python -m chunkstore export`` in a new process, plain and
``--sign`` (the process's wall time, imports included: model-signing's import is
part of what --sign costs).  Medians are recorded with the command and the machine.
benchmarks/results/export.json comes from (a 2-core machine shared with other jobs)::

    python -m benchmarks.bench_export --mib 8 64 --out benchmarks/results/export.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _make_store(where: Path, mib: int) -> Path:
    import torch

    from torch_bridge import Checkpointer

    width = int((mib * 2**20 / 4 / 2) ** 0.5)  # two square layers of float32
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    store = where / f"store-{mib}"
    with Checkpointer(store, run="bench") as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
    return store


def _make_key(where: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path = where / "key.pem"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _timed(run: Any, out: Path, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        if out.is_dir():
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
        started = time.perf_counter()
        run(out)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _in_process(store: Path, key: Path, where: Path, repeat: int) -> dict[str, float]:
    import chunkstore
    from torch_bridge.tools.artifact import export_artifact
    from torch_bridge.tools.export import export_safetensors

    with chunkstore.open(store) as opened:
        ways = {
            "plain": lambda out: export_safetensors(opened, "latest", out),
            "lineage": lambda out: export_artifact(opened, "latest", out),
            "signed": lambda out: export_artifact(opened, "latest", out, sign_with=key),
        }
        return {name: _timed(run, where / f"out-{name}", repeat)
                for name, run in ways.items()}


def _new_process(store: Path, key: Path, where: Path, repeat: int) -> dict[str, float]:
    commands = {"plain": [], "signed": ["--sign", str(key)]}
    result = {}
    for name, extra in commands.items():
        out = where / f"cli-{name}"

        def run(out: Path, extra: list[str] = extra) -> None:
            subprocess.run([sys.executable, "-m", "chunkstore", "export", str(store),
                            "latest", str(out), *extra], check=True, capture_output=True)
        result[name] = _timed(run, out, repeat)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    records = []
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        where = Path(tmp)
        key = _make_key(where)
        for mib in args.mib:
            store = _make_store(where, mib)
            in_process = _in_process(store, key, where, args.repeat)
            new_process = _new_process(store, key, where, args.repeat)
            weights = (where / "out-plain").stat().st_size
            records.append({"weights_mib": round(weights / 2**20, 2),
                            "in_process_s": in_process, "new_process_s": new_process,
                            "signed_over_plain_in_process":
                                in_process["signed"] / in_process["plain"],
                            "signed_over_plain_new_process":
                                new_process["signed"] / new_process["plain"]})
            print(json.dumps(records[-1]), flush=True)
    result = {"command": " ".join(["python -m benchmarks.bench_export", *sys.argv[1:]]),
              "machine": f"{platform.node()} {os.cpu_count()} cores, shared with other jobs",
              "repeat": args.repeat, "median": True, "runs": records}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
