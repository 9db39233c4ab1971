"""Backend for every non-local URL (``memory://``, ``s3://``, ``gs://`` ...) via fsspec.

Object stores make each completed PUT atomic and durable, so :meth:`put` is
one ``pipe_file``.  :meth:`put_if_absent` needs a server-side conditional
create: s3fs's ``pipe_file(..., mode="create")`` sends ``If-None-Match: *``
and turns the 412 answer into ``FileExistsError``.  (s3fs's
``open(path, "xb")`` does *not* do this for an empty object: it falls back
to an unconditional ``touch``.)  Filesystems without a server-side condition
get a check-then-write under a process-wide lock, which is atomic only
within one process; :attr:`FsspecBackend.atomic_create` says which applies.
"""

from __future__ import annotations

import builtins
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, ClassVar, ParamSpec, TypeVar

import fsspec

from chunkstore.backends.base import DELETE_BATCH, Backend, ObjectInfo
from chunkstore.errors import BackendUnavailableError, ChunkStoreError

_P = ParamSpec("_P")
_T = TypeVar("_T")
#: Packages whose exceptions mean the remote storage failed (network, server,
#: credentials): they become BackendUnavailableError, which the CLI maps to exit 4.
_REMOTE_PACKAGES = frozenset({"botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "adlfs",
                              "urllib3", "requests", "fsspec"})
#: What the storage contract itself raises; passed through unchanged.
_CONTRACT_ERRORS = (FileNotFoundError, FileExistsError, ChunkStoreError)


def _remote_failure(exc: Exception) -> bool:
    if isinstance(exc, _CONTRACT_ERRORS):
        return False
    package = type(exc).__module__.split(".", 1)[0]
    return package in _REMOTE_PACKAGES or isinstance(exc, (OSError, TimeoutError))


