"""The ``chunkstore`` command line: inspect, check and maintain a store.

Every command opens an existing store with ``create=False`` (only ``init`` and
``demo`` create one), so a mistyped path is an error, never a new store.
Errors from the core become one ``chunkstore: error: ...`` line on stderr and
an exit code chosen by :func:`exit_code_for`.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any

import click

import chunkstore
from chunkstore.dtypes import element_size
from chunkstore.errors import (
    ChunkStoreError,
    FormatVersionError,
    IntegrityError,
    InvalidInputError,
    NotAStoreError,
)
from chunkstore.gc import GcResult
from chunkstore.manifest import TensorEntry
from chunkstore.progress import TerminalProgress
from chunkstore.report import StoreStats
from chunkstore.report import stats as store_stats
from chunkstore.retention import parse_duration
from chunkstore.store import Store, VersionInfo
from chunkstore.tree import Leaf
from chunkstore.verify import VerifyResult

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_INTEGRITY = 3
EXIT_FAILURE = 4

# --- errors and exit codes ------------------------------------------------------------------


class CliError(click.ClickException):
    """An error shown as one ``chunkstore: error: ...`` line, with its exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code  # type: ignore[misc]  # click reads it per instance

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"chunkstore: error: {self.format_message()}", file=file, err=True)


def exit_code_for(exc: BaseException) -> int:
    """2 for bad input, 3 for integrity and format errors, 4 for anything else."""
    if isinstance(exc, (InvalidInputError, NotAStoreError)):
        return EXIT_USAGE
    if isinstance(exc, (IntegrityError, FormatVersionError)):
        return EXIT_INTEGRITY
    return EXIT_FAILURE


#: Commands that need PyTorch live in torch_bridge and are imported only when run,
#: so the core CLI (and ``chunkstore --help``) never imports torch.
LAZY_COMMANDS = {
    "demo": ("torch_bridge.cli", "demo",
             "Train a small model with async saves, SIGKILL it, resume bit-exactly."),
    "export": ("torch_bridge.cli", "export",
               "Write a version's weights as a safetensors file."),
    "plan": ("torch_bridge.cli", "plan",
             "The checkpoint interval that minimises pause cost plus lost work."),
}


class ChunkstoreGroup(click.Group):
    """The top-level group: turns core errors (in any subcommand) into one-line errors,
    and loads the torch commands on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            module_name, attr, summary = LAZY_COMMANDS[cmd_name]
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                return _missing_torch_command(cmd_name, summary, exc)
            command: click.Command = getattr(module, attr)
            return command
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ChunkStoreError as exc:
            raise CliError(str(exc), exit_code_for(exc)) from exc
        except OSError as exc:
            raise CliError(str(exc), EXIT_FAILURE) from exc


def _missing_torch_command(name: str, summary: str, exc: ImportError) -> click.Command:
    def run() -> None:
        raise CliError(f"`chunkstore {name}` needs PyTorch ({exc}); install it with"
                       " pip install 'chunkstore[torch]'", EXIT_FAILURE)

    return click.Command(name, callback=run, help=summary, short_help=summary)


# --- sizes ----------------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse ``65536``, ``64K``, ``4MiB``, ``1M`` (binary) or ``1MB`` (decimal) into bytes."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 65536, 64KiB, 4MiB, 1M, 1MB)")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def format_size(n: float) -> str:
    """Bytes as a human size with binary units: ``512 B``, ``1.5 KiB``, ``4.0 MiB``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def format_duration(seconds: float) -> str:
    """``90`` -> ``1m30s``, ``3600`` -> ``1h``."""
    whole = round(seconds)
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if whole >= size or (unit == "s" and not parts):
            parts.append(f"{whole // size}{unit}")
            whole %= size
    return "".join(parts)


def format_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


class SizeParam(click.ParamType[int]):
    """A click parameter that accepts human sizes (see :func:`parse_size`)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


# --- shared helpers -------------------------------------------------------------------------


@contextmanager
def open_store(path: str) -> Iterator[Store]:
    """Open an existing store (never creates one) and close it afterwards."""
    store = chunkstore.open(path, create=False)
    try:
        yield store
    finally:
        store.close()


def emit_json(doc: object) -> None:
    click.echo(json.dumps(doc, indent=2))


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 right: Sequence[int] = ()) -> list[str]:
    """Columns padded to their widest cell; columns listed in ``right`` right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    lines = []
    for row in (headers, *rows):
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return lines


