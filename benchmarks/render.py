"""Turn the suite's results files into ``latest.md`` and PNG plots.

Reads ``latest.json`` (records), ``run.json`` (run description) and, when
present, ``restore_floors.json``, ``core.json``, ``pause.json`` and
``memory_table.json`` from the same folder.  Usage::

    python -m benchmarks.render benchmarks/results
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.summarize import core_table, memory_table, pause_table, restore_floor_table

MB = 1e6


def _load(folder: Path, name: str) -> Any:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def _by_workload(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        grouped.setdefault(record["workload"], []).append(record)
    return grouped


def added_per_version(record: dict[str, Any]) -> float:
    """Median bytes a save after the first added to the system's storage."""
    stored = record["cumulative_bytes"]
    steps = [b - a for a, b in itertools.pairwise(stored)]
    return statistics.median(steps) if steps else float(stored[0])


def mean_added_per_version(record: dict[str, Any]) -> float:
    """Mean bytes a save after the first added: (bytes after N - after the first) / (N - 1),
    what a user pays (the median falls on a delta save; a full copy every few saves is
    in the mean)."""
    stored = record["cumulative_bytes"]
    return (stored[-1] - stored[0]) / (len(stored) - 1) if len(stored) > 1 \
        else float(stored[0])


def workload_table(workloads: dict[str, Any]) -> list[str]:
    lines = ["| workload | trained | params (trainable) | state per version | versions"
             " (runs x N, every k steps) | ideal tensor-dedup amplification |",
             "|---|---|---|---|---|---|"]
    for name, meta in workloads.items():
        trained = meta.get("trained", meta["optimizer"])
        if "rows_touched_per_save_median" in meta:
            trained += (f"; {meta['rows_touched_per_save_median']:.1%} of embedding rows"
                        " touched between saves (Zipf)")
        lines.append(
            f"| {name} | {trained} | {meta['params'] / 1e6:.2f}M"
            f" ({meta['trainable_fraction']:.1%}) | {meta['logical_bytes'] / MB:.1f} MB"
            f" | {meta['versions']} ({meta['runs']} x {meta['versions'] // meta['runs']},"
            f" k={meta['save_every']}) | {meta['ideal_tensor_dedup_amplification']:.2f} |")
    return lines


