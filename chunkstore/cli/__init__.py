"""The ``chunkstore`` command line: inspect, check and maintain a store.

Every command opens an existing store with ``create=False`` (only ``init`` and
``demo`` create one), so a mistyped path is an error, never a new store.
Every way a command fails becomes one ``chunkstore: error: ...`` line on
stderr and an exit code from the table in ``chunkstore --help``
(:mod:`chunkstore.cli.app` says how).

The modules: :mod:`~chunkstore.cli.common` (exit codes, errors, sizes,
tables), :mod:`~chunkstore.cli.inspection` (init, log, show, diff, report),
:mod:`~chunkstore.cli.versions` (tag, rm), :mod:`~chunkstore.cli.maintenance`
(verify, gc, prune, index), :mod:`~chunkstore.cli.transfer` (sync),
:mod:`~chunkstore.cli.keys` (key) and
:mod:`~chunkstore.cli.app` (the group and
:func:`main`).  The torch commands live in :mod:`torch_bridge.tools.cli`.
"""

from chunkstore.cli.app import cli, main
from chunkstore.cli.common import (
    EXIT_FAILURE,
    EXIT_INTEGRITY,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PASSWORD,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    CliError,
    exit_code_for,
    format_duration,
    format_size,
    missing_dependency,
    parse_size,
    plural,
)

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTEGRITY",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PASSWORD",
    "EXIT_PROBLEMS",
    "EXIT_USAGE",
    "CliError",
    "cli",
    "exit_code_for",
    "format_duration",
    "format_size",
    "main",
    "missing_dependency",
    "parse_size",
    "plural",
]
