"""The codecs' inner loops in C (``chunkstore/codecs/_native.c``), where built.

The extension is optional (``setup.py``): an install without a C compiler
leaves :data:`MODULE` None and the codecs use their numpy fallbacks, which
write and read the same bytes.  ``CHUNKSTORE_NO_NATIVE=1`` in the environment
forces the fallbacks.
"""

from __future__ import annotations

import os
from types import ModuleType


def _load() -> ModuleType | None:
    if os.environ.get("CHUNKSTORE_NO_NATIVE") == "1":
        return None
    try:
        from chunkstore.codecs import _native  # type: ignore[attr-defined]
    except ImportError:
        return None
    module: ModuleType = _native
    return module


#: The extension module, or None where the numpy fallbacks are in use.
MODULE = _load()
#: True when the native loops are in use.
NATIVE = MODULE is not None
