"""Commands that check and maintain a store: ``verify``, ``gc``, ``prune`` and
``index rebuild``."""

from __future__ import annotations

import time
from typing import Any

import click

from chunkstore.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    GRACE_OPT,
    JSON_OPT,
    STORE_ARG,
    CliError,
    emit_json,
    format_duration,
    format_size,
    label,
    open_store,
    plural,
    set_exit_code,
)
from chunkstore.cli.verifytext import verify_text
from chunkstore.maintenance.gc import GcResult
from chunkstore.maintenance.retention import PruneResult, parse_duration
from chunkstore.maintenance.verify import DataSubset, VerifyResult
from chunkstore.objects.signing import Trust
from chunkstore.progress import TerminalProgress

# --- verify ---------------------------------------------------------------------------------


@click.command()
@STORE_ARG
@click.argument("selector", required=False)
@click.option("--quick", is_flag=True,
              help="Only check that every chunk exists; do not read, decode and hash it."
              " A version an earlier verify read whole is only checked present.")
@click.option("--read-data-subset", "subset", metavar="N/M|X%",
              help="Read only part of the data: N/M, slice N of M (M runs, N=1..M, read"
              " every object once), or X%, a random sample; the rest is checked present.")
@click.option("--trust", "trust", multiple=True, metavar="PUBKEY",
              type=click.Path(dir_okay=False),
              help="A public key file (KEY.pub from `chunkstore keygen`) whose signatures"
              " are trusted; repeatable. Each version is then reported signed-by-trusted,"
              " signed-by-untrusted, unsigned, bad-signature (a problem) or corrupt.")
@JSON_OPT
def verify(store_path: str, selector: str | None, quick: bool, subset: str | None,
           trust: tuple[str, ...], as_json: bool) -> None:
    """Check a store: every chunk reachable from the versions is present,
    decodes and hashes right; records and manifests parse; the index's
    reference counts match the manifests.

    With SELECTOR only that version is checked (and refcounts are not).
    Where something is wrong, the answer lists each version once by
    RUN@STEP (readable, or damaged with the entries a read cannot
    return), then each damaged object once: its kind (chunk, pack, node,
    record, moved record: a repacked pack's record of where its members
    went, tag), its key in the store, missing or corrupt, and the versions
    and entries that need it; then the command that mends it. Damaged
    objects are rewritten from a whole copy by `chunkstore repair STORE
    --from OTHER`; refcount and index problems (the index is a cache) by
    `chunkstore index rebuild`. --json gives "versions" and "objects"
    the same way, and "problems" one per version and entry it breaks
    (kinds: missing-chunk, corrupt-chunk, corrupt-node, corrupt-record,
    corrupt-tag, corrupt-moved, format-version, unreadable, refcount,
    index, bad-signature).

    With --trust, each version's signature (docs/format.md §14) is checked
    against its commit record and reported per version: signed-by-trusted,
    signed-by-untrusted, unsigned, bad-signature (a problem: exit 1), or
    corrupt (signed, but its data fails its checks).

    --quick reads no chunk. It reads and parses each version's commit
    record and manifests once: the index remembers each version a verify
    of the whole store found readable, and a later --quick over the whole
    store checks that every object of such a version is still there (one
    listing of the chunk objects and one of the nodes) without reading
    them again (versions never change; a rebuilt index remembers nothing).
    A verify without --quick, or with SELECTOR, reads everything every
    time.

    A large store can be read over several runs: --read-data-subset N/M
    reads the stored objects (chunk objects and packs) of slice N of M,
    chosen by digest, so the runs 1/M .. M/M read each object exactly
    once; X% reads a random X% of them. Every run still checks that every
    object each version needs is there (no read), parses the manifests and
    counts references. The bytes read and the time are reported.

    \b
    Examples:
      chunkstore verify ckpts/ && echo clean
      chunkstore verify ckpts/ --read-data-subset "$(( 10#$(date +%j) % 7 + 1 ))/7"
      chunkstore verify ckpts/ --read-data-subset 5%
      chunkstore verify ckpts/ --trust release.pub --json

    \b
    Exit codes: 0 clean; 1 problems found (also when a reader such as
    `head` stops early); 2 bad selector, bad subset or not a store.
    """
    started = time.monotonic()
    data_subset = None if subset is None else DataSubset.parse(subset)  # before opening
    if data_subset is not None and quick:
        raise CliError("--quick reads no data; --read-data-subset chooses which data to"
                       " read: give one or the other", EXIT_USAGE)
    trusted = Trust(trust)  # a bad key file fails before the store is opened
    with open_store(store_path) as store, TerminalProgress() as progress:
        store.trust = trusted
        result: VerifyResult = store.verify(selector, read_data=not quick,
                                            read_data_subset=subset, progress=progress)
    # decided before the answer is written: a reader that stops early (`| head`) does
    # not turn problems found into a success
    set_exit_code(EXIT_OK if result.ok else EXIT_PROBLEMS)
    if as_json:
        emit_json({**result.to_json(), "seconds": round(time.monotonic() - started, 3)})
    else:
        verify_text(result, quick, store_path)
    if not result.ok:
        raise SystemExit(EXIT_PROBLEMS)


