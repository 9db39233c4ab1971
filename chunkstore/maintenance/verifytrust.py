"""What ``verify --quick`` takes from the index instead of reading it: the versions a
verify found readable or their own save recorded (:meth:`~chunkstore.index.lmdbindex.
Index.verified_versions`), checked present by a listing; and what a verify tells the
index back: the versions it found readable, and those it found damaged, which no
later ``--quick`` trusts (docs/recovery.md, "What verify --quick reads")."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from chunkstore.errors import StorageFullError
from chunkstore.format.digest import Digest
from chunkstore.handle.tree import FlatTree
from chunkstore.index.writegate import WriterBusy
from chunkstore.maintenance.atfault import ChunkCheck
from chunkstore.maintenance.findings import Problem, VersionVerdict
from chunkstore.maintenance.verifyload import load_versions
from chunkstore.objects.kinds import NODES

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle
    from chunkstore.index.lmdbindex import VerifiedVersion

log = logging.getLogger(__name__)


def split_refs(joined: bytes) -> list[bytes]:
    """The raw digests of an index's references (32 bytes each, joined)."""
    return [joined[i:i + 32] for i in range(0, len(joined), 32)]


def trusted_versions(store: StoreHandle, ids: list[str], chunks: set[bytes]
                     ) -> dict[str, VerifiedVersion]:
    """The versions of ``ids`` whose record and tree an earlier verify found readable,
    or the save that built them recorded
    (:meth:`~chunkstore.index.lmdbindex.Index.verified_versions`), and every object of
    which is still stored, by one listing of the chunk objects (``chunks``, raw
    digests) and one of the nodes (an object store: one LIST request per 1,000
    objects).  A version one of whose objects is not listed is left out: the caller
    checks it as an unknown one, which names what is missing the usual way (and finds a
    repacked pack's members where its moved record says)."""
    known = store.index.verified_versions(ids)
    if not known:
        return known
    nodes = {d.raw for d in store.objects.ids(NODES)}
    return {vid: v for vid, v in known.items()
            if all(d in chunks for d in split_refs(v.chunk_refs))
            and all(d in nodes for d in split_refs(v.node_refs))}


def load_untrusted(store: StoreHandle, ids: list[str], trusted: dict[str, VerifiedVersion],
                   problems: list[Problem], reads: dict[ChunkCheck, list[str]]
                   ) -> tuple[dict[str, FlatTree], dict[str, VersionVerdict]]:
    """Read the versions of ``ids`` not ``trusted``, then those trusted that list a
    node found damaged (:func:`_sharing_damaged_nodes`), until none does."""
    trees, verdicts = load_versions(store, [i for i in ids if i not in trusted],
                                    problems, reads)
    while sharing := _sharing_damaged_nodes(trusted, problems):
        # read too, so each is named with the entries it loses, as before it was trusted
        more_trees, more_verdicts = load_versions(store, sharing, problems, reads)
        trees.update(more_trees)
        verdicts.update(more_verdicts)
    return trees, verdicts


def _sharing_damaged_nodes(trusted: dict[str, VerifiedVersion], problems: list[Problem]
                           ) -> list[str]:
    """The trusted versions that list a node this verify read damaged (a version read
    shares it), taken out of ``trusted``: a node is damaged for every version that lists
    it, not only the one that was read."""
    damaged = {Digest.parse(p.digest).raw for p in problems
               if p.object_kind == "node" and p.digest is not None}
    sharing = [vid for vid, known in trusted.items()
               if damaged and not damaged.isdisjoint(split_refs(known.node_refs))]
    for vid in sharing:
        del trusted[vid]
    return sharing


def note_readable(store: StoreHandle, trees: dict[str, FlatTree], refs: dict[str, set[bytes]],
                  verdicts: dict[str, VersionVerdict], problems: list[Problem]) -> None:
    """Remember in the index the versions this verify of the whole store found
    readable, for the next ``--quick`` (none when it found the index's references
    wrong: the index is then to be rebuilt, not trusted).  Only a help: a disk too
    full to write it costs the next quick verify its reading, nothing else."""
    if any(p.kind in ("refcount", "index") for p in problems):
        return
    try:
        store.index.note_verified(
            (vid, len(flat.leaves), refs[vid],
             {d.raw for d in flat.tree_nodes | flat.data_nodes()})
            for vid, flat in trees.items() if not verdicts[vid].damaged)
    except StorageFullError as exc:
        log.warning("verify could not remember the versions it found readable: %s", exc)


def forget_damaged(store: StoreHandle, verdicts: dict[str, VersionVerdict]) -> None:
    """Drop what the index holds readable of the versions this verify found damaged (a
    save or an earlier verify recorded them before the damage), so that the next
    ``--quick`` reads them again instead of trusting them.  Only a help, as
    :func:`note_readable` is."""
    damaged = [vid for vid, verdict in verdicts.items() if verdict.damaged]
    if not damaged:
        return
    try:
        store.index.forget_verified(damaged)
    except (StorageFullError, WriterBusy) as exc:
        log.warning("verify could not forget the versions it found damaged (the next"
                    " --quick may trust them): %s", exc)
