"""The restore a drill times, run in a fresh process (``chunkstore drill`` starts it):
the newest version that reads back (or the selector's, falling back to the run's
earlier versions), phase by phase.

1. **discovery**: open the store (its index counts in what it lacks), list the
   versions, pick the candidate, load its manifest (every node hash-checked).  A
   commit record this release cannot read (a newer format) is a failed candidate
   of its own, named by its error, and the restore goes on to the next.
2. **download**: every stored object the version's entries need (chunk objects and
   packs, delta bases included) is read once into memory, in the store's thread
   pool: the bytes a fresh machine pulls.  An object that is not there is left to
   the next phase, which names it the way any read does.
3. **validation**: ``verify`` of the version over the copies in memory: every chunk
   decoded and hash-checked, every entry checked readable.  A problem fails the
   candidate with the error class of its kind (MissingChunkError, ...).
4. **materialization**: every entry read into fresh objects (numpy arrays, or what
   the caller's ``materialize`` makes: torch tensors in torch_bridge's drill), by
   the ordinary read path, which hash-checks again (a restore never skips it).

With trusted keys (``chunkstore drill --require-signed --trust KEY.pub``, handed to
the process in ``CHUNKSTORE_DRILL_TRUST``), a candidate not signed by one of them
fails before phase 1's manifest is loaded, as ``UntrustedVersionError``, and the
restore falls back as it does past damage (docs/format.md §14).

Each phase is timed once, for the candidate that succeeded; the time spent on
candidates that failed is ``fallback_seconds``.  The copies in memory are dropped
at the end: a drill needs about twice the version's stored size in memory.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore.backends.prefetch import PrefetchBackend
from chunkstore.errors import (
    ChunkStoreError,
    SelectorError,
    SigningKeyError,
    UntrustedVersionError,
)
from chunkstore.format.digest import Digest
from chunkstore.format.manifest import DataEntry, TensorEntry
from chunkstore.handle.versions import VersionInfo
from chunkstore.maintenance.verify import verify
from chunkstore.objects.kinds import CHUNKS
from chunkstore.objects.signing import Trust
from chunkstore.read.reader import VersionReader, chunk_reads

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle

#: Reads entry ``name`` of the version into a fresh object (an array, a tensor).
Materialize = Callable[[VersionReader, str], object]

#: The trusted public key files of a ``--require-signed`` drill, a JSON list (a path
#: may hold any separator).
TRUST_ENV = "CHUNKSTORE_DRILL_TRUST"


def trust_environment(files: Sequence[str]) -> dict[str, str]:
    """What hands the drill's restore process ``files`` as its trusted keys."""
    return {TRUST_ENV: json.dumps([os.path.abspath(path) for path in files])}


def trust_from_env() -> Trust | None:
    """The keys the drill's restore requires a signature of (None: it does not)."""
    text = os.environ.get(TRUST_ENV, "")
    try:
        files = json.loads(text) if text else []
    except ValueError:
        raise SigningKeyError(TRUST_ENV, f"not a JSON list of key files: {text!r}") from None
    if not isinstance(files, list):
        raise SigningKeyError(TRUST_ENV, f"not a JSON list of key files: {text!r}")
    return Trust([str(f) for f in files]) if files else None


#: The error each kind of verify problem stands for.
_ERROR_OF_PROBLEM = {
    "missing-chunk": "MissingChunkError", "corrupt-chunk": "CorruptChunkError",
    "format-version": "FormatVersionError", "corrupt-record": "CorruptRecordError",
    "corrupt-node": "CorruptNodeError", "corrupt-tag": "CorruptTagError",
}


def read_array(reader: VersionReader, name: str) -> object:
    """The default materialization: a new numpy array."""
    return reader.get(name)