# --- gc and prune ---------------------------------------------------------------------------


def gc_text(result: GcResult) -> None:
    verb = "would free" if result.dry_run else "freed"
    click.echo(f"{'dry run: ' if result.dry_run else ''}"
               f"{plural(result.versions_considered, 'live version')};"
               f" {verb} {format_size(result.bytes_freed + result.orphan_bytes_freed)}"
               f" ({plural(result.chunks_deleted, 'chunk')},"
               f" {plural(result.nodes_deleted, 'manifest node')},"
               f" {plural(result.orphans_deleted, 'unindexed object')})")
    click.echo(f"kept for the grace period ({format_duration(result.grace_s)}):"
               f" {format_size(result.kept_by_grace_bytes)} in"
               f" {plural(result.kept_by_grace, 'object')};"
               f" kept for saves in progress: {plural(result.kept_by_sessions, 'object')}")
    if result.sessions_expired:
        click.echo(f"expired {plural(result.sessions_expired, 'write session')} of dead"
                   " processes")
    click.echo(sweep_text(result))
    if result.temporaries_deleted:
        click.echo(f"removed {plural(result.temporaries_deleted, 'temporary file')} of"
                   " interrupted writes")
    if result.packs_repacked:
        click.echo(f"{'would repack' if result.dry_run else 'repacked'}"
                   f" {plural(result.packs_repacked, 'pack')} at least"
                   f" {result.repack_unused or 0:.0%} garbage:"
                   f" {format_size(result.repack_bytes_copied)} live copied into new packs,"
                   f" {format_size(result.repack_bytes_freed)} freed")
    if result.pack_garbage_bytes:
        click.echo(f"garbage inside live packs before this run:"
                   f" {format_size(result.pack_garbage_bytes)}")
    for line in result.repack_skipped:
        click.echo(f"not repacked: {line}")
    if result.moved_records_deleted:
        click.echo(f"{'would delete' if result.dry_run else 'deleted'}"
                   f" {plural(result.moved_records_deleted, 'moved record')} no version needs")
    if result.unfinished_deletions:
        click.echo(f"finished {plural(result.unfinished_deletions, 'deletion')} of an"
                   " interrupted gc")
    if result.deferred:
        click.echo(f"deferred: {plural(result.deferred, 'object')}, for"
                   f" {plural(result.sessions_waited_for, 'save')} in progress")
    for line in result.index_disagreements:
        click.echo(f"warning: {line}", err=True)


def sweep_text(result: GcResult) -> str:
    """One line: whether the run listed storage for orphans, why, and the next one."""
    did = ("would sweep" if result.dry_run else "swept") if result.swept else "no sweep"
    line = f"orphan sweep: {did} ({result.sweep_reason})"
    if result.sessions_retired:
        line += f"; retired {plural(result.sessions_retired, 'dead save session')}"
    if result.next_sweep_due is not None:
        wait = result.next_sweep_due - time.time()
        line += (f"; next due in {format_duration(wait)}" if wait > 0
                 else "; next due at the next run")
    return line


@click.command()
@STORE_ARG
@GRACE_OPT
@click.option("-n", "--dry-run", is_flag=True,
              help="Decide exactly as a real run would; delete nothing.")
