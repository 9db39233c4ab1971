"""Commands that prove a store restores: ``drill`` (and ``drill-restore``, the
restore process a drill starts, hidden from the help)."""

from __future__ import annotations

import json
import time
from typing import Any

import click

import chunkstore
from chunkstore.cli.common import (
    EXIT_INTEGRITY,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    JSON_OPT,
    STORE_ARG,
    CliError,
    echo_lines,
    emit_json,
    format_duration,
    format_size,
    open_store,
    render_table,
    storage_options_environment,
)
from chunkstore.maintenance.drill import (
    MATERIALIZE,
    READY_LINE,
    SCENARIOS,
    DrillResult,
    check_timeout,
    drill,
    repair_command,
)
from chunkstore.maintenance.drillhistory import FailedDrill
from chunkstore.maintenance.drillrestore import restore, trust_environment, trust_from_env
from chunkstore.maintenance.report import StoreStats
from chunkstore.objects.signing import Trust

#: drill's exit status when its target (the newest version, or SELECTOR's) did not
#: restore, whether or not the restore fell back to an earlier version: distinct from
#: 1 (another part of the drill failed) so that a job can tell "the newest checkpoint
#: is damaged" from "the smoke test failed".
EXIT_TARGET_FAILED = 5

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


def _headline(result: DrillResult, store_path: str) -> str:
    record = result.record
    restored = (f"{str(record.version)[:12]} ({record.run}@{record.step}) in"
                f" {record.recovery_seconds:.2f} s")
    if record.target_failed:
        target = f"{record.target_run}@{record.target_step} ({str(record.target)[:12]})"
        fallback = (f"the restore fell back to {restored}" if record.restored
                    else "no earlier version restored either")
        return (f"drill of {store_path}: FAILED: the target {target} did not restore"
                f" ({record.error}); {fallback}")
    if record.restored:
        return f"drill of {store_path}: restored {restored}"
    return f"drill of {store_path}: no version restored ({record.error})"


def drill_text(result: DrillResult, store_path: str) -> None:
    record = result.record
    click.echo(_headline(result, store_path))
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
    if record.target_failed:
        command = repair_command(store_path, record.target_run, record.target_step)
        click.echo(f"repair the target from a copy that holds it whole (a mirror, a sync"
                   f" destination): {command}")


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
@click.option("--require-signed", is_flag=True,
              help="Restore only versions signed by a --trust key, as"
              " `Checkpointer.restore(require_signed=True)` does: others fail as damaged"
              " ones do (docs/format.md §14).")
@click.option("--trust", "trust", multiple=True, metavar="PUBKEY",
              type=click.Path(dir_okay=False, exists=True),
              help="A public key file (KEY.pub from `chunkstore keygen`) whose signatures"
              " --require-signed accepts (only with it); repeatable.")
@JSON_OPT
def drill_command(store_path: str, selector: str | None, scenarios: tuple[str, ...],
                  then: str | None, then_timeout: str, materialize: str, no_record: bool,
                  require_signed: bool, trust: tuple[str, ...], as_json: bool) -> None:
    """Restore a version in a fresh process and report the recovery time.

    The target is the newest version (or SELECTOR's). The restore takes it
    as a resuming job would, falling back to the newest earlier version that
    reads back whole (with SELECTOR, its run's earlier steps), and times
    each phase: startup (the interpreter and imports),
    discovery (open, list versions, pick one, load its manifest), download
    (every object it needs, read into memory; bytes and GB/s), validation
    (every chunk decoded and hash-checked) and materialization (every entry
    read into new arrays or tensors). With --then, the time until the
    command reports its first successful update is added.

    The drill passes only if the target itself restores. When it is refused
    (damaged or missing data) and the restore falls back, the drill fails
    with exit code 5: the record names the target, the error and what the
    fallback restored and how long it took, and the message names the
    command that mends the target from another copy of the store:
    `chunkstore repair STORE --from OTHER RUN@STEP`.

    Each --scenario copies the version (and the one before it in its run)
    into a scratch store with `chunkstore sync`, damages the copy, restores
    from it and checks the outcome: the damaged version is refused with
    MissingChunkError, CorruptChunkError or FormatVersionError and the
    restore falls back to the earlier version (or fails with that error when
    there is none). The store itself is never damaged.

    The result is stored in the store (drills/...); `chunkstore report` shows
    each run's last successful drill, its age and its recovery time, and the
    newest drill that failed since.

    \b
    Examples:
      chunkstore drill ckpts/
      chunkstore drill ckpts/ exp1@latest --scenario all --json
      chunkstore drill ckpts/ --then 'python train.py --resume --max-steps 1'
      chunkstore drill ckpts/ --require-signed --trust release.pub

    \b
    Exit codes: 0 the target restored, and --then and every scenario passed;
    1 --then or a scenario failed, or the restore process gave no result;
    2 bad selector, not a store, bad option; 5 the target did not restore
    (the restore fell back to an earlier version, or restored nothing).
    """
    chosen = tuple(SCENARIOS) if "all" in scenarios else tuple(dict.fromkeys(scenarios))
    ready_within = check_timeout(then_timeout, "--then-timeout")
    child_env = {**storage_options_environment(store_path),
                 **_trust_environment(require_signed, trust)}
    with open_store(store_path) as store:
        result = drill(store, selector, scenarios=chosen, then=then,
                       then_timeout=ready_within, materialize=materialize,
                       opener=chunkstore.open, record=not no_record,
                       child_env=child_env)
    if as_json:
        emit_json(result.to_json())
    else:
        drill_text(result, store_path)
    if result.record.target_failed:
        raise SystemExit(EXIT_TARGET_FAILED)
    if not result.ok:
        raise SystemExit(EXIT_PROBLEMS)


