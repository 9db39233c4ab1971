"""Commands that create a store and look into it: ``init``, ``log``, ``show``,
``diff`` and ``report``.  None of them changes a version."""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import click
from click.core import ParameterSource

from chunkstore.cli.common import (
    EXIT_USAGE,
    GRACE_OPT,
    JSON_OPT,
    SIZE_MEANINGS,
    STORE_ARG,
    CliError,
    SizeParam,
    command_line_password,
    echo_lines,
    emit_json,
    explains_sizes,
    format_duration,
    format_ratio,
    format_size,
    hold_text,
    label,
    local_time,
    open_any,
    open_store,
    plural,
    render_table,
    size_key,
    tags_by_version,
    version_json,
)
from chunkstore.cli.recovery import drill_warnings_text, drills_text
from chunkstore.errors import (
    ConfigRecoveredWarning,
    NotAStoreError,
    PasswordRequiredError,
    RecoveredConfigError,
    WrongPasswordError,
    recover_command,
)
from chunkstore.format.dtypes import element_size
from chunkstore.format.manifest import MAX_DELTA_DEPTH, TensorEntry
from chunkstore.format.records import DEFAULT_DELTA_DEPTH
from chunkstore.handle.basecopies import BASE_COPY_BYTES
from chunkstore.handle.tree import Leaf
from chunkstore.index.indexfile import RESERVE_ENV_VAR, RESERVE_FLOOR, RESERVE_NAME, ReservePlan
from chunkstore.maintenance.census import RankStats, VersionRanks, ranks_of, shard_ranks
from chunkstore.maintenance.report import (
    GC_FROM_INDEX,
    RestoreReads,
    StoreStats,
    VersionStats,
    restore_reads,
)
from chunkstore.maintenance.report import stats as store_stats
from chunkstore.maintenance.retention import parse_duration
from chunkstore.protocol.holds import Hold, read_hold
from chunkstore.store import Store, VersionInfo

# --- init -----------------------------------------------------------------------------------


@click.command()
@click.argument("path")
@click.option("--chunk-size", type=SizeParam(), default="4MiB", show_default=True,
              help="Largest chunk a tensor is cut into: a multiple of 64 bytes between"
              " 4KiB and 256MiB. Fixed for the life of the store.")
@click.option("--compression", type=click.Choice(["auto", "none", "zstd", "shuffle-zstd"]),
              default="auto", show_default=True,
              help="Codec policy for new chunks (auto: shuffle-zstd for floats, zstd for"
              " the rest, raw where compressing does not pay, and deltas against the"
              " run's previous version where they pay, in a store with --delta-depth).")
@click.option("--delta-depth", type=click.IntRange(0, MAX_DELTA_DEPTH), default=DEFAULT_DELTA_DEPTH,
              show_default=True,
              help="Longest chain of delta chunks a save builds (0: no deltas). A chain"
              " also ends once its stored bytes pass twice a chunk's raw bytes, so dense"
              " updates get chains of about 2 and sparse ones (a few rows changed) ten"
              " or more. Deeper chains store less per version and restore slower."
              " A saving process keeps"
              " a copy of the chunks that changed, to encode its next save against (up"
              f" to {BASE_COPY_BYTES / 2**30:g} GiB; Store.base_copies.budget). Fixed for"
              " the life of the store; a process may save with shorter chains"
              " (chunkstore.open(PATH, delta_depth=N), N at most this).")
@click.option("--recover", is_flag=True,
              help="Write back the chunkstore.json of an existing store whose config is"
              " damaged or missing, recovered from its commit records and manifests (chunk"
              " size, delta depth, creation time; docs/format.md §2.1). --chunk-size and"
              " --delta-depth, if given, replace what was recovered, checked against the"
              " manifests. Refused when the config is valid.")
@click.option("--encrypt", is_flag=True,
              help="Create an encrypted store (docs/format.md §13): every object sealed"
              " with AES-256-GCM, chunk ids keyed, under a random master key wrapped by"
              " the password (--password-file before the command name,"
              " $CHUNKSTORE_PASSWORD, $CHUNKSTORE_PASSWORD_FILE, or asked twice on a"
              " terminal). Every command then needs the password. Chosen for the life of"
              " the store.")
