"""Restore as a resuming job sees it: a new process builds its model and optimizer
afresh, then loads the newest checkpoint into them.

For each workload the parent trains the model a few steps, saves three versions
into a chunkstore store with a ``Checkpointer`` (the default store: policy
``auto``, with delta chains, so the newest version is read through its chains)
and the newest state with ``torch.save`` (fsynced), then starts fresh processes,
alternating which system goes first in each round:

- ``torch``: ``torch.load(path, weights_only=True)``, then ``load_state_dict`` of
  every object (what a job that checkpoints with torch.save does on a restart);
- ``chunkstore``: ``Checkpointer(path, run=...).restore(**objects)`` (open the
  store, sync its index, pick the newest version, read it into the objects).

Each process imports torch and builds its objects untimed (both systems pay that),
then times its restore; the figure is that time (``restore_s``), the median over
``--runs`` processes, with the range, and the ratio per round; ``cpu_s``: the CPU
seconds of the process over the same span (every thread), which other work on a
shared machine moves less.  The import of
``torch_bridge.Checkpointer`` (chunkstore and the bridge: what only chunkstore's
job pays) is reported apart (``import_s``, byte code cached: the children write it
under the work directory even where ``PYTHONDONTWRITEBYTECODE`` is set) and counted
in by ``with_import_per_round``.  A first process per system warms up, untimed.
Phases, each timed inside the same call by processes of their own (wrappers around
the functions that do them; the per-chunk phases summed over the read threads, so
they may add up to more than the wall time of the read):

- ``open``: the store's config and its index opened (``chunkstore.open`` less the
  two next);
- ``index_sync``: ``reconcile`` (versions committed or removed elsewhere) and the
  GC journal's listing;
- ``pick``: the run's versions listed, the newest's manifest read and hash-checked,
  the targets planned (everything before the first chunk is read);
- ``read_wall``: the chunk reads of every tensor, wall time (``get_many_into``), and
  within them, thread-summed: ``read`` (bytes from the backend, or mapped), ``hash``
  (BLAKE3), ``decode`` (the rest of the jobs: headers, codecs, delta chains);
- ``apply``: after the reads: staging copies, ``load_state_dict`` of every object
  (the copy into place), RNG states.

torch's phases: ``load`` (``torch.load``) and ``apply`` (``load_state_dict``).

Targets (issue 49): the restore at most 0.8x torch.load's end to end where the
newest version has no delta chains, at most 1.0x where it has (a chain costs a
decode per link that torch.load does not pay).  Whether it has is read from the
store, untimed, before the rounds: the chains its manifest lists for the chunks a
restore reads (``chains``: chunks, how many of them are deltas, links in all);
``target`` says which applies and whether the median ratio meets it.
Usage (the results file's command)::

    python -m benchmarks.bench_resume --runs 7 --out benchmarks/results/resume.json
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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS: tuple[str, ...] = ("torch", "chunkstore")
WORKLOADS = ("mlp", "mlp-frozen", "gpt", "lora", "mixed-precision", "sparse-embedding")
#: Versions the parent saves into the store (torch.save: the newest only).
VERSIONS = 3
#: The most a restore may take, as a fraction of torch.load's time (issue 49), where
#: the newest version reads no delta chain, and where it reads some.
TARGET_WITHOUT_CHAINS = 0.8
TARGET_WITH_CHAINS = 1.0


def _mlp(frozen_layers: int) -> Callable[[], dict[str, Any]]:
    """A 10-layer 1024-wide MLP with AdamW; the first ``frozen_layers`` layers frozen."""
    def build() -> dict[str, Any]:
        import torch
        torch.manual_seed(0)
        layers = [torch.nn.Linear(1024, 1024) for _ in range(10)]
        for layer in layers[:frozen_layers]:
            layer.requires_grad_(False)
        model = torch.nn.Sequential(*layers)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        return {"model": model, "optimizer": optimizer}
    return build


def _suite_gpt() -> Any:
    """The suite's GPT at full scale (seeded: the same weights in every process)."""
    from benchmarks.workloads import FULL
    from benchmarks.workloads import _gpt as gpt
    return gpt(FULL)


def _gpt() -> dict[str, Any]:
    """The suite's dense workload: its GPT with AdamW."""
    import torch
    model = _suite_gpt()
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=3e-4)}


def _lora() -> dict[str, Any]:
    """The suite's LoRA workload: its GPT with rank-8 adapters on q, k, v and o, the
    adapters trained by AdamW."""
    import torch

    from benchmarks.workloads import FULL
    model = _suite_gpt()
    model.add_lora(FULL.lora_rank)
    return {"model": model, "optimizer": torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-3)}


