"""Commands that prove a store restores: ``drill`` (and ``drill-restore``, the
restore process a drill starts, hidden from the help)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import click

import chunkstore
from chunkstore.cli.common import (
    EXIT_INTEGRITY,
    EXIT_PROBLEMS,
    JSON_OPT,
    STORE_ARG,
    echo_lines,
    emit_json,
    format_duration,
    format_size,
    open_store,
    render_table,
    storage_options_environment,
)
from chunkstore.maintenance.drill import MATERIALIZE, READY_LINE, SCENARIOS, DrillResult, drill
from chunkstore.maintenance.drillrestore import restore
from chunkstore.maintenance.report import DrillSummary
from chunkstore.maintenance.retention import parse_duration

_PHASE_NAMES = {"startup": "startup", "discovery": "discovery", "download": "download",
                "validation": "validation", "materialization": "materialization",
                "first_update": "first update"}


def _phase_note(name: str, result: DrillResult) -> str:
    record = result.record
    seconds = record.phases.get("download") or 0.0
    if name == "download":
        rate = record.bytes_downloaded / seconds / 1e9 if seconds else 0.0
        return f"{format_size(record.bytes_downloaded)}, {rate:.2f} GB/s"
    if name == "materialization":
        return f"{result.restore.get('entries', 0)} entries as {record.materialized_as}"
    if name == "first_update":
        return result.then_detail or ""
    return ""


def drill_text(result: DrillResult, store_path: str) -> None:
    record = result.record
    if record.restored:
        click.echo(f"drill of {store_path}: restored {str(record.version)[:12]}"
                   f" ({record.run}@{record.step}) in {record.recovery_seconds:.2f} s")
    else:
        click.echo(f"drill of {store_path}: no version restored ({record.error})")
    for attempt in result.restore.get("attempts", []):
        click.echo(f"  refused {attempt['version'][:12]}: {attempt['error']}:"
                   f" {attempt['message']}")
    for name, label in _PHASE_NAMES.items():
        seconds = record.phases.get(name)
        if seconds is not None:
            note = _phase_note(name, result)
            click.echo(f"  {label:<16} {seconds:8.3f} s  {note}".rstrip())
    for outcome in record.scenarios:
        verdict = "pass" if outcome.ok else "FAIL"
        click.echo(f"scenario {outcome.name}: {verdict} ({outcome.outcome}): {outcome.detail}")
    if result.drill_id is not None:
        click.echo(f"recorded as drills/{result.drill_id}: {'ok' if record.ok else 'FAILED'}")


@click.command("drill")
@STORE_ARG
@click.argument("selector", required=False)
@click.option("--scenario", "scenarios", multiple=True,
              type=click.Choice([*SCENARIOS, "all"]),
              help="Also drill a fault on a scratch copy (repeatable): a chunk deleted, an"
              " object truncated, a commit record of a newer format; all: every one.")
@click.option("--then", "then", metavar="CMD",
              help=f"After the restore, run CMD (a shell line) and time it until it prints"
              f" {READY_LINE} on a line or exits 0. Its environment names the version:"
              " CHUNKSTORE_DRILL_STORE, _VERSION, _RUN, _STEP.")
@click.option("--then-timeout", default="10m", show_default=True, metavar="DURATION",
              help="How long --then's command may take to get ready.")
@click.option("--materialize", type=click.Choice(MATERIALIZE), default="auto",
              show_default=True,
              help="What the restore reads entries into: torch tensors when torch_bridge"
              " is importable (auto), or numpy arrays.")
@click.option("--no-record", is_flag=True, help="Do not store a drill record.")
@JSON_OPT
def drill_command(store_path: str, selector: str | None, scenarios: tuple[str, ...],
                  then: str | None, then_timeout: str, materialize: str, no_record: bool,
                  as_json: bool) -> None:
    """Restore a version in a fresh process and report the recovery time.

    The restore takes the newest version that reads back whole (or
    SELECTOR's, falling back to its run's earlier steps), as a resuming job
    would, and times each phase: startup (the interpreter and imports),
    discovery (open, list versions, pick one, load its manifest), download
    (every object it needs, read into memory; bytes and GB/s), validation
    (every chunk decoded and hash-checked) and materialization (every entry
    read into new arrays or tensors). With --then, the time until the
    command reports its first successful update is added.

    Each --scenario copies the version (and the one before it in its run)
    into a scratch store with `chunkstore sync`, damages the copy, restores
    from it and checks the outcome: the damaged version is refused with
    MissingChunkError, CorruptChunkError or FormatVersionError and the
    restore falls back to the earlier version (or fails with that error when
    there is none). The store itself is never damaged.

    The result is stored in the store (drills/...); `chunkstore report` shows
    each run's last successful drill, its age and its recovery time.

    \b
    Examples:
      chunkstore drill ckpts/
      chunkstore drill ckpts/ exp1@latest --scenario all --json
      chunkstore drill ckpts/ --then 'python train.py --resume --max-steps 1'

    \b
    Exit codes: 0 the restore and every scenario passed; 1 a drill failed;
    2 bad selector, not a store, bad option.
    """
    chosen = tuple(SCENARIOS) if "all" in scenarios else tuple(dict.fromkeys(scenarios))
    with open_store(store_path) as store:
        result = drill(store, selector, scenarios=chosen, then=then,
                       then_timeout=parse_duration(then_timeout), materialize=materialize,
                       opener=chunkstore.open, record=not no_record,
                       child_env=storage_options_environment(store_path))
    if as_json:
        emit_json(result.to_json())
    else:
        drill_text(result, store_path)
    if not result.ok:
        raise SystemExit(EXIT_PROBLEMS)


@click.command("drill-restore", hidden=True)
@STORE_ARG
@click.argument("selector", required=False)
def drill_restore(store_path: str, selector: str | None) -> None:
    """The restore process `chunkstore drill` starts: one JSON line on stdout."""
    started = time.monotonic()
    with open_store(store_path) as store:
        report = restore(store, selector, started=started)
    doc: dict[str, Any] = report.to_json()
    click.echo(json.dumps(doc))
    if not report.ok:
        raise SystemExit(EXIT_INTEGRITY)


def drills_text(drills: Sequence[DrillSummary]) -> None:
    """``report``'s lines on drills: each run's last successful one."""
    if not drills:
        return
    click.echo("")
    click.echo("last successful drill, per run:")
    rows = [[d.run, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.time)),
             format_duration(d.age_s) + " ago", d.version[:12], f"{d.recovery_seconds:.2f} s",
             ", ".join(d.scenarios) or "-"] for d in drills]
    echo_lines(["  " + line for line in render_table(
        ["RUN", "WHEN", "AGE", "VERSION", "RECOVERY", "SCENARIOS"], rows, right=(2, 4))])


COMMANDS = (drill_command, drill_restore)
