"""``chunkstore verify``'s answer as text, in the order a user acts on it:

1. one line: what was checked, and the verdict (versions damaged, objects damaged,
   index problems, warnings), with no later line that contradicts it;
2. where something is wrong, each version once by ``RUN@STEP`` (damaged, with the
   entries a read cannot return, or readable);
3. each damaged stored object once: its kind (chunk, pack, node, record, moved
   record, tag), its key in the store, what is wrong, and the versions and entries
   that need it;
4. the index's problems (a cache: ``index rebuild``);
5. the command that mends each kind of problem.

``--json`` gives the same as ``versions`` and ``objects``, beside the raw
``problems`` (one per version and entry a damaged object breaks).
"""

from __future__ import annotations

import click

from chunkstore.cli.common import format_size, plural
from chunkstore.maintenance.findings import (
    INDEX_KINDS,
    NEWER_FORMAT,
    DamagedObject,
    VersionVerdict,
    folded_warnings,
)
from chunkstore.maintenance.verify import VerifyResult

#: Readable versions listed one per line up to this many; past it, one summary line.
READABLE_LISTED = 20
#: Names (versions, entries, index problems) shown in a list before "and N more".
NAMES_SHOWN = 5
INDEX_LINES = 10


def verify_text(result: VerifyResult, quick: bool, store_path: str = "STORE") -> None:
    click.echo(f"{plural(result.versions_checked, 'version')}, {_checked(result, quick)}:"
               f" {_verdict(result)} ({result.seconds:.2f} s)")
    if result.versions_trusted:
        click.echo(f"({result.versions_trusted} of {plural(result.versions_checked, 'version')}"
                   " read by an earlier verify: their commit records and manifests were"
                   " checked present, not read again; a verify without --quick reads"
                   " everything)")
    if any(v.signature is not None for v in result.versions):
        _signatures_text(result)
    if not result.ok:
        _versions_text(result, _readable_word(result, quick))
        _objects_text(result.objects, {v.id: v.label for v in result.versions})
        _unreadable_text(result)
        _index_text(result)
    for warning in folded_warnings(result.warnings, result.objects):
        click.echo(f"warning: {warning.kind}: {warning.message} (no read uses a pack's own"
                   " header: each member a version needs was read back whole, checked by its"
                   " own header and hash)", err=True)
    _remedies_text(result, store_path)


def _signatures_text(result: VerifyResult) -> None:
    """With trusted keys: how many versions of each signature verdict, then every
    version not signed by a trusted key, by name."""
    counts: dict[str, int] = {}
    for verdict in result.versions:
        counts[verdict.signature or ""] = counts.get(verdict.signature or "", 0) + 1
    click.echo("signatures: " + ", ".join(f"{n} {status}" for status, n in sorted(
        counts.items())))
    width = max((len(v.label) for v in result.versions), default=0)
    for verdict in result.versions:
        if verdict.signature != "signed-by-trusted":
            key = f"  key {verdict.signed_by[:16]}" if verdict.signed_by else ""
            click.echo(f"  {verdict.label:<{width}}  {verdict.id[:12]}  {verdict.signature}"
                       + key)


def _checked(result: VerifyResult, quick: bool) -> str:
    chunks = plural(result.chunks_checked, "chunk")
    if quick:  # --quick reads no chunk, so it has no byte count to give
        return f"{chunks} present"
    if result.subset is not None:
        return (f"{chunks} present; data subset {result.subset}:"
                f" {result.objects_read} of {plural(result.objects_total, 'object')}"
                f" ({plural(result.chunks_read, 'chunk')}) read and hash-checked"
                f" ({format_size(result.bytes_checked)})")
    return f"{chunks} read and hash-checked ({format_size(result.bytes_checked)})"


def _verdict(result: VerifyResult) -> str:
    parts = []
    damaged = sum(v.damaged for v in result.versions)
    if damaged:
        parts.append(f"{damaged} of {plural(len(result.versions), 'version')} damaged")
    if result.objects:
        parts.append(plural(len(result.objects), "damaged object"))
    index = sum(p.kind in INDEX_KINDS for p in result.problems)
    if index:
        parts.append(plural(index, "index problem"))
    if not parts and not result.ok:  # a finding of a kind this layout does not group
        parts.append(plural(len(result.problems), "problem"))
    verdict = ", ".join(parts) or "ok"
    warnings = folded_warnings(result.warnings, result.objects)
    return verdict + (f", {plural(len(warnings), 'warning')}" if warnings else "")


def _readable_word(result: VerifyResult, quick: bool) -> str:
    if quick:
        return "present (not read: --quick)"
    if result.subset is not None:
        return f"no damage found (data subset {result.subset} read)"
    return "readable"


