"""``verify``'s reading of the versions it checks: each version's commit record and
manifest tree, then the data nodes they list (each distinct one once), read in
parallel (:func:`~chunkstore.read.reader.map_jobs`: on an object store each read
waits on a request, and a first ``--quick`` verify of an index reads every
version); then every version checked in turn, so the findings come in the order and
with the words of reading them one after another: the leaves a read cannot read,
and the chunk reads each readable leaf implies (:mod:`chunkstore.maintenance.verify`
checks those)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkstore.errors import (
    ChunkStoreError,
    CorruptChunkError,
    CorruptNodeError,
    CorruptRecordError,
    CorruptTagError,
    FormatVersionError,
    MissingChunkError,
)
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import DataEntry
from chunkstore.format.records import CommitRecord
from chunkstore.handle.tree import FlatTree, flatten, load_data
from chunkstore.maintenance.atfault import ChunkCheck, at, node_at_fault
from chunkstore.maintenance.findings import NEWER_FORMAT, Problem, VersionVerdict
from chunkstore.objects.kinds import NODES, VERSIONS
from chunkstore.read.reader import chunk_reads, map_jobs

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

__all__ = ["load_versions", "problem_from"]


_KINDS: tuple[tuple[type[ChunkStoreError], str], ...] = (
    (MissingChunkError, "missing-chunk"), (CorruptChunkError, "corrupt-chunk"),
    (FormatVersionError, "format-version"), (CorruptRecordError, "corrupt-record"),
    (CorruptNodeError, "corrupt-node"), (CorruptTagError, "corrupt-tag"),
)


def problem_from(exc: ChunkStoreError, version: str | None) -> Problem:
    """A finding from the typed error a read raised; ``unreadable`` for the rest
    (an unknown dtype, a sharded tensor this release cannot read)."""
    kind = next((k for cls, k in _KINDS if isinstance(exc, cls)), "unreadable")
    return Problem(kind, str(exc), version, getattr(exc, "digest", None))


def _check_leaves(store: StoreHandle, verdict: VersionVerdict, flat: FlatTree,
                  problems: list[Problem], reads: dict[ChunkCheck, list[str]],
                  checked: dict[object, list[ChunkCheck]],
                  data: dict[Digest, ChunkStoreError | None]) -> None:
    """Check every leaf the way a read does; collect the chunk reads it implies
    (each chunk at every length its positions imply, with the versions that need it).
    A leaf that an earlier version lists too and that passed is checked once
    (``checked``, by data node, or by the tensor entry the manifest decoder shares
    between versions, which ``trees`` keeps alive: its chunk reads).  ``data``: what
    the read of each data node raised (None: it read), from :func:`_read_data`."""
    for name, leaf in flat.leaves.items():
        key = leaf.digest if isinstance(leaf, DataEntry) else id(leaf)
        known = checked.get(key)
        if known is not None:
            _needed_by(reads, known, verdict.id)
            continue
        if isinstance(leaf, DataEntry):
            failure = data[leaf.digest]
            if failure is not None:
                problems.append(at(verdict, problem_from(failure, None), name,
                                           node_at_fault(store, failure)))
            else:
                checked[key] = []
            continue
        try:
            spans = chunk_reads(leaf, store.chunk_size)
        except ChunkStoreError as exc:  # a dtype or layout this release cannot read
            problems.append(at(verdict, problem_from(exc, None), name))
            continue
        except ValueError as exc:  # what chunk_reads finds wrong with the manifest
            corrupt = CorruptNodeError(flat.owners[name].hex, f"entry {name!r}: {exc}")
            problems.append(at(verdict, problem_from(corrupt, None), name,
                                       ("node", NODES.key(flat.owners[name]), "corrupt")))
            continue
        checks = [(digest, length, chain, location, locations)
                  for digest, _start, length, chain, location, locations in spans]
        checked[key] = checks
        _needed_by(reads, checks, verdict.id)


def _needed_by(reads: dict[ChunkCheck, list[str]], checks: list[ChunkCheck],
               version_id: str) -> None:
    """Note that version ``version_id`` needs each of ``checks``."""
    for check in checks:
        needed_by = reads.setdefault(check, [])
        if not needed_by or needed_by[-1] != version_id:
            needed_by.append(version_id)


@dataclass
class _VersionRead:
    """What reading one version's commit record and manifest tree found: the record or
    why it could not be read; the tree, or why not."""

    record: CommitRecord | None = None
    record_failure: FileNotFoundError | ChunkStoreError | None = None
    flat: FlatTree | None = None
    tree_failure: ChunkStoreError | None = None


def _read_version(store: StoreHandle, version_id: str) -> _VersionRead:
    """A pool job: the version's record and tree, each failure kept for its finding."""
    try:
        record = store.read_record(version_id)
    except (FileNotFoundError, ChunkStoreError) as exc:
        return _VersionRead(record_failure=exc)
    try:
        return _VersionRead(record, flat=flatten(store.objects, record.root, store.node_cache))
    except ChunkStoreError as exc:
        return _VersionRead(record, tree_failure=exc)