@click.option("--sweep/--no-sweep", default=None,
              help="List storage for objects no index knows (orphans of killed saves) now,"
              " or never; by default only when a dead save's session shows some may be"
              " there, or a day after this index's last sweep.")
@click.option("--repack-unused", type=click.FloatRange(0, 1, min_open=True), default=0.5,
              show_default=True, metavar="FRACTION",
              help="Repack a pack of small chunks once this fraction of it is garbage: copy"
              " its live chunks into a new pack and delete it.")
@click.option("--no-repack", is_flag=True,
              help="Never repack; a pack is deleted only when all of it is garbage.")
@click.option("--session-wait", type=click.FloatRange(min=0), default=120.0,
              show_default=True, metavar="SECONDS",
              help="How long to wait for saves in progress (on any machine) that started"
              " before this gc; past it nothing is deleted (exit 4: run gc again).")
@JSON_OPT
def gc(store_path: str, grace: str, dry_run: bool, sweep: bool | None, repack_unused: float,
       no_repack: bool, session_wait: float, as_json: bool) -> None:
    """Delete chunks and manifest nodes that no version references.

    An object is deleted only after it has been unreferenced for the
    grace period (default one hour), so a reader of a version removed a
    moment ago keeps working, and never while a save in progress uses it.
    Objects left by killed saves are collected the same way, by write
    time: gc lists storage for them (the orphan sweep) when a dead save's
    session shows there may be some, once a day (CHUNKSTORE_SWEEP_INTERVAL
    seconds) after this index's last sweep, or with --sweep; a gc with
    nothing to delete otherwise costs a few requests whatever the store's
    size. --json says whether it swept, why, and when the next is due.
    Versions are removed with `rm` or `prune` first; gc frees their
    space. Small chunks live in packs, deleted whole: a pack at least
    --repack-unused garbage has its live chunks copied into a new pack
    (old versions keep reading them, through a moved record) and is then
    deleted like any other object; --dry-run says what that would do.
    A gc that outlives half the grace period stops (exit 4) rather than
    break that promise; run it again. Only one gc runs at a time.

    \b
    Examples:
      chunkstore gc ckpts/ --dry-run      # what would be freed
      chunkstore gc ckpts/ --grace 2d --json

    \b
    Exit codes: 0 done; 2 bad option or not a store; 4 another gc is
    running, the run stopped at half the grace period, saves in progress
    outlasted --session-wait (nothing was deleted), or storage failed.
    """
    with open_store(store_path) as store, TerminalProgress() as progress:
        result = store.gc(parse_duration(grace), dry_run=dry_run, sweep=sweep,
                          progress=progress, repack_unused=None if no_repack else repack_unused,
                          session_wait=session_wait)
    if as_json:
        emit_json(result.to_json())
    else:
        gc_text(result)
    if result.deferred:
        raise CliError(f"deferred {plural(result.deferred, 'object')}:"
                       f" {plural(result.sessions_waited_for, 'save')} in progress outlasted"
                       f" the session wait ({format_duration(session_wait)}); nothing was"
                       " deleted; run gc again once they finish", EXIT_FAILURE)


def parse_best(text: str | None) -> tuple[Any, ...] | None:
    """``loss:3`` or ``accuracy:3:max`` -> ``("loss", 3)`` / ``("accuracy", 3, "max")``."""
    if text is None:
        return None
    parts: list[str] = text.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit():
        raise CliError(f"--keep-best {text!r}: expected METRIC:N or METRIC:N:max", EXIT_USAGE)
    return (parts[0], int(parts[1]), *parts[2:])


@click.command()
@STORE_ARG
@click.option("--run", help="Only this run (default: every run, each on its own).")
@click.option("--keep-last", type=click.IntRange(min=1), metavar="N",
              help="Keep the newest N versions.")
@click.option("--keep-every", type=click.IntRange(min=1), metavar="K",
              help="Keep versions whose step is a multiple of K.")
@click.option("--keep-within", metavar="DURATION",
              help="Keep versions saved within DURATION of now (30m, 12h, 7d).")
@click.option("--keep-best", metavar="METRIC:N[:max]",
              help="Keep the N versions with the lowest METRIC (highest with :max), read from"
              " the version's metadata (top level or under 'metrics').")