def init(path: str, chunk_size: int, compression: str, delta_depth: int,
         recover: bool, encrypt: bool) -> None:
    """Create an empty store at PATH (a directory or fsspec URL), or with
    --recover write back the config of an existing one.

    PATH must not exist yet or be an empty directory. Sizes accept
    65536, 64K, 64KiB, 4M, 4MiB (binary units) or 4MB (decimal).

    A store whose chunkstore.json is damaged or missing opens read-only
    (with a ConfigRecoveredWarning), from a config recovered from its
    commit records and manifests: reads, log, show, verify, report and
    export work; saves, gc, rm, prune and tags are refused until
    `chunkstore init --recover PATH` writes the config back. Give
    --chunk-size when no manifest fixes it (a store without tensors), and
    --delta-depth when the store was created with another than the default.

    \b
    Example:
      chunkstore init ckpts/ --chunk-size 1MiB --compression zstd
      chunkstore init ckpts/ --delta-depth 8
      chunkstore init --encrypt ckpts/
      chunkstore init --recover ckpts/

    \b
    Exit codes: 0 created (--recover: written back); 2 PATH is already a
    store, is not empty, or a setting is out of range, and with --recover:
    PATH holds no store, its config is valid, or cannot be written back as
    asked; 4 storage failure.
    """
    if recover:
        ctx = click.get_current_context()
        given = {name for name in ("chunk_size", "delta_depth", "compression")
                 if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT}
        _write_back(path, chunk_size if "chunk_size" in given else None,
                    delta_depth if "delta_depth" in given else None,
                    compression if "compression" in given else None)
        return
    try:
        with _quietly_opened(path) as existing:
            damaged = existing.recovered_config
            hint = (f"; its chunkstore.json {damaged.reason}: `{recover_command(path)}` writes"
                    " it back" if damaged is not None else "")
            raise CliError(f"{path} is already a chunkstore store (chunk size"
                           f" {format_size(existing.chunk_size)}){hint}; nothing changed",
                           EXIT_USAGE)
    except NotAStoreError:
        pass  # the normal case: nothing there yet
    except (PasswordRequiredError, WrongPasswordError):
        raise CliError(f"{path} is already a chunkstore store (encrypted); nothing changed",
                       EXIT_USAGE) from None
    password = command_line_password(path, confirm=True) if encrypt else None
    store = open_any(path, create=True, chunk_size=chunk_size, compression=compression,
                     delta_depth=delta_depth, encrypt=encrypt, password=password)
    with store:
        click.echo(f"created an empty{' encrypted' if encrypt else ''} store at {path}"
                   f" (chunk size {format_size(store.chunk_size)}, compression"
                   f" {store.config.compression}, delta depth {store.config.delta_depth})")


