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


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_revision() -> dict[str, Any]:
    """The git commit of the working directory and whether tracked files differ from it."""
    rev = _git("rev-parse", "HEAD")
    if rev is None:
        return {}
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {"code_rev": rev, "code_dirty": bool(dirty) if dirty is not None else None}


def world_size() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return int(os.environ.get("WORLD_SIZE", "1"))


def provenance() -> dict[str, Any]:
    """Captured once per Checkpointer; user-supplied meta is merged over it."""
    return {
        **code_revision(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "chunkstore": chunkstore.__version__,
        "host": socket.gethostname(),
        "world_size": world_size(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
    }
