"""Cross-cutting behaviour as backends that wrap a backend.

Each wrapper implements the full :class:`Backend` interface by forwarding to
``inner`` and changes only what it is for: :class:`ReadOnlyBackend` refuses
writes, :class:`KillAfterBackend` SIGKILLs the process before (or just after)
a chosen write (crash tests).  :func:`wrap_from_env` lets a test inject that
fault into a store opened in a subprocess.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TypeVar

from chunkstore.backends.base import DELETE_BATCH, Backend, ObjectInfo
from chunkstore.errors import BackendError

_T = TypeVar("_T")

#: Environment variable read by :func:`wrap_from_env`.
FAULT_ENV_VAR = "CHUNKSTORE_FAULT"
_KILL_BEFORE_PUT = "kill-before-put"
_KILL_AFTER_PUT = "kill-after-put"
_KILL_BEFORE_DELETE = "kill-before-delete"
_KILL_AFTER_DELETE = "kill-after-delete"
_FAULTS = {_KILL_BEFORE_PUT: ("put", False), _KILL_AFTER_PUT: ("put", True),
           _KILL_BEFORE_DELETE: ("delete", False), _KILL_AFTER_DELETE: ("delete", True)}


class ForwardingBackend(Backend):
    """Forwards every call, conveniences included, to ``inner``; subclass to intercept.

    Deferred writes are not forwarded as such: they go through this class's
    own ``put_if_absent`` (durable on return), so a subclass that intercepts
    ``put_if_absent`` sees every object write.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.url = inner.url

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Forward to ``inner.put``."""
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """Forward to ``inner.put_if_absent``."""
        return self.inner.put_if_absent(key, data)

    def get(self, key: str) -> bytes:
        """Forward to ``inner.get``."""
        return self.inner.get(key)

    def stat(self, key: str) -> ObjectInfo:
        """Forward to ``inner.stat``."""
        return self.inner.stat(key)

    def delete(self, key: str) -> bool:
        """Forward to ``inner.delete``."""
        return self.inner.delete(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        """Forward to ``inner.list``."""
        return self.inner.list(prefix)

    def exists(self, key: str) -> bool:
        """Forward to ``inner.exists``."""
        return self.inner.exists(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Forward to ``inner.get_range``."""
        return self.inner.get_range(key, start, length)

    def view_range(self, key: str, start: int, length: int, *, populate: bool = True
                   ) -> bytes | memoryview:
        """Forward to ``inner.view_range``; a subclass that intercepts ``get_range`` gets
        every ranged read there instead (counting, fault injection), unless it
        intercepts this method too."""
        if type(self).get_range is not ForwardingBackend.get_range:
            return self.get_range(key, start, length)
        return self.inner.view_range(key, start, length, populate=populate)

    def read_into(self, key: str, start: int, buffer: memoryview) -> int:
        """Forward to ``inner.read_into``."""
        return self.inner.read_into(key, start, buffer)

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Forward to ``inner.list_info``."""
        return self.inner.list_info(prefix)

    def local_path(self) -> str | None:
        """Forward to ``inner.local_path``."""
        return self.inner.local_path()

    def listing_stamp(self, prefix: str) -> str | None:
        """Forward to ``inner.listing_stamp``."""
        return self.inner.listing_stamp(prefix)

    def discard(self, key: str) -> bool:
        """Forward to ``inner.discard``, through this class's ``delete`` when it is
        intercepted (so a subclass that intercepts ``delete`` sees every removal)."""
        if type(self).delete is not ForwardingBackend.delete:
            return self.delete(key)
        return self.inner.discard(key)

    def delete_many(self, keys: Sequence[str]) -> None:
        """Forward to ``inner.delete_many``, or key by key through this class's
        ``delete`` when it is intercepted (so a subclass that intercepts ``delete``, to
        refuse it or to die at one, sees every removal; one that counts requests
        intercepts this method too)."""
        if type(self).delete is not ForwardingBackend.delete:
            super().delete_many(keys)
            return
        self.inner.delete_many(keys)

    def flush(self) -> None:
        """Forward to ``inner.flush``."""
        self.inner.flush()

    def remove_temporaries(self, older_than: float, dry_run: bool = False) -> int:
        """Forward to ``inner.remove_temporaries``."""
        return self.inner.remove_temporaries(older_than, dry_run)

    def remove_folders(self, prefixes: Sequence[str]) -> int:
        """Forward to ``inner.remove_folders``."""
        return self.inner.remove_folders(prefixes)

    def close(self) -> None:
        """Close ``inner``."""
        self.inner.close()


class ReadOnlyBackend(ForwardingBackend):
    """Reads pass through; every write raises :class:`~chunkstore.errors.BackendError`."""

    def _refuse(self, operation: str, key: str) -> BackendError:
        return BackendError(
            f"store opened read-only: cannot {operation} {key!r} in {self.url}"
            " (open it without read_only to change it)"
        )

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Raise :class:`BackendError`; nothing is written."""
        raise self._refuse("put", key)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """Raise :class:`BackendError`; nothing is written."""
        raise self._refuse("create", key)

    def delete(self, key: str) -> bool:
        """Raise :class:`BackendError`; nothing is deleted."""
        raise self._refuse("delete", key)

    def remove_folders(self, prefixes: Sequence[str]) -> int:
        """Raise :class:`BackendError`; nothing is removed."""
        raise self._refuse("remove folder", prefixes[0] if prefixes else "")


