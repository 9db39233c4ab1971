"""Commands that name, remove and hold versions: ``tag``, ``rm``, ``hold`` and
``release``."""

from __future__ import annotations

import click

from chunkstore.cli.common import (
    EXIT_USAGE,
    JSON_OPT,
    STORE_ARG,
    CliError,
    echo_lines,
    emit_json,
    format_size,
    label,
    local_time,
    open_store,
    plural,
    render_table,
    tags_by_version,
    version_json,
)
from chunkstore.errors import AmbiguousSelectorError, HeldVersionError, SelectorError
from chunkstore.handle.removal import removed_already
from chunkstore.maintenance.purge import PurgeResult
from chunkstore.progress import TerminalProgress
from chunkstore.protocol.holds import held_ids, read_hold
from chunkstore.protocol.tombstones import RemovedVersion
from chunkstore.store import Store, VersionInfo

# --- tag ------------------------------------------------------------------------------------


@click.command()
@STORE_ARG
@click.argument("selector", required=False)
@click.argument("name", required=False)
@click.option("-d", "--delete", "delete_name", metavar="NAME", help="Remove the tag NAME.")
@JSON_OPT
def tag(store_path: str, selector: str | None, name: str | None, delete_name: str | None,
        as_json: bool) -> None:
    """Name a version, list tags, or remove one.

    A tag pins its version: `rm` refuses a tagged version and retention
    never removes it. Tag names use letters, digits and _.+=- (not
    "latest"). Setting an existing tag moves it and says from which version.

    \b
    Examples:
      chunkstore tag ckpts/ exp1@5000 best     # tag a version
      chunkstore tag ckpts/                    # list tags
      chunkstore tag ckpts/ -d best            # remove a tag

    \b
    Exit codes: 0 done; 2 bad selector or name, unknown tag, or not a store.
    """
    with open_store(store_path) as store:
        if delete_name is not None:
            if selector or name:
                raise CliError("give either -d NAME or SELECTOR NAME, not both", EXIT_USAGE)
            _untag(store, delete_name, as_json)
        elif selector is not None:
            if name is None:
                raise CliError("missing tag NAME: chunkstore tag STORE SELECTOR NAME",
                               EXIT_USAGE)
            _set_tag(store, selector, name, as_json)
        else:
            _list_tags(store, as_json)


def _untag(store: Store, name: str, as_json: bool) -> None:
    if not store.untag(name):
        raise CliError(f"no tag named {name!r}; nothing changed", EXIT_USAGE)
    if as_json:
        emit_json({"removed": name})
    else:
        click.echo(f"removed tag {name}")


def _set_tag(store: Store, selector: str, name: str, as_json: bool) -> None:
    """Tag a version, saying which version the tag named before when it moves."""
    previous_id = store.tags().get(name)
    info = store.tag(selector, name)
    previous = _tagged_version(store, previous_id) if previous_id != info.id else None
    if as_json:
        emit_json({"tagged": name, "version": info.to_json(),
                   "moved_from": previous.to_json() if previous else previous_id})
    elif previous_id == info.id:
        click.echo(f"tag {name} already names {label(info)}; nothing changed")
    elif previous_id is not None:
        was = label(previous) if previous else previous_id[:8]
        click.echo(f"moved tag {name} from {was} to {label(info)}")
    else:
        click.echo(f"tagged {label(info)} as {name}")


def _tagged_version(store: Store, version_id: str | None) -> VersionInfo | None:
    if version_id is None:
        return None
    try:
        return store.resolve(version_id)
    except SelectorError:  # a tag left on a version removed since
        return None


def _list_tags(store: Store, as_json: bool) -> None:
    infos = {name: store.resolve(vid) for name, vid in store.tags().items()}
    if as_json:
        emit_json({"tags": {n: infos[n].to_json() for n in sorted(infos)}})
    elif not infos:
        click.echo("no tags")
    else:
        rows = [[n, infos[n].short_id, f"{infos[n].run}@{infos[n].step}", local_time(infos[n])]
                for n in sorted(infos)]
        echo_lines(render_table(["TAG", "ID", "RUN@STEP", "CREATED"], rows))


# --- rm -------------------------------------------------------------------------------------


@click.command()
@STORE_ARG
@click.argument("selectors", nargs=-1, required=True, metavar="SELECTOR...")
@click.option("--force", is_flag=True, help="Also remove tagged versions (drops their tags).")
@click.option("-n", "--dry-run", is_flag=True, help="Say what would be removed; change nothing.")
@click.option("--purge", is_flag=True,
              help="Also delete now (grace 0) the data no other version shares, and report"
              " what stays because other versions share it.")