def echo_lines(lines: Sequence[str]) -> None:
    for line in lines:
        click.echo(line)


def local_time(info: VersionInfo) -> str:
    stamp = dt.datetime.fromtimestamp(info.created, dt.timezone.utc).astimezone()
    return stamp.strftime("%Y-%m-%d %H:%M:%S")


def tags_by_version(store: Store) -> dict[str, list[str]]:
    result: dict[str, list[str]] = {}
    for tag, version_id in sorted(store.tags().items()):
        result.setdefault(version_id, []).append(tag)
    return result


def version_json(info: VersionInfo, tags: dict[str, list[str]]) -> dict[str, Any]:
    return {**info.to_json(), "tags": tags.get(info.id, [])}


def label(info: VersionInfo) -> str:
    return f"{info.short_id} ({info.run}@{info.step})"


STORE_ARG = click.argument("store_path", metavar="STORE")
JSON_OPT = click.option("--json", "as_json", is_flag=True,
                        help="Print one JSON document on stdout instead of text.")

# --- the command group ----------------------------------------------------------------------


@click.group(cls=ChunkstoreGroup)
@click.version_option(chunkstore.__version__, prog_name="chunkstore")
def cli() -> None:
    """Incremental, deduplicated storage for training checkpoints.

    A store is a directory (or an fsspec URL such as s3://bucket/ckpts) that
    holds tensors cut into content-addressed chunks, so each saved checkpoint
    (a "version") only adds the chunks that changed since earlier saves.
    Programs save versions through the Python API (chunkstore.open); these
    commands inspect, check and maintain a store.

    \b
    Selectors (wherever a command takes SELECTOR):
      latest       the newest version in the store
      RUN@latest   the newest version of run RUN
      RUN@STEP     the version of run RUN saved at step STEP
      NAME         a tag (see `chunkstore tag`)
      3fa9c1d2     a version id, or a unique prefix of at least 4 hex digits

    \b
    Getting started:
      chunkstore demo               # train, SIGKILL, resume bit-exactly, show the savings
      chunkstore log ckpts/         # list the versions in a store
      chunkstore report ckpts/      # where the bytes go
      chunkstore verify ckpts/      # check every chunk
      chunkstore prune ckpts/ --keep-last 3 && chunkstore gc ckpts/

    \b
    Exit codes:
      0  success
      1  a check found problems (verify, index rebuild)
      2  bad usage or bad input: unknown option, bad selector or name,
         a path that is not a store
      3  integrity error: corrupt or missing data, unsupported format version
      4  any other failure (storage backend, I/O)
    """


# --- init -----------------------------------------------------------------------------------


@cli.command()
@click.argument("path")
@click.option("--chunk-size", type=SizeParam(), default="4MiB", show_default=True,
              help="Largest chunk a tensor is cut into: a multiple of 64 bytes between"
              " 4KiB and 256MiB. Fixed for the life of the store.")
@click.option("--compression", type=click.Choice(["auto", "none", "zstd", "shuffle-zstd"]),
              default="auto", show_default=True,
              help="Codec policy for new chunks (auto: shuffle-zstd for floats, zstd for"
              " the rest, raw where compressing does not pay).")
def init(path: str, chunk_size: int, compression: str) -> None:
    """Create an empty store at PATH (a directory or fsspec URL).

    PATH must not exist yet or be an empty directory. Sizes accept
    65536, 64K, 64KiB, 4M, 4MiB (binary units) or 4MB (decimal).

    \b
    Example:
      chunkstore init ckpts/ --chunk-size 1MiB --compression zstd

    \b
    Exit codes: 0 created; 2 PATH is already a store, is not empty,
    or a setting is out of range; 4 storage failure.
    """
    try:
        with open_store(path) as existing:
            raise CliError(f"{path} is already a chunkstore store (chunk size"
                           f" {format_size(existing.chunk_size)}); nothing changed", EXIT_USAGE)
    except NotAStoreError:
        pass  # the normal case: nothing there yet
    store = chunkstore.open(path, create=True, chunk_size=chunk_size, compression=compression)
    with store:
        click.echo(f"created an empty store at {path} (chunk size"
                   f" {format_size(store.chunk_size)}, compression {store.config.compression})")