class KillAfterBackend(ForwardingBackend):
    """Test-only fault injector: SIGKILL this process at a chosen write.

    The first ``count`` writes (``put``/``put_if_absent``) whose key starts
    with ``prefix`` go through; the next one kills the process *before*
    anything is written, so ``count=0`` dies at the first matching write.
    With ``after=True`` that fatal write completes (durably) first and the
    process dies right after it, before the caller sees it return: the
    crash point between one write and whatever the caller does next.
    Other writes and all reads are untouched.  With ``operation="delete"``
    the same applies to deletes instead of writes (crash tests of GC).
    """

    def __init__(self, inner: Backend, prefix: str, count: int, *, after: bool = False,
                 operation: str = "put") -> None:
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if operation not in ("put", "delete"):
            raise ValueError(f"operation must be 'put' or 'delete', got {operation!r}")
        super().__init__(inner)
        self.operation = operation
        self.prefix = prefix
        self.count = count
        self.after = after
        self._matched = 0
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Kill the process if this is the fatal write, else forward."""
        fatal = self._is_fatal(key)
        if fatal and not self.after:
            _die()
        self.inner.put(key, data)
        if fatal:
            _die()

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """Kill the process if this is the fatal write, else forward."""
        fatal = self._is_fatal(key)
        if fatal and not self.after:
            _die()
        created = self.inner.put_if_absent(key, data)
        if fatal:
            _die()
        return created

    def delete(self, key: str) -> bool:
        """Kill the process if this is the fatal delete, else forward."""
        fatal = self._is_fatal(key, "delete")
        if fatal and not self.after:
            _die()
        existed = self.inner.delete(key)
        if fatal:
            _die()
        return existed

    def _is_fatal(self, key: str, operation: str = "put") -> bool:
        if operation != self.operation or not key.startswith(self.prefix):
            return False
        with self._lock:  # concurrent writers: exactly `count` matching writes pass
            self._matched += 1
            return self._matched > self.count


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def wrap_from_env(backend: Backend, environ: Mapping[str, str] | None = None) -> Backend:
    """Wrap ``backend`` in the fault named by ``CHUNKSTORE_FAULT``, or return it unchanged.

    Faults are ``kill-before-put``, ``kill-after-put``, ``kill-before-delete``
    and ``kill-after-delete``, each as ``<fault>:<prefix>:<count>`` (see
    :class:`KillAfterBackend`).
    Unset or empty means no fault; anything else raises ``ValueError`` so a
    typo never silently disables a crash test.
    """
    spec = (os.environ if environ is None else environ).get(FAULT_ENV_VAR, "")
    if not spec:
        return backend
    kind, _, rest = spec.partition(":")
    prefix, sep, count_text = rest.rpartition(":")
    if kind not in _FAULTS or not sep or not count_text.isdigit():
        raise ValueError(
            f"{FAULT_ENV_VAR}={spec!r} is not understood; expected"
            f" '<fault>:<key prefix>:<count >= 0>' with <fault> one of {', '.join(_FAULTS)}"
        )
    operation, after = _FAULTS[kind]
    return KillAfterBackend(backend, prefix, int(count_text), after=after, operation=operation)


class RequestHook(ForwardingBackend):
    """Calls :meth:`request` before each storage request it forwards (``put``, ``get``,
    ``head``, ``delete``, ``delete_many`` (one per :data:`DELETE_BATCH` keys), ``list``,
    and ``walk`` for a sweep of temporary files), and
    :meth:`listed` once a listing has been read to its end: subclass to count requests
    (the benchmarks and tests that count them share this)."""

    def request(self, operation: str, key: str) -> None:
        """One request of ``operation`` on ``key`` (a listing: its prefix)."""

    def listed(self, prefix: str, count: int) -> None:
        """A listing of ``prefix`` returned ``count`` entries."""

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.request("put", key)
        super().put(key, data)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        self.request("put", key)
        return super().put_if_absent(key, data)

    def get(self, key: str) -> bytes:
        self.request("get", key)
        return super().get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.request("get", key)
        return super().get_range(key, start, length)

    def read_into(self, key: str, start: int, buffer: memoryview) -> int:
        self.request("get", key)
        return super().read_into(key, start, buffer)

    def stat(self, key: str) -> ObjectInfo:
        self.request("head", key)
        return super().stat(key)

    def exists(self, key: str) -> bool:
        self.request("head", key)
        return super().exists(key)

    def delete(self, key: str) -> bool:  # discard comes here too
        self.request("delete", key)
        return super().delete(key)

    def delete_many(self, keys: Sequence[str]) -> None:
        """One ``delete_many`` request per :data:`DELETE_BATCH` keys (what S3 answers)."""
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start:start + DELETE_BATCH]
            self.request("delete_many", batch[0])
            self.inner.delete_many(batch)

    def list(self, prefix: str = "") -> Iterator[str]:
        self.request("list", prefix)
        return self._counted(prefix, self.inner.list(prefix))

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self.request("list", prefix)
        return self._counted(prefix, self.inner.list_info(prefix))

    def remove_temporaries(self, older_than: float, dry_run: bool = False) -> int:
        self.request("walk", "")
        return super().remove_temporaries(older_than, dry_run)

    def _counted(self, prefix: str, items: Iterator[_T]) -> Iterator[_T]:
        n = 0
        for item in items:
            n += 1
            yield item
        self.listed(prefix, n)
