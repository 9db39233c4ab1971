"""PNG plots of the suite's results (matplotlib, headless)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: plots are files

import matplotlib.pyplot as plt

MB = 1e6
STYLE = {"torch.save": ("tab:red", "o"), "safetensors": ("tab:orange", "s"),
         "dcp": ("tab:purple", "^"), "chunkstore-none": ("tab:blue", "D"),
         "chunkstore-auto-d0": ("tab:olive", "P"), "chunkstore-auto": ("tab:green", "v")}


def _style(system: str) -> tuple[str, str]:
    return STYLE.get(system, ("tab:gray", "x"))


def stored_bytes(records: list[dict[str, Any]], workloads: dict[str, Any], out: Path) -> None:
    """Cumulative stored bytes against version number, one panel per workload."""
    names = list(dict.fromkeys(r["workload"] for r in records))
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        for r in (r for r in records if r["workload"] == name):
            color, marker = _style(r["system"])
            stored = [b / MB for b in r["cumulative_bytes"]]
            ax.plot(range(1, len(stored) + 1), stored, color=color, marker=marker,
                    markersize=3, label=r["system"])
        ideal = workloads.get(name, {}).get("ideal_cumulative_bytes")
        if ideal:
            ax.plot(range(1, len(ideal) + 1), [b / MB for b in ideal], color="black",
                    linestyle="--", linewidth=1, label="ideal tensor dedup")
        ax.set_title(name)
        ax.set_xlabel("version")
        ax.set_ylabel("stored MB (cumulative)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _limit_lines(ax: Any, core: dict[str, Any] | None) -> None:
    if core is None:
        return
    for key, label, style in (("memcpy_gbps", "memcpy", ":"),
                              ("blake3_1thread_gbps", "BLAKE3 1 thread", "-."),
                              ("write_fsync_gbps", "write+fsync", "--")):
        ax.axhline(core["limits"][key], color="black", linestyle=style, linewidth=1,
                   label=label)


def _workload_bars(ax: Any, records: list[dict[str, Any]], key: str, title: str,
                   core: dict[str, Any] | None) -> None:
    names = list(dict.fromkeys(r["workload"] for r in records))
    systems = list(dict.fromkeys(r["system"] for r in records))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        values = []
        for name in names:
            match = [r for r in records if r["workload"] == name and r["system"] == system]
            values.append(match[0]["logical_bytes"] / match[0][key] / 1e9 if match else 0)
        ax.bar([x + i * width for x in range(len(names))], values, width,
               color=_style(system)[0], label=system)
    _limit_lines(ax, core)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=20,
                  fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s of logical state")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")


def _core_bars(ax: Any, core: dict[str, Any]) -> None:
    t = core["torch"]
    bars = [("torch.save", t["save_gbps"], "tab:red"), ("torch.load", t["load_gbps"], "tab:red")]
    for key, color in (("chunkstore-none", "tab:blue"), ("chunkstore-auto", "tab:green")):
        r = core[key]
        bars += [(f"{key}\nfirst save", r["first_save_gbps"], color),
                 (f"{key}\nre-save", r["resave_gbps"], color),
                 (f"{key}\nrestore", r["restore_gbps"], color)]
    ax.bar(range(len(bars)), [b[1] for b in bars], color=[b[2] for b in bars])
    _limit_lines(ax, core)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=30, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s")
    ax.set_title(f"{core['logical_bytes'] / 1e9:.2f} GB state (bench_core)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")


def throughput(records: list[dict[str, Any]], core: dict[str, Any] | None, out: Path) -> None:
    """Save and restore throughput per workload and system, and bench_core's, vs the limits."""
    panels = 3 if core is not None else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    _workload_bars(axes[0], records, "save_s", "sync save (after the first)", core)
    _workload_bars(axes[1], records, "restore_s", "restore of the latest version", core)
    axes[0].legend(fontsize=7)
    if core is not None:
        _core_bars(axes[2], core)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