# --- log ------------------------------------------------------------------------------------


@cli.command()
@STORE_ARG
@click.option("--run", help="Only versions of this run.")
@click.option("-n", "limit", type=click.IntRange(min=1), help="Show at most N versions.")
@JSON_OPT
def log(store_path: str, run: str | None, limit: int | None, as_json: bool) -> None:
    """List the versions in STORE, newest first.

    For each version: short id, RUN@STEP, creation time (local), logical
    bytes (the size of the checkpoint as saved), new stored bytes (what
    saving it added to the store after dedup and compression) and tags.

    \b
    Example:
      chunkstore log ckpts/ --run exp1 -n 5

    \b
    Exit codes: 0 listed (also when empty); 2 STORE is not a store.
    """
    with open_store(store_path) as store:
        versions = list(reversed(store.versions(run)))[:limit]
        tags = tags_by_version(store)
    if as_json:
        emit_json({"versions": [version_json(v, tags) for v in versions]})
        return
    if not versions:
        click.echo(f"no versions in {store_path}" + (f" for run {run!r}" if run else ""))
        return
    rows = [[v.short_id, f"{v.run}@{v.step}", local_time(v), format_size(v.logical_bytes),
             format_size(v.new_stored_bytes), ", ".join(tags.get(v.id, []))] for v in versions]
    echo_lines(render_table(["ID", "RUN@STEP", "CREATED", "LOGICAL", "NEW STORED", "TAGS"],
                            rows, right=(3, 4)))


# --- show -----------------------------------------------------------------------------------


def describe_leaf(name: str, leaf: Leaf) -> dict[str, Any]:
    """What ``show`` and ``diff`` say about one entry."""
    if isinstance(leaf, TensorEntry):
        return {"name": name, "kind": "tensor", "dtype": leaf.dtype, "shape": list(leaf.shape),
                "bytes": leaf.nbytes, "chunks": sum(len(s.chunks) for s in leaf.shards)}
    return {"name": name, "kind": "data", "dtype": None, "shape": None, "bytes": leaf.nbytes,
            "chunks": 0}


def type_text(entry: dict[str, Any]) -> str:
    if entry["kind"] == "data":
        return "data"
    return f"{entry['dtype']}{entry['shape']}"


def show_text(info: VersionInfo, tags: list[str], entries: list[dict[str, Any]]) -> None:
    fields = [("id", info.id), ("run@step", f"{info.run}@{info.step}"),
              ("created", local_time(info)), ("parent", info.parent or "-"),
              ("root", info.root.hex), ("logical", format_size(info.logical_bytes)),
              ("new raw", format_size(info.new_bytes)),
              ("new stored", format_size(info.new_stored_bytes)),
              ("tags", ", ".join(tags) or "-")]
    echo_lines(render_table(["version", ""], [[k, v] for k, v in fields])[1:])
    meta = info.to_json()["meta"]
    click.echo("meta:" + ("" if meta else " -"))
    for key, value in sorted(meta.items()):
        click.echo(f"  {key}: {json.dumps(value)}")
    click.echo(f"entries ({len(entries)}):")
    rows = [[e["name"], e["kind"], type_text(e), format_size(e["bytes"]), str(e["chunks"])]
            for e in entries]
    echo_lines(["  " + line for line in render_table(
        ["NAME", "KIND", "TYPE", "SIZE", "CHUNKS"], rows, right=(3, 4))])


