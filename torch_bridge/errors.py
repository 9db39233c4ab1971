"""Errors and warnings of torch_bridge, rooted in chunkstore's error tree."""

from __future__ import annotations

from chunkstore.errors import ChunkStoreError, InvalidInputError


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


class AsyncSaveError(ChunkStoreError):
    """Raised by save()/wait()/close() when the previous background save failed."""

    def __init__(self, run: str, step: int, cause: BaseException) -> None:
        super().__init__(f"background save of {run}@{step} failed and was not published:"
                         f" {type(cause).__name__}: {cause}")
        self.run = run
        self.step = step


class NotAtUpdateBoundaryWarning(UserWarning):
    """Warned when a save sees gradients the optimizer has not applied yet."""


class RestoreFallbackWarning(UserWarning):
    """Warned when the newest version is damaged and restore falls back to an older one."""


class RngMismatchWarning(UserWarning):
    """Warned when a checkpoint's CUDA RNG states cannot be applied on this machine."""
