"""The store as users open it: :func:`open` and :class:`Store`, the facade.

A :class:`Store` is the store handle (:class:`~chunkstore.handle.handle.StoreHandle`:
objects, index, config, caches, versions, tags, removal) plus what needs the layers
above it: writing and reading versions (:mod:`chunkstore.write`,
:mod:`chunkstore.read`) and the operations over the whole store
(:mod:`chunkstore.maintenance`), each a thin method that delegates.  Nothing in the
package imports this module but the command line (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import operator
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from chunkstore.backends import LOCAL_SCHEMES, open_backend
from chunkstore.backends.wrappers import wrap_from_env
from chunkstore.codecs.policy import check_policy
from chunkstore.errors import (
    ChunkStoreError,
    ConfigRecoveredWarning,
    InvalidInputError,
    InvalidSettingError,
    RecoveredConfigError,
    SavesInProgressError,
    StoreLocationError,
)
from chunkstore.format.manifest import MAX_DELTA_DEPTH
from chunkstore.format.records import (
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    Encryption,
    StoreConfig,
)
from chunkstore.handle.encryption import (
    check_encrypt,
    check_new_store,
    check_password_given,
    clone_keys,
    unlocked,
)
from chunkstore.handle.handle import (
    MAX_NODE_TARGET,
    MAX_PACK_TARGET,
    NODE_TARGET_BYTES,
    PACK_TARGET_BYTES,
    StoreHandle,
    selector_list,
)
from chunkstore.handle.storeconfig import (
    RecoveredConfig,
    check_settings,
    config_to_write,
    load_or_create_config,
    read_only_reason,
    recorded_created,
    recover_read_only,
    write_config,
)
from chunkstore.handle.versions import VersionInfo
from chunkstore.index.gclock import finish_abandoned_deletions
from chunkstore.index.lmdbindex import open_index
from chunkstore.maintenance.gc import collect
from chunkstore.maintenance.purge import PurgeResult, purge
from chunkstore.maintenance.rebuild import rebuild
from chunkstore.maintenance.reconcile import reconcile, reconcile_if_changed
from chunkstore.maintenance.report import stats
from chunkstore.maintenance.retention import Policy, prune
from chunkstore.maintenance.verify import verify
from chunkstore.objects.objectstore import ObjectStore
from chunkstore.objects.signing import PrivateKeyLike, PublicKeyLike, Trust
from chunkstore.protocol.audit import AuditEvent, AuditPruneResult, list_events, prune_events
from chunkstore.protocol.holds import Hold
from chunkstore.protocol.journal import sync_journal
from chunkstore.read.reader import VersionReader
from chunkstore.write.writer import VersionWriter

if TYPE_CHECKING:
    from chunkstore.maintenance.gc import GcResult
    from chunkstore.maintenance.reconcile import RebuildResult
    from chunkstore.maintenance.report import StoreStats
    from chunkstore.maintenance.retention import PruneResult
    from chunkstore.maintenance.verify import VerifyResult
    from chunkstore.progress import Progress

__all__ = ["Store", "VersionInfo", "check_sync_locations", "open"]


#: The most worker threads a store handle accepts.
MAX_THREADS = 1024


def _whole_number(value: object, what: str, low: int, high: int) -> int:
    """``value`` as an int (numpy integers too, never a bool) in ``[low, high]``."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None or not low <= number <= high:
        raise InvalidSettingError(f"{what} {value!r} must be an integer in [{low}, {high}]")
    return number


def _chunk_size(value: object) -> int:
    number = _whole_number(value, "chunk size", 0, 2**63)
    if not (MIN_CHUNK_SIZE <= number <= MAX_CHUNK_SIZE and number % 64 == 0):
        raise InvalidSettingError(
            f"chunk size {number} must be a multiple of 64 between {MIN_CHUNK_SIZE}"
            f" and {MAX_CHUNK_SIZE}")
    return number


def _location(url: object) -> str:
    """A store's path or URL as text; a typed error for what names no location."""
    try:
        text = os.fspath(url)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidInputError(f"a store is named by a path or URL, not by"
                                f" {type(url).__name__} {url!r}") from None
    if not isinstance(text, str) or not text or "\0" in text:
        raise InvalidInputError(f"{text!r} is not a store location (a path or URL: not"
                                " empty, no NUL character, text)")
    return text