@click.option("--grace", default=None, metavar="DURATION",
              help="With --purge: what versions removed earlier keep (as for gc;"
              " default 1h).")
@JSON_OPT
def rm(store_path: str, selectors: tuple[str, ...], force: bool, dry_run: bool,
       purge: bool, grace: str | None, as_json: bool) -> None:
    """Unpublish versions: they stop being listed or loadable.

    Their chunks stay on storage until `chunkstore gc` finds them
    unreferenced by every remaining version for the grace period, so an
    rm does not free space by itself. Tagged versions are refused unless
    --force. All selectors are resolved before anything is removed: one
    bad selector removes nothing. A version under a legal hold (`chunkstore
    hold`) is refused, --force or not, and nothing is removed.

    With --purge the data of the removed versions that no other version
    shares is deleted at once (a garbage collection narrowed to them, at
    grace 0: readers of these versions lose them now; a save running at the
    same time is never broken, it writes again what it needs). It reports
    the bytes freed, the bytes that stay because other versions share them
    and (up to 10) which versions, and bytes kept for another reason
    (versions removed earlier within --grace, live readers, saves in
    progress). On an encrypted store purge deletes the sealed objects but
    cannot destroy keys: copies kept elsewhere (bucket versioning, backups,
    synced stores) stay readable to password holders.

    \b
    Examples:
      chunkstore rm ckpts/ exp1@100 exp1@200 --dry-run
      chunkstore rm ckpts/ exp1@300 --purge --json

    \b
    A version whose commit record cannot be read is never listed; name it by
    its full id to remove it.

    \b
    A rerun is safe: a selector (full id, id prefix or RUN@STEP) that names a
    version removed already, whose tombstone is still in the store (removed
    less than a GC grace period ago, or by a removal that did not finish), is
    reported as "already removed", not an error; RUN@latest, latest and tags
    name what is published now. A selector that names nothing, published or
    removed, is still a bad selector.

    \b
    Exit codes: 0 removed or already removed (or would be, with --dry-run);
    2 bad selector, tagged version without --force, held version, or not a
    store; 4 with --purge, a gc running on the store.
    """
    if grace is not None and not purge:  # else it would be silently ignored
        raise CliError("--grace is for --purge (what versions removed earlier keep); add"
                       " --purge or drop --grace; nothing removed", EXIT_USAGE)
    with open_store(store_path) as store:
        infos, gone = _removals(store, selectors)
        if not infos:  # a rerun of a removal that finished: nothing to do
            _already_report(gone, dry_run, purge, as_json)
            return
        tags = tags_by_version(store)
        pinned = [(i, tags[i.id]) for i in infos if i.id in tags]
        if pinned and not force:
            names = "; ".join(f"{i.short_id} is tagged {', '.join(t)}" for i, t in pinned)
            raise CliError(f"{names}; untag first or pass --force; nothing removed", EXIT_USAGE)
        if dry_run:  # what rm would refuse, a dry run refuses too (a real rm asks again)
            listed = held_ids(store.objects)
            held = {i.id: (found.reason if (found := read_hold(store.objects, i.id)) else None)
                    for i in infos if i.id in listed}
            if held:
                raise HeldVersionError(held)
        if purge and not dry_run:
            with TerminalProgress() as progress:
                result = store.purge([info.id for info in infos], force=force,
                                     grace="1h" if grace is None else grace,
                                     progress=progress)
            _purge_report(result, tags, gone, as_json)
            return
        if not dry_run:
            store.delete_many([info.id for info in infos], force=force)
    if as_json:
        emit_json({"dry_run": dry_run, "removed": [version_json(i, tags) for i in infos],
                   "already_removed": [r.to_json() for r in gone]})
        return
    verb = "would remove" if dry_run else "removed"
    for info in infos:
        click.echo(f"{verb} {label(info)}")
    _already_lines(gone)
    if not dry_run:
        click.echo("space is freed by `chunkstore gc` once no version references the chunks")


def _removals(store: Store, selectors: tuple[str, ...]
              ) -> tuple[list[VersionInfo], list[RemovedVersion]]:
    """The versions to remove, each once, and those the selectors name that a removal
    took already (a rerun); any other bad selector raises, before anything changes."""
    infos: dict[str, VersionInfo] = {}
    gone: dict[str, RemovedVersion] = {}
    for selector in selectors:
        try:
            info = store.resolve_for_removal(selector)
        except AmbiguousSelectorError:
            raise
        except SelectorError:
            removed = removed_already(store, selector)
            if removed is None:
                raise
            gone[removed.version_id] = removed
            continue
        infos[info.id] = info
    return list(infos.values()), [r for vid, r in gone.items() if vid not in infos]