def _names(names: list[str], shown: int = NAMES_SHOWN) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def _versions_text(result: VerifyResult, readable: str) -> None:
    ordered = result.versions  # in RUN@STEP order
    width = max((len(v.label) for v in ordered), default=0)
    healthy = [v for v in ordered if not v.damaged]
    listed = healthy if len(healthy) <= READABLE_LISTED else []
    click.echo("versions:")
    for verdict in ordered:
        if verdict.damaged or verdict in listed:
            click.echo(f"  {verdict.label:<{width}}  {verdict.id[:12]}"
                       f"  {_version_state(verdict, readable)}")
    if healthy and not listed:
        newest: dict[str, str] = {}
        for verdict in healthy:  # in step order: the last of each run is the newest
            newest[verdict.run or ""] = verdict.label
        click.echo(f"  {plural(len(healthy), 'more version')} {readable}; the newest of each"
                   f" run: {_names(sorted(newest.values()))} (--json lists every version)")


def _version_state(verdict: VersionVerdict, readable: str) -> str:
    if not verdict.damaged:
        return readable
    if not verdict.damaged_entries:
        return f"damaged: {verdict.reason or 'cannot be read'}"
    of = f" of {verdict.entries}" if verdict.entries is not None else ""
    return (f"damaged: {len(verdict.damaged_entries)}{of} entries cannot be read:"
            f" {_names(verdict.damaged_entries)}")


def _objects_text(objects: list[DamagedObject], labels: dict[str, str]) -> None:
    if not objects:
        return
    click.echo("damaged objects (each once, with what needs it):")
    for damaged in objects:
        click.echo(f"  {damaged.kind} {damaged.key}: {_object_state(damaged)}")
        if damaged.needed_by:
            versions = [labels.get(v, v[:12]) for v in damaged.needed_by]
            entries = sorted({n for names in damaged.needed_by.values() for n in names})
            needs = f"; entries {_names(entries)}" if entries else ""
            click.echo(f"    needed by {plural(len(versions), 'version')}:"
                       f" {_names(versions)}{needs}")


def _object_state(damaged: DamagedObject) -> str:
    if damaged.state == "missing":
        return "missing"
    reason = damaged.notes[0] if damaged.notes else damaged.reason
    text = f"{damaged.state}: {reason}"
    if damaged.kind == "pack" and damaged.chunks:
        fail = "fails its" if len(damaged.chunks) == 1 else "fail their"
        text += f"; {plural(len(damaged.chunks), 'chunk')} in it {fail} check"
    return text


def _unreadable_text(result: VerifyResult) -> None:
    """Entries this release cannot read (no object is damaged: a newer dtype or layout)."""
    found = [p for p in result.problems if p.kind == "unreadable"]
    if not found:
        return
    click.echo("entries this release cannot read:")
    labels = {v.id: v.label for v in result.versions}
    for problem in found:
        version = problem.version or ""
        click.echo(f"  {labels.get(version, version[:12])} entry {problem.tensor}:"
                   f" {problem.message}")


def _index_text(result: VerifyResult) -> None:
    found = [p for p in result.problems if p.kind in INDEX_KINDS]
    if not found:
        return
    click.echo("index problems (the index is a cache of the store; no data is damaged):")
    labels = {v.id: v.label for v in result.versions}
    for problem in found[:INDEX_LINES]:
        what = (f"version {labels.get(problem.version, problem.version[:12])}"
                if problem.version else f"chunk {(problem.digest or '')[:16]}")
        click.echo(f"  {problem.kind} {what}: {problem.message}")
    if len(found) > INDEX_LINES:
        click.echo(f"  and {len(found) - INDEX_LINES} more (--json lists every one)")


def _remedies_text(result: VerifyResult, store_path: str) -> None:
    repairable = [o for o in result.objects if o.repairable]
    if repairable:
        them = "it" if len(repairable) == 1 else f"these {len(repairable)} objects"
        click.echo(f"to repair: `chunkstore repair {store_path} --from OTHER` rewrites {them}"
                   " from a store holding whole copies (a mirror, or a store sync wrote);"
                   " add --dry-run first to see what it would fix")
    tags = [o.key.rsplit("/", 1)[-1] for o in result.objects if o.kind == "tag"]
    if tags:
        click.echo(f"to fix a tag: `chunkstore tag {store_path} -d NAME`, then tag the version"
                   f" again (damaged: {_names(tags)})")
    if any(o.state == NEWER_FORMAT for o in result.objects) or any(
            p.kind == "unreadable" for p in result.problems):
        click.echo("to read what this release cannot: upgrade chunkstore")
    if any(p.kind in INDEX_KINDS for p in result.problems):
        click.echo(f"to fix the index: `chunkstore index rebuild {store_path}`")