@cli.command()
@STORE_ARG
@click.argument("selector")
@JSON_OPT
def show(store_path: str, selector: str, as_json: bool) -> None:
    """Show one version: its record, metadata and every entry.

    Entries are tensors (dtype, shape, size, number of chunks) or plain
    data (trainer state and the like, stored as one encoded node).

    \b
    Example:
      chunkstore show ckpts/ exp1@latest

    \b
    Exit codes: 0 shown; 2 bad selector or not a store; 3 damaged manifest.
    """
    with open_store(store_path) as store:
        reader = store.open_version(selector)
        tags = tags_by_version(store).get(reader.info.id, [])
        entries = [describe_leaf(n, leaf) for n, leaf in reader.entries().items()]
    if as_json:
        version: dict[str, Any] = {**reader.info.to_json(), "tags": tags}
        emit_json({"version": version, "entries": entries})
    else:
        show_text(reader.info, tags, entries)


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


@cli.command()
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


def report_text(stats: StoreStats, store_path: str) -> None:
    if stats.versions:
        rows = [[v.id[:12], f"{v.run}@{v.step}", format_size(v.logical_bytes),
                 format_size(v.new_bytes), format_size(v.new_stored_bytes)]
                for v in stats.versions]
        echo_lines(render_table(["ID", "RUN@STEP", "LOGICAL", "NEW RAW", "NEW STORED"], rows,
                                right=(2, 3, 4)))
        click.echo("")
    fields = [
        ("versions", str(len(stats.versions))),
        ("chunks", str(stats.chunks)),
        ("logical, all versions", format_size(stats.logical_bytes_total)),
        ("logical, latest version", format_size(stats.latest_logical_bytes)),
        ("unique chunk bytes", format_size(stats.unique_raw_bytes)),
        ("physical (stored)", format_size(stats.physical_bytes)),
        ("dedup ratio", format_ratio(stats.dedup_ratio or None)),
        ("compression ratio", format_ratio(stats.compression_ratio or None)),
        ("amplification", format_ratio(stats.amplification or None)
         + "  (physical / logical of the latest version; one full copy per version"
         f" would be {len(stats.versions)}.00x)" if stats.versions else "-"),
        ("reclaimable by gc now", format_size(stats.reclaimable_now_bytes)
         + f"  (unreferenced for longer than {format_duration(stats.grace_s)})"),
        ("reclaimable after grace", f"{format_size(stats.reclaimable_bytes)} in"
         f" {stats.reclaimable_chunks} unreferenced objects"),
    ]
    click.echo(f"store {store_path}")
    echo_lines(["  " + line for line in render_table(["", ""], fields)[1:]])


GRACE_OPT = click.option("--grace", default="1h", show_default=True, metavar="DURATION",
                         help="Grace period: an unreferenced object is deleted only after it"
                         " has been unreferenced this long (90, 30m, 1h, 2d, 1w).")


@cli.command()
@STORE_ARG
@GRACE_OPT
@JSON_OPT
def report(store_path: str, grace: str, as_json: bool) -> None:
    """Where the bytes go: per version and in total.

    \b
    Per version: logical bytes (the checkpoint's size as saved), new raw
    bytes (chunks it was the first to reference) and new stored bytes
    (those chunks after compression).
    Totals: dedup ratio (logical bytes of all versions / unique chunk
    bytes), compression ratio (unique chunk bytes / stored bytes),
    storage amplification (stored bytes / logical bytes of the latest
    version; saving a full copy each time, as torch.save does, gives N
    after N versions) and what garbage collection could reclaim now and
    once the grace period of the currently unreferenced objects has passed.

    \b
    Example:
      chunkstore report ckpts/ --json | jq .totals.amplification

    \b
    Exit codes: 0 reported; 2 not a store.
    """
    with open_store(store_path) as store:
        stats = store_stats(store, parse_duration(grace))
    if as_json:
        emit_json(stats.to_json())
    else:
        report_text(stats, store_path)


# --- verify ---------------------------------------------------------------------------------


@cli.command()
@STORE_ARG
@click.argument("selector", required=False)
@click.option("--quick", is_flag=True,
              help="Only check that every chunk exists; do not read, decode and hash it.")
