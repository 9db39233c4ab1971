"""How a training state sits in one chunkstore version, written and read.

A version written by torch_bridge holds, per state key (``model``,
``optimizer``, ..., ``rng``), one tensor entry per tensor, plus one plain-data
entry ``_torch_bridge``::

    {"format": 1, "step": 100,
     "states": {"model": {"skeleton": ..., "tensors": [[path, entry, kind, dtype, shape]],
                          "module_metadata": ...}, ...}}

A version saved by many ranks (:mod:`torch_bridge.distributed.ranks`) holds
``"world_size": W, "ranks": [states of rank 0, ..., states of rank W-1]``
instead of ``"states"``; a tensor of kind ``dtensor`` is a global tensor of
which the rank held a box (its entry's shards are the boxes of every rank).

Reading is two passes: check that every tensor fits the object it goes into
(nothing is touched when one does not), then read each tensor, hash-verified,
straight into the existing storage where it can.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from chunkstore.errors import InvalidInputError, UnsupportedDtypeError
from chunkstore.format.dtypes import numpy_dtype
from chunkstore.format.manifest import TensorEntry
from torch_bridge.capture.dtensors import is_dtensor, read_local
from torch_bridge.capture.state import (
    CapturedState,
    EntryNames,
    TensorRecord,
    capture,
    is_missing,
    lookup,
    path_text,
    rebuild,
)
from torch_bridge.capture.tensors import as_array, readable_in_place, torch_dtype
from torch_bridge.errors import (
    CorruptCheckpointError,
    MetaDeviceError,
    NotACheckpointError,
    PartialRestoreWarning,
    StateMismatchError,
    StateNotFoundError,
    WorldSizeMismatchError,
)

if TYPE_CHECKING:
    from chunkstore import Store, VersionInfo, VersionReader
    from chunkstore.objects.signing import PrivateKeyLike

BRIDGE_ENTRY = "_torch_bridge"
FORMAT = 1
RESERVED_KEYS = frozenset({"rng", "step"})
#: The kind of a tensor record whose entry is a global tensor of which this rank
#: holds a box (a DTensor): written and read by :mod:`torch_bridge.distributed.ranks`.
DTENSOR = "dtensor"

Array = tuple[np.ndarray, str | None]


@runtime_checkable
class Stateful(Protocol):
    """What save/restore accept besides plain state trees (torch.distributed.checkpoint's)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def check_key(key: str) -> str:
    if not key.isidentifier() or key.startswith("_"):
        raise InvalidInputError(f"state key {key!r} must be an identifier not starting"
                                " with '_'")
    return key


def capture_states(states: dict[str, Any]) -> list[CapturedState]:
    """Call state_dict() on each Stateful and take every tree apart (no copies yet)."""
    names = EntryNames({BRIDGE_ENTRY})
    captured = []
    for key, obj in states.items():
        tree = obj.state_dict() if isinstance(obj, Stateful) else obj
        captured.append(capture(key, tree, names))
    return captured


def write_version(store: Store, run: str, step: int, meta: dict[str, Any],
                  captured: list[CapturedState], arrays: Iterable[Array],
                  before_commit: Callable[[], None] | None = None,
                  sign_with: PrivateKeyLike | None = None) -> VersionInfo:
    """Publish one version from captured states and their arrays (in record order).

    A step the run already has is replaced (``replace=True``): a resumed run
    that saves a step again, after a crash lost what followed, holds the state
    to keep; a save identical in tensors and meta publishes nothing.
    """
    records = [r for c in captured for r in c.records]
    with store.new_version(run, step, meta=meta, replace=True, sign_with=sign_with) as version:
        version.before_commit = before_commit
        for record, (array, override) in zip(records, arrays, strict=True):
            version.put(record.entry, array, dtype=override)
        version.put_data(BRIDGE_ENTRY, {"format": FORMAT, "step": step,
                                        "states": {c.key: c.section() for c in captured}})
    return version.info


def saved_ranks(reader: VersionReader) -> list[dict[str, dict[str, Any]]]:
    """Each rank's states, in rank order (one rank for a single-process version)."""
    if BRIDGE_ENTRY not in reader.names():
        raise NotACheckpointError(f"version {reader.info.short_id} was not written by"
                                  " torch_bridge (it has no _torch_bridge entry)")
    header = reader.get_data(BRIDGE_ENTRY)
    if not isinstance(header, dict):
        raise CorruptCheckpointError(reader.info.id, "not a dict")
    if header.get("format") != FORMAT:
        raise NotACheckpointError(f"version {reader.info.short_id} has torch_bridge format"
                                  f" {header.get('format')!r}; this release reads {FORMAT}")
    ranks = header["ranks"] if "ranks" in header else [header.get("states")]
    if not isinstance(ranks, list) or not ranks:
        raise CorruptCheckpointError(reader.info.id, "no list of ranks' states")
    for states in ranks:
        _check_states(reader.info.id, states)
    return ranks


def _check_states(version_id: str, states: Any) -> None:
    """One rank's states as torch_bridge writes them, or CorruptCheckpointError: every
    later step reads them without asking again."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(version_id, why)

    if not isinstance(states, dict):
        raise bad("a rank's states are not a dict")
    for key, section in states.items():
        if not isinstance(key, str) or not isinstance(section, dict) \
                or "skeleton" not in section or not isinstance(section.get("tensors"), list):
            raise bad(f"state {key!r} is not a section with a skeleton and tensors")
        for plain in section["tensors"]:
            if not (isinstance(plain, list) and len(plain) == 5):
                raise bad(f"state {key!r} lists a tensor record that is not five fields")
            path, entry, kind, dtype, shape = plain
            if not _is_path(path) or not isinstance(entry, str) \
                    or kind not in ("torch", "numpy", DTENSOR) or not isinstance(dtype, str) \
                    or not isinstance(shape, list) or not all(
                        type(d) is int and d >= 0 for d in shape):
                raise bad(f"state {key!r} lists a malformed tensor record {plain!r:.200}")


def _is_path(path: Any) -> bool:
    """A saved tensor path: a list whose parts can be dict keys (a rebuilt tree's)."""
    try:
        return isinstance(path, list) and hash(tuple(path)) is not None
    except TypeError:
        return False


def read_sections(reader: VersionReader, rank: int = 0, world: int = 1
                  ) -> dict[str, dict[str, Any]]:
    """The states ``rank`` of ``world`` saved; WorldSizeMismatchError when the version
    was saved by another number of ranks."""
    ranks = saved_ranks(reader)
    if len(ranks) != world:
        raise WorldSizeMismatchError(reader.info.id, len(ranks), world)
    return ranks[rank]


class _Plan:
    """Where each tensor of one state goes: an existing tensor (in place) or a new one."""

    def __init__(self, key: str, section: dict[str, Any]) -> None:
        self.key = key
        self.section = section
        self.records = [TensorRecord.from_plain(t) for t in section["tensors"]]
        self.targets: list[torch.Tensor | np.ndarray] = []


def load_states(reader: VersionReader, targets: dict[str, Any],
                sections: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Read the states named by ``targets`` (live objects or trees); return rebuilt trees.

    Tensors land in the live tree's tensors when shape and dtype agree;
    a disagreement raises StateMismatchError, and a live tensor on the meta
    device (which holds no data: a copy into it does nothing) MetaDeviceError,
    before anything is read.
    ``sections``: one rank's states of a multi-rank version (the version's
    own for a single-process one); their ``dtensor`` records fill the live
    DTensors' local boxes.
    """
    plans = _plans(reader, targets, read_sections(reader) if sections is None else sections)
    requests: list[tuple[str, np.ndarray, str | None]] = []
    copies: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
    boxes: list[tuple[str, torch.Tensor]] = []
    for plan in plans:
        for record, target in zip(plan.records, plan.targets, strict=True):
            if record.kind == DTENSOR:
                assert isinstance(target, torch.Tensor)
                boxes.append((record.entry, target))
            else:
                requests.append(_request(record, target, copies))
    reader.get_many_into(requests)  # every chunk of every tensor, hash-checked, in parallel
    for name, dtensor in boxes:
        read_local(reader, name, dtensor)
    for target, staging, pin in copies:
        with torch.no_grad():
            target.copy_(staging, non_blocking=pin)
    trees = {}
    for plan in plans:
        loaded = {record.path: target for record, target in zip(plan.records, plan.targets,
                                                                strict=True)}
        trees[plan.key] = rebuild(plan.section["skeleton"], loaded,
                                  plan.section.get("module_metadata"))
    return trees


def _plans(reader: VersionReader, targets: dict[str, Any], sections: dict[str, dict[str, Any]]
           ) -> list[_Plan]:
    """Where every saved tensor of the targets' states goes; the typed errors, before
    anything is read."""
    missing = sorted(k for k in targets if k not in sections)
    if missing:
        raise StateNotFoundError(reader.info.id, missing, sorted(sections))
    plans = [_Plan(key, sections[key]) for key in targets]
    problems: list[str] = []
    for plan in plans:
        obj = targets[plan.key]
        live = obj.state_dict() if isinstance(obj, Stateful) else obj
        _check_structure(plan, obj, live, problems)
        _check_kind(plan, obj, problems)
        for record in plan.records:
            plan.targets.append(_target(reader, plan.key, record, live, problems))
    on_meta = [path_text(plan.key, record.path) for plan in plans
               for record, target in zip(plan.records, plan.targets, strict=True)
               if isinstance(target, torch.Tensor) and target.device.type == "meta"]
    if on_meta:
        raise MetaDeviceError(reader.info.id, on_meta)
    if problems:
        raise StateMismatchError(reader.info.id, problems)
    return plans


def warn_unrestored(info: VersionInfo, saved: Iterable[str], targets: dict[str, Any],
                    stacklevel: int = 2) -> None:
    """Warn when the version holds states the restore did not ask for (``rng`` aside:
    leaving it is what ``rng=False`` asks)."""
    left = sorted(key for key in saved if key not in targets and key != "rng")
    if left:
        warnings.warn(PartialRestoreWarning.leaving(
            f"version {info.short_id} ({info.run}@{info.step})", left), stacklevel=stacklevel + 1)


def _target(reader: VersionReader, key: str, record: TensorRecord, live: Any,
            problems: list[str]) -> torch.Tensor | np.ndarray:
    entry = reader.entry(record.entry)
    if not isinstance(entry, TensorEntry):
        raise NotACheckpointError(f"entry {record.entry!r} should be a tensor")
    shape = tuple(entry.shape)
    if record.kind == "numpy":
        return _array_target(entry, key, record, live, problems)
    try:
        dtype = torch_dtype(entry.dtype)
    except UnsupportedDtypeError as exc:
        problems.append(f"{path_text(key, record.path)}: {exc}")
        return np.empty(0)
    existing = lookup(live, record.path)
    if record.kind == DTENSOR and not is_dtensor(existing):
        problems.append(f"{path_text(key, record.path)} is a sharded tensor (DTensor) in the"
                        " checkpoint but not here: restore into objects whose state holds"
                        " it (e.g. an optimizer whose state is initialised)")
        return np.empty(0)
    if is_missing(existing) or not isinstance(existing, torch.Tensor):
        return torch.empty(shape, dtype=dtype)
    if tuple(existing.shape) != shape or existing.dtype != dtype:
        have = f"{str(existing.dtype).removeprefix('torch.')}{list(existing.shape)}"
        problems.append(f"{path_text(key, record.path)} is {entry.dtype}{list(shape)} in"
                        f" the checkpoint but {have} here")
    return existing


def _request(record: TensorRecord, target: torch.Tensor | np.ndarray,
             copies: list[tuple[torch.Tensor, torch.Tensor, bool]]
             ) -> tuple[str, np.ndarray, str | None]:
    """The read that fills ``target``: in place when its memory allows, else through a
    host staging tensor copied in afterwards (recorded in ``copies``)."""
    if isinstance(target, np.ndarray):
        return record.entry, target, None
    if readable_in_place(target):
        array, override = as_array(target)
        return record.entry, array, override
    pin = target.device.type == "cuda" and torch.cuda.is_available()
    staging = torch.empty(tuple(target.shape), dtype=target.dtype, pin_memory=pin)
    copies.append((target, staging, pin))
    array, override = as_array(staging)
    return record.entry, array, override


def _check_structure(plan: _Plan, obj: Any, live: Any, problems: list[str]) -> None:
    """What load_state_dict would refuse only after the tensors were read in place: a
    module whose state names other entries, an optimizer whose parameter groups differ.
    Found here, before anything is read, nothing live is touched."""
    skeleton = plan.section.get("skeleton")
    if isinstance(obj, torch.nn.Module) and isinstance(skeleton, dict) \
            and isinstance(live, dict) and _loads_strictly(obj):
        missing = sorted(str(k) for k in set(live) - set(skeleton))
        unexpected = sorted(str(k) for k in set(skeleton) - set(live))
        if missing or unexpected:
            problems.append(f"{plan.key}: the checkpoint lacks {missing[:5]} and has"
                            f" {unexpected[:5]} that this module does not")
    elif isinstance(obj, torch.optim.Optimizer) and isinstance(skeleton, dict) \
            and isinstance(live, dict) \
            and type(obj).load_state_dict is torch.optim.Optimizer.load_state_dict \
            and not getattr(obj, "_optimizer_load_state_dict_pre_hooks", None) \
            and not getattr(obj, "_optimizer_load_state_dict_post_hooks", None):
        def sizes(state: dict[str, Any]) -> list[int]:
            groups = state.get("param_groups")
            return [len(g.get("params", ())) if isinstance(g, dict) else -1
                    for g in groups] if isinstance(groups, list) else []
        if sizes(skeleton) != sizes(live):
            problems.append(f"{plan.key}: the checkpoint's parameter groups hold"
                            f" {sizes(skeleton)} parameters, this optimizer's {sizes(live)}")


def _check_kind(plan: _Plan, obj: Any, problems: list[str]) -> None:
    """A target that is itself an array, a tensor, a list or a dict must have been saved
    as one (else the loaded state has nowhere to go in it)."""
    if isinstance(obj, Stateful):
        return
    skeleton = plan.section.get("skeleton")
    whole = [r.kind for r in plan.records if r.path == ()]
    if isinstance(obj, np.ndarray):
        fits = whole == ["numpy"]
    elif isinstance(obj, torch.Tensor):
        fits = bool(whole) and whole[0] != "numpy"
    elif isinstance(obj, list):
        fits = isinstance(skeleton, (list, tuple))
    elif isinstance(obj, dict):
        fits = isinstance(skeleton, dict)
    else:
        return
    if not fits:
        saved = whole[0] if whole else type(skeleton).__name__
        problems.append(f"{plan.key} is {saved} in the checkpoint but a"
                        f" {type(obj).__name__} here")


def _loads_strictly(module: torch.nn.Module) -> bool:
    """Whether load_state_dict surely refuses other keys: no module in it renames or
    fills keys (load hooks, its own _load_from_state_dict, as BatchNorm's, or its own
    load_state_dict).  Only then are the keys compared before anything is read."""
    base = torch.nn.Module
    for sub in module.modules():
        kind = type(sub)
        if getattr(sub, "_load_state_dict_pre_hooks", None) \
                or getattr(sub, "_load_state_dict_post_hooks", None) \
                or kind._load_from_state_dict is not base._load_from_state_dict \
                or kind.load_state_dict is not base.load_state_dict:
            return False
    return True


def _array_target(entry: TensorEntry, key: str, record: TensorRecord, live: Any,
                  problems: list[str]) -> np.ndarray:
    """Where a saved numpy array goes: the live array in place when shape and dtype
    agree (as a tensor is), a new one where there is none."""
    shape, want = tuple(entry.shape), numpy_dtype(entry.dtype)
    existing = lookup(live, record.path)
    if not isinstance(existing, np.ndarray):
        return np.empty(shape, dtype=want)
    if existing.shape != shape or existing.dtype != want:
        problems.append(f"{path_text(key, record.path)} is {entry.dtype}{list(shape)} in the"
                        f" checkpoint but {existing.dtype}{list(existing.shape)} here")
        return existing
    if existing.flags.writeable and existing.flags.c_contiguous:
        return existing
    return np.empty(shape, dtype=want)  # read beside it; apply_states copies it over


def apply_states(targets: dict[str, Any], trees: dict[str, Any],
                 special: dict[str, Callable[[Any], None]] | None = None) -> None:
    """Hand each rebuilt tree to its object's load_state_dict (or a special loader)."""
    for key, tree in trees.items():
        obj = targets[key]
        if special and key in special:
            special[key](tree)
        elif isinstance(obj, Stateful):
            obj.load_state_dict(tree)
        elif isinstance(obj, dict) and isinstance(tree, dict):
            obj.update(tree)
        elif isinstance(obj, list) and isinstance(tree, (list, tuple)):
            obj[:] = tree
        elif isinstance(obj, np.ndarray) and isinstance(tree, np.ndarray):
            if tree is not obj:  # read beside it (not writable or not contiguous)
                np.copyto(obj, tree)
        elif isinstance(obj, torch.Tensor) and isinstance(tree, torch.Tensor):
            if tree is not obj:
                with torch.no_grad():
                    obj.copy_(tree)
        else:
            targets[key] = tree  # a plain value: the caller's dict gets the loaded one


def check_restorable(key: str, obj: Any) -> None:
    """Refuse, before anything is read, a restore target that cannot take the saved state
    in place (an int, a str, a tuple): its loaded value would reach nobody."""
    if isinstance(obj, np.ndarray) and not obj.flags.writeable:
        raise InvalidInputError(f"state {key!r} is a read-only array; pass a writable one")
    if not isinstance(obj, (Stateful, dict, list, np.ndarray, torch.Tensor)):
        raise InvalidInputError(
            f"state {key!r} is a {type(obj).__name__}, which cannot be restored in place:"
            " pass an object with load_state_dict(), a dict, a list, a tensor or an array"
            f" (e.g. {key}={{'value': ...}} saved and restored as a dict)")