def _trust_environment(require_signed: bool, trust: tuple[str, ...]) -> dict[str, str]:
    """What hands the restore process the keys it requires a signature of."""
    if trust and not require_signed:  # else the keys would be silently ignored
        raise CliError("--trust names the keys --require-signed accepts: add"
                       " --require-signed (or drop --trust); nothing was run", EXIT_USAGE)
    if not require_signed:
        return {}
    if not trust:
        raise CliError("--require-signed needs the keys to trust: --trust KEY.pub",
                       EXIT_USAGE)
    Trust(trust)  # a file that is no public key fails here, not in the child
    return trust_environment(trust)


@click.command("drill-restore", hidden=True)
@STORE_ARG
@click.argument("selector", required=False)
def drill_restore(store_path: str, selector: str | None) -> None:
    """The restore process `chunkstore drill` starts: one JSON line on stdout."""
    started = time.monotonic()
    with open_store(store_path) as store:
        report = restore(store, selector, started=started, trust=trust_from_env())
    doc: dict[str, Any] = report.to_json()
    click.echo(json.dumps(doc))
    if not report.ok:
        raise SystemExit(EXIT_INTEGRITY)


def _failed_row(d: FailedDrill) -> list[str]:
    target = f"{d.run}@{d.target_step}" if d.target_step is not None else "-"
    instead = (f"{d.restored_run}@{d.restored_step} in {d.recovery_seconds:.2f} s"
               if d.restored is not None and d.target_failed else "-")
    return [d.run, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.time)),
            format_duration(d.age_s) + " ago", str(d.failures), target, d.reason, instead]


def drill_warnings_text(stats: StoreStats) -> None:
    """A warning on stderr for each drill record ``report`` skipped."""
    for warning in stats.drill_warnings:
        click.echo(f"warning: {warning}", err=True)


def drills_text(stats: StoreStats) -> None:
    """``report``'s lines on drills: each run's last successful one, the newest that
    failed since, and a warning (on stderr) for each record skipped."""
    drill_warnings_text(stats)
    if stats.drills:
        click.echo("")
        click.echo("last successful drill, per run:")
        rows = [[d.run, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.time)),
                 format_duration(d.age_s) + " ago", d.version[:12],
                 f"{d.recovery_seconds:.2f} s", ", ".join(d.scenarios) or "-"]
                for d in stats.drills]
        echo_lines(["  " + line for line in render_table(
            ["RUN", "WHEN", "AGE", "VERSION", "RECOVERY", "SCENARIOS"], rows, right=(2, 4))])
    if stats.failed_drills:
        click.echo("")
        click.echo("FAILED drills, per run: the newest since its last successful drill:")
        rows = [_failed_row(d) for d in stats.failed_drills]
        echo_lines(["  " + line for line in render_table(
            ["RUN", "WHEN", "AGE", "FAILED", "TARGET", "WHY", "RESTORED INSTEAD"], rows,
            right=(2, 3))])


COMMANDS = (drill_command, drill_restore)