@JSON_OPT
def verify(store_path: str, selector: str | None, quick: bool, as_json: bool) -> None:
    """Check a store: every chunk reachable from the versions is present,
    decodes and hashes right; records and manifests parse; the index's
    reference counts match the manifests.

    With SELECTOR only that version is checked (and refcounts are not).
    Problems are listed one per line as KIND VERSION DETAIL; the kinds are
    missing-chunk, corrupt-chunk, corrupt-node, corrupt-record,
    format-version, refcount, index. Refcount and index problems are fixed
    by `chunkstore index rebuild`; the others mean lost or damaged data.

    \b
    Example:
      chunkstore verify ckpts/ && echo clean

    \b
    Exit codes: 0 clean; 1 problems found; 2 bad selector or not a store.
    """
    started = time.monotonic()
    with open_store(store_path) as store:
        result: VerifyResult = store.verify(selector, read_data=not quick,
                                            progress=TerminalProgress())
    if as_json:
        emit_json({**result.to_json(), "seconds": round(time.monotonic() - started, 3)})
    else:
        for problem in result.problems:
            where = (problem.version or "-")[:12]
            what = f" chunk {problem.digest[:16]}" if problem.digest else ""
            click.echo(f"{problem.kind} {where}{what}: {problem.message}")
        checked = "present" if quick else "read and hash-checked"
        click.echo(f"{result.versions_checked} versions, {result.chunks_checked} chunks"
                   f" {checked} ({format_size(result.bytes_checked)}):"
                   + (" ok" if result.ok else f" {len(result.problems)} problems"))
    if not result.ok:
        raise SystemExit(EXIT_PROBLEMS)


# --- tag ------------------------------------------------------------------------------------


@cli.command()
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
    "latest"). Setting an existing tag moves it.

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
            if not store.untag(delete_name):
                raise CliError(f"no tag named {delete_name!r}; nothing changed", EXIT_USAGE)
            if as_json:
                emit_json({"removed": delete_name})
            else:
                click.echo(f"removed tag {delete_name}")
            return
        if selector is not None:
            if name is None:
                raise CliError("missing tag NAME: chunkstore tag STORE SELECTOR NAME",
                               EXIT_USAGE)
            info = store.tag(selector, name)
            if as_json:
                emit_json({"tagged": name, "version": info.to_json()})
            else:
                click.echo(f"tagged {label(info)} as {name}")
            return
        tags = store.tags()
        infos = {name: store.resolve(vid) for name, vid in tags.items()}
    if as_json:
        emit_json({"tags": {n: infos[n].to_json() for n in sorted(infos)}})
        return
    if not infos:
        click.echo("no tags")
    for tag_name in sorted(infos):
        click.echo(f"{tag_name}  {label(infos[tag_name])}")


# --- rm -------------------------------------------------------------------------------------


