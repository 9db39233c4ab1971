"""Storage backends behind one URL-scheme registry.

:func:`open_backend` maps a location to a :class:`Backend`: plain paths and
``file://`` URLs get the fsync-ing :class:`~chunkstore.backends.local.LocalBackend`,
every other scheme goes through fsspec.  Backend modules and their packages
(s3fs, gcsfs, ...) are imported only when a URL needs them, and a missing
package is reported with the command that installs it.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from chunkstore.backends.base import Backend, ObjectInfo
from chunkstore.errors import InvalidInputError, MissingDependencyError

__all__ = ["Backend", "ObjectInfo", "open_backend"]

#: Schemes served by the local backend.
LOCAL_SCHEMES = frozenset({"", "file", "local"})

#: scheme -> (module that must import, what to pip install: the package itself, which works
#: however chunkstore was installed; the [s3] extra installs the same).  Schemes not listed
#: here fall back to fsspec's own registry of implementations.
SCHEME_PACKAGES: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "s3fs (what the [s3] extra installs)"),
    "s3a": ("s3fs", "s3fs (what the [s3] extra installs)"),
    "gs": ("gcsfs", "gcsfs"),
    "gcs": ("gcsfs", "gcsfs"),
    "az": ("adlfs", "adlfs"),
    "abfs": ("adlfs", "adlfs"),
    "abfss": ("adlfs", "adlfs"),
}


def open_backend(url: str, **storage_options: Any) -> Backend:
    """Return the backend for a path or URL.

    ``storage_options`` (credentials, ``client_kwargs`` ...) are handed to the
    fsspec filesystem; local paths take none.  Raises
    :class:`~chunkstore.errors.MissingDependencyError` when the scheme's
    package is not installed and :class:`~chunkstore.errors.InvalidInputError`
    for an unknown scheme.
    """
    scheme, _, rest = url.partition("://") if "://" in url else ("", "", url)
    if scheme in LOCAL_SCHEMES:
        if storage_options:
            raise InvalidInputError(
                f"local path {url!r} takes no storage options (got {sorted(storage_options)})"
            )
        from chunkstore.backends.local import LocalBackend

        return LocalBackend(os.path.abspath(os.path.expanduser(rest)))
    _require_filesystem(scheme)
    from chunkstore.backends.fsspec_backend import FsspecBackend

    return FsspecBackend(url, **storage_options)


def _require_filesystem(scheme: str) -> None:
    """Import the package behind ``scheme`` or say how to install it."""
    # (``fsspec.registry`` the attribute is a mapping that shadows the module.)
    from fsspec.registry import known_implementations as known
    from fsspec.registry import registry as registered

    if scheme in SCHEME_PACKAGES:
        module, install = SCHEME_PACKAGES[scheme]
        advice = f"pip install {install}"
    elif scheme in known:
        module = known[scheme]["class"].rsplit(".", 1)[0]
        advice = known[scheme].get("err") or f"pip install {module.split('.', 1)[0]}"
    elif scheme in registered:  # registered at runtime, already imported
        return
    else:
        raise InvalidInputError(f"unknown URL scheme {scheme!r} in a store location")
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{scheme}:// locations need a package that is not installed ({exc}); {advice}"
        ) from exc