@contextlib.contextmanager
def _quietly_opened(path: str) -> Iterator[Store]:
    """The store at ``path``, without the warning of a recovered config (init says it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigRecoveredWarning)
        store = open_any(path, create=False)
    with store:
        yield store


def _write_back(path: str, chunk_size: int | None, delta_depth: int | None,
                compression: str | None) -> None:
    """``init --recover``: write the recovered config back and say what it holds."""
    with _quietly_opened(path) as store:
        recovered = store.recovered_config
        try:
            config = store.write_back_config(chunk_size=chunk_size, delta_depth=delta_depth,
                                             compression=compression)
        except RecoveredConfigError as exc:
            raise CliError(str(exc), EXIT_USAGE) from exc
    assert recovered is not None  # write_back_config refused a valid config
    size_from = "given" if chunk_size is not None else "from the manifests"
    depth_from = "given" if delta_depth is not None else (
        "the longest delta chain listed" if recovered.longest_chain > DEFAULT_DELTA_DEPTH
        else "the default")
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(config.created))
    click.echo(f"wrote chunkstore.json back at {path} (it {recovered.reason}): chunk size"
               f" {format_size(config.chunk_size)} ({size_from}), delta depth"
               f" {config.delta_depth} ({depth_from}), compression {config.compression},"
               f" created {created} (from {recovered.created_from}), format version"
               f" {config.format_version}; the store is writable again")


# --- log ------------------------------------------------------------------------------------


#: Versions ``log`` lists unless told otherwise (``-n``, ``--all``).
LOG_LIMIT = 100


@click.command()
@explains_sizes
@STORE_ARG
@click.option("--run", help="Only versions of this run.")
@click.option("-n", "--limit", "limit", type=click.IntRange(min=1),
              help=f"Show at most N versions, the newest  [default: {LOG_LIMIT}]")
@click.option("--all", "show_all", is_flag=True, help="Show every version (no limit).")
@click.option("--mirror", metavar="MIRROR",
              help="Also say whether store MIRROR (path or URL) holds each version.")
@JSON_OPT
def log(store_path: str, run: str | None, limit: int | None, show_all: bool,
        mirror: str | None, as_json: bool) -> None:
    """List the versions in STORE, newest first.

    For each version: short id, RUN@STEP, creation time (local), its
    three sizes (below) and its tags; where the store holds legal holds, a
    HELD column gives each held version's reason (--json: "held" and
    "hold" for every version). With --mirror, also whether the
    store MIRROR holds it (a tiered Checkpointer's durable tier, or any
    store `chunkstore sync` copies into): MIRRORED yes or no, and
    "mirrored" in --json.

    The newest 100 versions are listed unless -n or --all says otherwise;
    a last line says how many more there are (--json: "total", the
    versions there are, listed or not). Only the versions listed are read,
    so a store of many thousand versions lists its newest at once.

    \b
    Examples:
      chunkstore log ckpts/ --run exp1 -n 5
      chunkstore log ckpts/ --all --json
      chunkstore log /local/ckpts --mirror s3://bucket/ckpts

    \b
    Exit codes: 0 listed (also when empty); 2 STORE (or MIRROR) is not a store,
    or both -n and --all are given.
    """
    if show_all and limit is not None:
        raise CliError("-n limits the versions listed and --all lists every one: give one"
                       " or the other", EXIT_USAGE)
    count = None if show_all else limit or LOG_LIMIT
    with open_store(store_path) as store:
        versions = store.newest(run, count)
        total = len(versions) if count is None or len(versions) < count \
            else store.version_count(run)
        tags = tags_by_version(store)
        holds = store.holds()  # read in the store: a hold made on another machine shows
    mirrored: set[str] | None = None
    if mirror is not None:
        with open_store(mirror) as durable:
            mirrored = {v.id for v in versions if durable.lists_version(v.id)}
    if as_json:
        emit_json({"versions": [
            {**version_json(v, tags, holds), **({} if mirrored is None
                                         else {"mirrored": v.id in mirrored})}
            for v in versions], "total": total})
        return
    if not versions:
        click.echo(f"no versions in {store_path}" + (f" for run {run!r}" if run else ""))
        return
    rows = [[v.short_id, f"{v.run}@{v.step}", local_time(v), *size_cells(v),
             *([] if mirrored is None else ["yes" if v.id in mirrored else "no"]),
             ", ".join(tags.get(v.id, [])),
             *([hold_text(holds.get(v.id))] if holds else [])] for v in versions]
    echo_lines(render_table(["ID", "RUN@STEP", "CREATED", *SIZE_HEADERS,
                             *([] if mirrored is None else ["MIRRORED"]), "TAGS",
                             *(["HELD"] if holds else [])],
                            rows, right=(3, 4, 5)))
    if total > len(versions):
        click.echo(f"... {plural(total - len(versions), 'older version')} not listed"
                   " (-n N lists the newest N, --all every one)")


SIZE_HEADERS = [name.upper() for name, _ in SIZE_MEANINGS]


def size_cells(v: VersionInfo | VersionStats) -> list[str]:
    """A version's sizes, in the order of :data:`SIZE_MEANINGS` (each column is the
    attribute and JSON key its header names)."""
    return [format_size(getattr(v, size_key(name))) for name, _ in SIZE_MEANINGS]


# --- show -----------------------------------------------------------------------------------


def describe_leaf(name: str, leaf: Leaf, ranks: tuple[int, ...] | None = None
                  ) -> dict[str, Any]:
    """What ``show`` and ``diff`` say about one entry (with the rank that wrote each
    shard, when the version records it)."""
    if isinstance(leaf, TensorEntry):
        shards = [{"offsets": list(s.offsets), "sizes": list(s.sizes), "chunks": len(s.chunks),
                   "bytes": s.nbytes(element_size(leaf.dtype))} for s in leaf.shards]
        for shard, rank in zip(shards, ranks or (), strict=False):
            shard["rank"] = rank
        return {"name": name, "kind": "tensor", "dtype": leaf.dtype, "shape": list(leaf.shape),
                "bytes": leaf.nbytes, "chunks": sum(len(s.chunks) for s in leaf.shards),
                "shards": shards}
    return {"name": name, "kind": "data", "dtype": None, "shape": None, "bytes": leaf.nbytes,
            "chunks": 0}


def type_text(entry: dict[str, Any]) -> str:
    if entry["kind"] == "data":
        return "data"
    return f"{entry['dtype']}{entry['shape']}"


def shard_text(shard: dict[str, Any]) -> str:
    box = f"{shard['offsets']}+{shard['sizes']}"
    return box if "rank" not in shard else f"rank {shard['rank']}: {box}"


def reads_text(reads: RestoreReads) -> str:
    """What the ``restore reads`` size of ``show`` counts, with this version's counts."""
    text = f"stored bytes a restore decodes: every chunk ({reads.chunks:,})"
    text += (f" and every base its delta chain lists ({reads.links:,}; up to"
             f" {reads.longest_chain} for one chunk)" if reads.links else ", no delta chains")
    if reads.unsized:
        text += f"; {plural(reads.unsized, 'object')} the index has no size for left out"
    return text