@cli.command()
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
    Exit codes: 0 removed (or would be, with --dry-run); 2 bad selector,
    tagged version without --force, or not a store.
    """
    with open_store(store_path) as store:
        infos = list({info.id: info for info in map(store.resolve, selectors)}.values())
        tags = tags_by_version(store)
        pinned = [(i, tags[i.id]) for i in infos if i.id in tags]
        if pinned and not force:
            names = "; ".join(f"{i.short_id} is tagged {', '.join(t)}" for i, t in pinned)
            raise CliError(f"{names}; untag first or pass --force; nothing removed", EXIT_USAGE)
        if not dry_run:
            for info in infos:
                store.delete(info.id, force=force)
    if as_json:
        emit_json({"dry_run": dry_run, "removed": [version_json(i, tags) for i in infos]})
        return
    verb = "would remove" if dry_run else "removed"
    for info in infos:
        click.echo(f"{verb} {label(info)}")
    if not dry_run:
        click.echo("space is freed by `chunkstore gc` once no version references the chunks")


# --- gc and prune ---------------------------------------------------------------------------


def gc_text(result: GcResult) -> None:
    verb = "would free" if result.dry_run else "freed"
    click.echo(f"{'dry run: ' if result.dry_run else ''}{result.versions_considered} live"
               f" versions; {verb} {format_size(result.bytes_freed + result.orphan_bytes_freed)}"
               f" ({result.chunks_deleted} chunks, {result.nodes_deleted} manifest nodes,"
               f" {result.orphans_deleted} unindexed objects)")
    click.echo(f"kept for the grace period ({format_duration(result.grace_s)}):"
               f" {format_size(result.kept_by_grace_bytes)} in {result.kept_by_grace} objects;"
               f" kept for saves in progress: {result.kept_by_sessions} objects")
    if result.sessions_expired:
        click.echo(f"expired {result.sessions_expired} write sessions of dead processes")
    if result.temporaries_deleted:
        click.echo(f"removed {result.temporaries_deleted} temporary files of interrupted writes")
    if result.unfinished_deletions:
        click.echo(f"finished {result.unfinished_deletions} deletions of an interrupted gc")
    for line in result.index_disagreements:
        click.echo(f"warning: {line}", err=True)


@cli.command()
@STORE_ARG
@GRACE_OPT
@click.option("-n", "--dry-run", is_flag=True,
              help="Decide exactly as a real run would; delete nothing.")
@click.option("--no-sweep", is_flag=True,
              help="Skip listing storage for objects the index does not know.")
@JSON_OPT
def gc(store_path: str, grace: str, dry_run: bool, no_sweep: bool, as_json: bool) -> None:
    """Delete chunks and manifest nodes that no version references.

    An object is deleted only after it has been unreferenced for the
    grace period (default one hour), so a reader of a version removed a
    moment ago keeps working, and never while a save in progress uses it.
    Objects left by killed saves are collected the same way, by write
    time. Versions are removed with `rm` or `prune` first; gc frees their
    space. A gc that outlives half the grace period stops (exit 4) rather
    than break that promise; run it again. Only one gc runs at a time.

    \b
    Examples:
      chunkstore gc ckpts/ --dry-run      # what would be freed
      chunkstore gc ckpts/ --grace 2d --json

    \b
    Exit codes: 0 done; 2 bad option or not a store; 4 another gc is
    running, the run stopped at half the grace period, or storage failed.
    """
    with open_store(store_path) as store:
        progress = TerminalProgress()
        result = store.gc(parse_duration(grace), dry_run=dry_run, sweep=not no_sweep,
                          progress=progress)
    if as_json:
        emit_json(result.to_json())
    else:
        gc_text(result)


def parse_best(text: str | None) -> tuple[Any, ...] | None:
    """``loss:3`` or ``accuracy:3:max`` -> ``("loss", 3)`` / ``("accuracy", 3, "max")``."""
    if text is None:
        return None
    parts: list[str] = text.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit():
        raise CliError(f"--keep-best {text!r}: expected METRIC:N or METRIC:N:max", EXIT_USAGE)
    return (parts[0], int(parts[1]), *parts[2:])


@cli.command()
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
    with open_store(store_path) as store:
        result = store.prune(run=run, dry_run=dry_run, verify=not no_verify,
                             keep_last=keep_last, keep_every=keep_every,
                             keep_within=keep_within, keep_best=parse_best(keep_best),
                             min_previous=min_previous)
    if as_json:
        emit_json(result.to_json())
        return
    for vid in result.unverified:
        click.echo(f"warning: version {vid[:12]} does not verify; kept, and not counted as"
                   " the newest good version", err=True)
    verb = "would remove" if dry_run else "removed"
    for info in result.removed:
        click.echo(f"{verb} {label(info)}")
    click.echo(f"{len(result.kept)} versions kept, {len(result.removed)}"
               f" {'would be removed' if dry_run else 'removed'}"
               + ("" if dry_run or not result.removed else
                  "; run `chunkstore gc` to free their space after the grace period"))


# --- index ----------------------------------------------------------------------------------


@cli.group()
def index() -> None:
    """Maintain the LMDB index (a cache of what the manifests say)."""


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
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(f"index rebuilt: {result.versions} versions, {result.chunks} chunks"
                   f" ({result.unreferenced_chunks} unreferenced)")
        for vid in result.skipped:
            click.echo(f"skipped unreadable version {vid[:12]} (see `chunkstore verify`)")
    if result.skipped:
        raise SystemExit(EXIT_PROBLEMS)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``chunkstore`` console script."""
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name="chunkstore")
    except KeyboardInterrupt:
        click.echo("chunkstore: interrupted", err=True)
        raise SystemExit(130) from None
