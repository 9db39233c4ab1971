"""Print the performance tables of docs/performance.md from the results files (markdown).

Usage::

    python benchmarks/summarize.py                  # print, from benchmarks/results/
    python benchmarks/summarize.py --update-readme  # rewrite docs/performance.md's tables
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def core_table(core: dict[str, Any]) -> list[str]:
    lim, t = core["limits"], core["torch"]
    gib = core["logical_bytes"] / (1 << 30)
    lines = [
        f"State: {gib:.2f} GiB of float32. Machine limits measured in the same run: memcpy"
        f" {lim['memcpy_gbps']:.1f} GB/s, BLAKE3 {lim['blake3_1thread_gbps']:.1f} GB/s per"
        f" thread, write+fsync {lim['write_fsync_gbps']:.2f} GB/s"
        + (f", AES-256-GCM in 64 KiB segments {lim['aes_gcm_seal_1thread_gbps']:.1f} GB/s"
           f" sealing, {lim['aes_gcm_open_1thread_gbps']:.1f} GB/s opening per thread"
           if "aes_gcm_seal_1thread_gbps" in lim else "") + ".",
        "",
        "| | first save | unchanged re-save | restore (hash-checked) | stored bytes |",
        "|---|---|---|---|---|",
        f"| torch.save / torch.load | {t['save_gbps']:.2f} GB/s | {t['save_gbps']:.2f} GB/s |"
        f" {t['load_gbps']:.2f} GB/s | {core['logical_bytes'] / 1e9:.2f} GB per version |",
    ]
    st = core.get("safetensors")
    if st is not None:
        lines.append(f"| safetensors save_file / load_file | {st['save_gbps']:.2f} GB/s |"
                     f" {st['save_gbps']:.2f} GB/s | {st['load_gbps']:.2f} GB/s (not checked) |"
                     f" {core['logical_bytes'] / 1e9:.2f} GB per version |")
    for key, label in (("chunkstore-none", "chunkstore, no compression"),
                       ("chunkstore-auto", "chunkstore, compression auto"),
                       ("chunkstore-auto-enc", "chunkstore, compression auto, encrypted")):
        r = core.get(key)
        if r is None:  # a run before encrypted stores were measured
            continue
        versus = f"{r['restore_vs_torch_load']:.2f}x"
        if "restore_time_vs_safetensors" in r:
            versus += f"; {r['restore_time_vs_safetensors']:.2f}x safetensors' time"
        lines.append(
            f"| {label} | {r['first_save_gbps']:.2f} GB/s ({r['first_save_vs_torch_save']:.2f}x)"
            f" | {r['resave_gbps']:.2f} GB/s ({r['resave_vs_torch_save']:.1f}x)"
            f" | {r['restore_gbps']:.2f} GB/s ({versus})"
            f" | {r['physical_bytes'] / 1e9:.2f} GB, then ~0 per unchanged version |")
    return lines


def pause_table(pause: dict[str, Any]) -> list[str]:
    mib = pause["state_bytes"] / (1 << 20)
    return [
        f"Async save of {mib:.0f} MiB of model and Adam state (`torch_bridge.Checkpointer`):",
        "",
        "| memcpy of the state | async pause | sync save |",
        "|---|---|---|",
        f"| {pause['memcpy_s'] * 1e3:.1f} ms | {pause['async_pause_s'] * 1e3:.1f} ms"
        f" ({pause['async_pause_over_memcpy']:.2f}x memcpy) | {pause['sync_save_s'] * 1e3:.0f} ms"
        f" ({pause['sync_save_over_memcpy']:.0f}x memcpy) |",
    ]


def gc_table(gc: dict[str, Any]) -> list[str]:
    lines = [
        f"GC on a store of {gc['chunks']:,} chunks after {gc['garbage_fraction']:.0%} became"
        f" garbage: {gc['gc_s']:.2f} s ({gc['chunks_deleted']:,} chunks deleted; the dry run"
        f" {gc['gc_dry_run_s']:.2f} s). A run with nothing to delete takes"
        f" {gc['gc_idle_no_sweep_s'] * 1e3:.0f} ms without the orphan sweep and"
        f" {gc['gc_idle_s']:.2f} s with it (the sweep lists every object; this first run of"
        " a fresh index also marks every version to look for packs to repack).",
    ]
    repack = gc.get("repack")
    if repack:
        lines += ["", (
            f"Repacking ({repack['versions']} versions of 256 small tensors, all but"
            f" {repack['versions_kept']} unpublished): the GC took {repack['gc_s']:.2f} s,"
            f" repacked {repack['packs_repacked']} of {repack['live_packs_before']} live packs"
            f" ({repack['repack_bytes_copied'] / 2**20:.1f} MiB of live members copied), and"
            f" the store went from {repack['store_bytes_before'] / 2**20:.1f} to"
            f" {repack['store_bytes_after'] / 2**20:.1f} MiB (to"
            f" {repack['store_bytes_after_gc_without_repacking'] / 2**20:.1f} MiB with"
            " `--no-repack`); every kept version read back exact.")]
    return lines


def protocol_table(after: dict[str, Any]) -> list[str]:
    """The many-indexes protocol's cost, against the code before it where measured."""
    before = _load("protocol-before.json")

    def cells(key: str, pick: Any) -> str:
        old = pick(before) if before is not None else None
        return f"| {'-' if old is None else old} | {pick(after)} |"

    s3 = after["s3"]
    rows = [("S3 requests: first save", lambda d: d["s3"]["requests_per_save"]["first"]["total"]),
            ("S3 requests: unchanged re-save",
             lambda d: d["s3"]["requests_per_save"]["unchanged"]["total"]),
            ("S3 requests: save with one tensor changed",
             lambda d: d["s3"]["requests_per_save"]["partial"]["total"]),
            ("S3 requests: GC that deletes", lambda d: d["s3"]["gc_requests"]["total"]),
            ("S3 requests: GC with nothing to delete",
             lambda d: d["s3"]["gc_idle_requests"]["total"])]
    rows += [(f"local {kind} save, {after['mib']} MiB",
              lambda d, k=kind: f"{d['local']['save_s'][k] * 1e3:.0f} ms")
             for kind in ("first", "unchanged", "partial")]
    lines = [f"What the many-indexes protocol costs (`{after['command']}`, {after['tensors']}"
             f" tensors; S3: {s3['mib']} MiB on a moto server; *before*: the same script on"
             " the code before the protocol):", "", "| | before | after |", "|---|---|---|"]
    lines += [f"| {label} " + cells(label, pick) for label, pick in rows]
    return lines


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f}"


