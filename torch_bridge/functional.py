"""save/load of a state dict for loops that manage their own steps and versions."""

from __future__ import annotations

import os
from typing import Any

from chunkstore import Store, VersionInfo
from chunkstore.collector import collector_paused
from torch_bridge.capture.layout import (
    apply_states,
    capture_states,
    check_key,
    load_states,
    write_version,
)
from torch_bridge.capture.provenance import code_revision_once, provenance
from torch_bridge.checkpointer import open_store, sync_arrays


@collector_paused()
def save(store: Store | str | os.PathLike[str], state_dict: dict[str, Any], *, run: str,
         step: int, meta: dict[str, Any] | None = None) -> VersionInfo:
    """Publish ``state_dict`` as a version of ``run`` at ``step`` and return it.

    Each top-level key is one state: a tree of tensors and plain values (a
    model's state_dict) or an object with ``state_dict()``.  RNG states are
    not captured (use :class:`~torch_bridge.Checkpointer` for training loops).
    A path that holds no store gets one (``load`` never creates one: it raises
    :class:`~chunkstore.errors.NoStoreError`).

    The version's provenance is a Checkpointer's, with ``meta`` merged over it
    per call; its git part (``code_rev``, ``code_dirty``) is asked of git once
    per process and working directory, not at every save (two subprocesses
    cost more than a small save), so a commit or an edit made while the
    process runs is not seen.
    """
    for key in state_dict:
        check_key(key)
    opened, owned = open_store(store, create=True)
    try:
        captured = capture_states(state_dict)
        return write_version(opened, run, step, provenance(meta, code_revision_once()),
                             captured, sync_arrays(captured))
    finally:
        if owned:
            opened.close()


@collector_paused()
def load(store: Store | str | os.PathLike[str], selector: str, state_dict: dict[str, Any]
         ) -> dict[str, Any]:
    """Load the states named by ``state_dict``'s keys from the version ``selector``.

    Tensors are read, hash-verified, into ``state_dict``'s existing tensors
    where shape and dtype agree (StateMismatchError when they do not, before
    anything is read); objects with ``load_state_dict`` get their state.
    Returns the loaded trees by key.
    """
    for key in state_dict:
        check_key(key)
    opened, owned = open_store(store, create=False)
    try:
        with opened.open_version(selector) as reader:  # its read lease ends with the read
            trees = load_states(reader, state_dict)
        apply_states(state_dict, trees)
        return trees
    finally:
        if owned:
            opened.close()
