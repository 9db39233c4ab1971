"""What ``verify``'s findings mean to the person who has to act on them.

:func:`~chunkstore.maintenance.verify.verify` records a :class:`Problem` for every
version a damaged object breaks, so one pack cut short is dozens of findings: each
chunk in it, for each version that uses one.  :func:`summarize` folds them into the
two answers a user acts on:

1. **each version once** (:class:`VersionVerdict`): readable or damaged, and which of
   its entries (tensors and data) cannot be read; a version whose commit record or
   manifest tree cannot be read is damaged as a whole;
2. **each damaged object once** (:class:`DamagedObject`): its kind (chunk, pack,
   node, record, moved record, tag), its key in the store, whether it is missing or
   corrupt, and the versions and entries that need it.  These are what
   ``chunkstore repair STORE --from OTHER`` rewrites.

Findings about the index (``refcount``, ``index``) break no version and name no
stored object: the index is a cache, and ``chunkstore index rebuild`` restores it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Finding kinds that are the index's (a cache), not damage to what the store holds.
INDEX_KINDS = frozenset({"refcount", "index"})
#: ``object_state`` of an object a copy from another store mends (``repair``).
REPAIRABLE = frozenset({"missing", "corrupt"})
#: ``object_state`` of an object this release cannot read (a newer format).
NEWER_FORMAT = "newer format"


@dataclass(frozen=True)
class Problem:
    """One finding: ``kind`` is a stable machine-readable word.

    ``version`` (with its ``run`` and ``step``) is the version it breaks, ``tensor``
    the entry of that version; ``object_kind`` and ``object_key`` name the stored
    object at fault (chunk, pack, node, record, moved record, tag) and
    ``object_state`` what is wrong with it (missing, corrupt, newer format).
    """

    kind: str  # missing-chunk, corrupt-chunk, corrupt-node, corrupt-record, corrupt-tag,
    #            corrupt-moved, format-version, unreadable, refcount, index,
    #            bad-signature
    message: str
    version: str | None = None
    digest: str | None = None
    run: str | None = None
    step: int | None = None
    tensor: str | None = None
    object_kind: str | None = None
    object_key: str | None = None
    object_state: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def version_label(version_id: str, run: str | None, step: int | None) -> str:
    """``RUN@STEP``, or the short id where the run and step are unknown."""
    return f"{run}@{step}" if run is not None and step is not None else version_id[:12]


@dataclass
class VersionVerdict:
    """One checked version: ``damaged`` when a read of it fails anywhere.

    ``damaged_entries`` are the entries a read cannot return; ``reason`` says why no
    entry can be read at all (its commit record or manifest tree is damaged).
    """

    id: str
    run: str | None = None
    step: int | None = None
    #: entries (tensors and data) the version holds; None: its tree cannot be read
    entries: int | None = None
    damaged: bool = False
    damaged_entries: list[str] = field(default_factory=list)
    reason: str | None = None
    #: who signed it, as the trusted keys see it (chunkstore.handle.signatures: "corrupt"
    #: for a damaged version); None: no trusted keys were given, signatures not checked
    signature: str | None = None
    #: the fingerprint of the key that signed it
    signed_by: str | None = None

    @property
    def label(self) -> str:
        return version_label(self.id, self.run, self.step)

    def to_json(self) -> dict[str, Any]:
        found = {"id": self.id, "run": self.run, "step": self.step, "label": self.label,
                 "damaged": self.damaged, "entries": self.entries,
                 "damaged_entries": self.damaged_entries, "reason": self.reason}
        if self.signature is not None:
            found.update(signature=self.signature, signed_by=self.signed_by)
        return found


@dataclass
class DamagedObject:
    """One stored object at fault, named once, with what needs it."""

    kind: str  # chunk, pack, node, record, moved record, tag
    key: str
    state: str  # missing, corrupt, newer format
    reason: str
    #: the chunks a read found damaged in it (the members of a pack; the chunk itself)
    chunks: set[str] = field(default_factory=set)
    #: the versions that need it, each with the entries it breaks there
    needed_by: dict[str, list[str]] = field(default_factory=dict)
    #: what else is known of it (a pack's own header)
    notes: list[str] = field(default_factory=list)

    @property
    def repairable(self) -> bool:
        """Whether ``chunkstore repair`` rewrites it from another store's copy (a tag is
        the user's to set again)."""
        return self.kind != "tag" and self.state in REPAIRABLE

    def to_json(self, labels: dict[str, str]) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key, "state": self.state,
                "reason": self.reason, "notes": self.notes, "chunks": len(self.chunks),
                "versions": [labels.get(v, v[:12]) for v in self.needed_by],
                "version_ids": list(self.needed_by),
                "entries": {labels.get(v, v[:12]): names for v, names in self.needed_by.items()}}


def summarize(problems: list[Problem], warnings: list[Problem],
              verdicts: dict[str, VersionVerdict]) -> list[DamagedObject]:
    """Mark the damaged versions in ``verdicts`` and return each damaged object once,
    in the order the findings first name it, with the versions that need it in the
    order of ``verdicts``; a pack-header warning about an object that is damaged
    anyway becomes a note on it."""
    objects: dict[tuple[str, str], DamagedObject] = {}
    for problem in problems:
        if problem.kind in INDEX_KINDS:
            continue
        if problem.version is not None:
            _mark_version(verdicts, problem.version, problem)
        if problem.object_kind is not None and problem.object_key is not None:
            _add_to_object(objects, problem.object_kind, problem.object_key, problem)
    order = {vid: i for i, vid in enumerate(verdicts)}
    for damaged in objects.values():  # in the order of the versions, entries by name
        damaged.needed_by = {vid: sorted(names) for vid, names in sorted(
            damaged.needed_by.items(), key=lambda item: order.get(item[0], len(order)))}
    for verdict in verdicts.values():
        verdict.damaged_entries.sort()
    by_digest = {o.key.rsplit("/", 1)[-1]: o for o in objects.values() if o.kind == "pack"}
    for warning in warnings:
        if warning.digest is not None and warning.digest in by_digest:
            by_digest[warning.digest].notes.append(warning.message)
    return list(objects.values())


def _add_to_object(objects: dict[tuple[str, str], DamagedObject], kind: str, key: str,
                   problem: Problem) -> None:
    damaged = objects.get((kind, key))
    if damaged is None:
        damaged = objects[kind, key] = DamagedObject(
            kind, key, problem.object_state or "corrupt", problem.message)
    if problem.digest is not None and problem.kind.endswith("chunk"):
        damaged.chunks.add(problem.digest)
    if problem.version is not None:
        names = damaged.needed_by.setdefault(problem.version, [])
        if problem.tensor is not None and problem.tensor not in names:
            names.append(problem.tensor)


def _mark_version(verdicts: dict[str, VersionVerdict], version_id: str,
                  problem: Problem) -> None:
    verdict = verdicts.setdefault(version_id, VersionVerdict(version_id, problem.run,
                                                             problem.step))
    verdict.damaged = True
    if problem.tensor is not None:
        if problem.tensor not in verdict.damaged_entries:
            verdict.damaged_entries.append(problem.tensor)
    elif verdict.reason is None:
        verdict.reason = problem.message


def folded_warnings(warnings: list[Problem], objects: list[DamagedObject]) -> list[Problem]:
    """The warnings that are not already a note on a damaged object."""
    noted = {note for o in objects for note in o.notes}
    return [w for w in warnings if w.message not in noted]
