"""Compare two suite runs (``python -m benchmarks.suite --out-dir DIR``) figure by figure.

    python -m benchmarks.compare_runs BEFORE_DIR AFTER_DIR [--out FILE.md]

Reads each run's ``latest.md`` tables (sync save / restore per workload and system)
and its ``core.json`` and ``pause.json``, and writes one table of after / before
ratios: what a change that should not move performance is checked with.  Both runs
should come from one machine in one sitting (this machine varies 10-20% run to run).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

TIMES = "## Sync save and restore time"


def _save_restore(run: Path) -> dict[tuple[str, str], tuple[float, float]]:
    """(workload, system) -> (median sync save ms, restore ms) from latest.md."""
    text = (run / "latest.md").read_text()
    table = text[text.index(TIMES):].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    systems = [c.strip() for c in rows[0].strip("|").split("|")][2:]
    found = {}
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for system, cell in zip(systems, cells[2:], strict=True):
            match = re.fullmatch(r"([\d.]+) / ([\d.]+) ms", cell)
            if match:
                found[(cells[0], system)] = (float(match[1]), float(match[2]))
    return found


def _core(run: Path) -> dict[str, float]:
    core = json.loads((run / "core.json").read_text())
    pause = json.loads((run / "pause.json").read_text())
    figures = {"torch.save 1 GiB (s)": core["torch"]["save_s"],
               "torch.load 1 GiB (s)": core["torch"]["load_s"],
               "async pause (s)": pause["async_pause_s"],
               "memcpy of the paused state (s)": pause["memcpy_s"]}
    for system in ("chunkstore-none", "chunkstore-auto"):
        for key in ("first_save_s", "resave_s", "restore_s"):
            figures[f"{system} 1 GiB {key[:-2].replace('_', ' ')} (s)"] = core[system][key]
    return figures


def compare(before: Path, after: Path) -> str:
    lines = [f"# {after.name} against {before.name}", "",
             "After / before, per figure (1.00: unchanged; this machine moves 10-20% run to"
             " run).", "", "## Sync save and restore, median ms", "",
             "| workload | system | save before | save after | ratio | restore before |"
             " restore after | ratio |", "|---|---|---|---|---|---|---|---|"]
    old, new = _save_restore(before), _save_restore(after)
    for key in old:
        if key in new and key[1].startswith("chunkstore"):
            (s0, r0), (s1, r1) = old[key], new[key]
            lines.append(f"| {key[0]} | {key[1]} | {s0:.0f} | {s1:.0f} | {s1 / s0:.2f} |"
                         f" {r0:.0f} | {r1:.0f} | {r1 / r0:.2f} |")
    lines += ["", "## 1 GiB throughput and async pause", "",
              "| figure | before | after | ratio |", "|---|---|---|---|"]
    c0, c1 = _core(before), _core(after)
    for name, value in c0.items():
        lines.append(f"| {name} | {value:.3f} | {c1[name]:.3f} | {c1[name] / value:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = compare(args.before, args.after)
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