def _pair(mine: float, theirs: float, unit: str, digits: int = 3) -> str:
    """``mine / theirs unit (ratio)``: chunkstore's figure against DCP's."""
    ratio = f" ({mine / theirs:.2f}x)" if theirs else ""
    if unit == "MiB":
        return f"{_mib(mine)} / {_mib(theirs)} MiB{ratio}"
    return f"{mine:.{digits}f} / {theirs:.{digits}f} {unit}{ratio}"


def _per_rank(result: dict[str, Any]) -> str:
    sizes = result.get("per_rank_bytes")
    if not sizes:
        return "-"
    low, high = min(sizes), max(sizes)
    return f"{_mib(low)}" + ("" if _mib(low) == _mib(high) else f"-{_mib(high)}")


def dcp_table(report: dict[str, Any]) -> list[str]:
    """The sharded DCP benchmark: chunkstore against DCP's FileSystemWriter, per world size."""
    by = {(r["world"], r["system"]): r for r in report["results"]}
    worlds = sorted({r["world"] for r in report["results"]})
    head = report.get("head_fraction")
    state = (f"a {report['mib']} MiB frozen base sharded by rows over the ranks"
             + (f", a trained head of {head:.0%} of its size sharded with its Adam moments and"
                " a small replicated vector with its moments" if head is not None else ""))
    loads = report["results"][0].get("load_s_all")  # absent from reports of one load
    load_note = (f" Load: the median of {len(loads)} loads, each until its slowest rank is"
                 " done." if loads else "")
    lines = [
        f"Sharded state through `torch.distributed.checkpoint` (`{report['command']}`): {state};"
        f" {report['versions']} versions (the last with `dcp.async_save`), ranks as gloo"
        f" processes on one {report['machine']['cpus']}-CPU machine. Each cell: chunkstore"
        f" (`ChunkStoreWriter`) / DCP (`FileSystemWriter`).{load_note}",
        "",
        "| world size | stored | stored per rank (MiB) | median save | async pause | load |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for w in worlds:
        mine, theirs = by[w, "chunkstore"], by[w, "dcp-filesystem"]
        lines.append(
            f"| {w} | {_pair(mine['stored_bytes'], theirs['stored_bytes'], 'MiB')}"
            f" | {_per_rank(mine)} / {_per_rank(theirs)}"
            f" | {_pair(mine['save_s_median'], theirs['save_s_median'], 's')}"
            f" | {_pair(mine['async_pause_s'], theirs['async_pause_s'], 's')}"
            f" | {_pair(mine['load_s'], theirs['load_s'], 's')} |")
    targets = report.get("targets")
    if targets:
        ratios = report["chunkstore_over_dcp"]
        verdicts = []
        for key, what in (("stored", "stored bytes"), ("save_time", "median save time"),
                          ("load_time", "median load time")):
            if key not in targets:  # a report from before the load target
                continue
            missed = [w for w in map(str, worlds) if not ratios[w]["meets_target"][key]]
            verdicts.append(f"{what} at most {targets[key]}x DCP's: "
                            + ("met at every world size" if not missed
                               else f"missed at world size {', '.join(missed)}"))
        lines += ["", "Targets: " + "; ".join(verdicts) + "."]
    return lines


def memory_table(doc: dict[str, Any]) -> list[str]:
    """bench_memory_table's figures, a row per system and state size, and every target
    that a chunkstore row misses, with by how much."""
    targets = doc["targets"]
    working = targets["working_bytes"]
    lines = [
        f"Peak resident memory over the process's own before each operation, in MiB, at"
        f" each state size (`{doc['command']}`, {doc['saves']} saves of a state whose every"
        " element changes, each operation in a process of its own; restores and loads of"
        " the last version, checked against the saved state's sums). *sync save*: the"
        " worst save's peak (the base copies chunkstore's handle held; what the save"
        " needed beyond them). *async save*: the peak over all saves, the staging copy"
        " included (staging; base copies; beyond both). *restore*: into the live"
        " state's tensors (peak, share of the state). *load*: into new objects (peak;"
        " beyond the state it returns).",
        "",
        "| system | state | sync save | async save | restore into live tensors"
        " | load into new objects | checked |",
        "|---|---|---|---|---|---|---|",
    ]
    misses: list[str] = []
    for row in doc["rows"]:
        state = row["state_bytes"]
        sync, asynchronous, live, fresh = (row[k] for k in ("sync", "async", "live", "fresh"))
        async_cell = "none (no async save)" if asynchronous is None else (
            f"{_mib(asynchronous['peak_bytes'])} ({_mib(asynchronous['staging_bytes'])};"
            f" {_mib(asynchronous['copies_bytes'])}; {_mib(asynchronous['working_bytes'])})")
        lines.append(
            f"| {row['system']} | {_mib(state)} | {_mib(sync['peak_bytes'])}"
            f" ({_mib(sync['copies_bytes'])}; {_mib(sync['working_bytes'])}) | {async_cell}"
            f" | {_mib(live['extra_bytes'])} ({live['extra_bytes'] / state:.2f})"
            f" | {_mib(fresh['peak_bytes'])} ({_mib(fresh['extra_bytes'])})"
            f" | {'yes' if live['verified'] and fresh['verified'] else 'NO'} |")
        if row["system"].startswith("chunkstore"):
            misses += _memory_misses(row, state * targets["restore_share"], working)
    lines += ["", "Targets for chunkstore: a restore's or load's extra memory at most"
              f" {targets['restore_share']:.3g} of the state; a sync save's beyond its base"
              f" copies under {_mib(working)} MiB; an async save's beyond its staging copy"
              " and base copies under the same. "
              + ("Missed (why: docs/performance.md, *Memory side by side*):" if misses
                 else "All met."), ""]
    return lines + [f"- {miss}" for miss in misses]


def _memory_misses(row: dict[str, Any], restore_bound: float, working: int) -> list[str]:
    name = f"{row['system']} at {_mib(row['state_bytes'])} MiB"
    checks = [("restore into live tensors", row["live"], "extra_bytes", restore_bound),
              ("load into new objects, beyond the state", row["fresh"], "extra_bytes",
               restore_bound),
              ("sync save beyond its base copies", row["sync"], "working_bytes", working)]
    if row["async"] is not None:
        checks.append(("async save beyond staging and base copies", row["async"],
                       "working_bytes", working))
    misses = []
    for what, measured, key, bound in checks:
        got = measured[key]
        if got <= bound:
            continue
        kinds = ("" if "anon_peak_bytes" not in measured else
                 f" (sampled peaks: anonymous {_mib(measured['anon_peak_bytes'])} MiB, file"
                 f" pages mapped from the page cache {_mib(measured['file_peak_bytes'])} MiB)")
        misses.append(f"{name}, {what}: {_mib(got)} MiB against {_mib(bound)} MiB,"
                      f" {_mib(got - bound)} MiB over{kinds}")
    return misses

#: Issue 49's restore targets: a system's restore of the latest version at most this many
#: times a reference's, measured in the same run (``benchmarks.systems.REFERENCES``).
RESTORE_TARGETS = (("chunkstore-auto", "checked-read", 1.0),
                   ("chunkstore-none", "copy-hash-floor", 1.2))


def restore_floors(records: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """The suite's restore references and, per workload, each target's restore times
    (wall and CPU, of the latest version), ratio and verdict (None where the run
    measured either side on no record)."""
    workloads: dict[str, Any] = {}
    for record in records:
        workloads.setdefault(record["workload"], {})[record["system"]] = record
    per_workload = {}
    for name, found in workloads.items():
        rows = {}
        for system, reference, bound in RESTORE_TARGETS:
            mine, theirs = found.get(system), found.get(reference)
            ratio = (None if mine is None or theirs is None
                     else mine["restore_s"] / theirs["restore_s"])
            rows[f"{system}/{reference}"] = {
                "system_s": _figure(mine, "restore_s"),
                "reference_s": _figure(theirs, "restore_s"),
                "system_cpu_s": _figure(mine, "restore_cpu_s"),
                "reference_cpu_s": _figure(theirs, "restore_cpu_s"),
                "ratio": ratio, "at_most": bound,
                "meets_target": None if ratio is None else ratio <= bound}
        per_workload[name] = rows
    return {"command": command,
            "targets": [{"system": system, "reference": reference, "at_most": bound}
                        for system, reference, bound in RESTORE_TARGETS],
            "references": [record for record in records if record.get("reference")],
            "workloads": per_workload}


def _figure(record: dict[str, Any] | None, key: str) -> Any:
    return None if record is None else record.get(key)


def _ms(seconds: float | None, cpu: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f} ms" + ("" if cpu is None else f" (CPU {cpu * 1e3:.0f})")


def restore_floor_table(doc: dict[str, Any]) -> list[str]:
    """The restore targets per workload, each ratio marked where it misses, and a line
    naming every miss with its figure."""
    pairs = [f"{t['system']}/{t['reference']}" for t in doc["targets"]]
    how = {r["system"]: r["how"] for r in doc["references"]}
    intro = [
        "Restore of the latest version into the live tensors (median wall time; in"
        " parentheses the median CPU time of the restoring process, all its threads)"
        " against two references timed in turns with the systems in the same run"
        f" (`{doc['command']}`): "
        + "; ".join(f"*{name}*: {text}" for name, text in how.items()) + ".", ""]
    header = ["workload"]
    for target in doc["targets"]:
        header += [target["system"], target["reference"],
                   f"over {target['reference']} (at most {target['at_most']}x)"]
    lines = [*intro, "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    missed: dict[str, list[str]] = {pair: [] for pair in pairs}
    for name, rows in doc["workloads"].items():
        cells = [name]
        for pair in pairs:
            row = rows[pair]
            ratio = row["ratio"]
            cells += [_ms(row["system_s"], row["system_cpu_s"]),
                      _ms(row["reference_s"], row["reference_cpu_s"]),
                      "-" if ratio is None else f"{ratio:.2f}x"
                      + ("" if row["meets_target"] else " (over)")]
            if row["meets_target"] is False:
                missed[pair].append(f"{name} ({ratio:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    verdicts = []
    for target, pair in zip(doc["targets"], pairs, strict=True):
        measured = [name for name, rows in doc["workloads"].items()
                    if rows[pair]["ratio"] is not None]
        verdict = ("not measured" if not measured else
                   "met on every workload" if not missed[pair] else
                   f"missed on {', '.join(missed[pair])}")
        verdicts.append(f"{target['system']}'s restore at most {target['at_most']}x"
                        f" {target['reference']}'s: {verdict}")
    return [*lines, "", "Targets: " + "; ".join(verdicts) + "."]


def suite_sections(names: tuple[str, ...]) -> list[str]:
    """Sections of the suite's latest.md, by heading, with their tables."""
    path = RESULTS / "latest.md"
    if not path.exists():
        return []
    out: list[str] = []
    keep = False
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            keep = line[3:].strip() in names
            if keep:
                out.append("#" + line)  # one level down inside the README section
            continue
        if keep and not line.startswith("!["):
            out.append(line)
    return out


# The tables moved from the README to docs/performance.md (the README keeps headline figures,
# each one of that page's: tests/test_readme.py checks it); the flag keeps its name.
README = RESULTS.parent.parent / "docs" / "performance.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def render_all() -> str:
    parts = []
    sections = suite_sections(("Storage amplification after N versions",
                               "Storage per incremental version", "Training pause per save",
                               "Objects written per save", "Sync save and restore time"))
    if sections:
        parts.append("\n".join(sections).strip())
    for name, render in (("core.json", core_table), ("pause.json", pause_table),
                         ("gc.json", gc_table), ("protocol.json", protocol_table),
                         ("dcp.json", dcp_table), ("memory_table.json", memory_table),
                         ("restore_floors.json", restore_floor_table)):
        doc = _load(name)
        if doc is not None:
            parts.append("\n".join(render(doc)))
    return "\n\n".join(parts)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description="Print the performance tables from benchmarks/results/*.json,"
        " or write them into docs/performance.md between the results markers.")
    parser.add_argument("--update-readme", action="store_true",
                        help="replace the tables in docs/performance.md instead of printing them")
    args = parser.parse_args()
    text = render_all()
    if not args.update_readme:
        print(text)
        return
    readme = README.read_text()
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    README.write_text(readme[:start] + "\n" + text + "\n" + readme[end:])


if __name__ == "__main__":
    main()