@click.option("--min-previous", type=click.IntRange(min=0), default=1, show_default=True,
              help="Older versions always kept behind the newest one that verifies.")
@click.option("--no-verify", is_flag=True,
              help="Do not hash-check the newest versions to find the newest good one.")
@click.option("-n", "--dry-run", is_flag=True, help="Say what would be removed; change nothing.")
@JSON_OPT
def prune(store_path: str, run: str | None, keep_last: int | None, keep_every: int | None,
          keep_within: str | None, keep_best: str | None, min_previous: int, no_verify: bool,
          dry_run: bool, as_json: bool) -> None:
    """Unpublish the versions no retention policy keeps.

    Policies compose: a version is kept if any policy keeps it. Whatever
    the policies say, tagged versions are kept, and so are the newest
    version that verifies (each run's newest versions are hash-checked
    until one passes) and --min-previous versions before it. Space is
    freed by `chunkstore gc` afterwards.

    \b
    Examples:
      chunkstore prune ckpts/ --keep-last 3 --keep-every 1000 --dry-run
      chunkstore prune ckpts/ --run exp1 --keep-best val_loss:2 --keep-within 1d

    \b
    Exit codes: 0 done; 2 no policy, a bad policy, or not a store.
    """
    if (keep_last, keep_every, keep_within, keep_best) == (None, None, None, None):
        raise CliError("give at least one retention policy (--keep-last, --keep-every,"
                       " --keep-within, --keep-best); nothing removed", EXIT_USAGE)
    with open_store(store_path) as store:
        result = store.prune(run=run, dry_run=dry_run, verify=not no_verify,
                             keep_last=keep_last, keep_every=keep_every,
                             keep_within=keep_within, keep_best=parse_best(keep_best),
                             min_previous=min_previous)
    for vid in result.unverified:
        click.echo(f"warning: version {vid[:12]} does not verify; kept, and not counted as"
                   " the newest good version", err=True)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    if as_json:
        emit_json(result.to_json())
    else:
        prune_text(result)


def prune_text(result: PruneResult) -> None:
    verb = "would remove" if result.dry_run else "removed"
    for info in result.removed:
        click.echo(f"{verb} {label(info)}")
    kept = plural(len(result.kept), "version")
    click.echo(f"{kept} kept, {len(result.removed)}"
               f" {'would be removed' if result.dry_run else 'removed'}"
               + ("" if result.dry_run or not result.removed else
                  "; run `chunkstore gc` to free their space after the grace period"))


# --- index ----------------------------------------------------------------------------------


@click.group()
def index() -> None:
    """Maintain the index: an LMDB cache of what the manifests say
    (reference counts, versions, tags), which `rebuild` recreates.

    \b
    Example:
      chunkstore verify ckpts/ || chunkstore index rebuild ckpts/
    """


@index.command("rebuild")
@STORE_ARG
@JSON_OPT
def index_rebuild(store_path: str, as_json: bool) -> None:
    """Recreate the index from the commit records and manifests on storage.

    Use it when `verify` reports refcount or index problems, after copying
    a store, or when the index directory was lost. Run it while no save or
    gc is running against the store. Versions whose manifests cannot be
    read are left out and listed.

    \b
    Example:
      chunkstore index rebuild ckpts/

    \b
    Exit codes: 0 rebuilt; 1 some versions could not be read; 2 not a store.
    """
    with open_store(store_path) as store:
        result = store.rebuild_index()
    set_exit_code(EXIT_PROBLEMS if result.skipped else EXIT_OK)  # also for `| head`
    if as_json:
        emit_json(result.to_json())
    else:
        packs = f", {plural(result.packs, 'pack')} of small chunks among them" \
            if result.packs else ""
        click.echo(f"index rebuilt: {plural(result.versions, 'version')},"
                   f" {plural(result.chunks, 'chunk object')} ({result.unreferenced_chunks}"
                   f" unreferenced{packs})")
        for vid in result.skipped:
            click.echo(f"skipped unreadable version {vid[:12]} (see `chunkstore verify`)")
    if result.skipped:
        raise SystemExit(EXIT_PROBLEMS)


COMMANDS = (verify, gc, prune, index)