def pivot(records: list[dict[str, Any]], cell: Callable[[dict[str, Any]], str],
          extra: tuple[str, Callable[[str], str]] | None = None) -> list[str]:
    """Workloads down, systems across; ``extra`` adds a last column per workload."""
    systems = list(dict.fromkeys(r["system"] for r in records))
    header = ["workload", "versions", *systems] + ([extra[0]] if extra else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, group in _by_workload(records).items():
        cells = {r["system"]: cell(r) for r in group}
        row = [name, str(group[0]["versions"]), *(cells.get(s, "-") for s in systems)]
        lines.append("| " + " | ".join(row + ([extra[1](name)] if extra else [])) + " |")
    return lines


def amplification_table(records: list[dict[str, Any]], workloads: dict[str, Any]) -> list[str]:
    def ideal(name: str) -> str:
        value = workloads.get(name, {}).get("ideal_tensor_dedup_amplification")
        return "-" if value is None else f"{value:.2f}"

    return pivot(records, lambda r: f"{r['amplification']:.2f}",
                 ("ideal (tensor dedup)", ideal))


def incremental_table(records: list[dict[str, Any]], workloads: dict[str, Any]) -> list[str]:
    """Bytes an incremental save adds, over what torch.save adds (and, where the workload
    counts them, over the bytes of the rows touched since the previous save)."""
    baseline = {r["workload"]: added_per_version(r) for r in records
                if r["system"] == "torch.save"}
    mean_baseline = {r["workload"]: mean_added_per_version(r) for r in records
                     if r["system"] == "torch.save"}

    def cell(r: dict[str, Any]) -> str:
        added, mean = added_per_version(r), mean_added_per_version(r)
        name = r["workload"]
        text = (f"{added / baseline[name]:.3f} / {mean / mean_baseline[name]:.3f}"
                if name in baseline else "-")
        touched = workloads.get(name, {}).get("touched_row_bytes_per_save_median")
        return text + (f" ({added / touched:.2f}x / {mean / touched:.2f}x touched)"
                       if touched else "")

    def touched_cell(name: str) -> str:
        touched = workloads.get(name, {}).get("touched_row_bytes_per_save_median")
        return "-" if not touched else f"{touched / MB:.1f} MB"

    return pivot(records, cell, ("touched rows' bytes per save", touched_cell))


def _pause_cell(r: dict[str, Any]) -> str:
    text = f"{r['pause_s'] * 1e3:.0f} ms"
    return text + (f" ({r['pause_s'] / r['memcpy_s']:.1f}x memcpy)" if r["pause_kind"] == "async"
                   else " (sync)")


def objects_per_save(record: dict[str, Any]) -> tuple[int, float] | None:
    """Objects (files) the first save wrote, and the median a later save added."""
    counts = record.get("cumulative_objects")
    if not counts:
        return None
    added = [b - a for a, b in itertools.pairwise(counts)]
    return counts[0], statistics.median(added) if added else 0.0


def _objects_cell(r: dict[str, Any]) -> str:
    counts = objects_per_save(r)
    return "-" if counts is None else f"{counts[0]} / {counts[1]:.0f}"


def detail_table(records: list[dict[str, Any]]) -> list[str]:
    lines = ["| workload | system | stored after N | added per save | save (first / then)"
             " | pause | restore latest / oldest | peak RSS (state loaded; base copies)"
             " | verified |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        copies = r.get("base_copies_bytes")
        held = "" if copies is None else f"; {copies / MB:.0f} MB"
        rss = (f"{r['peak_rss_bytes'] / MB:.0f} MB ({r['baseline_rss_bytes'] / MB:.0f} MB{held})"
               if r.get("rss_isolated", True) else "shared process")
        pause = _pause_cell(r)
        lines.append(
            f"| {r['workload']} | {r['system']} | {r['physical_bytes'] / MB:.1f} MB"
            f" | {added_per_version(r) / MB:.2f} MB"
            f" | {r['first_save_s'] * 1e3:.0f} / {r['save_s'] * 1e3:.0f} ms | {pause}"
            f" | {r['restore_s'] * 1e3:.0f} / {r['restore_oldest_s'] * 1e3:.0f} ms | {rss}"
            f" | {'yes' if r['restore_verified'] else 'NO'} |")
    return lines


#: Issue 50's target for an encrypted store against the same policy unencrypted: save and
#: restore times at most this ratio, stored bytes within 1%.
ENCRYPTION_TIME_TARGET = 1.15
ENCRYPTION_BYTES_TARGET = 1.01


def encryption_table(records: list[dict[str, Any]], encrypted: str = "chunkstore-auto-enc",
                     plain: str = "chunkstore-auto") -> list[str]:
    """``encrypted`` over ``plain`` per workload: first save, save (median after the
    first), restore and stored bytes, each marked where it misses the target; empty
    where the run measured either system on no workload."""
    pairs = [(name, {r["system"]: r for r in group}) for name, group
             in _by_workload(records).items()]
    pairs = [(name, (found[encrypted], found[plain])) for name, found in pairs
             if encrypted in found and plain in found]
    if not pairs:
        return []
    lines = ["| workload | first save | save | restore | stored bytes |", "|---|---|---|---|---|"]
    for name, (enc, base) in pairs:
        cells = []
        for key, target in (("first_save_s", ENCRYPTION_TIME_TARGET),
                            ("save_s", ENCRYPTION_TIME_TARGET),
                            ("restore_s", ENCRYPTION_TIME_TARGET),
                            ("physical_bytes", ENCRYPTION_BYTES_TARGET)):
            ratio = enc[key] / base[key]
            cells.append(f"{ratio:.{4 if key == 'physical_bytes' else 2}f}x"
                         + (" (over)" if ratio > target else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _floors_section(floors: dict[str, Any] | None) -> list[str]:
    """Chunkstore's restores against the checked read and the copy+hash floor (issue 49),
    where the run measured them."""
    if floors is None or not floors["references"]:
        return []
    return ["## Restore against its floors", "", *restore_floor_table(floors), ""]


def markdown(folder: Path) -> str:
    records, run = _load(folder, "latest.json"), _load(folder, "run.json")
    m = run["machine"]
    lines = [
        "# Benchmark results", "",
        f"Made by `{run['command']}` ({run['mode']} mode) on {run['date']}, in"
        f" {run['runtime_s'] / 60:.1f} min: {m['cpus']} CPUs, {m['platform']}, Python"
        f" {m['python']}, torch {m['torch']}. Timings are medians (saves: over the saves after"
        f" the first; restores: over {run['repeat']} runs); every save is durable (fsync)"
        " before it returns; restores read from the page cache and are checked bit for bit.",
        "", "## Workloads", "", *workload_table(run["workloads"]), "",
        "## Storage amplification after N versions", "",
        "Physical bytes of all N versions / logical bytes of one version (torch.save's is N"
        " by construction). *ideal* is what deduplicating whole tensors would reach.", "",
        *amplification_table(records, run["workloads"]), "",
        "![cumulative stored bytes](stored_bytes.png)", "",
        "## Storage per incremental version", "",
        "Bytes a save after the first adds, over what torch.save adds (a full copy), as"
        " *median / mean*: the median falls on a delta save, the mean ((bytes after N -"
        " after the first) / (N - 1)) is what a user pays, full copies included; for the"
        " sparse-embedding workload also over the bytes of the embedding rows touched since"
        " the previous save (their weights and Adagrad accumulators).", "",
        *incremental_table(records, run["workloads"]), "",
        "## Training pause per save", "",
        "How long the training loop stops per save: `Checkpointer(async_save=True)` for"
        " chunkstore, `async_save` for DCP (median after the first, which also allocates"
        " the staging buffers), the sync save for torch.save and safetensors. memcpy: a"
        " plain copy of the whole state into reused buffers, timed right after each async"
        " save in its turn (median after the first).",
        "", *pivot(records, _pause_cell), "",
        "## Objects written per save", "",
        "Files (objects, on an object store: PUT requests) the first save wrote / the"
        " median a later save added.", "",
        *pivot(records, _objects_cell), "",
        "## Sync save and restore time", "",
        "Median sync save after the first / restore of the latest version (into the"
        " training state's tensors, hash- or bit-checked).", "",
        *pivot(records, lambda r: f"{r['save_s'] * 1e3:.0f} / {r['restore_s'] * 1e3:.0f} ms"),
        "",
        *_floors_section(_load(folder, "restore_floors.json")),
        "## Per workload and system", "",
        "Peak RSS of the process that made the sync saves, with what it held once the"
        " state was loaded (the rest is what saving added) and, for chunkstore, what the"
        " store handle's base copies held after the last save (copies of the chunks it"
        " wrote, kept as the next save's delta bases: `Store.base_copies.budget`, 1 GiB by"
        " default; part of the peak).", "",
        *detail_table(records), "",
    ]
    encryption = encryption_table(records)
    if encryption:
        lines += ["## What encryption costs", "",
                  "chunkstore-auto-enc (the default policy in an encrypted store: every object"
                  " sealed with AES-256-GCM in 64 KiB segments, chunk ids keyed) over"
                  " chunkstore-auto, per workload: times of the first save, the median save"
                  " after it and the restore of the latest version, and the bytes stored"
                  f" after N versions; *(over)*: past the target ({ENCRYPTION_TIME_TARGET}x"
                  f" for times, {ENCRYPTION_BYTES_TARGET}x for bytes).", "",
                  *encryption, ""]
    core, pause = _load(folder, "core.json"), _load(folder, "pause.json")
    if core is not None:
        lines += ["## Throughput against the machine's limits (bench_core)", "",
                  *core_table(core), "", "![throughput](throughput.png)", ""]
    if pause is not None:
        lines += ["## Async pause (bench_pause)", "", *pause_table(pause), ""]
    side = _load(folder, "memory_table.json")
    if side is not None:
        lines += ["## Peak memory side by side (bench_memory_table)", "",
                  *memory_table(side), ""]
    return "\n".join(lines)


def write_all(folder: Path) -> None:
    from benchmarks import plots

    (folder / "latest.md").write_text(markdown(folder))
    records = _load(folder, "latest.json")
    plots.stored_bytes(records, _load(folder, "run.json")["workloads"],
                       folder / "stored_bytes.png")
    plots.throughput(records, _load(folder, "core.json"), folder / "throughput.png")


if __name__ == "__main__":
    write_all(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"))