def show_text(info: VersionInfo, tags: list[str], entries: list[dict[str, Any]],
              ranks: tuple[RankStats, ...] | None = None,
              reads: RestoreReads | None = None, hold: Hold | None = None) -> None:
    fields = [("id", info.id), ("run@step", f"{info.run}@{info.step}"),
              ("created", local_time(info)), ("parent", info.parent or "-"),
              ("root", info.root.hex), ("tags", ", ".join(tags) or "-"),
              ("held", "-" if hold is None else f"yes: {hold.describe()}")]
    sizes = [[name, size, meaning] for (name, meaning), size
             in zip(SIZE_MEANINGS, size_cells(info), strict=True)]
    if reads is not None:
        sizes.append(["restore reads", format_size(reads.stored_bytes), reads_text(reads)])
    echo_lines(render_table(["", ""], [[k, v] for k, v in fields])[1:])
    echo_lines(render_table(["", "", ""], sizes, right=(1,))[1:])
    meta = info.to_json()["meta"]
    click.echo("meta:" + ("" if meta else " -"))
    for key, value in sorted(meta.items()):
        click.echo(f"  {key}: {json.dumps(value)}")
    click.echo(f"entries ({len(entries)}):")
    rows = [[e["name"], e["kind"], type_text(e), format_size(e["bytes"]), str(e["chunks"])]
            for e in entries]
    headers = ["NAME", "KIND", "TYPE", "SIZE", "CHUNKS"]
    if ranks is not None or any(len(e.get("shards", ())) > 1 for e in entries):
        # saved by several processes: each shard's box, and its rank where recorded
        headers.append("SHARDS (rank: offsets+sizes)" if ranks is not None
                       else "SHARDS (offsets+sizes)")
        for row, e in zip(rows, entries, strict=True):
            row.append((", " if ranks is not None else " ").join(
                shard_text(s) for s in e.get("shards", ())))
    echo_lines(["  " + line for line in render_table(headers, rows, right=(3, 4))])
    if ranks is not None:
        click.echo(f"shards by rank (saved by {plural(len(ranks), 'rank')}):")
        table = [[str(r.rank), str(r.shards), str(r.chunks), format_size(r.logical_bytes)]
                 for r in ranks]
        echo_lines(["  " + line for line in render_table(["RANK", "SHARDS", "CHUNKS", "SIZE"],
                                                          table, right=(0, 1, 2, 3))])