def _mixed() -> dict[str, Any]:
    """The suite's mixed-precision workload: its GPT in bfloat16, AdamW stepping fp32
    master weights (copied back into the model after each step)."""
    import torch
    model = _suite_gpt().to(torch.bfloat16)
    master = torch.nn.ParameterList([torch.nn.Parameter(p.detach().float().clone())
                                     for p in model.parameters()])
    return {"model": model, "master": master,
            "optimizer": torch.optim.AdamW(master.parameters(), lr=3e-4)}


def _sparse() -> dict[str, Any]:
    """The suite's sparse-embedding workload: DLRM, row-wise Adagrad and Adam."""
    import torch

    from benchmarks.models import DLRM, RowWiseAdagrad
    from benchmarks.workloads import FULL
    torch.manual_seed(5)
    model = DLRM(FULL.tables, FULL.rows, FULL.dim)
    return {"model": model,
            "sparse_opt": RowWiseAdagrad(model.embeddings.parameters(), lr=0.05),
            "dense_opt": torch.optim.Adam([*model.bottom.parameters(),
                                           *model.top.parameters()], lr=1e-3)}


BUILD: dict[str, Callable[[], dict[str, Any]]] = {
    "mlp": _mlp(0), "mlp-frozen": _mlp(8), "gpt": _gpt, "lora": _lora,
    "mixed-precision": _mixed, "sparse-embedding": _sparse}
#: The language models of BUILD (trained on random tokens).
_LMS = ("gpt", "lora", "mixed-precision")


def _train_step(workload: str, objects: dict[str, Any], step: int) -> None:
    import torch
    model = objects["model"]
    gen = torch.Generator().manual_seed(step)
    optimizers = [obj for obj in objects.values() if isinstance(obj, torch.optim.Optimizer)]
    model.zero_grad(set_to_none=True)
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    if workload.startswith("mlp"):
        loss = model(torch.randn(64, 1024, generator=gen)).square().mean()
    elif workload in _LMS:
        from benchmarks.models import lm_loss
        from benchmarks.workloads import FULL
        loss = lm_loss(model, torch.randint(0, FULL.vocab, (FULL.batch, FULL.seq + 1),
                                            generator=gen))
    else:
        from benchmarks.workloads import FULL
        ids = torch.randint(0, FULL.rows, (FULL.tables, FULL.sparse_batch, FULL.pooling),
                            generator=gen)
        loss = model(torch.randn(FULL.sparse_batch, 13, generator=gen), ids).square().mean()
    loss.backward()
    master = objects.get("master")
    if master is not None:  # mixed precision: the step is the fp32 copy's
        for weight, param in zip(master, model.parameters(), strict=True):
            weight.grad = None if param.grad is None else param.grad.float()
    for optimizer in optimizers:
        optimizer.step()
    if master is not None:
        with torch.no_grad():
            for weight, param in zip(master, model.parameters(), strict=True):
                param.copy_(weight)
        # The step took the model's gradients (into the master weights'): left on the
        # model, the Checkpointer saw a save between backward() and step() and warned.
        model.zero_grad(set_to_none=True)


def prepare(workload: str, work: Path) -> dict[str, Any]:
    """Train, save VERSIONS versions to the store and the newest with torch.save."""
    import torch

    import torch_bridge
    objects = BUILD[workload]()
    store = work / f"{workload}.store"
    with torch_bridge.Checkpointer(store, run="job") as ckpt:
        for step in range(1, VERSIONS + 1):
            _train_step(workload, objects, step)
            ckpt.save(step, **objects)
    state = {key: obj.state_dict() for key, obj in objects.items()}
    path = work / f"{workload}.pt"
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return {"torch_bytes": path.stat().st_size,
            "tensor_bytes": sum(t.nbytes for t in _tensors(state))}


def chains(store: Path) -> dict[str, int]:
    """The delta chains a restore of the store's newest version reads, from its
    manifest: the chunks of its tensors, how many of them are deltas (list a chain)
    and the links of all their chains."""
    import chunkstore
    from chunkstore.format.manifest import TensorEntry
    chunks = deltas = links = 0
    with chunkstore.open(store) as opened, opened.open_version("latest") as version:
        for entry in version.entries().values():
            if not isinstance(entry, TensorEntry):
                continue
            for shard in entry.shards:
                for i in range(len(shard.chunks)):
                    chunks += 1
                    deltas += bool(shard.chain(i))
                    links += len(shard.chain(i))
    return {"chunks": chunks, "delta_chunks": deltas, "links": links}


def target(chained: dict[str, int], ratio: float) -> dict[str, Any]:
    """The target that applies to a workload whose newest version reads ``chained``,
    and whether ``ratio`` (the restore's time over torch.load's) meets it."""
    has_chains = chained["links"] > 0
    limit = TARGET_WITH_CHAINS if has_chains else TARGET_WITHOUT_CHAINS
    return {"has_chains": has_chains, "at_most": limit, "ratio": ratio,
            "met": ratio <= limit}