def _read_data_node(store: StoreHandle, digest: Digest) -> ChunkStoreError | None:
    """A pool job: whether the data node reads (None) or what its read raises."""
    try:
        load_data(store.objects, digest)
    except ChunkStoreError as exc:
        return exc
    return None


def _load_version(store: StoreHandle, verdict: VersionVerdict, read: _VersionRead,
                  problems: list[Problem]) -> FlatTree | None:
    """The version's tree; None, with the finding, where its commit record or tree
    cannot be read (its run and step then come from the index, where it has them)."""
    record_key = VERSIONS.key(verdict.id)
    if read.record is None:
        exc = read.record_failure
        entry = store.index.version(verdict.id)
        if entry is not None:
            verdict.run, verdict.step = entry.run, entry.step
        if isinstance(exc, FileNotFoundError):  # removed meanwhile: nothing to repair
            problems.append(at(verdict, Problem(
                "corrupt-record", "commit record vanished while verifying (deleted"
                " concurrently?)")))
        else:
            assert exc is not None
            state = NEWER_FORMAT if isinstance(exc, FormatVersionError) else "corrupt"
            problems.append(at(verdict, problem_from(exc, None), None,
                                       ("record", record_key, state)))
        return None
    verdict.run, verdict.step = read.record.run, read.record.step
    if read.tree_failure is not None:
        problems.append(at(verdict, problem_from(read.tree_failure, None), None,
                                   node_at_fault(store, read.tree_failure)))
    return read.flat


def load_versions(store: StoreHandle, ids: list[str], problems: list[Problem],
                  reads: dict[ChunkCheck, list[str]]
                  ) -> tuple[dict[str, FlatTree], dict[str, VersionVerdict]]:
    """Read every version of ``ids`` (records and trees, then the data nodes they
    list, each distinct one once) in parallel; then check each in turn, so the
    findings come in the order and with the words of a serial read."""
    found = map_jobs(store.executor, ids, functools.partial(_read_version, store),
                     store.read_jobs)
    listed = {leaf.digest: None for read in found if read.flat is not None
              for leaf in read.flat.leaves.values() if isinstance(leaf, DataEntry)}
    data = dict(zip(listed, map_jobs(store.executor, list(listed),
                                     functools.partial(_read_data_node, store), store.read_jobs),
                    strict=True))
    trees: dict[str, FlatTree] = {}
    verdicts: dict[str, VersionVerdict] = {}
    checked: dict[object, list[ChunkCheck]] = {}
    for version_id, read in zip(ids, found, strict=True):
        verdict = verdicts[version_id] = VersionVerdict(version_id)
        flat = _load_version(store, verdict, read, problems)
        if flat is not None:
            verdict.entries = len(flat.leaves)
            _check_leaves(store, verdict, flat, problems, reads, checked, data)
            trees[version_id] = flat
    return trees, verdicts