@click.command()
@explains_sizes
@STORE_ARG
@click.argument("selector")
@JSON_OPT
def show(store_path: str, selector: str, as_json: bool) -> None:
    """Show one version: its record, metadata and every entry.

    A version under a legal hold says so, with the hold's reason, who
    placed it and when (--json: "held" and "hold").

    Entries are tensors (dtype, shape, size, number of chunks) or plain
    data (trainer state and the like, stored as one encoded node). A tensor
    saved by several processes (torch.distributed.checkpoint through
    torch_bridge.dcp) lists its shards: the box each holds (offsets+sizes
    in the full tensor) and the rank that wrote it; a table then sums the
    shards, chunks and bytes of each rank (--json: "rank" in each shard,
    "ranks" per rank).

    \b
    What a restore of the version decodes ("restore reads"; --json:
    "restore_reads"): the stored bytes of every chunk and of every base its
    delta chain lists, each counted as often as a restore reads it. In a
    store with delta chains a restore decodes a chunk's chain from its root,
    so a version at the end of a long chain reads more than it stored
    (set a new store's delta_depth to trade storage for restore time).

    \b
    Example:
      chunkstore show ckpts/ exp1@latest

    \b
    Exit codes: 0 shown; 2 bad selector or not a store; 3 damaged manifest.
    """
    with open_store(store_path) as store:
        reader = store.open_version(selector)
        tags = tags_by_version(store).get(reader.info.id, [])
        hold = read_hold(store.objects, reader.info.id)
        leaves = reader.entries()
        record = shard_ranks(reader)
        listed = {} if record is None else record.ranks
        entries = [describe_leaf(n, leaf, listed.get(n)) for n, leaf in leaves.items()]
        ranks = None if record is None else ranks_of(leaves, record)
        reads = restore_reads(store, leaves)
    if as_json:
        version: dict[str, Any] = {**reader.info.to_json(), "tags": tags,
                                   "held": hold is not None,
                                   "hold": None if hold is None else hold.to_json()}
        doc: dict[str, Any] = {"version": version, "entries": entries,
                               "restore_reads": reads.to_json()}
        if ranks is not None:
            doc["ranks"] = [{k: v for k, v in r.to_json().items() if k != "new_bytes"}
                            for r in ranks]
        emit_json(doc)
    else:
        show_text(reader.info, tags, entries, ranks, reads, hold)


# --- diff -----------------------------------------------------------------------------------


def diff_entries(old: dict[str, Leaf], new: dict[str, Leaf]) -> list[dict[str, Any]]:
    """Per entry: added, removed, changed (with the chunks that differ) or same."""
    rows = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a is None or b is None:
            leaf = b if a is None else a
            assert leaf is not None
            rows.append({**describe_leaf(name, leaf), "change": "added" if a is None else "removed",
                         "changed_chunks": None, "changed_bytes": leaf.nbytes})
            continue
        row = {**describe_leaf(name, b), "change": "same", "changed_chunks": 0,
               "changed_bytes": 0}
        if isinstance(a, TensorEntry) and isinstance(b, TensorEntry):
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                row.update(change="changed", changed_chunks=row["chunks"],
                           changed_bytes=b.nbytes, was=type_text(describe_leaf(name, a)))
            else:
                spans_a = {s for shard in a.shards
                           for s in shard.chunk_spans(element_size(a.dtype))}
                differing = [s for shard in b.shards
                             for s in shard.chunk_spans(element_size(b.dtype))
                             if s not in spans_a]
                if differing:
                    row.update(change="changed", changed_chunks=len(differing),
                               changed_bytes=sum(length for _, _, length in differing))
        elif a != b:
            row.update(change="changed", changed_chunks=None, changed_bytes=b.nbytes)
        rows.append(row)
    return rows


