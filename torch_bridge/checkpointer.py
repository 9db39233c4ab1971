"""The Checkpointer: save and restore a whole training state, optionally in the background.

In the manner of torch.distributed.checkpoint's Stateful protocol and Orbax's
CheckpointManager: any object with ``state_dict()``/``load_state_dict()`` is
saved under the keyword it is passed with; RNG states are always captured;
``all_steps``/``latest_step`` list what is there; ``wait`` flushes.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import numbers
import os
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch.distributed as dist

import chunkstore
from chunkstore import Store, VersionInfo
from chunkstore.collector import collector_paused
from chunkstore.errors import (
    InvalidInputError,
    NoStoreError,
    RunInUseError,
    RunLeaseLostError,
    SigningKeyError,
)
from chunkstore.format import plaindata
from chunkstore.maintenance.autocollect import DEFAULT_COLLECT_GRACE_S, Collector
from chunkstore.maintenance.retention import Candidate, Policy, decide, warn_held
from chunkstore.objects.signing import PrivateKeyLike, PublicKeyLike, Trust, signing_key
from chunkstore.protocol.runlease import RunLease, describe_holder
from torch_bridge.capture import boundary
from torch_bridge.capture.layout import (
    RESERVED_KEYS,
    capture_states,
    check_key,
    check_restorable,
    write_version,
)
from torch_bridge.capture.provenance import provenance
from torch_bridge.capture.rng import capture_rng, restore_rng
from torch_bridge.capture.staging import StagingBuffers
from torch_bridge.capture.state import CapturedState
from torch_bridge.capture.tensors import as_array, host_copy
from torch_bridge.distributed.collectives import all_gather_plain, process_group_active
from torch_bridge.distributed.ranks import capture_copies, restore_ranks, save_ranks
from torch_bridge.errors import (
    AsyncSaveError,
    NotAtUpdateBoundaryWarning,
    RanksFailedError,
    RunNotFoundWarning,
)
from torch_bridge.tiers.mirror import DEFAULT_MIRROR_TIMEOUT_S, MirrorTier
from torch_bridge.tiers.restore import RestoreSource, TierRestore, ranks_tier, refill

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

log = logging.getLogger(__name__)
T = TypeVar("T")
#: How long ``close`` lets a collection after retention finish (one asked for, or one
#: running), by default; one cut short is a killed GC, which is safe.
COLLECT_CLOSE_S = 30.0
boundary.install()  # at import, so the first optimizer steps of a loop are seen too


def open_store(path_or_store: str | os.PathLike[str] | Store, *, create: bool = False,
               chunk_size: int | None = None, compression: str | None = None
               ) -> tuple[Store, bool]:
    """The store, and whether we opened it (and so must close it).  A path that holds
    no store raises :class:`~chunkstore.errors.NoStoreError` unless ``create``."""
    if isinstance(path_or_store, Store):
        return path_or_store, False
    return chunkstore.open(path_or_store, create=create, chunk_size=chunk_size,
                           compression=compression), True


def sync_arrays(captured: list[CapturedState]) -> list[tuple[np.ndarray, str | None]]:
    """Arrays to store straight from the live tensors (copied only off-CPU or strided)."""
    arrays = []
    for state in captured:
        for value in state.values:
            arrays.append((value, None) if isinstance(value, np.ndarray)
                          else as_array(host_copy(value)))
    return arrays


class Checkpointer:
    """Saves and restores training state as versions of one run in a chunkstore store.

    ``keep_last=N`` keeps the N newest versions of the run, ``keep_every=K``
    also keeps every version whose step is a multiple of K; others are deleted
    after each save (tagged versions, the newest and the one before it never
    are, so ``restore`` can always fall back), and a collection in a background
    thread then frees what only they needed (``collect=False``: left to
    ``chunkstore gc``), with a grace period of ``collect_grace`` seconds (default 0:
    a reader of this release anywhere is protected by its read lease, a save in
    flight by its session; give a grace where readers of older releases share the
    store).  ``keep_best=("val_loss", 3)`` also keeps the three
    versions with the lowest ``val_loss`` among the metrics each ``save(step,
    metrics={...})`` records (``("accuracy", 3, "max")`` the highest), as Orbax's
    ``best_fn`` does.  With none of them, nothing is deleted.
    ``async_save=True`` makes ``save`` return after copying the state into
    reused host buffers; the write runs in a background thread.

    Under torch.distributed (a default process group initialised before the
    Checkpointer is made) ``save`` and ``restore`` are collectives: every rank
    makes the Checkpointer and calls them with its own objects at the same
    step; each save is one version rank 0 publishes once every rank's data is
    durable, holding every rank's state (DTensor boxes once, tensors equal on
    several ranks once, RNG states and other per-rank state per rank), and
    ``restore`` loads the same version on every rank.  With ``async_save=True``
    the pause is the copy into host memory; the exchanges run in the background
    on a process group of the checkpoint's own.  The protocol and why it is
    safe: :mod:`torch_bridge.distributed.ranks`.

    The store is created by the first ``save`` when ``path_or_url`` holds none
    (never by ``restore``, ``all_steps`` or ``latest_step``, so a mistyped path
    creates nothing): ``restore`` then raises
    :class:`~chunkstore.errors.NoStoreError` naming the path, or returns None
    with ``missing_ok=True`` (a job's first start).  Reading :attr:`store`
    creates it too, since a :class:`chunkstore.Store` stands for a store that
    exists.

    A run has one writer.  The Checkpointer takes the run's lease in the store at its
    first contact with the run: when it is made (the store exists), else at
    ``restore`` or the first ``save`` (docs/format.md §11.5; visible from every
    machine, kept alive by a heartbeat, given back by ``close``).  A second launch of a
    running job raises :class:`~chunkstore.errors.RunInUseError` there, naming the
    first (host, pid, since), before it trains, instead of mixing its steps into the
    run's history.  A job restarted after its process died continues at once on the
    same host, and on another once the old lease expires (60 s after its last
    heartbeat reached the store, ``CHUNKSTORE_RUN_LEASE``; clocks are never compared);
    ``takeover=True`` takes a live lease: the old process then publishes nothing more
    (:class:`~chunkstore.errors.RunLeaseLostError`), even if it was paused in the
    middle of a commit.  ``read_only=True`` takes no lease and refuses to save: an
    evaluation job reads a run while it trains.  A second Checkpointer of the run in
    one process is refused at its first save.  Under a process group rank 0 holds the
    lease for the job, from the first save.

    Every version records provenance: the git revision of the working
    directory (``code_rev``, ``code_dirty``), library versions, host and
    world size, with ``meta`` merged over it.  Outside a git checkout
    ``code_rev`` is None and ``code_rev_unknown`` says why; pass the revision
    yourself with ``meta={"code_rev": ...}``.

    ``mirror=`` (a path, URL or open store) makes the store a fast local tier mirrored
    to a durable one (docs/recovery.md): a background replicator opens the mirror and
    copies each published version there, off the training thread, so a mirror that is
    down, refuses connections or never answers costs a save nothing; a version leaves
    the local tier only once the mirror holds it.  ``mirror_options`` are the storage
    options of a mirror given by URL (S3 requests are bounded by default, see
    :data:`torch_bridge.tiers.mirror.S3_MIRROR_OPTIONS`); a restore waits at most
    ``mirror_timeout`` seconds for the mirror before it reads the local tier alone.
    ``mirror_pending`` (and ``mirror_pending_reasons``) say what is not mirrored yet.

    ``sign_with`` (a key file from ``chunkstore keygen``, its password in
    ``$CHUNKSTORE_KEY_PASSWORD`` where it has one, or a loaded key) signs every version
    saved (docs/format.md §14); ``restore(require_signed=True)`` restores only versions
    signed by a key in ``trust`` (public key files or loaded keys) or by that key.
    """

    #: the keys the restore in progress requires a signature of (``require_signed``)
    _restore_trust: Trust | None = None

    def __init__(self, path_or_url: str | os.PathLike[str] | Store, *, run: str = "default",
                 keep_last: int | None = None, keep_every: int | None = None,
                 async_save: bool = False, meta: dict[str, Any] | None = None,
                 chunk_size: int | None = None, compression: str | None = None,
                 takeover: bool = False, read_only: bool = False,
                 keep_best: tuple[Any, ...] | None = None,
                 mirror: str | os.PathLike[str] | Store | None = None,
                 mirror_keep_last: int | None = None,
                 mirror_options: dict[str, Any] | None = None,
                 mirror_timeout: float = DEFAULT_MIRROR_TIMEOUT_S,
                 collect: bool = True,
                 collect_grace: float = DEFAULT_COLLECT_GRACE_S,
                 sign_with: PrivateKeyLike | None = None,
                 trust: Iterable[PublicKeyLike] | PublicKeyLike = ()) -> None:
        if keep_best is not None:
            keep_best = tuple(keep_best) if isinstance(keep_best, list) else keep_best
            Policy(keep_best=keep_best)  # checks it: (metric, n) or (metric, n, "min"|"max")
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every),
                            ("mirror_keep_last", mirror_keep_last)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise InvalidInputError(f"{name} must be a positive int or None, got {value!r}")
        if isinstance(mirror_timeout, bool) or not isinstance(mirror_timeout, int | float) \
                or not mirror_timeout > 0:
            raise InvalidInputError(f"mirror_timeout must be a positive number of seconds,"
                                    f" got {mirror_timeout!r}")
        if isinstance(collect_grace, bool) or not isinstance(collect_grace, int | float) \
                or not 0 <= collect_grace < float("inf"):
            raise InvalidInputError(f"collect_grace must be a number of seconds, 0 or more,"
                                    f" got {collect_grace!r}")
        for name, where in (("path_or_url", path_or_url), ("mirror", mirror)):
            if not (where is None and name == "mirror") \
                    and not isinstance(where, str | os.PathLike | Store):
                raise InvalidInputError(f"{name} must be a path, a store URL or an open store,"
                                        f" got {type(where).__name__} {where!r}")
        if meta is not None and not isinstance(meta, dict):
            raise InvalidInputError(f"meta must be a dict of plain data (or None), got"
                                    f" {type(meta).__name__} {meta!r}")
        #: the key every save signs its version with (docs/format.md §14), loaded now so a
        #: bad key file fails here, and the keys ``restore(require_signed=True)`` trusts:
        #: ``trust`` and this key's own public half
        self._signing_key, self._trust = _signing(sign_with, trust)
        self._location = path_or_url
        self._settings = (chunk_size, compression)
        self._store, self._owns_store, self._missing = _open_store_on_ranks(
            path_or_url, chunk_size, compression)
        #: No store at construction: the first save creates it (under a process group,
        #: on every rank at the same save, so ranks agree whether it is a collective).
        self._create_at_save = self._store is None
        self.run = run
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.keep_best = keep_best
        self.async_save = async_save
        # Provenance (a git call) is gathered at the first save: a restore needs none.
        self._user_meta = meta
        self._meta: dict[str, Any] | None = None
        plaindata.encode(meta or {})  # unencodable metadata fails here, not in every save
        self._staging = StagingBuffers()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: tuple[int, Future[VersionInfo]] | None = None
        self._last_info: VersionInfo | None = None
        self._closed = False
        #: the run's writer lease (docs/format.md §11.5), taken at the first save; under a
        #: process group rank 0 holds it for the job
        self._takeover = takeover
        #: an async save's process group under torch.distributed (never the training's)
        self._group: Any = None
        self._lease: RunLease | None = None
        self._holds_run = False
        #: the durable tier (``mirror=``): opened by its replicator's thread, which copies
        #: each published version there in the background (rank 0's, on ranks)
        self._mirror_location = mirror
        self.mirror_keep_last = mirror_keep_last
        self._tier: MirrorTier | None = None if mirror is None else MirrorTier(
            mirror, run=run, keep_last=mirror_keep_last, options=mirror_options,
            timeout=float(mirror_timeout), local=_weak_store(self))
        self._retention_lock = threading.Lock()
        #: the collection that follows retention (``collect``), made at its first trigger
        self._collect = collect
        self._collect_grace = float(collect_grace)
        self._collector: Collector | None = None
        #: where the last ``restore`` read from, and why (:class:`RestoreSource`)
        self.last_restore: RestoreSource | None = None
        self._timings: dict[str, float] = {}
        if mirror is not None and _same_place(path_or_url, mirror):
            raise InvalidInputError(f"mirror={mirror!r} is the Checkpointer's own store;"
                                    " name another store (a directory elsewhere, or an s3://"
                                    " URL)")
        self._read_only = read_only
        self._take_run_early()
        boundary.install()
        _OPEN.add(self)

    @property
    def meta(self) -> dict[str, Any]:
        """What every version records: provenance, with ``meta`` merged over it."""
        if self._meta is None:
            self._meta = provenance(self._user_meta)
        return self._meta

    # --- the store ---------------------------------------------------------------------------

    @property
    def store(self) -> Store:
        """The run's store; created now when the path holds none yet (a save would)."""
        if self._store is None:
            self._store, self._owns_store = open_store(
                self._location, create=True, chunk_size=self._settings[0],
                compression=self._settings[1])
        return self._store

    def _store_for_save(self) -> Store:
        """The store, created at the first save when there was none; under a process group
        rank 0 creates it first, so the ranks never race to create one store."""
        if self._create_at_save and process_group_active():
            self._agreed("creating the store", lambda: self.store if dist.get_rank() == 0
                         else None)
        self._create_at_save = False
        return self.store

    def _existing_store(self) -> Store | None:
        """The store if one exists (looked for again when there was none: another process
        may have saved since), never creating one."""
        if self._store is None and not process_group_active():
            self._store, self._owns_store, self._missing = _open_store_on_ranks(
                self._location, *self._settings)
        return self._store

    # --- saving ------------------------------------------------------------------------------

    @collector_paused()
    def save(self, step: int, *, metrics: dict[str, float] | None = None,
             **stateful: Any) -> VersionInfo | None:
        """Save ``stateful`` objects (and every RNG state) as the version of ``step``.

        Synchronous: returns the published version.  Async: waits for the
        previous save, copies the state into staging buffers and returns None;
        ``wait()`` returns the version.  Bad state raises here, naming its key path.
        Under a process group every rank returns the version; ranks at different
        steps raise ``RanksDisagreeError`` on every rank and publish nothing.

        ``metrics`` (names to finite numbers, e.g. ``{"val_loss": 0.31}``) are
        recorded with the version (its metadata's ``"metrics"``): ``keep_best``
        and ``chunkstore prune --keep-best`` rank versions by them, and
        ``chunkstore show`` lists them.  Under a process group rank 0's are recorded.
        """
        self._check_open()
        if self._read_only:
            raise InvalidInputError(f"this Checkpointer of run {self.run!r} is read_only: it"
                                    " restores and lists, and saves nothing")
        if process_group_active():  # what one rank may fail alone fails on every rank
            meta = self._agreed(f"the save of {self.run}@{step}",
                                lambda: self._meta_with(step, metrics))
        else:
            meta = self._meta_with(step, metrics)
        self.wait()
        self._warn_unapplied(step, stateful)
        if process_group_active():
            self._store_for_save()
            self._hold_run_on_ranks()
            if self.async_save:
                self._save_ranks_async(step, stateful, meta)
                return None
            return self._save_ranks(step, stateful, meta)
        states = self._states(stateful)
        captured = capture_states(states)
        self._store_for_save()  # after the state is checked: a refused save creates nothing
        if not self.async_save:
            info = self._write(step, captured, sync_arrays(captured), meta)
            self._last_info = info
            return info
        entries = [r.entry for c in captured for r in c.records]
        arrays = self._staging.stage(entries, [v for c in captured for v in c.values])
        for state in captured:
            state.values = []  # the background reads the staging buffers, never the originals
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="torch_bridge-save")
        self._pending = (step, self._executor.submit(self._write, step, captured, arrays,
                                                      meta))
        return None

    def _take_run_early(self) -> None:
        """Take the run at the first contact (made, restore): a second launch of a running
        job is refused before it trains.  Another Checkpointer of this process holding
        the run is no second launch: it is refused at its first save, as before."""
        if self._read_only or self._lease is not None or self._store is None \
                or process_group_active():
            return
        try:
            self._hold_run()
        except RunInUseError as exc:
            if exc.holder.get("pid") == os.getpid() and exc.holder.get(
                    "host") == socket.gethostname():
                return
            if self._owns_store and not self._holds_run:
                self._store.close()
            raise

    def _hold_run(self) -> None:
        """Take the run's writer lease at the first save: a run has one writer, so a second
        launch of the job fails here (``RunInUseError``, naming the first) instead of
        mixing its steps into the run's history."""
        if self._lease is None:
            lease = RunLease(self.store.objects, self.run, purpose="Checkpointer")
            lease.acquire(takeover=self._takeover)
            self._lease = lease
            if lease.head is not None and self.store.index.version(lease.head) is None:
                self.store.reconcile()  # the save in flight at a takeover, published now
            # A Checkpointer dropped without close() gives the run back when collected.
            weakref.finalize(self, _release_quietly, lease)
            if lease.took_over is not None:
                log.warning("run %r: took over the writer lease of %s", self.run,
                            describe_holder(lease.took_over, time.time()))
        self._holds_run = True

    def _hold_run_on_ranks(self) -> None:
        """Rank 0 takes (at the first save) or checks (at every later one) the job's lease;
        every rank raises what rank 0 found, so no rank waits in a collective for it."""
        problem = None
        if dist.get_rank() == 0:
            try:
                if self._lease is None:
                    self._hold_run()
                else:
                    self._lease.check_known()
            except Exception as exc:  # any failure: every rank must hear of it
                problem = [type(exc).__name__, str(exc)]
        found = all_gather_plain(problem)[0]
        if found is not None:
            if found[0] == RunLeaseLostError.__name__:
                raise RunLeaseLostError(self.run, None)
            if found[0] == RunInUseError.__name__:
                raise RunInUseError(self.run, {}, found[1])
            raise RanksFailedError("taking the run's lease", {0: f"{found[0]}: {found[1]}"})

    @staticmethod
    def _warn_unapplied(step: int, stateful: dict[str, Any]) -> None:
        unapplied = boundary.unapplied_gradients(stateful.items())
        if unapplied:
            warnings.warn(NotAtUpdateBoundaryWarning(
                f"step {step}: {unapplied[0]} holds a gradient no optimizer step has applied"
                f" ({len(unapplied)} parameters); a save between backward() and step() or"
                " mid-accumulation does not resume exactly: save after optimizer.step()"),
                stacklevel=3)

    def _meta_with(self, step: int, metrics: dict[str, float] | None) -> dict[str, Any]:
        """The version's metadata: provenance and ``meta``, and this save's metrics."""
        if metrics is None:
            if self.keep_best is not None:
                warnings.warn(RuntimeWarning(
                    f"run {self.run!r}: step {step} records no metrics, so keep_best"
                    f" ({self.keep_best[0]!r}) cannot rank it; pass"
                    f" save(step, metrics={{{self.keep_best[0]!r}: ...}}, ...)"), stacklevel=3)
            return self.meta
        if not isinstance(metrics, dict) or not metrics:
            raise InvalidInputError(f"metrics must be a non-empty dict of names to numbers,"
                                    f" like {{'val_loss': 0.31}}; got {metrics!r} (to save an"
                                    " object named 'metrics' as state, give it another name)")
        clean: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name:
                raise InvalidInputError(f"metric names must be non-empty strings, got {name!r}")
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                    math.isfinite(float(value))):
                raise InvalidInputError(f"metric {name!r} must be a finite number, got"
                                        f" {value!r}")
            clean[name] = float(value)
        if self.keep_best is not None and self.keep_best[0] not in clean:
            warnings.warn(RuntimeWarning(
                f"run {self.run!r}: step {step} records no {self.keep_best[0]!r} (it records"
                f" {', '.join(sorted(clean))}), so keep_best cannot rank it"), stacklevel=3)
        return {**self.meta, "metrics": clean}

    def _save_ranks(self, step: int, stateful: dict[str, Any], meta: dict[str, Any]
                    ) -> VersionInfo:
        """Every rank's state as one version (:mod:`torch_bridge.distributed.ranks`); rank 0
        publishes it and applies retention."""
        info = save_ranks(self.store, self.run, step, meta,
                          lambda: self._states(stateful), before_commit=self._lease_check(),
                          sign_with=self._signing_key)
        return self._published_on_ranks(step, info)

    def _agreed(self, action: str, work: Callable[[], T]) -> T:
        """Run ``work`` on every rank and exchange the outcome: a rank that failed raises
        its own error, every other rank RanksFailedError (none waits in a collective
        for a rank that left).  A collective."""
        error: Exception | None = None
        result = None
        try:
            result = work()
        except Exception as exc:
            error = exc
        failures = {rank: text for rank, text in enumerate(all_gather_plain(
            None if error is None else f"{type(error).__name__}: {error}")) if text}
        if error is not None:
            raise error
        if failures:
            raise RanksFailedError(action, failures)
        return result  # type: ignore[return-value]

    def _lease_check(self) -> Callable[[], None] | None:
        """What rank 0 checks right before its commit: the job's lease still its own."""
        return self._lease  # claims its slot, then checks (docs/format.md §11.5)

    def _published_on_ranks(self, step: int, info: VersionInfo) -> VersionInfo:
        if dist.get_rank() == 0:
            self._mirror_published(info.id)
            self._retain(step, info)
        self._last_info = info
        return info

    def _save_ranks_async(self, step: int, stateful: dict[str, Any], meta: dict[str, Any]
                          ) -> None:
        """The training pauses for the copy into host memory (and the ranks agreeing it
        worked); the protocol runs in the background on the checkpoint's own group."""
        if self._group is None:  # made by every rank at the same save: a collective
            self._group = dist.new_group(backend="gloo")
        group = self._group
        prepared = capture_copies(lambda: self._states(stateful), group)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="torch_bridge-save")

        def background() -> VersionInfo:
            info = save_ranks(self.store, self.run, step, meta, None, prepared=prepared,
                              group=group, before_commit=self._lease_check(),
                              sign_with=self._signing_key)
            return self._published_on_ranks(step, info)
        self._pending = (step, self._executor.submit(background))

    def _states(self, stateful: dict[str, Any]) -> dict[str, Any]:
        for key in stateful:
            if key in RESERVED_KEYS:
                raise InvalidInputError(f"state key {key!r} is reserved (RNG states are"
                                        " captured automatically)")
            check_key(key)
        return {**stateful, "rng": capture_rng()}

    def _write(self, step: int, captured: list[CapturedState],
               arrays: list[tuple[np.ndarray, str | None]], meta: dict[str, Any]
               ) -> VersionInfo:
        # The lease is taken at the first contact with an existing store (made, restore),
        # else here, at the save that creates the store; a run known to be taken over
        # (by the heartbeat, or an earlier save) saves nothing.  The commit claims its
        # slot, then checks the store.
        if self._lease is None:
            self._hold_run()
        else:
            self._lease.check_known()
        assert self._lease is not None
        info = write_version(self.store, self.run, step, meta, captured, arrays,
                             before_commit=self._lease, sign_with=self._signing_key)
        self._mirror_published(info.id)
        self._retain(step, info)
        return info

    def _retain(self, step: int, info: VersionInfo) -> None:
        if self._tier is not None:
            return  # the replicator's thread applies it after each copy (it asks the mirror)
        try:
            self._apply_retention(info.id)
        except Exception as exc:  # the version is published; retention can run next time
            warnings.warn(RuntimeWarning(
                f"run {self.run!r}: step {step} was saved, but removing old versions"
                f" failed: {exc}"), stacklevel=3)

    def wait(self, *, mirror: bool = False, timeout: float | None = None
             ) -> VersionInfo | None:
        """Block until the save in flight is published; raise AsyncSaveError if it failed.

        ``mirror=True`` also waits until every version published so far is copied to
        the mirror (``timeout`` seconds at most), raising
        :class:`~chunkstore.errors.MirrorError` naming the versions left when copies
        keep failing, the mirror cannot be reached, the time runs out or a version's
        local copy is damaged (``mirror_pending_reasons`` says which)."""
        info = self._wait_save()
        if mirror and self._tier is not None:
            self._tier.wait(timeout)
        return info

    def _wait_save(self) -> VersionInfo | None:
        pending, self._pending = self._pending, None
        if pending is not None:
            step, future = pending
            try:
                self._last_info = future.result()
            except Exception as exc:
                raise AsyncSaveError(self.run, step, exc) from exc
        return self._last_info

    def _apply_retention(self, just_written: str | None) -> None:
        if self.keep_last is None and self.keep_every is None and self.keep_best is None:
            return
        with self._retention_lock:  # the replicator's thread applies it too
            self._apply_retention_locked(just_written)

    def _apply_retention_locked(self, just_written: str | None) -> None:
        versions = self.store.versions(self.run)
        policy = Policy(keep_last=self.keep_last, keep_every=self.keep_every,
                        keep_best=self.keep_best, min_previous=1)
        # The newest two at least (the newest and min_previous=1 behind it): restore
        # falls back to the one before a damaged newest.
        decision = decide([Candidate(v.id, v.step, v.created, v.meta) for v in versions],
                          policy, time.time())
        pinned = set(self.store.tags().values())
        dropped = []
        for version in versions:
            if version.id in decision.drop and version.id not in pinned \
                    and version.id != just_written:
                if self._tier is not None and not self._tier.may_leave(version.id):
                    continue  # never the last whole copy: the mirror's store must hold it
                dropped.append(version)
        # held versions stay (and are named)
        held = self.store.delete_listed_many(dropped, operation="keep_last")
        warn_held(held, f"run {self.run!r}: keep_last")
        removed = len(dropped) - len(held)
        if removed and self._collect:  # what they alone needed goes now, not in an hour
            if self._collector is None:
                self._collector = Collector(self.store, self._collect_grace)
            self._collector.trigger()

    # --- the mirror ---------------------------------------------------------------------------

    def _mirror_published(self, version_id: str) -> None:
        """Hand a published version to the replicator (started at the first; it opens
        the mirror and finds the versions a killed replicator left, in its own thread).
        No I/O here: the save is published whatever the mirror does."""
        if self._tier is not None:
            self._tier.published(version_id, _weakly(self._after_mirrored))

    def _after_mirrored(self, version_id: str) -> None:
        """In the replicator's thread: what the fast tier kept only until it was
        mirrored may go now, and the mirror keeps its own ``mirror_keep_last``."""
        self._apply_retention(None)
        if self._tier is not None:
            self._tier.apply_retention()

    @property
    def mirror_pending(self) -> list[str]:
        """Versions published here and not yet copied to the mirror, oldest first: those
        waiting for a copy (the mirror down or not reached yet included) and those whose
        local copy is damaged."""
        return [] if self._tier is None else self._tier.pending

    @property
    def mirror_pending_reasons(self) -> dict[str, str]:
        """Why each version of :attr:`mirror_pending` is not mirrored yet."""
        return {} if self._tier is None else self._tier.pending_reasons

    # --- restoring ---------------------------------------------------------------------------

    @collector_paused()
    def restore(self, step: int | None = None, *, rng: bool = True, missing_ok: bool = False,
                require_signed: bool = False, **stateful: Any) -> int | None:
        """Load the newest version that verifies into ``stateful``; return its step.

        Nothing to restore is an error unless ``missing_ok``: a path that holds no
        store raises :class:`~chunkstore.errors.NoStoreError` naming it (nothing is
        created).  The run having no version returns None (touching nothing), with
        a :class:`RunNotFoundWarning` naming the runs the store holds when it holds
        others (``run=`` mistyped).  ``missing_ok=True`` is for a job's first start:
        None, quietly, when there is no store or no version of the run.

        A damaged newest version warns and falls back to the one before.  With
        ``step``, exactly that step is loaded (no fallback).  ``rng=False``
        leaves the global RNGs alone.  Under a process group every rank loads
        the same version: the newest whose parts read back intact on every rank.

        ``require_signed=True`` restores only versions signed by a trusted key (``trust=``,
        and the ``sign_with`` key): one unsigned, signed by another key or with a bad
        signature is skipped with the same warning as a damaged one (with ``step``: an
        :class:`~chunkstore.errors.UntrustedVersionError`).
        """
        self._check_open()
        self._restore_trust = self._trust_for(require_signed)
        self._timings = {}
        self.last_restore = None
        if step is not None:
            if isinstance(step, bool) or not isinstance(step, numbers.Integral):
                raise InvalidInputError(f"step must be an integer (or None for the newest),"
                                        f" got {type(step).__name__} {step!r}")
            step = int(step)
        self.wait()
        for key, obj in stateful.items():
            check_key(key)
            check_restorable(key, obj)
        store = self._existing_store()
        self._take_run_early()  # a second launch is refused before it restores
        if self._tier is not None and not process_group_active():
            restored = self._restore_with_mirror(step, stateful, rng, missing_ok)
            if restored is None and not missing_ok and store is not None:
                self._warn_of_other_runs()
            return restored
        if self._tier is not None:
            store, self.last_restore = ranks_tier(store, self.run, self._reachable_mirror)
        if store is None:
            if missing_ok:
                return None
            raise NoStoreError(self._missing[0], f"{self._missing[1]}; nothing was restored"
                               " (check the path; for a job's first start pass"
                               " restore(..., missing_ok=True), and the first save creates"
                               " the store)")
        if process_group_active():
            restored = self._restore_on_ranks(store, step, stateful, rng)
            if self.last_restore is not None and self.last_restore.tier == "mirror":
                return restored  # no local store to name other runs from
        else:
            restored = self._restore_tiers(step, stateful, rng, [("local", store)])
        if restored is None and not missing_ok:
            self._warn_of_other_runs()
        return restored

    def _trust_for(self, require_signed: bool) -> Trust | None:
        """The keys a restore requires a signature of (None: it does not)."""
        if not require_signed:
            return None
        if not self._trust:
            raise SigningKeyError("require_signed", "no trusted key: give the Checkpointer"
                                  " trust=[PUBLIC_KEY_FILE, ...] (or sign_with=KEY)")
        return self._trust

    def _restore_on_ranks(self, store: Store, step: int | None, stateful: dict[str, Any],
                          rng: bool) -> int | None:
        targets = {**stateful, "rng": {}} if rng else dict(stateful)
        restored = restore_ranks(store, self.run, step, targets,
                                 {"rng": restore_rng} if rng else {}, self._restore_trust)
        if self.last_restore is not None:  # the tier ranks_tier chose
            self.last_restore = replace(self.last_restore, step=restored or 0)
        return restored

    def _restore_with_mirror(self, step: int | None, stateful: dict[str, Any], rng: bool,
                             missing_ok: bool) -> int | None:
        """The restore with a mirror: from the nearest tier that holds the newest version
        whole (the local store first, else the mirror)."""
        local, mirror = self._existing_store(), self._reachable_mirror()
        if local is None and mirror is None:
            if missing_ok:
                return None
            raise NoStoreError(self._missing[0], f"{self._missing[1]}, and the mirror holds"
                               " no store either; nothing was restored (for a job's first"
                               " start pass restore(..., missing_ok=True))")
        return self._restore_tiers(step, stateful, rng, [("local", local), ("mirror", mirror)])

    def _restore_tiers(self, step: int | None, stateful: dict[str, Any], rng: bool,
                       tiers: list[tuple[str, Store | None]]) -> int | None:
        """The restore in one process: the newest version that loads (or ``step``'s),
        from the nearest of ``tiers`` that holds it whole; one read from the mirror is
        copied into the local tier afterwards (a fresh node refills it)."""
        source = TierRestore(self.run, stateful, rng, step, self._timings,
                             self._restore_trust).run_over(
            tiers, self._refill, lambda: self._store is not None)
        if source is None:
            return None
        self.last_restore = source
        return source.step

    def _reachable_mirror(self) -> Store | None:
        """The mirror for a restore, its versions listed within ``mirror_timeout``
        seconds; None, with a warning, when it cannot be reached (the local tier then
        serves alone) or holds no store."""
        assert self._tier is not None

        def warn(message: str) -> None:
            warnings.warn(RuntimeWarning(message), stacklevel=6)
        return self._tier.for_restore(warn)

    def _refill(self, info: VersionInfo) -> None:
        """Heal the local tier with a version read from the mirror."""
        assert self._tier is not None
        mirror = self._tier.open(create=False)
        assert mirror is not None
        refill(mirror, self._store or self._location, self.run, info)
        self._existing_store()  # the local store, where the copy just created it

    def _warn_of_other_runs(self) -> None:
        others = [run for run in self.store.runs() if run != self.run]
        if others:
            warnings.warn(RunNotFoundWarning.naming(self.run, self.store.url, others),
                          stacklevel=4)

    # --- listing and closing -----------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps of the run's versions, in order (a save in flight not included; none
        while the path holds no store, which this does not create)."""
        self._check_open()
        store = self._existing_store()
        return [] if store is None else [v.step for v in store.versions(self.run)]

    def latest_step(self) -> int | None:
        """The highest step saved (what ``restore`` tries first); None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError("this Checkpointer is closed")

    def close(self, timeout: float | None = None) -> None:
        """Flush the save in flight (raising its error) and release the store.

        With a mirror, the copies queued go on while they succeed (for ``timeout``
        seconds at most; None: as long as they succeed, each request bounded by the
        mirror's own timeouts), and a RuntimeWarning names the versions left, and why;
        the next Checkpointer with this mirror copies them."""
        if self._closed:
            return
        held = False  # a copy hung on the mirror holds the local store
        try:
            self.wait()
        finally:
            self._closed = True
            _OPEN.discard(self)
            try:
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                held = self._close_mirror(timeout)
                if self._collector is not None:  # a collection cut short is a killed GC
                    self._collector.close(COLLECT_CLOSE_S if timeout is None else timeout)
            finally:
                if self._lease is not None:
                    with contextlib.suppress(Exception):  # it expires by itself otherwise
                        self._lease.release()
                if self._group is not None:
                    with contextlib.suppress(Exception):
                        dist.destroy_process_group(self._group)
                if self._owns_store and self._store is not None and not held:
                    self._store.close()

    def _close_mirror(self, timeout: float | None) -> bool:
        """Let the replicator finish what is queued (while copies succeed, ``timeout``
        seconds at most), then release the mirror; warn naming the versions left (the
        next Checkpointer copies them).  True when a copy hung on the mirror still holds
        the replicator: the local store then stays open for it."""
        if self._tier is None:
            return False
        left, why = self._tier.close(timeout)
        if left:
            warnings.warn(RuntimeWarning(
                f"run {self.run!r}: {len(left)} version(s) are not mirrored yet ({why});"
                " the next Checkpointer with this mirror copies them"), stacklevel=3)
        return self._tier.replicator is not None and self._tier.replicator.running

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(AsyncSaveError):  # the exception propagating matters more
            self.close()



