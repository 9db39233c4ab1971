"""Commands that move versions between stores: ``sync``, and ``repair``, which rewrites
what is damaged in one store from another's checked bytes."""

from __future__ import annotations

import time

import click

from chunkstore.cli.common import (
    EXIT_INTEGRITY,
    EXIT_PROBLEMS,
    JSON_OPT,
    emit_json,
    format_size,
    open_any,
    plural,
)
from chunkstore.maintenance.repair import RepairResult, repair_locations
from chunkstore.maintenance.sync import SyncResult, sync_locations
from chunkstore.progress import TerminalProgress
from chunkstore.store import check_sync_locations


def sync_text(result: SyncResult) -> None:
    verb = "would copy" if result.dry_run else "copied"
    if result.created:
        click.echo(f"{'would create' if result.dry_run else 'created'} {result.dst or 'DST'}"
                   " with the source's settings")
    click.echo(f"{verb} {plural(len(result.copied), 'version')}"
               f" ({plural(result.objects_copied, 'object')},"
               f" {format_size(result.bytes_copied)}); {len(result.skipped)} already there;"
               f" {plural(result.objects_present, 'referenced object')} and"
               f" {plural(result.subtrees_present, 'whole subtree')} found in place")
    for version_id in result.copied:
        click.echo(f"  {version_id[:12]}")
    for hold in result.held_at_source:
        click.echo(f"held at the source: {hold.version_id[:12]} ({hold.describe()}); a hold"
                   f" stays in its store: `chunkstore hold {result.dst or 'DST'}"
                   f" {hold.version_id[:12]} --reason TEXT` holds the copy")
    if result.tags_created:
        click.echo(f"tags {'to create' if result.dry_run else 'created'}:"
                   f" {', '.join(result.tags_created)}")
    for conflict in result.conflicts:
        click.echo(f"tag conflict: {conflict.name} names {conflict.dst_version[:12]} in the"
                   f" destination, {conflict.src_version[:12]} in the source; left as it is"
                   " (move it with `chunkstore tag` if the source is right)")
    for step in result.step_conflicts:
        click.echo(f"not copied: {step.run}@{step.step} ({step.src_version[:12]})"
                   f" is another version than {step.dst_version[:12]}, which the"
                   " destination has at that step; a store holds one version per step of a"
                   " run: remove one of them, or sync into another store")
    for failed in result.failed:
        click.echo(f"not copied: {failed.run}@{failed.step} ({failed.version[:12]}) is"
                   f" damaged in the source: {failed.message}")
    if result.failed:
        click.echo("nothing of a damaged version was published; the source can be repaired"
                   " from a store holding a whole copy: `chunkstore repair SRC --from OTHER"
                   " RUN@STEP`, then sync again")
    if result.verified:
        verdict = "ok" if result.ok else plural(len(result.problems), "problem")
        click.echo(f"read back {plural(result.verified, 'version')}, hash-checked: {verdict}")
    for problem in result.problems:
        click.echo(f"problem: {problem}")
    if result.problems:
        click.echo("a sync never replaces what DST holds unless it fails its check while"
                   " being copied; to mend a damaged version of DST: `chunkstore repair DST"
                   " --from SRC`")


@click.command()
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.argument("selectors", nargs=-1, metavar="[SELECTOR]...")
@click.option("--dry-run", is_flag=True,
              help="Say what would be copied (versions, objects, bytes); change nothing.")
@click.option("--verify", "verify_after", is_flag=True,
              help="Read every selected version back from DST, hash-checked: those"
                   " copied and those already there.")