@click.command()
@STORE_ARG
@click.argument("old")
@click.argument("new")
@click.option("--all", "show_all", is_flag=True, help="Also list entries that did not change.")
@JSON_OPT
def diff(store_path: str, old: str, new: str, show_all: bool, as_json: bool) -> None:
    """Compare two versions entry by entry (OLD and NEW are selectors).

    Tensors are compared chunk by chunk without reading their data: a
    changed tensor shows how many of its chunks (and bytes) differ, which
    is what a save of NEW after OLD had to write. Plain data entries are
    compared by content hash.

    \b
    Example:
      chunkstore diff ckpts/ exp1@100 exp1@latest

    \b
    Exit codes: 0 compared (whether or not anything differs); 2 bad selector
    or not a store; 3 damaged manifest.
    """
    with open_store(store_path) as store:
        a, b = store.open_version(old), store.open_version(new)
        rows = diff_entries(a.entries(), b.entries())
    counts = {k: sum(r["change"] == k for r in rows)
              for k in ("added", "removed", "changed", "same")}
    changed_bytes = sum(r["changed_bytes"] for r in rows)
    if as_json:
        emit_json({"old": a.info.to_json(), "new": b.info.to_json(), "counts": counts,
                   "changed_bytes": changed_bytes,
                   "entries": rows if show_all else [r for r in rows if r["change"] != "same"]})
        return
    marks = {"added": "+", "removed": "-", "changed": "~", "same": " "}
    shown = [r for r in rows if show_all or r["change"] != "same"]
    table = [[marks[r["change"]], r["name"], type_text(r),
              "-" if r["changed_chunks"] is None else f"{r['changed_chunks']}/{r['chunks']}",
              format_size(r["changed_bytes"])] for r in shown]
    click.echo(f"{label(a.info)} -> {label(b.info)}")
    if table:
        echo_lines(render_table(["", "NAME", "TYPE", "CHUNKS", "CHANGED"], table, right=(3, 4)))
    click.echo(f"{counts['added']} added, {counts['removed']} removed, {counts['changed']}"
               f" changed, {counts['same']} unchanged; {format_size(changed_bytes)} differ")


# --- report ---------------------------------------------------------------------------------


def ranks_text(versions: list[VersionRanks]) -> None:
    """The versions saved by several processes, one row per rank."""
    click.echo("by rank (versions saved by several processes):")
    rows = [[v.id[:12], f"{v.run}@{v.step}", str(r.rank), str(r.shards),
             format_size(r.logical_bytes), format_size(r.new_bytes)]
            for v in versions for r in v.ranks]
    echo_lines(["  " + line for line in render_table(
        ["ID", "RUN@STEP", "RANK", "SHARDS", *SIZE_HEADERS[:2]], rows,
        right=(2, 3, 4, 5))])
    click.echo("  (a rank's shards: their bytes, and those of their chunks no earlier version"
               " and no lower rank holds)")
    click.echo("")


def report_text(stats: StoreStats, store_path: str) -> None:
    if stats.versions:
        rows = [[v.id[:12], f"{v.run}@{v.step}", *size_cells(v)] for v in stats.versions]
        echo_lines(render_table(["ID", "RUN@STEP", *SIZE_HEADERS], rows, right=(2, 3, 4)))
        click.echo("")
    if stats.ranks:
        ranks_text(stats.ranks)
    fields = [
        ("versions", str(len(stats.versions))),
        ("chunks", str(stats.chunks)),
        ("logical, all versions", format_size(stats.logical_bytes_total)),
        ("logical, latest version", format_size(stats.latest_logical_bytes)),
        ("unique chunk bytes", format_size(stats.unique_raw_bytes)),
        ("stored, live", format_size(stats.live_bytes)
         + "  (chunks and nodes a published version reaches)"),
        ("stored, awaiting gc", f"{format_size(stats.awaiting_gc_bytes)} in"
         f" {plural(stats.awaiting_gc_objects, 'object')}  (no published version reaches"
         " them)"),
        ("physical (stored)", format_size(stats.physical_bytes)),
        ("dedup ratio", format_ratio(stats.dedup_ratio or None)),
        ("compression ratio", format_ratio(stats.compression_ratio or None)),
        ("delta chunks", f"{stats.delta_chunks}  (deltas against an earlier version;"
         f" {stats.mean_chain_depth:.2f} bases behind one on average,"
         f" {stats.max_chain_depth} at most)"),
        ("packed chunks", f"{stats.packed_chunks} in {plural(stats.packs, 'pack')}  (small"
         f" chunks stored together; {format_size(stats.packed_garbage_bytes)} inside live"
         " packs no live version lists)"),
        ("amplification", format_ratio(stats.amplification or None)
         + "  (physical / logical of the latest version; one full copy per version"
         f" would be {len(stats.versions)}.00x)" if stats.versions else "-"),
        ("reclaimable by gc now", f"{format_size(stats.reclaimable_now_bytes)} in"
         f" {plural(stats.reclaimable_now_objects, 'object')}  (what `gc --grace"
         f" {format_duration(stats.grace_s)}` deletes now; the rest once the grace has"
         " passed)"),
    ]
    if stats.gc_source == GC_FROM_INDEX:
        fields.append(("gc figures", "from the index's refcounts; objects no index record"
                       " names (orphans of killed saves, which only a sweep finds) are not"
                       " in them: `report --full` runs GC's dry run with the sweep"))
    if stats.gc_unknown is not None:
        fields = [f for f in fields if not f[0].startswith(("stored, awaiting", "reclaimable"))]
        fields.append(("awaiting gc", f"unknown: {stats.gc_unknown}"))
    if stats.space_reserve is not None:
        fields.append(("space reserve", _reserve_text(stats.space_reserve)))
    click.echo(f"store {store_path}")
    echo_lines(["  " + line for line in render_table(["", ""], fields)[1:]])
    drills_text(stats)