#: Where a Checkpointer found no store, and why: (url, reason).
Missing = tuple[str, str]


def _signing(sign_with: PrivateKeyLike | None,
             trust: Iterable[PublicKeyLike] | PublicKeyLike
             ) -> tuple[ec.EllipticCurvePrivateKey | None, Trust]:
    """The signing key (loaded now, so a bad key file fails at construction) and the
    keys a ``require_signed`` restore trusts: ``trust`` and the signing key's own."""
    key = None if sign_with is None else signing_key(sign_with)
    return key, Trust(trust).plus(None if key is None else key.public_key())


def _open_store_on_ranks(path_or_store: str | os.PathLike[str] | Store,
                         chunk_size: int | None, compression: str | None
                         ) -> tuple[Store | None, bool, Missing]:
    """The store if one exists (never created here), whether we opened it, and where and
    why there is none.  Under a process group rank 0 looks first and the other ranks
    open the store only if it found one, so every rank agrees."""
    if not process_group_active() or isinstance(path_or_store, Store):
        return _open_existing(path_or_store, chunk_size, compression)
    if dist.get_rank() == 0:
        found = _open_existing(path_or_store, chunk_size, compression)
        all_gather_plain(found[0] is not None)
        return found
    if all_gather_plain(None)[0]:
        return (*open_store(path_or_store, chunk_size=chunk_size, compression=compression),
                ("", ""))
    return None, False, (os.fspath(path_or_store), "rank 0 found none there")