def _typed_errors(method: Callable[_P, _T]) -> Callable[_P, _T]:
    """Turn a failure of the remote storage into :class:`BackendUnavailableError`."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            if not _remote_failure(exc):
                raise
            backend, key = args[0], args[1] if len(args) > 1 else ""
            if isinstance(key, (list, tuple)):  # a bulk request: its first key, not all
                key = f"{key[0]} and {len(key) - 1} more" if len(key) > 1 else "".join(key)
            raise BackendUnavailableError(getattr(backend, "url", "?"), str(key),
                                          f"{type(exc).__name__}: {exc}") from exc

    return wrapper

log = logging.getLogger(__name__)

#: Serialises check-then-write creates for filesystems without a conditional PUT.
#: Process-wide because memory:// keeps one store per process, shared by instances.
_LOCAL_CREATE_LOCK = threading.Lock()

#: Info keys that may hold the modification time, most specific first.
_MTIME_KEYS = ("LastModified", "mtime", "last_modified", "updated", "created")


class FsspecBackend(Backend):
    """Objects under the root of an fsspec URL."""

    #: Protocols whose ``pipe_file(mode="create")`` is a server-side conditional create.
    ATOMIC_CREATE_PROTOCOLS: ClassVar[frozenset[str]] = frozenset({"s3", "s3a"})
    #: Protocols whose storage lives in one process, so the create lock covers every writer.
    ONE_PROCESS_PROTOCOLS: ClassVar[frozenset[str]] = frozenset({"memory"})
    #: Protocols listed page by page through the S3 API (:meth:`_pages`).
    PAGED_LIST_PROTOCOLS: ClassVar[frozenset[str]] = frozenset({"s3", "s3a"})
    #: Keys one LIST request asks for on S3 (its ceiling, and what a request without
    #: ``MaxKeys`` gets); tests set fewer on an instance to cross pages cheaply.
    list_page_keys: int = 1000
    #: Protocols that accept ``use_listings_cache`` (listings must never be stale).
    LISTING_CACHE_PROTOCOLS: ClassVar[frozenset[str]] = frozenset(
        {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}
    )

    @_typed_errors
    def __init__(self, url: str, **storage_options: Any) -> None:
        """Open ``url``; ``storage_options`` go to the fsspec filesystem unchanged."""
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        options: dict[str, Any] = {}
        if protocol in self.LISTING_CACHE_PROTOCOLS:
            # A cached listing would hide objects written by other processes.
            # (fsspec caches filesystem instances by their options, so this one
            # is never shared with a caller's listing-caching instance.)
            options["use_listings_cache"] = False
        options.update(storage_options)
        fs, root = fsspec.core.url_to_fs(url, **options)
        self.url = url
        #: The underlying fsspec filesystem (for diagnostics and tests).
        self.fs: fsspec.AbstractFileSystem = fs
        self._root = str(root).rstrip("/")
        self._protocol = protocol
        #: Whether put_if_absent is atomic across processes (server-side condition).
        self.atomic_create = protocol in self.ATOMIC_CREATE_PROTOCOLS
        #: Whether listings stream page by page (:meth:`_pages`).
        self.paged_listing = protocol in self.PAGED_LIST_PROTOCOLS
        if not self.atomic_create and protocol not in self.ONE_PROCESS_PROTOCOLS:
            log.warning("%s: objects are created check-then-write here (this release knows"
                        " a conditional create only on S3), which is atomic within one"
                        " process only: save to this store from one process at a time",
                        url)

    # --- the abstract interface ----------------------------------------------------------

    @_typed_errors
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Write the object with one PUT (atomic and durable once it returns)."""
        path = self._path(key)
        # bytes(): botocore rejects memoryview bodies, and memory:// would keep
        # a view aliasing the caller's buffer.  No copy when data is bytes.
        self.fs.pipe_file(path, bytes(data))
        self.fs.invalidate_cache(path)

    @_typed_errors
    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """Create the object unless it exists; see :attr:`atomic_create` for the guarantee."""
        path = self._path(key)
        payload = bytes(data)
        try:
            if self.atomic_create:
                # If-None-Match: * -- the server decides, so exactly one creator wins.
                self.fs.pipe_file(path, payload, mode="create")
            else:
                with _LOCAL_CREATE_LOCK:
                    if self.fs.exists(path):
                        return False
                    self.fs.pipe_file(path, payload)
        except FileExistsError:
            return False
        finally:
            self.fs.invalidate_cache(path)
        return True

    @_typed_errors
    def get(self, key: str) -> bytes:
        """Return the whole object; ``FileNotFoundError`` if absent."""
        path = self._path(key)
        try:
            return bytes(self.fs.cat_file(path))
        except IsADirectoryError:
            raise FileNotFoundError(f"no object {key!r} in {self.url}") from None

    @_typed_errors
    def stat(self, key: str) -> ObjectInfo:
        """Return size and mtime from ``fs.info``; ``FileNotFoundError`` if absent."""
        info = self.fs.info(self._path(key))
        if info.get("type") != "file":
            raise FileNotFoundError(f"no object {key!r} in {self.url} (a prefix has that name)")
        return ObjectInfo(key=key, size=int(info["size"]), mtime=_mtime(info))

    @_typed_errors
    def delete(self, key: str) -> bool:
        """Remove the object; return whether it existed.

        Object stores delete missing keys silently, so existence is checked
        first: two concurrent deleters may both get ``True``.
        """
        path = self._path(key)
        if not self.exists(key):
            return False
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            return False
        finally:
            self.fs.invalidate_cache(path)
        return True

    def delete_many(self, keys: Sequence[str]) -> None:
        """On S3 one DeleteObjects request per :data:`DELETE_BATCH` keys (a key the
        server could not delete is an ``OSError`` naming it); elsewhere key by key."""
        if self._protocol not in self.ATOMIC_CREATE_PROTOCOLS:
            super().delete_many(keys)
            return
        for start in range(0, len(keys), DELETE_BATCH):
            self._delete_batch(keys[start:start + DELETE_BATCH])

    @_typed_errors
    def _delete_batch(self, keys: Sequence[str]) -> None:
        paths = [self._path(key) for key in keys]
        buckets = {path.split("/", 1)[0] for path in paths}
        if not paths:
            return
        if len(buckets) != 1:
            raise ValueError(f"keys of one store lie in one bucket, not {sorted(buckets)}")
        try:
            # s3fs's own rm of a list batches too, but drops the errors the server
            # reports per key: a record not deleted must not pass for one removed.
            answer = self.fs.call_s3(
                "delete_objects", Bucket=buckets.pop(), Delete={
                    "Objects": [{"Key": path.split("/", 1)[1]} for path in paths],
                    "Quiet": True})
        finally:
            for path in paths:
                self.fs.invalidate_cache(path)
        errors = answer.get("Errors") or []
        if errors:
            first = errors[0]
            raise OSError(f"{len(errors)} of {len(paths)} objects were not deleted, the first"
                          f" {first.get('Key')!r}: {first.get('Code')} {first.get('Message')}")

    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield keys starting with ``prefix`` in ascending byte order.

        On S3 page by page (:meth:`_pages`); elsewhere only the deepest directory
        the prefix implies is searched.
        """
        if self.paged_listing:
            for page in self._pages(prefix):
                yield from (info.key for info in page)
            return
        yield from self._list(prefix)

    @_typed_errors
    def _list(self, prefix: str = "") -> builtins.list[str]:
        keys = (self._key(path) for path in self._find(prefix, detail=False))
        return sorted(key for key in keys if key.startswith(prefix))

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """:meth:`list` with each key's size and mtime, from the listing itself: on S3
        one LIST request per :attr:`list_page_keys` keys, not a HEAD per key besides."""
        if self.paged_listing:
            for page in self._pages(prefix):
                yield from page
            return
        yield from self._list_info(prefix)

    @_typed_errors
    def _list_info(self, prefix: str) -> builtins.list[ObjectInfo]:
        found = self._find(prefix, detail=True)
        infos = (ObjectInfo(key=self._key(path), size=int(info["size"]), mtime=_mtime(info))
                 for path, info in found.items() if info.get("type", "file") == "file")
        return sorted((info for info in infos if info.key.startswith(prefix)),
                      key=lambda info: info.key)

    def _find(self, prefix: str, detail: bool) -> Any:
        """``fs.find`` below the deepest directory ``prefix`` implies, freshly listed;
        nothing where it does not exist."""
        directory, _, _ = prefix.rpartition("/")
        search = f"{self._root}/{directory}" if directory else self._root or "/"
        self.fs.invalidate_cache(search)
        try:
            return self.fs.find(search, detail=detail)
        except FileNotFoundError:
            return {} if detail else []

    def _pages(self, prefix: str) -> Iterator[builtins.list[ObjectInfo]]:
        """The keys under ``prefix`` as S3 pages them: one ListObjectsV2 request (the
        whole prefix filtered server-side) per :attr:`list_page_keys` keys, each sent
        once the page before is used up, so a listing holds one page, never the store
        (s3fs's ``find`` builds a dict of every key before it returns one).

        S3 returns keys in ascending byte order and continues after the last key of
        the page before: a key stored throughout the listing comes exactly once; one
        added or removed meanwhile may or may not.
        """
        bucket, _, folder = self._root.partition("/")
        request: dict[str, Any] = {"Bucket": bucket, "MaxKeys": self.list_page_keys,
                                   "Prefix": f"{folder}/{prefix}" if folder else prefix}
        while True:
            answer = self._list_page(prefix, request)
            page = [ObjectInfo(key=self._key(f"{bucket}/{entry['Key']}"),
                               size=int(entry["Size"]), mtime=_mtime(entry))
                    for entry in answer.get("Contents", ()) if not entry["Key"].endswith("/")]
            token = answer.get("NextContinuationToken") if answer.get("IsTruncated") else None
            del answer  # the page is held once (as ObjectInfo) while the caller reads it
            yield page
            if token is None:
                return
            request["ContinuationToken"] = token

    @_typed_errors
    def _list_page(self, prefix: str, request: Mapping[str, Any]) -> dict[str, Any]:
        """One ListObjectsV2 request (``prefix`` names the listing in an error); no
        page where the bucket does not exist."""
        try:
            answer: dict[str, Any] = self.fs.call_s3("list_objects_v2", **request)
        except FileNotFoundError:
            return {}
        return answer

    # --- faster derived conveniences -----------------------------------------------------

    @_typed_errors
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Fetch only the requested bytes (an HTTP range request on object stores)."""
        if start < 0 or length < 0:
            raise ValueError(f"invalid range: start={start}, length={length}")
        path = self._path(key)
        if length == 0:
            self.stat(key)  # still FileNotFoundError for a missing key
            return b""
        try:
            return bytes(self.fs.cat_file(path, start=start, end=start + length))
        except IsADirectoryError:
            raise FileNotFoundError(f"no object {key!r} in {self.url}") from None
        except (FileNotFoundError, PermissionError):
            raise
        except OSError:
            # S3 answers 416 (InvalidRange) when start is at or past the end;
            # the contract asks for an empty result there.
            if start >= self.stat(key).size:
                return b""
            raise

    def close(self) -> None:
        """Drop cached listings; fsspec closes connections when the filesystem is collected."""
        self.fs.invalidate_cache()

    # --- helpers -------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"key {key!r} must be a relative path without '..'")
        return f"{self._root}/{key}"

    def _key(self, path: str) -> str:
        """Turn a path returned by ``find`` back into a key relative to the root."""
        if not self._root:  # e.g. bare memory://: paths come back as "/key"
            return path.lstrip("/")
        return path[len(self._root) + 1 :]


def _mtime(info: Mapping[str, Any]) -> float:
    """Seconds since the epoch from whichever time field the filesystem reports, else 0.0."""
    for name in _MTIME_KEYS:
        value = info.get(name)
        if isinstance(value, datetime):
            if value.tzinfo is None:  # fsspec filesystems report UTC
                value = value.replace(tzinfo=timezone.utc)
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0
