"""Which stored object a failed check of ``verify`` is about, and what needs it.

A read fails on a chunk, but the object to mend is the stored one: the chunk object,
a delta base of its chain, the pack either lies in now (found through the moved
records of a repacked pack), the moved record that leads nowhere, or the manifest
node a tree or data read failed on.  Each finding is given its version's run and
step, the entry of that version it breaks and that object as (kind, key, state), so
:func:`~chunkstore.maintenance.findings.summarize` can name each object once.
Only failed checks come here: a clean verify walks nothing twice.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from chunkstore.errors import ChunkStoreError, FormatVersionError
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import PackLocation, TensorEntry
from chunkstore.handle.tree import FlatTree
from chunkstore.maintenance.findings import NEWER_FORMAT, Problem, VersionVerdict
from chunkstore.objects.kinds import CHUNKS, MOVED, NODES
from chunkstore.read.members import Locations, locate_member
from chunkstore.read.reader import chunk_reads

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

#: one chunk read verify makes: digest, length, listed delta chain and pack location
ChunkCheck = tuple[Digest, int, tuple[Digest, ...], PackLocation | None, Locations]


def at(verdict: VersionVerdict, problem: Problem, tensor: str | None = None,
        where: tuple[str, str, str] | None = None) -> Problem:
    """``problem`` as it breaks ``verdict``'s version (entry ``tensor``), naming the
    stored object at fault: ``where`` is its (kind, key, state)."""
    kind, key, state = where or (None, None, None)
    return replace(problem, version=verdict.id, run=verdict.run, step=verdict.step,
                   tensor=tensor, object_kind=kind, object_key=key, object_state=state)


def node_at_fault(store: StoreHandle, exc: ChunkStoreError) -> tuple[str, str, str] | None:
    """The manifest node a tree or data read failed on, as (kind, key, state)."""
    digest = getattr(exc, "digest", None)
    if digest is None:  # a newer format: the error names the node only in its text
        return None
    if isinstance(exc, FormatVersionError):
        return "node", NODES.key(Digest.parse(digest)), NEWER_FORMAT
    present = store.objects.exists(NODES, Digest.parse(digest))
    return "node", NODES.key(Digest.parse(digest)), "corrupt" if present else "missing"


def failed_read_problems(store: StoreHandle, failed: list[tuple[ChunkCheck, Problem]],
                         reads: dict[ChunkCheck, list[str]], trees: dict[str, FlatTree],
                         verdicts: dict[str, VersionVerdict]) -> list[Problem]:
    """Name each failed chunk read for every version and entry it breaks, with the
    stored object at fault (the pack a member lies in, not the member)."""
    problems: list[Problem] = []
    entries = _entries_needing(store, {check for check, _ in failed},
                               {vid for check, _ in failed for vid in reads[check]}, trees)
    for check, problem in failed:
        where = _object_at_fault(store, check, problem)
        for vid in reads[check]:
            names: list[str | None] = [*entries.get((vid, check), ())] or [None]
            for name in names:
                problems.append(at(verdicts[vid], problem, name, where))
    return problems


def _entries_needing(store: StoreHandle, checks: set[ChunkCheck], versions: set[str],
                     trees: dict[str, FlatTree]) -> dict[tuple[str, ChunkCheck], list[str]]:
    """The entries of each of ``versions`` that make each of ``checks`` (only the
    versions a failed read breaks are walked again)."""
    needing: dict[tuple[str, ChunkCheck], list[str]] = {}
    for vid in sorted(versions):
        for name, leaf in trees[vid].leaves.items():
            if not isinstance(leaf, TensorEntry):
                continue
            try:
                spans = chunk_reads(leaf, store.chunk_size)
            except (ChunkStoreError, ValueError):
                continue  # reported by _check_leaves
            for digest, _start, length, chain, location, locations in spans:
                check = (digest, length, chain, location, locations)
                if check in checks:
                    names = needing.setdefault((vid, check), [])
                    if not names or names[-1] != name:
                        names.append(name)
    return needing


def _object_at_fault(store: StoreHandle, check: ChunkCheck, problem: Problem
                     ) -> tuple[str, str, str]:
    """The stored object a failed chunk read is about, as (kind, key, state): the
    chunk object, a delta base of its chain, or the pack either lies in now (through
    the moved records of a repacked pack; a moved record that leads nowhere is it)."""
    digest, _length, chain, location, locations = check
    failed = digest if problem.digest is None else Digest.parse(problem.digest)
    state = {"missing-chunk": "missing", "format-version": NEWER_FORMAT}.get(problem.kind,
                                                                           "corrupt")
    if failed == digest:
        at = location
    elif failed in chain:
        at = (locations or (None,) * len(chain))[chain.index(failed)]
    else:  # a pack found missing names the pack
        return _pack_at_fault(store, failed, state)
    if at is None:
        return "chunk", CHUNKS.key(failed), state
    try:
        at = locate_member(store, failed, at)
    except ChunkStoreError:
        return _pack_at_fault(store, at.pack, "missing")
    return "pack", CHUNKS.key(at.pack), state


def _pack_at_fault(store: StoreHandle, pack: Digest, state: str) -> tuple[str, str, str]:
    if store.objects.exists(CHUNKS, pack):
        return "pack", CHUNKS.key(pack), state
    if store.objects.exists(MOVED, pack):  # repacked, and its record does not lead on
        return "moved record", MOVED.key(pack), "corrupt"
    return "pack", CHUNKS.key(pack), "missing"
