"""``chunkstore audit``: list a store's audit trail, or prune its oldest events
(docs/format.md §16)."""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

import click

from chunkstore.cli.common import (
    EXIT_USAGE,
    JSON_OPT,
    STORE_ARG,
    CliError,
    format_size,
    open_store,
    plural,
)
from chunkstore.errors import InvalidSettingError
from chunkstore.format.digest import is_hex_digest
from chunkstore.maintenance.retention import parse_duration
from chunkstore.protocol.audit import AuditEvent
from chunkstore.protocol.holds import printable


def parse_time(text: str, now: float) -> float:
    """Unix time from an ISO 8601 date or time (UTC unless it names an offset) or a
    duration before ``now`` (``30m``, ``2d``)."""
    try:
        return now - parse_duration(text)
    except InvalidSettingError:
        pass
    try:
        when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise CliError(f"bad time {text!r}: give an ISO 8601 date or time (2026-12-05,"
                       " 2026-12-05T11:30:00Z; UTC unless an offset is named) or a"
                       " duration ago (30m, 2d)", EXIT_USAGE) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


def _utc(when: float | None) -> str:
    return "?" if when is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(when))


def _what(event: AuditEvent) -> str:
    """What the event names, in a line."""
    if event.damage is not None:
        return f"DAMAGED audit/{event.id}: {event.damage}"
    fields = dict(event.fields)
    parts = []
    versions = fields.pop("versions", None)
    if isinstance(versions, list):
        named = [f"{v.get('run')}@{v.get('step')} {str(v.get('id'))[:12]}"
                 if "run" in v else str(v.get("id"))[:12]
                 for v in versions if isinstance(v, dict)]
        parts.append(", ".join(named) if len(named) <= 3
                     else f"{plural(len(named), 'version')} ({', '.join(named[:2])}, ...)")
    for name, value in sorted(fields.items()):
        if value is None or value == [] or value is False:
            continue
        # A byte count no float holds is a crafted one: printed as it is stored.
        text = format_size(value) if name in ("bytes", "orphan_bytes") \
            and isinstance(value, int) and 0 <= value < 2**63 else value \
            if isinstance(value, str) else json.dumps(value)
        parts.append(f"{name}={text[:12] if is_hex_digest(text) else text}")
    return "; ".join(parts)


def _line(event: AuditEvent) -> str:
    """The event in a line of printable text: whoever can write the bucket can store an
    event with escape sequences or line breaks in any field (each prints as ``?``)."""
    return printable(f"{_utc(event.when):20}  {event.op or '?':10} {event.phase or '?':6}"
                     f"  {event.who or '?'} ({event.process or '?'})  {_what(event)}")


@click.command()
@STORE_ARG
@click.option("--since", metavar="TIME",
              help="Only events from TIME on (ISO 8601, UTC unless an offset is named, or a"
              " duration ago: 2d).")
@click.option("--run", "run_name", metavar="RUN", help="Only events that name a version of RUN.")
@click.option("--prune-before", metavar="TIME",
              help="Delete the events older than TIME instead of listing (recorded by an"
              " event of its own).")
@JSON_OPT
def audit(store_path: str, since: str | None, run_name: str | None,
          prune_before: str | None, as_json: bool) -> None:
    """List the audit trail of STORE, oldest first, or prune its oldest events.

    Every publish (save, Checkpointer, DCP, sync), removal (rm, prune,
    keep_last, purge), tag change, hold and release, key change, repair and
    GC run that deletes something stores an event (audit/<UTC time>-<random>) with
    who (user@host), which process and what it names. Each is stored
    *before* the change it announces ("intent"), so no change goes
    unrecorded whatever kills the process; an intent with no change after it
    is an operation that was refused, failed or was killed. Removals and GC
    runs add a "done" event with what they did. An event that cannot be
    read is listed as DAMAGED. Events are not copied by sync.

    \b
    Examples:
      chunkstore audit ckpts/
      chunkstore audit s3://bucket/ckpts --since 2d --run exp1 --json
      chunkstore audit ckpts/ --prune-before 2026-01-01

    \b
    Exit codes: 0 listed (damaged events included) or pruned; 2 a bad time or
    option, or not a store.
    """
    now = time.time()
    if prune_before is not None:
        if since is not None or run_name is not None:
            raise CliError("--prune-before takes no --since or --run: it prunes every event"
                           " older than its TIME", EXIT_USAGE)
        _prune(store_path, parse_time(prune_before, now), as_json)
        return
    start = parse_time(since, now) if since is not None else None
    with open_store(store_path) as store:
        events = store.audit(since=start, run=run_name)
        if as_json:
            found: list[dict[str, Any]] = [event.to_json() for event in events]
            click.echo(json.dumps({"events": found}, indent=2))
            return
        for event in events:  # as they are read: a long trail prints as it goes
            click.echo(_line(event))


def _prune(store_path: str, before: float, as_json: bool) -> None:
    with open_store(store_path) as store:
        result = store.prune_audit(before)
    if as_json:
        click.echo(json.dumps({"pruned": len(result.pruned), "before": result.before,
                               "event": result.event}, indent=2))
    else:
        click.echo(f"pruned {plural(len(result.pruned), 'audit event')} older than"
                   f" {_utc(before)} (recorded as event {result.event})")


COMMANDS = (audit,)
