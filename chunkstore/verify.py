"""``verify``: every chunk reachable from the chosen versions is present, decodes
and hashes right; commit records and manifest nodes parse; refcounts match.

Findings are collected as :class:`Problem` objects instead of stopping at the
first one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore.digest import Digest, chunk_key
from chunkstore.errors import (
    ChunkStoreError,
    CorruptChunkError,
    FormatVersionError,
    IntegrityError,
    MissingChunkError,
)
from chunkstore.manifest import decode_data
from chunkstore.progress import NullProgress, Progress
from chunkstore.reader import read_chunk
from chunkstore.tree import FlatTree, flatten, read_node

if TYPE_CHECKING:
    from chunkstore.store import Store


@dataclass(frozen=True)
class Problem:
    """One finding: ``kind`` is a stable machine-readable word."""

    kind: str  # missing-chunk, corrupt-chunk, corrupt-node, corrupt-record, format-version,
    #            refcount, index
    message: str
    version: str | None = None
    digest: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class VerifyResult:
    versions_checked: int = 0
    chunks_checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "versions_checked": self.versions_checked,
                "chunks_checked": self.chunks_checked, "bytes_checked": self.bytes_checked,
                "problems": [p.to_json() for p in self.problems]}


def _problem_from(exc: ChunkStoreError, version: str | None) -> Problem:
    if isinstance(exc, MissingChunkError):
        return Problem("missing-chunk", str(exc), version, exc.digest)
    if isinstance(exc, CorruptChunkError):
        return Problem("corrupt-chunk", str(exc), version, exc.digest)
    if isinstance(exc, FormatVersionError):
        return Problem("format-version", str(exc), version)
    kind = "corrupt-record" if "commit record" in str(exc) else "corrupt-node"
    return Problem(kind, str(exc), version, getattr(exc, "digest", None))


def _load_versions(store: Store, ids: list[str], result: VerifyResult
                   ) -> dict[str, FlatTree]:
    trees: dict[str, FlatTree] = {}
    for version_id in ids:
        result.versions_checked += 1
        try:
            record = store.read_record(version_id)
            flat = flatten(store.backend, record.root, store.node_cache)
            for digest in flat.data_nodes():
                decode_data(digest, read_node(store.backend, digest))  # hash-checked
            trees[version_id] = flat
        except FileNotFoundError:
            result.problems.append(Problem("corrupt-record", "commit record vanished while"
                                           " verifying (deleted concurrently?)", version_id))
        except ChunkStoreError as exc:
            result.problems.append(_problem_from(exc, version_id))
    return trees


def _check_chunk(store: Store, digest: Digest, read_data: bool) -> tuple[int, Problem | None]:
    try:
        if read_data:
            return len(read_chunk(store, digest)), None
        store.backend.stat(chunk_key(digest))
        return 0, None
    except FileNotFoundError:
        return 0, _problem_from(MissingChunkError(digest.hex), None)
    except (IntegrityError, FormatVersionError) as exc:
        return 0, _problem_from(exc, None)


def _check_refcounts(store: Store, trees: dict[str, FlatTree], unreadable: set[str],
                     result: VerifyResult) -> None:
    indexed = {e.id for e in store.index.versions()}
    for vid in sorted(set(trees) - indexed):
        result.problems.append(Problem("index", "version is not in the index; run"
                                       " `chunkstore index rebuild`", vid))
    expected: Counter[Digest] = Counter()
    for flat in trees.values():
        expected.update(flat.chunk_digests())
    # A version whose manifests cannot be read is already reported; take the
    # index's word for its references rather than flag each as a refcount error
    # (rebuilding the index would drop them and expose the chunks to GC).
    for vid in sorted(indexed & unreadable):
        expected.update(store.index.version_refs(vid))
    for digest, record in store.index.iter_chunks():
        if record.refcount != expected.get(digest, 0):
            result.problems.append(Problem(
                "refcount", f"index counts {record.refcount} references, the manifests"
                f" {expected.get(digest, 0)}; run `chunkstore index rebuild`", None, digest.hex))
        expected.pop(digest, None)
    for digest in expected:
        result.problems.append(Problem("refcount", "referenced chunk has no index record;"
                                       " run `chunkstore index rebuild`", None, digest.hex))


def verify(store: Store, sel: str | None = None, *, read_data: bool = True,
           progress: Progress | None = None) -> VerifyResult:
    """Check the chosen version (all when ``sel`` is None); refcounts only for all."""
    progress = progress or NullProgress()
    result = VerifyResult()
    ids = [store.resolve(sel).id] if sel is not None else sorted(store.backend_version_ids())
    trees = _load_versions(store, ids, result)
    owners: dict[Digest, str] = {}
    for vid, flat in trees.items():
        for digest in flat.chunk_digests():
            owners.setdefault(digest, vid)
    checks = store.executor.map(lambda d: _check_chunk(store, d, read_data), list(owners))
    progress.start(len(owners), "verify: chunks")
    for digest, (size, problem) in zip(list(owners), checks, strict=True):
        progress.advance()
        result.chunks_checked += 1
        result.bytes_checked += size
        if problem is not None:
            result.problems.append(Problem(problem.kind, problem.message, owners[digest],
                                           problem.digest))
    progress.finish()
    if sel is None:
        _check_refcounts(store, trees, set(ids) - set(trees), result)
    return result