def _open_existing(path_or_store: str | os.PathLike[str] | Store, chunk_size: int | None,
                   compression: str | None) -> tuple[Store | None, bool, Missing]:
    try:
        store, owned = open_store(path_or_store, chunk_size=chunk_size, compression=compression)
    except NoStoreError as exc:
        return None, False, (exc.url, exc.reason)
    return store, owned, ("", "")


#: Checkpointers not yet closed: at exit, a failed background save is reported
#: on stderr rather than lost with the process.
_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


@atexit.register
def _report_unfinished_saves() -> None:
    for checkpointer in list(_OPEN):
        try:
            checkpointer.wait()
        except AsyncSaveError as exc:
            print(f"torch_bridge: {exc}", file=sys.stderr)


def _same_place(here: str | os.PathLike[str] | Store, there: str | os.PathLike[str] | Store
                ) -> bool:
    def place(location: str | os.PathLike[str] | Store) -> str:
        if isinstance(location, Store):
            location = location.objects.local_path() or location.url
        text = os.fspath(location)
        return os.path.realpath(text) if "://" not in text else text.rstrip("/")
    return place(here) == place(there)


def _release_quietly(lease: RunLease) -> None:
    with contextlib.suppress(Exception):
        lease.release()


def _weak_store(checkpointer: Checkpointer) -> Callable[[], Store]:
    """The Checkpointer's store, without keeping the Checkpointer alive (its mirror
    tier's replicator thread may outlive it)."""
    ref = weakref.ref(checkpointer)

    def store() -> Store:
        owner = ref()
        if owner is None:
            raise InvalidInputError("the Checkpointer of this mirror was dropped")
        return owner.store
    return store


def _weakly(method: Callable[[str], None]) -> Callable[[str], None]:
    """``method`` without keeping its object alive (a replicator's thread outlives a
    Checkpointer dropped without close(), which must still be collectable)."""
    ref = weakref.WeakMethod(method)

    def call(version_id: str) -> None:
        bound = ref()
        if bound is not None:
            bound(version_id)
    return call
