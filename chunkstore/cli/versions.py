"""Commands that name and remove versions: ``tag`` and ``rm``."""

from __future__ import annotations

import click

from chunkstore.cli.common import (
    EXIT_USAGE,
    JSON_OPT,
    STORE_ARG,
    CliError,
    echo_lines,
    emit_json,
    label,
    local_time,
    open_store,
    render_table,
    tags_by_version,
    version_json,
)
from chunkstore.errors import SelectorError
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
@JSON_OPT
def rm(store_path: str, selectors: tuple[str, ...], force: bool, dry_run: bool,
       as_json: bool) -> None:
    """Unpublish versions: they stop being listed or loadable.

    Their chunks stay on storage until `chunkstore gc` finds them
    unreferenced by every remaining version for the grace period, so an
    rm does not free space by itself. Tagged versions are refused unless
    --force. All selectors are resolved before anything is removed: one
    bad selector removes nothing.

    \b
    Example:
      chunkstore rm ckpts/ exp1@100 exp1@200 --dry-run

    \b
    A version whose commit record cannot be read is never listed; name it by
    its full id to remove it.

    \b
    Exit codes: 0 removed (or would be, with --dry-run); 2 bad selector,
    tagged version without --force, or not a store.
    """
    with open_store(store_path) as store:
        infos = list({info.id: info for info in map(store.resolve_for_removal, selectors)}.values())
        tags = tags_by_version(store)
        pinned = [(i, tags[i.id]) for i in infos if i.id in tags]
        if pinned and not force:
            names = "; ".join(f"{i.short_id} is tagged {', '.join(t)}" for i, t in pinned)
            raise CliError(f"{names}; untag first or pass --force; nothing removed", EXIT_USAGE)
        if not dry_run:
            store.delete_many([info.id for info in infos], force=force)
    if as_json:
        emit_json({"dry_run": dry_run, "removed": [version_json(i, tags) for i in infos]})
        return
    verb = "would remove" if dry_run else "removed"
    for info in infos:
        click.echo(f"{verb} {label(info)}")
    if not dry_run:
        click.echo("space is freed by `chunkstore gc` once no version references the chunks")


COMMANDS = (tag, rm)