def _reserve_text(plan: ReservePlan) -> str:
    """The index's space reserve: its size, and why that size."""
    size = (f"{format_size(plan.held)} in {os.path.join(plan.path, RESERVE_NAME)}"
            if plan.held else "none held")
    if plan.fixed:
        why = f"its size fixed by {RESERVE_ENV_VAR}"
    else:
        why = (f"sized to what they need here: twice the index's"
               f" {format_size(plan.index_bytes)}, a tombstone for each of"
               f" {plural(plan.versions, 'version')} and {format_size(RESERVE_FLOOR)};"
               " it grows with the store")
    if not plan.size_ok:
        why += (f"; {format_size(plan.needed)} now, made by the next save where the disk"
                " has room for it twice over")
    return f"{size}  (room for rm and gc on a full disk, {why})"


@click.command()
@explains_sizes
@STORE_ARG
@GRACE_OPT
@click.option("--full", is_flag=True,
              help="Take the awaiting-gc and reclaimable figures from GC's dry run with"
              " the orphan sweep (reads every manifest, lists every object) instead of"
              " the index's refcounts.")
@JSON_OPT
def report(store_path: str, grace: str, full: bool, as_json: bool) -> None:
    """Where the bytes go: per version and in total.

    \b
    Per version: its three sizes (below).
    Totals: stored bytes split into live (reached by a published version)
    and awaiting gc (removed versions, killed saves); dedup ratio (logical
    bytes of all versions / unique live chunk bytes), compression ratio
    (unique live chunk bytes / live stored bytes), storage amplification
    (all stored bytes / logical bytes of the latest version; saving a full
    copy each time, as torch.save does, gives N after N versions) and what
    `gc` with the same --grace would delete now. The awaiting-gc and
    reclaimable figures come from the index's refcounts (--json:
    "gc_source": "index"): they leave out what only GC's sweep of storage
    finds, the orphans of killed saves and the objects of versions another
    index removed and this one has not yet counted out. With --full they come
    from the same code as `gc --dry-run` with the sweep ("gc_source":
    "gc-dry-run"), so the two always agree; that reads every manifest and
    lists every object.
    Per rank, for versions saved by several processes (torch_bridge.dcp):
    the shards each rank wrote, their bytes (LOGICAL) and the raw bytes of
    their chunks that no earlier version and no lower rank holds (NEW;
    --json: "ranks", with logical_bytes and new_bytes).
    Per run, its last successful `chunkstore drill`: when, its age, the
    version restored and the recovery time (--json: "drills"); and the newest
    drill that failed since, with why (a target refused: what the fallback
    restored and how long it took; --json: "failed_drills"). A drill record
    that cannot be read is skipped with a warning on stderr
    (--json: "drill_warnings").

    \b
    Example:
      chunkstore report ckpts/ --json | jq .totals.amplification

    \b
    Exit codes: 0 reported; 2 not a store.
    """
    with open_store(store_path) as store:
        stats = store_stats(store, parse_duration(grace), full=full)
    if as_json:
        emit_json(stats.to_json())
        drill_warnings_text(stats)
    else:
        report_text(stats, store_path)




COMMANDS = (init, log, show, diff, report)