class CandidateFailed(ChunkStoreError):
    """Raised (and caught) when a candidate version does not read back; ``error`` names
    the typed error a read meets."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(message)
        self.error = error


@dataclass(frozen=True)
class Attempt:
    """A candidate that failed, with the error that stopped it."""

    version: str
    error: str
    message: str
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "error": self.error, "message": self.message,
                "seconds": round(self.seconds, 4)}


@dataclass
class RestoreReport:
    """What the restore did: the version it got, and the time of each phase."""

    version: str | None = None
    run: str | None = None
    step: int | None = None
    attempts: list[Attempt] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    fallback_seconds: float = 0.0
    objects_downloaded: int = 0
    bytes_downloaded: int = 0
    entries: int = 0
    logical_bytes: int = 0
    materialized_as: str = "numpy"
    seconds: float = 0.0  # from the start of discovery to the end

    @property
    def ok(self) -> bool:
        return self.version is not None

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "version": self.version, "run": self.run, "step": self.step,
                "attempts": [a.to_json() for a in self.attempts],
                "phases": {k: round(v, 4) for k, v in self.phases.items()},
                "fallback_seconds": round(self.fallback_seconds, 4),
                "objects_downloaded": self.objects_downloaded,
                "bytes_downloaded": self.bytes_downloaded, "entries": self.entries,
                "logical_bytes": self.logical_bytes, "materialized_as": self.materialized_as,
                "seconds": round(self.seconds, 4)}


def candidates(store: StoreHandle, selector: str | None
               ) -> tuple[list[VersionInfo], list[tuple[str, ChunkStoreError]]]:
    """Versions to try, newest first, and the commit records that cannot be read
    (without a selector: they may be the newest; nothing says how old they are)."""
    if selector is not None:
        target = store.resolve(selector)
        earlier = [v for v in store.versions(target.run) if v.step < target.step]
        return [target, *reversed(earlier)], []
    listed = store.versions()
    known = {v.id for v in listed}
    unreadable: list[tuple[str, ChunkStoreError]] = []
    for version_id in sorted(set(store.stored_version_ids()) - known):
        try:
            store.read_record(version_id)
        except FileNotFoundError:
            continue
        except ChunkStoreError as exc:
            unreadable.append((version_id, exc))
    if not listed and not unreadable:
        raise SelectorError("latest", "the store has no version to restore")
    return sorted(listed, key=lambda v: (v.created, v.id), reverse=True), unreadable


def stored_objects(store: StoreHandle, reader: VersionReader) -> set[Digest]:
    """The chunk objects and packs the version's entries read (delta bases included)."""
    needed: set[Digest] = set()
    for leaf in reader.entries().values():
        if not isinstance(leaf, TensorEntry):
            continue
        try:
            spans = chunk_reads(leaf, store.chunk_size)
        except ValueError:
            continue  # validation names it
        for digest, _start, _length, chain, location, locations in spans:
            needed.add(digest if location is None else location.pack)
            for base, at in zip(chain, locations or (None,) * len(chain), strict=True):
                needed.add(base if at is None else at.pack)
    return needed


def _download(store: StoreHandle, needed: set[Digest]) -> tuple[int, int]:
    def fetch(digest: Digest) -> int:
        try:
            return len(store.objects.get(CHUNKS, digest))
        except FileNotFoundError:
            return -1  # missing, or a repacked pack (read through its moved record)

    sizes = [n for n in store.executor.map(fetch, sorted(needed, key=lambda d: d.raw)) if n >= 0]
    return len(sizes), sum(sizes)


def _validate(store: StoreHandle, version_id: str) -> None:
    result = verify(store, version_id)
    if result.problems:
        problem = result.problems[0]
        raise CandidateFailed(_ERROR_OF_PROBLEM.get(problem.kind, "unreadable"),
                              problem.message)


def _materialize(reader: VersionReader, materialize: Materialize) -> tuple[int, int]:
    restored: dict[str, object] = {}
    for name, leaf in reader.entries().items():
        if isinstance(leaf, DataEntry):
            restored[name] = reader.get_data(name)
        else:
            restored[name] = materialize(reader, name)
    return len(restored), reader.info.logical_bytes


def _restore_one(store: StoreHandle, info: VersionInfo, materialize: Materialize,
                 report: RestoreReport, trust: Trust | None) -> None:
    """Run phases 1 (the manifest) to 4 for one candidate; raise on failure."""
    started = time.monotonic()
    if trust is not None:
        check = store.signature(info.id, trust)
        if not check.trusted:
            raise UntrustedVersionError(info.id, check.status, check.reason)
    reader = VersionReader(store, info)
    needed = stored_objects(store, reader)
    loaded = time.monotonic()
    original = store.backend
    store.backend = prefetch = PrefetchBackend(original)
    try:
        objects, size = _download(store, needed)
        downloaded = time.monotonic()
        prefetch.recording = False
        _validate(store, info.id)
        validated = time.monotonic()
        entries, logical = _materialize(reader, materialize)
        done = time.monotonic()
    finally:
        store.backend = original
    report.phases.update(manifest=loaded - started, download=downloaded - loaded,
                         validation=validated - downloaded, materialization=done - validated)
    report.objects_downloaded, report.bytes_downloaded = objects, size
    report.entries, report.logical_bytes = entries, logical


def restore(store: StoreHandle, selector: str | None = None, *,
            materialize: Materialize = read_array, materialized_as: str = "numpy",
            started: float | None = None, trust: Trust | None = None) -> RestoreReport:
    """Restore the newest version that reads back (see the module docstring).

    ``started`` (a ``time.monotonic()``) is when discovery began: by default now;
    the drill's child process passes the time before it opened the store.  ``trust``:
    only versions signed by one of its keys are restored (others are failed candidates).
    """
    started = time.monotonic() if started is None else started
    report = RestoreReport(materialized_as=materialized_as)
    versions, unreadable = candidates(store, selector)
    report.attempts.extend(Attempt(vid, type(exc).__name__, str(exc), 0.0)
                           for vid, exc in unreadable)
    listed = time.monotonic()
    for info in versions:
        attempt_started = time.monotonic()
        try:
            _restore_one(store, info, materialize, report, trust)
        except ChunkStoreError as exc:
            error = exc.error if isinstance(exc, CandidateFailed) else type(exc).__name__
            report.attempts.append(Attempt(info.id, error, str(exc),
                                           time.monotonic() - attempt_started))
            report.fallback_seconds += time.monotonic() - attempt_started
            report.phases.clear()
            continue
        report.version, report.run, report.step = info.id, info.run, info.step
        report.phases["discovery"] = listed - started + report.phases.pop("manifest")
        break
    report.seconds = time.monotonic() - started
    return report