def _already_report(gone: list[RemovedVersion], dry_run: bool, purge: bool,
                    as_json: bool) -> None:
    if as_json:
        emit_json({"dry_run": dry_run, **({"purged": True} if purge and not dry_run else {}),
                   "removed": [], "already_removed": [r.to_json() for r in gone]})
        return
    _already_lines(gone)
    click.echo("nothing to do")


def _already_lines(gone: list[RemovedVersion]) -> None:
    for r in gone:
        name = f"{r.run}@{r.step}" if r.run is not None and r.step is not None else "?"
        when = "" if r.removed is None else f" at {local_time(r.removed)}"
        click.echo(f"already removed {r.version_id[:12]} ({name}){when}")


def _purge_report(result: PurgeResult, tags: dict[str, list[str]],
                  gone: list[RemovedVersion], as_json: bool) -> None:
    if as_json:
        emit_json({"dry_run": False, "purged": True,
                   "removed": [version_json(i, tags) for i in result.removed],
                   "already_removed": [r.to_json() for r in gone],
                   **{k: v for k, v in result.to_json().items() if k != "removed"}})
        return
    for info in result.removed:
        click.echo(f"removed {label(info)}")
    _already_lines(gone)
    click.echo(f"freed {format_size(result.bytes_freed)} in"
               f" {plural(result.objects_deleted, 'object')} no other version shares")
    if result.objects_shared:
        more = ", and others" if result.shared_with_more else ""
        click.echo(f"{format_size(result.bytes_shared)} in"
                   f" {plural(result.objects_shared, 'object')} stay, shared with version"
                   f"{'' if len(result.shared_with) == 1 else 's'}"
                   f" {', '.join(v[:12] for v in result.shared_with)}{more}")
    if result.objects_kept:
        click.echo(f"{format_size(result.bytes_kept)} in {plural(result.objects_kept, 'object')}"
                   " stay for now: versions removed earlier (within --grace), live readers or"
                   " saves in progress still reach them; `chunkstore gc` deletes them later")


# --- hold and release ---------------------------------------------------------------------


@click.command()
@STORE_ARG
@click.argument("selector")
@click.option("--reason", required=True, metavar="TEXT",
              help="Why the version must be kept (recorded with who and when).")
@JSON_OPT
def hold(store_path: str, selector: str, reason: str, as_json: bool) -> None:
    """Put a version under a legal hold: nothing removes it until released.

    `rm` refuses a held version (with --force too), `prune`, retention
    policies and a Checkpointer's keep_last skip it with a warning that
    names the hold, and GC keeps everything it needs. The hold is an object
    in the store (holds/<version id>), seen by every index on every machine;
    `log` and `show` mark held versions. Holding a held version replaces its
    reason. The first hold upgrades the store to format version 11, which
    releases that do not honour holds refuse to open.

    \b
    Examples:
      chunkstore hold ckpts/ exp1@5000 --reason "audit 2024-17: model shipped to ACME"
      chunkstore hold s3://bucket/ckpts best --reason "dispute #42" --json

    \b
    Exit codes: 0 held; 2 bad selector, empty or over-long reason, or not a
    store; 4 a removal of the version that started before the hold had not
    finished (the hold is stored: run hold again to confirm it).
    """
    with open_store(store_path) as store:
        placed = store.hold(selector, reason)
        info = store.resolve(placed.version_id)
    if as_json:
        emit_json({"held": True, "version": info.to_json(), "hold": placed.to_json()})
    else:
        click.echo(f"held {label(info)}: {placed.describe()}")


@click.command()
@STORE_ARG
@click.argument("selector")
@JSON_OPT
def release(store_path: str, selector: str, as_json: bool) -> None:
    """Release a version's legal hold (deletes its hold object).

    The version can be removed again from then on (`rm`, `prune`,
    retention). A hold object whose version is not listed (damaged, or left
    by a tool) is released by the full version id.

    \b
    Examples:
      chunkstore release ckpts/ exp1@5000
      chunkstore release ckpts/ 3f2a9c0d... --json

    \b
    Exit codes: 0 released; 2 the version is not held, bad selector, or not a store.
    """
    with open_store(store_path) as store:
        released = store.release(selector)
    if as_json:
        emit_json({"released": True, "hold": released.to_json()})
    else:
        click.echo(f"released the hold of {released.version_id[:12]} ({released.describe()})")


COMMANDS = (tag, rm, hold, release)