def _tensors(tree: Any) -> list[Any]:
    import torch
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


class _Phases:
    """Seconds spent inside wrapped functions, summed over threads."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        #: when a wrapped phase first started (perf_counter)
        self.first: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def wrap(self, owner: Any, attribute: str, phase: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self.first.setdefault(phase, start)
            try:
                return original(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - start)
        setattr(owner, attribute, timed)


def _instrument(phases: _Phases) -> None:
    """Wrap the functions each phase runs (see the module docstring)."""
    import chunkstore
    import chunkstore.store as store_module
    from chunkstore.format.digest import Digest
    from chunkstore.objects.objectstore import ObjectStore
    from chunkstore.read import reader
    phases.wrap(chunkstore, "open", "open_total")
    phases.wrap(store_module.Store, "reconcile", "index_sync")
    phases.wrap(store_module, "sync_journal", "index_sync")
    phases.wrap(reader.VersionReader, "get_many_into", "read_wall")
    phases.wrap(ObjectStore, "get_range", "read")
    phases.wrap(ObjectStore, "read_into", "read")
    if hasattr(ObjectStore, "view_range"):  # mapped reads (not in a baseline made before)
        phases.wrap(ObjectStore, "view_range", "read")
    original_of = Digest.of.__func__  # type: ignore[attr-defined]

    def hashed(cls: type[Digest], data: Any) -> Digest:
        start = time.perf_counter()
        try:
            return original_of(cls, data)  # type: ignore[no-any-return]
        finally:
            phases.add("hash", time.perf_counter() - start)
    Digest.of = classmethod(hashed)  # type: ignore[method-assign,assignment]
    if hasattr(Digest, "is_hash_of"):  # what a read checks each chunk with (not in a baseline
        phases.wrap(Digest, "is_hash_of", "hash")  # made before it: there Digest.of is)
    original_jobs = reader.run_jobs

    def jobs_timed(executor: Any, jobs: list[Callable[[], None]], at_once: int) -> None:
        def timed(job: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                start = time.perf_counter()
                try:
                    job()
                finally:
                    phases.add("jobs", time.perf_counter() - start)
            return run
        original_jobs(executor, [timed(job) for job in jobs], at_once)
    reader.run_jobs = jobs_timed  # type: ignore[assignment]


def child(system: str, workload: str, work: Path, phased: bool) -> dict[str, Any]:
    """One restore in this (fresh) process; its times."""
    import torch
    start = time.perf_counter()
    import chunkstore
    import torch_bridge
    torch_bridge.Checkpointer  # noqa: B018  (imported on first use: chunkstore and the bridge)
    import_s = time.perf_counter() - start
    objects = BUILD[workload]()
    if system == "torch":
        cpu = time.process_time()
        start = time.perf_counter()
        state = torch.load(work / f"{workload}.pt", weights_only=True)
        loaded = time.perf_counter()
        for key, obj in objects.items():
            obj.load_state_dict(state[key])
        end = time.perf_counter()
        return {"restore_s": end - start, "cpu_s": time.process_time() - cpu,
                "load": loaded - start, "apply": end - loaded, "import_s": import_s}
    phases = _Phases()
    if phased:
        _instrument(phases)
    cpu = time.process_time()
    start = time.perf_counter()
    with torch_bridge.Checkpointer(work / f"{workload}.store", run="job") as ckpt:
        opened = time.perf_counter()
        step = ckpt.restore(**objects)
        end = time.perf_counter()
        cpu_s = time.process_time() - cpu
    assert step == VERSIONS, step
    times: dict[str, Any] = {"restore_s": end - start, "cpu_s": cpu_s, "import_s": import_s,
                             "code": str(Path(chunkstore.__file__).parent.parent)}
    if phased:
        s = phases.seconds
        read_wall = s.get("read_wall", 0.0)
        times.update({
            "open": s["open_total"] - s.get("index_sync", 0.0),
            "index_sync": s.get("index_sync", 0.0),
            # Checkpointer's own set-up, then restore() up to the first chunk read
            "pick": (opened - start - s["open_total"]) + (phases.first["read_wall"] - opened),
            "read_wall": read_wall, "read": s.get("read", 0.0), "hash": s.get("hash", 0.0),
            "decode": s.get("jobs", 0.0) - s.get("read", 0.0) - s.get("hash", 0.0),
            "apply": end - phases.first["read_wall"] - read_wall,
        })
    return times


#: Where the code each system's process imports lies (``--baseline`` adds one).
CODE = {system: ROOT for system in SYSTEMS}


def _run_child(system: str, workload: str, work: Path, phased: bool) -> dict[str, Any]:
    # Run as a file, not with -m: the working directory is then not first on the path,
    # and a baseline's chunkstore and torch_bridge come before this tree's.
    command = [sys.executable, str(Path(__file__).resolve()), "--child",
               system.removesuffix("-baseline"), workload, str(work)]
    command += ["--phased"] if phased else []
    # Byte code cached as an installed package has it (this environment may set
    # PYTHONDONTWRITEBYTECODE): the first process of a run compiles, untimed.
    env = {key: value for key, value in os.environ.items()
           if key != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONWARNINGS="ignore", PYTHONPATH=f"{CODE[system]}{os.pathsep}{ROOT}",
               PYTHONPYCACHEPREFIX=str(work / "pycache" / system))
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def summary(values: list[float]) -> dict[str, float]:
    """Median and range of repeated timings (bench_restore reports them the same way)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare(workload: str, work: Path, runs: int) -> dict[str, Any]:
    described = prepare(workload, work)
    described["chains"] = chains(work / f"{workload}.store")
    for system in SYSTEMS:  # warm-up: byte code compiled, files in the page cache
        _run_child(system, workload, work, phased=False)
    times: dict[str, list[dict[str, Any]]] = {system: [] for system in CODE}
    systems = list(CODE)
    for turn in range(runs):
        first = turn % len(systems)
        for system in systems[first:] + systems[:first]:
            times[system].append(_run_child(system, workload, work, phased=False))
    phased: dict[str, list[dict[str, Any]]] = {system: [] for system in CODE if system != "torch"}
    for _ in range(max(3, runs // 2)):
        for system, runs_of in phased.items():
            runs_of.append(_run_child(system, workload, work, phased=True))
    result: dict[str, Any] = {**described}
    for system in CODE:
        keys = [k for k in times[system][0] if isinstance(times[system][0][k], float)]
        result[system] = {k: summary([t[k] for t in times[system]]) for k in keys}
    for system, runs_of in phased.items():
        result[system]["phases"] = {k: summary([t[k] for t in runs_of]) for k in runs_of[0]
                                    if k not in ("restore_s", "cpu_s", "import_s")
                                    and isinstance(runs_of[0][k], float)}
        result[system]["phased_restore_s"] = summary([t["restore_s"] for t in runs_of])
    for system in phased:
        pairs = list(zip(times[system], times["torch"], strict=True))
        result[f"{system}_vs_torch"] = {
            "of_medians": (result[system]["restore_s"]["median"]
                           / result["torch"]["restore_s"]["median"]),
            "per_round": summary([c["restore_s"] / t["restore_s"] for c, t in pairs]),
            # CPU seconds of the process (every thread), less moved by a shared machine
            "cpu_of_medians": (result[system]["cpu_s"]["median"]
                               / result["torch"]["cpu_s"]["median"]),
            # the import of chunkstore and torch_bridge counted in (both import torch)
            "with_import_per_round": summary([(c["restore_s"] + c["import_s"])
                                               / t["restore_s"] for c, t in pairs])}
    result["target"] = target(described["chains"],
                              result["chunkstore_vs_torch"]["of_medians"])
    return result


def _verdict(met: dict[str, Any]) -> str:
    chains = "chains" if met["has_chains"] else "no chains"
    return (f"{met['ratio']:.2f}x torch.load ({chains}: at most {met['at_most']:.1f}x,"
            f" {'met' if met['met'] else 'missed'})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/resume.json")
    parser.add_argument("--child", nargs=3, metavar=("SYSTEM", "WORKLOAD", "DIR"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--phased", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="a directory holding another release's chunkstore/ and"
                        " torch_bridge/ (e.g. from git archive), timed as"
                        " chunkstore-baseline in the same rounds")
    args = parser.parse_args(argv)
    if args.child:
        system, workload, work = args.child
        print(json.dumps(child(system, workload, Path(work), args.phased)))
        return
    if args.baseline:
        CODE["chunkstore-baseline"] = Path(args.baseline).resolve()
    work = Path(tempfile.mkdtemp(prefix="cs-resume-"))
    try:
        results: dict[str, Any] = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform()},
            "runs": args.runs, "versions": VERSIONS,
            "command": "python -m benchmarks.bench_resume " + " ".join(argv or sys.argv[1:]),
        }
        for workload in args.workloads.split(","):
            started = time.perf_counter()
            results[workload] = compare(workload, work, args.runs)
            print(f"{workload}: {_verdict(results[workload]['target'])}"
                  f" ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
        results["targets"] = {workload: results[workload]["target"]
                              for workload in args.workloads.split(",")}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(results, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