def check_sync_locations(src: object, dst: object) -> None:
    """``sync``'s two locations, checked before anything is opened: each an open store, a
    path or a URL (anything else a typed error, not a TypeError from inside), and a local
    destination that can hold a store (a dry run into a regular file said it would create
    one there, which the sync itself then could not)."""
    for where in (src, dst):
        if not isinstance(where, StoreHandle):
            _location(where)
    if not isinstance(dst, StoreHandle):
        _check_can_hold_a_store(_location(dst))


def _check_can_hold_a_store(text: str) -> None:
    """A local path whose nearest existing part is not a directory (a file, or a path
    under one) cannot become a store: :class:`StoreLocationError`, as creating it says."""
    scheme, _, rest = text.partition("://") if "://" in text else ("", "", text)
    if scheme not in LOCAL_SCHEMES:
        return
    path = os.path.abspath(os.path.expanduser(rest))
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise StoreLocationError(text, os.strerror(errno.ENOTDIR))


#: Packages whose own code rejects storage options it cannot take (s3fs passes the ones it
#: does not know on to aiobotocore, which raises TypeError at the first request).
_OPTION_TAKERS = frozenset({"fsspec", "s3fs", "aiobotocore", "botocore", "gcsfs", "adlfs",
                            "aiohttp"})


def _storage_options(options: object) -> dict[str, Any]:
    """``storage_options`` checked: None, or a dict of option names (text) to values."""
    if options is None:
        return {}
    if not isinstance(options, dict) or not all(isinstance(key, str) for key in options):
        raise InvalidInputError(f"storage options are a dict of fsspec option names to values"
                                f" (or None), not {type(options).__name__} {options!r}")
    return options


@contextlib.contextmanager
def _options_taken(url: str, options: dict[str, Any]) -> Iterator[None]:
    """An option the location's filesystem refuses (an unknown name, a value of the wrong
    type) fails inside that filesystem's code with a TypeError, AttributeError or
    ValueError, some only at its first request: a typed error naming the options, as bad
    input (the CLI's exit 2), instead of a traceback."""
    try:
        yield
    except (TypeError, AttributeError, ValueError) as exc:
        if not options or isinstance(exc, ChunkStoreError) or not _raised_in(exc, _OPTION_TAKERS):
            raise
        # The names only: values may be credentials.
        raise InvalidInputError(f"{url}: its filesystem refused the storage options"
                                f" ({', '.join(sorted(options))}): {type(exc).__name__}:"
                                f" {exc}") from exc


