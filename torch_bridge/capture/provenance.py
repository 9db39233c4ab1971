"""Where a checkpoint came from: code revision, library versions, host, world size."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from typing import Any

import numpy as np
import torch

import chunkstore

GIT_TIMEOUT_S = 5.0


def _git(*args: str) -> tuple[str | None, str]:
    """``git args`` in the working directory: its output, or None and why it failed."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"git could not run ({exc.__class__.__name__}: {exc})"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return None, lines[-1] if lines else f"git {args[0]} exited {done.returncode}"
    return done.stdout.strip(), ""


def code_revision() -> dict[str, Any]:
    """The git commit of the working directory and whether tracked files differ from it.

    Outside a git checkout (or without git) the revision is recorded as unknown,
    ``code_rev`` and ``code_dirty`` None, with the reason in ``code_rev_unknown``,
    so a version never looks as if its provenance were simply not asked for.
    Pass the revision yourself with ``Checkpointer(..., meta={"code_rev": ...})``.
    """
    rev, why = _git("rev-parse", "HEAD")
    if rev is None:
        return {"code_rev": None, "code_dirty": None,
                "code_rev_unknown": f"{why} (in {os.getcwd()}); pass meta={{'code_rev': ...}}"}
    dirty, _ = _git("status", "--porcelain", "--untracked-files=no")
    return {"code_rev": rev, "code_dirty": bool(dirty) if dirty is not None else None}


#: Working directory -> code_revision() there, for saves with no object to keep it in.
_REVISIONS: dict[str, dict[str, Any]] = {}


def code_revision_once() -> dict[str, Any]:
    """:func:`code_revision`, asking git once per process and working directory.

    For :func:`torch_bridge.save`, which has no object to keep it in between
    calls: two git subprocesses cost more than a small save.
    """
    cwd = os.getcwd()
    if cwd not in _REVISIONS:
        _REVISIONS[cwd] = code_revision()
    return dict(_REVISIONS[cwd])


def world_size() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return int(os.environ.get("WORLD_SIZE", "1"))


def provenance(meta: dict[str, Any] | None = None,
               revision: dict[str, Any] | None = None) -> dict[str, Any]:
    """Captured once per Checkpointer, with the user's ``meta`` merged over it.

    ``revision``: :func:`code_revision`'s answer when the caller has it
    already (else git is asked now).  A ``code_rev`` in ``meta`` replaces the
    one git gives (or the note that it is unknown).
    """
    revision = dict(revision) if revision is not None else code_revision()
    if meta is not None and "code_rev" in meta:
        revision.pop("code_rev_unknown", None)
    return {
        **revision,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "chunkstore": chunkstore.__version__,
        "host": socket.gethostname(),
        "world_size": world_size(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        **(meta or {}),
    }
