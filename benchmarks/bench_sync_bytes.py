"""Bytes a one-version sync moves into an empty store, against the version's stored bytes.

A training job (four 256x256 layers with AdamW and a frozen 2000x256 embedding, 5 MiB
of state, saved by ``Checkpointer(keep_last=3)`` every step) leaves packs
that hold members of versions its retention removed.  After a GC with no grace, the
newest version is synced alone into an empty folder, twice: with packs copied as the
members the version lists (the default) and with every pack copied whole
(``COMPACT_BELOW = 0``, what sync did before).  Stored bytes of a version: its commit
record, its nodes, its standalone chunk objects and the members it lists in packs.

Usage::

    python -m benchmarks.bench_sync_bytes --out benchmarks/results/sync_bytes.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import chunkstore
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import TensorEntry
from chunkstore.handle.tree import flatten
from chunkstore.maintenance import synccopy
from chunkstore.objects.kinds import CHUNKS, NODES, VERSIONS
from torch_bridge import Checkpointer


def train(store: Path, steps: int) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    frozen = nn.Embedding(2000, 256)  # saved every step, never trained
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    ckpt = Checkpointer(store, run="job", keep_last=3, async_save=False)
    ckpt.restore(model=net, embed=frozen, optimizer=opt, missing_ok=True)
    for step in range(1, steps + 1):
        loss = net(torch.randn(32, 256)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.save(step, model=net, embed=frozen, optimizer=opt)
    ckpt.close()


def stored_bytes(store: chunkstore.Store, version: str) -> int:
    record = store.read_record(version)
    flat = flatten(store.objects, record.root, store.node_cache)
    total = len(store.objects.get(VERSIONS, version))
    total += sum(len(store.objects.get(NODES, d)) for d in flat.tree_nodes | flat.data_nodes())
    members: set[tuple[Digest, int, int]] = set()
    for leaf in flat.leaves.values():
        if isinstance(leaf, TensorEntry):
            for shard in leaf.shards:
                for i, digest in enumerate(shard.chunks):
                    for at, base in ((shard.location(i), digest),
                                     *zip(shard.chain_locations(i), shard.chain(i),
                                          strict=True)):
                        if at is None:
                            members.add((base, -1, store.objects.stat(CHUNKS, base).size))
                        else:
                            members.add((at.pack, at.offset, at.length))
    return total + sum(length for _, _, length in members)


def one_sync(src: Path, dst: Path, version: str, compact_below: float) -> dict[str, Any]:
    saved = synccopy.COMPACT_BELOW
    synccopy.COMPACT_BELOW = compact_below
    try:
        started = time.perf_counter()
        result = chunkstore.sync(src, dst, [version])
        seconds = time.perf_counter() - started
    finally:
        synccopy.COMPACT_BELOW = saved
    assert result.ok and result.copied == [version]
    with chunkstore.open(dst) as copy:
        assert copy.verify().ok
    return {"bytes_copied": result.bytes_copied, "objects_copied": result.objects_copied,
            "seconds": round(seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        train(work / "src", args.steps)
        with chunkstore.open(work / "src") as src:
            src.gc(grace=0)
            newest = src.latest("job")
            assert newest is not None
            version_bytes = stored_bytes(src, newest.id)
            store_bytes = sum(i.size for kind in (CHUNKS, NODES)
                              for _, i in src.objects.infos(kind))
        rows = {"members": one_sync(work / "src", work / "dst-members", newest.id, 0.9),
                "whole_packs": one_sync(work / "src", work / "dst-whole", newest.id, 0.0)}
    for row in rows.values():
        row["over_stored"] = round(row["bytes_copied"] / version_bytes, 3)
    doc = {"machine": platform.machine(), "steps": args.steps, "keep_last": 3,
           "command": "python -m benchmarks.bench_sync_bytes"
                      + (f" --out {args.out}" if args.out else ""),
           "version_stored_bytes": version_bytes, "source_store_bytes": store_bytes,
           "sync": rows}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