def _raised_in(exc: BaseException, packages: frozenset[str]) -> bool:
    """Whether the innermost frame of ``exc``'s traceback runs code of ``packages``."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return str(module).partition(".")[0] in packages


def default_index_dir(url: str, objects: ObjectStore) -> str:
    local = objects.local_path()
    if local is not None:
        return os.path.join(local, "index")
    cache = os.environ.get("CHUNKSTORE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "chunkstore")
    return os.path.join(cache, "index", hashlib.sha256(url.encode()).hexdigest()[:24])


def open(
    url: str | os.PathLike[str], *, create: bool = False, chunk_size: int | None = None,
    compression: str | None = None, threads: int | None = None, index_dir: str | None = None,
    storage_options: dict[str, Any] | None = None, delta_depth: int | None = None,
    pack_size: int | None = None, node_size: int | None = None, encrypt: bool = False,
    password: str | None = None, key_of: StoreHandle | None = None,
    trust: Iterable[PublicKeyLike] = (),
) -> Store:
    """Open the store at a path or fsspec URL.

    Opening never creates a store unless ``create=True``: a location that holds
    nothing raises :class:`~chunkstore.errors.NoStoreError` ("no store at ...") and
    is left as it was (no directory is made), and one that holds something else
    :class:`~chunkstore.errors.NotAStoreError`.  Pass ``create=True`` where a store
    may be made (before a first save); ``chunkstore init`` does the same.

    ``chunk_size`` applies when the store is created; ``compression`` is the
    codec policy for this handle's writes (default: the store's setting);
    ``threads`` the size of the worker pool (default :func:`default_threads`;
    a save holds at most ``2 x threads`` chunks in memory).  ``delta_depth``
    bounds the chains of delta chunks a save builds against the run's previous version
    (each chain also bounded by its stored bytes; 0 turns deltas off): each link of a
    dense update's chain costs a restore a decode of the chunk (docs/performance.md,
    choosing ``delta_depth``).  A new store keeps it (default 16) for its life; on an
    existing store it bounds this handle's saves, at most the store's depth (above it:
    :class:`~chunkstore.errors.InvalidSettingError`, and nothing is opened).
    ``pack_size`` is the size at which this handle's saves seal a pack of small
    chunks (default :data:`chunkstore.handle.handle.PACK_TARGET_BYTES`); ``node_size`` the
    size up to which they inline a subtree of the names into its parent manifest
    node (default :data:`NODE_TARGET_BYTES`).

    ``encrypt=True`` with ``create=True`` creates an encrypted store (docs/format.md
    §13): every object sealed, chunk ids keyed, a random master key wrapped under
    ``password``.  An encrypted store opens with its ``password`` (default:
    ``CHUNKSTORE_PASSWORD``, else the file ``CHUNKSTORE_PASSWORD_FILE`` names); a
    wrong one raises :class:`~chunkstore.errors.WrongPasswordError`, none
    :class:`~chunkstore.errors.PasswordRequiredError`, and a password given to an
    unencrypted store :class:`~chunkstore.errors.NotEncryptedError`.  ``key_of``, an
    open encrypted store: a store created here (``create=True``) is its encrypted copy
    (its config and key objects: one master key, the same passwords), and a copy opens
    with its key, no password needed (``sync`` and the tiered Checkpointer's mirror).

    ``trust``: the keys whose signatures this handle trusts (public key PEM files, or
    loaded keys): :meth:`Store.signature` and ``verify`` report each version as
    signed-by-trusted, signed-by-untrusted, unsigned or bad-signature (docs/format.md
    §14).  A key that cannot be loaded is a :class:`~chunkstore.errors.SigningKeyError`
    before anything is opened.
    """
    # Numbers are checked (numpy integers taken as ints) before anything is opened.
    if chunk_size is not None:
        chunk_size = _chunk_size(chunk_size)
    if compression is not None:
        check_policy(compression)
    if pack_size is not None:
        pack_size = _whole_number(pack_size, "pack size", 1, MAX_PACK_TARGET)
    if node_size is not None:
        node_size = _whole_number(node_size, "node size", 0, MAX_NODE_TARGET)
    if delta_depth is not None:
        delta_depth = _whole_number(delta_depth, "delta depth", 0, MAX_DELTA_DEPTH)
    if threads is not None:
        threads = _whole_number(threads, "threads", 1, MAX_THREADS)
    trusted = Trust(trust)
    text = _location(url)
    check_password_given(text, create, encrypt, password)  # before anything is created
    options = _storage_options(storage_options)
    with _options_taken(text, options):
        objects = ObjectStore(wrap_from_env(open_backend(text, **options)))
        check_new_store(text, objects, create, encrypt, password)
        clone_keys(objects, key_of, create)
        loaded = load_or_create_config(text, objects, create, chunk_size, compression,
                                        delta_depth, Encryption() if encrypt else None)
    index_path = index_dir or default_index_dir(text, objects)
    if isinstance(loaded, StoreConfig):
        config, recovered = loaded, None
    else:  # damaged or missing: recovered from the store, which is then read-only
        recovered = _recover(text, objects, loaded, index_path)
        config = recovered.config
    check_settings(text, config, recovered, chunk_size, delta_depth)
    check_encrypt(text, config, encrypt)
    objects = unlocked(text, objects, config, password, encrypt, key_of)
    index = open_index(index_path)
    try:
        index.describe_store(config.identity())  # emptied if it describes another store
    except BaseException:
        index.close()
        raise
    store = Store(text, objects, config, index, compression or config.compression, threads)
    store.recovered_config = recovered
    store.trust = trusted
    if delta_depth is not None:
        store.delta_depth = delta_depth
    store.pack_size = pack_size or PACK_TARGET_BYTES
    store.node_size = NODE_TARGET_BYTES if node_size is None else node_size
    if index.needs_rebuild:  # another schema or store (emptied), or damaged and set aside
        # With saves elsewhere in progress, the reconcile below counts every version in.
        with contextlib.suppress(SavesInProgressError):
            store.rebuild_index()
    # Versions and tags committed or removed elsewhere since this index last looked
    # (no listing where the store vouches that nothing changed).
    reconcile_if_changed(store)
    # What GCs on other indexes deleted (and, for a new index, which of their runs
    # are still active): one listing of the GC journal.
    sync_journal(objects, index)
    return store


def _recover(url: str, objects: ObjectStore, reason: str, index_path: str) -> RecoveredConfig:
    """The config the store's objects describe (its identity the local index's, if that
    records one), the handle made read-only, and the recovery announced."""
    index = open_index(index_path)
    try:
        created = recorded_created(index)
    finally:
        index.close()
    recovered = recover_read_only(objects, reason, created)
    # stacklevel 3: the caller of chunkstore.open
    warnings.warn(ConfigRecoveredWarning(url, reason, recovered.describe()), stacklevel=3)
    return recovered


class Store(StoreHandle):
    """A chunkstore store.  Use :func:`chunkstore.open` to get one."""

    #: set when ``chunkstore.json`` is damaged or missing and the config was recovered
    #: from the store's objects: the store is read-only until :meth:`write_back_config`
    recovered_config: RecoveredConfig | None = None

    def _check_writable(self, operation: str) -> None:
        """Refuse a change before it starts on a store opened with a recovered config
        (its backend refuses every write too: this only spares the work before it)."""
        if self.recovered_config is not None:
            raise RecoveredConfigError(self.url, operation, read_only_reason(self.url))

    def write_back_config(self, *, chunk_size: int | None = None,
                          delta_depth: int | None = None,
                          compression: str | None = None) -> StoreConfig:
        """Write the recovered config back as ``chunkstore.json`` (``chunkstore init
        --recover``), with the settings given, each checked against the manifests;
        return it.  :class:`InvalidInputError` when the stored config is valid,
        :class:`RecoveredConfigError` when it cannot be written as asked.  Reopen the
        store to write into it."""
        if self.recovered_config is None:
            raise InvalidInputError(f"{self.url}'s chunkstore.json is valid: there is nothing"
                                    " to recover, and nothing was changed")
        if compression is not None:
            check_policy(compression)
        config = config_to_write(self.url, self.recovered_config, chunk_size, delta_depth,
                                 compression)
        write_config(self.objects, self.url, config)
        return config

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def new_version(self, run: str, step: int, meta: dict[str, Any] | None = None, *,
                    replace: bool = False, sign_with: PrivateKeyLike | None = None
                    ) -> VersionWriter:
        """Start a version; publish it by leaving the ``with`` block (or ``commit()``).

        One version per ``RUN@STEP``: saving a step the run already has publishes
        nothing when the content is the same (the existing version is returned),
        and is refused with :class:`DuplicateStepError` when it differs, unless
        ``replace`` (then the new version is published and the old one removed).

        ``sign_with``, a signing key (a PEM file path, its password in
        ``$CHUNKSTORE_KEY_PASSWORD`` where it has one, or a key from
        :func:`chunkstore.objects.signing.load_private_key`): the version is published
        with a signature of its commit record (docs/format.md §14).
        """
        self._check_writable(f"save {run}@{step}")
        return VersionWriter(self, run, step, meta, replace=replace, sign_with=sign_with)

    def delete(self, selector: str, *, force: bool = False) -> VersionInfo:
        self._check_writable(f"remove {selector}")
        return super().delete(selector, force=force)

    def delete_many(self, selectors: Iterable[str], *, force: bool = False
                    ) -> list[VersionInfo]:
        selectors = selector_list(selectors)
        self._check_writable("remove " + " ".join(selectors[:3])
                             + (f" and {len(selectors) - 3} more" if len(selectors) > 3 else ""))
        return super().delete_many(selectors, force=force)

    def tag(self, selector: str, name: str) -> VersionInfo:
        self._check_writable(f"tag {selector} {name}")
        return super().tag(selector, name)

    def untag(self, name: str) -> bool:
        self._check_writable(f"untag {name}")
        return super().untag(name)

    def hold(self, selector: str, reason: str) -> Hold:
        self._check_writable(f"hold {selector}")
        return super().hold(selector, reason)

    def release(self, selector: str) -> Hold:
        self._check_writable(f"release {selector}")
        return super().release(selector)

    def audit(self, *, since: float | None = None, run: str | None = None
              ) -> Iterator[AuditEvent]:
        """The audit trail, oldest first, read as it is iterated (docs/format.md §16):
        from ``since`` (Unix time), only events naming a version of ``run``.  An event
        that cannot be read is yielded with ``damage`` set, never raised."""
        return list_events(self.objects, since=since, run=run)

    def prune_audit(self, before: float) -> AuditPruneResult:
        """Delete the audit events older than ``before`` (Unix time), having recorded
        an event that says so: the only way an event is ever deleted."""
        self._check_writable("prune the audit trail")
        return prune_events(self.objects, before)

    def open_version(self, selector: str) -> VersionReader:
        """Open a version for reading; its manifest is loaded and hash-checked now."""
        return VersionReader(self, self.resolve(selector))

    def reconcile(self) -> None:
        """Count in versions committed elsewhere, count out versions deleted elsewhere."""
        reconcile(self)

    def list_after_miss(self) -> bool:
        """A selector missed: a full :func:`reconcile`, then it is looked up again (a
        miss is rare: it costs what every open once did)."""
        reconcile(self)
        return True


    # --- whole-store operations ------------------------------------------------------------

    def verify(self, sel: str | None = None, *, read_data: bool = True,
               read_data_subset: str | None = None,
               progress: Progress | None = None) -> VerifyResult:
        """Check versions (all, or the one ``sel`` names); with ``read_data_subset``
        (``"N/M"`` or ``"X%"``) read only those objects, checking the rest present;
        see :mod:`chunkstore.maintenance.verify`."""
        return verify(self, sel, read_data=read_data, read_data_subset=read_data_subset,
                      progress=progress)

    def stats(self, *, full: bool = True) -> StoreStats:
        """Sizes of the store (:func:`chunkstore.maintenance.report.stats`); with
        ``full=False`` what GC could reclaim comes from the index's refcounts, not
        from GC dry runs."""
        return stats(self, full=full)

    def gc(self, grace: object = "1h", *, dry_run: bool = False, sweep: bool | None = None,
           clock: Callable[[], float] = time.time, progress: Progress | None = None,
           session_wait: float = 120.0, repack_unused: float | None = 0.5) -> GcResult:
        """Delete chunks and nodes that no live version has referenced for ``grace``.

        ``grace`` is seconds, a ``timedelta`` or text (``"30m"``, ``"1h"``,
        ``"2d"``; default one hour), counted from when a version was removed.
        ``dry_run`` decides the same and deletes nothing.  ``sweep`` (True) also
        lists storage for objects no index record names (orphans of killed saves)
        and removes those older than the grace period; None (the default) does so
        only when it can find some or is due: a dead save's session, or a day
        since this index's last sweep (:mod:`chunkstore.maintenance.sweep`);
        False never.  ``session_wait`` bounds the wait for saves in progress (on any
        machine) that started before this GC; past it nothing is deleted and
        the result says how much was deferred.  ``repack_unused``: a live pack
        at least this fraction garbage has its live members copied into a new
        pack and is deleted (None: never repack; :mod:`chunkstore.maintenance.repack`).
        See :mod:`chunkstore.maintenance.gc`.
        """
        if not dry_run:
            self._check_writable("collect garbage")
        return collect(self, grace, dry_run=dry_run, sweep=sweep, clock=clock,
                       progress=progress, session_wait=session_wait,
                       repack_unused=repack_unused)

    def prune(self, *, run: str | None = None, dry_run: bool = False, verify: bool = True,
              keep_last: int | None = None, keep_every: int | None = None,
              keep_within: object = None, keep_best: tuple[Any, ...] | None = None,
              min_previous: int = 1) -> PruneResult:
        """Unpublish the versions no retention policy keeps (see
        :mod:`chunkstore.maintenance.retention`).

        Policies compose: a version is kept if any keeps it; tagged versions,
        the newest version that verifies and ``min_previous`` versions before
        it are always kept.  Space is freed by :meth:`gc` afterwards.
        """
        policy = Policy(keep_last=keep_last, keep_every=keep_every,
                        keep_within=keep_within,  # type: ignore[arg-type]
                        keep_best=keep_best, min_previous=min_previous)
        if not dry_run:
            self._check_writable("prune versions")
        return prune(self, policy, run=run, dry_run=dry_run, verify=verify)

    def purge(self, selector: str | Iterable[str], *, force: bool = False,
              grace: object = "1h", session_wait: float = 120.0,
              progress: Progress | None = None) -> PurgeResult:
        """Remove versions (one selector or a list) and delete now the data no other
        version shares; report what was freed and what stays, shared with which
        versions.  A held version is refused, and a tagged one unless ``force`` (nothing
        changes).  ``grace``
        protects versions removed earlier, as in :meth:`gc`; the purged ones get none.
        See :mod:`chunkstore.maintenance.purge` for what it promises."""
        selectors = [selector] if isinstance(selector, str) else selector_list(selector)
        self._check_writable("purge " + " ".join(selectors[:3]))
        infos = list({info.id: info for info in map(self.resolve, selectors)}.values())
        return purge(self, infos, force=force, grace=grace, session_wait=session_wait,
                     progress=progress)

    def finish_abandoned_deletions(self) -> None:
        """Finish deletions a killed GC left behind, unless a GC is running now."""
        finish_abandoned_deletions(self.index)

    def rebuild_index(self) -> RebuildResult:
        return rebuild(self)