@JSON_OPT
def sync(src: str, dst: str, selectors: tuple[str, ...], dry_run: bool, verify_after: bool,
         as_json: bool) -> None:
    """Copy versions from store SRC into store DST (paths or URLs).

    Only what DST lacks travels: chunks, packs, delta bases and manifest
    nodes first, each version's commit record last, so versions keep their
    ids and a sync that is killed publishes no partial version; run it
    again to finish (what landed is not sent again). DST is created with
    SRC's chunk size, delta depth and compression when it does not exist.
    Without SELECTOR every version is copied. Tags of the copied versions
    travel too, unless DST has the tag naming another version: that is
    reported as a conflict and left alone. A GC running on DST, from any
    machine, waits for the sync as it waits for a save.

    \b
    Examples:
      chunkstore sync ckpts/ s3://bucket/ckpts                # everything
      chunkstore sync ckpts/ /mnt/backup exp1@latest best     # two versions
      chunkstore sync --dry-run ckpts/ s3://bucket/ckpts      # what would travel

    \b
    Every object is checked as it is read from SRC (decoded and hash-checked,
    as a restore checks it) before DST gets it, and an object DST already
    holds is never replaced unless it fails that check itself. A version
    with a damaged or missing object is not published in DST; it is named
    with the object, and the other versions still travel. DST holds one
    version per RUN@STEP: a different version at a step DST has is a
    conflict, not copied. A legal hold belongs to the store it was placed
    in: a copied version held in SRC is named ("held at the source", JSON
    held_at_source), and its copy in DST is not held.

    \b
    Exit codes: 0 done; 1 a tag or step conflict, or --verify found a
    problem; 2 bad input (unknown selector, SRC not a store, SRC and DST the
    same store, DST with another chunk size); 3 a selected version is damaged
    in SRC (not copied; the others were); 4 I/O failure.
    """
    check_sync_locations(src, dst)  # a dry run into a file fails as the sync would
    started = time.monotonic()
    with TerminalProgress() as progress:
        result = sync_locations(src, dst, selectors, opener=open_any, dry_run=dry_run,
                                verify=verify_after, progress=progress)
    if as_json:
        emit_json({**result.to_json(), "seconds": round(time.monotonic() - started, 3)})
    else:
        sync_text(result)
    if result.failed:
        raise SystemExit(EXIT_INTEGRITY)
    if result.conflicts or not result.ok:
        raise SystemExit(EXIT_PROBLEMS)


def repair_text(result: RepairResult) -> None:
    verb = "would fix" if result.dry_run else "fixed"
    click.echo(f"checked {plural(result.versions_checked, 'version')} of {result.store}"
               f" against {result.source}: {verb} {plural(len(result.fixed), 'object')},"
               f" {len(result.unfixed)} could not be fixed")
    for fix in result.fixed:
        click.echo(f"  {verb} {fix.kind} {fix.digest[:16]} ({fix.problem}), needed by"
                   f" {', '.join(fix.versions)}")
    for fix in result.unfixed:
        click.echo(f"  not fixed: {fix.kind} {fix.digest[:16]} ({fix.problem}), needed by"
                   f" {', '.join(fix.versions)}: {fix.reason}")
    if result.dry_run:
        return
    if result.problems_after:
        damaged = sorted({p.version or "" for p in result.problems_after})
        click.echo(f"still damaged: {plural(len(damaged), 'version')}"
                   f" ({', '.join(v[:12] for v in damaged)}); `chunkstore verify` names"
                   " each problem; repair again from another copy, or remove the version")
    else:
        click.echo(f"read back {plural(result.versions_checked, 'version')}, hash-checked: ok")


@click.command()
@click.argument("store_path", metavar="STORE")
@click.argument("selectors", nargs=-1, metavar="[SELECTOR]...")
@click.option("--from", "source", required=True, metavar="OTHER",
              help="The store to take whole copies from (a mirror, or a store sync wrote).")
@click.option("--dry-run", is_flag=True,
              help="Check and say what would be fixed, and whether OTHER has it; change"
                   " nothing.")
@JSON_OPT
def repair(store_path: str, selectors: tuple[str, ...], source: str, dry_run: bool,
           as_json: bool) -> None:
    """Rewrite what is missing or damaged in STORE from OTHER's checked bytes.

    Every object the selected versions of STORE need (every version without
    SELECTOR) is read and checked as a restore checks it: commit records,
    manifest nodes, chunks with their delta bases, packs. An object that is
    missing or fails its check is replaced by OTHER's object of the same key,
    once that passed the same check in OTHER; nothing that passes its check is
    ever replaced. Each object is written atomically, so a repair that is
    killed leaves every object as it was or whole: run it again. The selected
    versions are then read back, hash-checked, and what is still wrong is
    named. OTHER is only read.

    \b
    Examples:
      chunkstore repair ckpts/ --from s3://bucket/ckpts            # every version
      chunkstore repair ckpts/ --from /mnt/backup exp1@latest      # one version
      chunkstore repair --dry-run ckpts/ --from s3://bucket/ckpts  # what would change

    \b
    Exit codes: 0 every selected version reads back whole (nothing was
    damaged, or all of it was fixed; a dry run: nothing is damaged); 2 bad
    input; 3 damage remains (or, in a dry run, was found); 4 I/O failure.
    """
    started = time.monotonic()
    with TerminalProgress() as progress:
        result = repair_locations(store_path, source, selectors, opener=open_any,
                                  dry_run=dry_run, progress=progress)
    if as_json:
        emit_json({**result.to_json(), "seconds": round(time.monotonic() - started, 3)})
    else:
        repair_text(result)
    if not result.ok or (dry_run and result.fixed):
        raise SystemExit(EXIT_INTEGRITY)


COMMANDS = (sync, repair)
