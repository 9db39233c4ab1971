"""Errors and warnings of torch_bridge, rooted in chunkstore's error tree."""

from __future__ import annotations

import contextlib
import os
import sys
import types

import chunkstore.errors as chunkstore_errors
from chunkstore.errors import ChunkStoreError, IntegrityError, InvalidInputError


class StateMismatchError(InvalidInputError):
    """Raised when a checkpoint's tensors do not fit the objects restored into (shape, dtype).

    Nothing has been loaded when it is raised.
    """

    def __init__(self, version_id: str, problems: list[str]) -> None:
        shown = "; ".join(problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        super().__init__(f"version {version_id[:12]} does not fit the objects to restore:"
                         f" {shown}{more}")
        self.version_id = version_id
        self.problems = problems


class StateNotFoundError(InvalidInputError):
    """Raised when restore() asks for a state key the checkpoint does not hold."""

    def __init__(self, version_id: str, missing: list[str], present: list[str]) -> None:
        super().__init__(f"version {version_id[:12]} has no state {', '.join(missing)}"
                         f" (it holds: {', '.join(present) or 'nothing'})")
        self.version_id = version_id
        self.missing = missing


class NotACheckpointError(InvalidInputError):
    """Raised when a version was not written by torch_bridge (no ``_torch_bridge`` entry)."""


class CorruptCheckpointError(IntegrityError):
    """Raised when a version's ``_torch_bridge`` section is not one torch_bridge writes
    (a damaged or crafted store): restore falls back to an older version."""

    def __init__(self, version_id: str, reason: str) -> None:
        super().__init__(f"version {version_id[:12]}: its _torch_bridge section is malformed"
                         f" ({reason}); run `chunkstore verify`, or restore an older step")
        self.version_id = version_id


class AsyncSaveError(ChunkStoreError):
    """Raised by save()/wait()/close() when the previous background save failed."""

    def __init__(self, run: str, step: int, cause: BaseException) -> None:
        super().__init__(f"background save of {run}@{step} failed and was not published:"
                         f" {type(cause).__name__}: {cause}")
        self.run = run
        self.step = step


class NotAtUpdateBoundaryWarning(UserWarning):
    """Warned when a save sees gradients the optimizer has not applied yet."""


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised here at the user's line: the first
    frame outside torch_bridge, chunkstore and contextlib (decorators add frames of their
    own, so a fixed level points at contextlib.py on some paths)."""
    ours = (os.path.dirname(os.path.abspath(__file__)),
            os.path.dirname(os.path.abspath(chunkstore_errors.__file__)),
            os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep + "contextlib")
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(ours):
        frame, level = frame.f_back, level + 1
    return level


#: What a message about damage found on restore says to do.
REPAIR_HINT = ("`chunkstore repair STORE --from OTHER` rewrites what is missing or damaged"
               " from a store holding whole copies (a mirror, a sync's copy); `chunkstore"
               " verify STORE` names every problem")


class RestoreFallbackWarning(UserWarning):
    """Warned when the newest version is damaged and restore falls back to an older one."""

    @classmethod
    def skipped(cls, run: str, failures: list[str], step: int, where: str = ""
                ) -> RestoreFallbackWarning:
        """The warning for a restore of ``step`` after skipping damaged ``failures``."""
        return cls(f"run {run!r}: skipped damaged version(s) {'; '.join(failures)};"
                   f"{where} restored step {step}. {REPAIR_HINT}")


def nothing_restored(run: str, failures: list[str], where: str = "") -> IntegrityError:
    """The error when every candidate version of ``run`` was damaged."""
    return IntegrityError(f"run {run!r}: no version could be restored{where}, and the objects"
                          f" passed in may hold part of a damaged version: {'; '.join(failures)}."
                          f" {REPAIR_HINT}")


class RunNotFoundWarning(UserWarning):
    """Warned when a restore finds no version of its run in a store that holds other runs
    (a typo in ``run=`` would otherwise start training from scratch without a word)."""

    @classmethod
    def naming(cls, run: str, url: str, others: list[str]) -> RunNotFoundWarning:
        shown = ", ".join(repr(r) for r in others[:10]) + (", ..." if len(others) > 10 else "")
        return cls(f"run {run!r} has no version in {url}, which holds run(s) {shown}: nothing"
                   " was restored (check run=)")


class PartialRestoreWarning(UserWarning):
    """Warned when a restore leaves states the version holds unrestored (an optimizer or
    scheduler not passed to ``restore``): the run would resume from a mix of restored
    and fresh state.  ``states`` names them."""

    def __init__(self, message: str, states: list[str]) -> None:
        super().__init__(message)
        self.states = states

    @classmethod
    def leaving(cls, label: str, states: list[str]) -> PartialRestoreWarning:
        shown = ", ".join(repr(s) for s in states)
        return cls(f"{label} also holds state(s) {shown}, which were not restored: pass"
                   " them to restore() to resume exactly (or filter this warning if leaving"
                   " them is intended)", states)


class MetaDeviceError(InvalidInputError):
    """Raised when a restore target holds tensors on the meta device (a module built under
    ``torch.device("meta")``): loading into them would do nothing.  Nothing is loaded;
    ``paths`` names them."""

    def __init__(self, version_id: str, paths: list[str]) -> None:
        shown = ", ".join(paths[:5]) + (f" (and {len(paths) - 5} more)" if len(paths) > 5
                                        else "")
        verb = "is" if len(paths) == 1 else "are"
        super().__init__(f"version {version_id[:12]}: {shown} {verb} on the meta device, which"
                         " holds no data, so restoring into it would do nothing; materialize"
                         " the module first (module.to_empty(device=...)), then restore")
        self.version_id = version_id
        self.paths = paths


class PickleRefusedError(InvalidInputError):
    """Raised when a DCP save holds a value that is not plain data (storing it needs
    pickle) or a DCP load would unpickle a stored value, without ``allow_pickle=True``.
    ``fqn`` names the value; nothing is published or loaded."""

    def __init__(self, fqn: str, message: str) -> None:
        super().__init__(message)
        self.fqn = fqn


class RngMismatchWarning(UserWarning):
    """Warned when a checkpoint's CUDA RNG states cannot be applied on this machine."""


class RanksDisagreeError(InvalidInputError):
    """Raised on every rank when the ranks of a save or restore ask for different things
    (step, run, state keys); nothing is published or loaded.

    ``ranks`` are the ranks that differ from rank 0, ``values`` what each rank asked for.
    """

    def __init__(self, what: str, values: list[object]) -> None:
        ranks = [r for r, value in enumerate(values) if value != values[0]]
        shown = ", ".join(f"rank {r}: {values[r]!r}" for r in ranks[:8])
        super().__init__(f"ranks {ranks} disagree with rank 0 on the {what} (rank 0:"
                         f" {values[0]!r}; {shown}); every rank must call it with the same"
                         f" {what}, at the same point of the training loop")
        self.what = what
        self.ranks = ranks
        self.values = values


class RanksFailedError(ChunkStoreError):
    """Raised on the other ranks when a save or restore failed on some ranks (the failing
    rank raises its own error); nothing was published or loaded.

    ``failures`` maps each failing rank to its error, as text.
    """

    def __init__(self, action: str, failures: dict[int, str]) -> None:
        shown = "; ".join(f"rank {r}: {text}" for r, text in sorted(failures.items())[:4])
        super().__init__(f"{action} failed on ranks {sorted(failures)}: {shown}")
        self.failures = failures


class WorldSizeMismatchError(InvalidInputError):
    """Raised when a version saved by one number of ranks is restored by another (each
    rank's RNG and data position belong to that rank)."""

    def __init__(self, version_id: str, saved: int, now: int) -> None:
        super().__init__(f"version {version_id[:12]} was saved by {saved} rank(s) and this"
                         f" restore runs on {now}; per-rank state (RNG, data position)"
                         f" restores rank for rank: restore it on {saved} rank(s), or load"
                         " the model alone with torch.distributed.checkpoint")
        self.version_id = version_id
        self.saved = saved
        self.now = now


class AsyncSaveUnderProcessGroupError(InvalidInputError):
    """Was raised when a Checkpointer with ``async_save=True`` saved under
    torch.distributed; async saves work there now, and the name stays importable for
    code that catches it."""
