"""What every command shares: exit codes, the one-line error, sizes, tables, options."""

from __future__ import annotations

import datetime as dt
import getpass
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, ParamSpec, TypeVar

import click

import chunkstore
from chunkstore.errors import (
    FormatVersionError,
    IntegrityError,
    InvalidInputError,
    MissingDependencyError,
    NotAStoreError,
    NotEncryptedError,
    PasswordRequiredError,
    WrongPasswordError,
)
from chunkstore.handle.encryption import password_from_env, read_password_file
from chunkstore.protocol.holds import Hold
from chunkstore.store import Store, VersionInfo

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_INTEGRITY = 3
EXIT_FAILURE = 4
EXIT_PASSWORD = 6  # a wrong password for an encrypted store (its own code; 5 is a drill's)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C

ERROR_PREFIX = "chunkstore: error: "

P = ParamSpec("P")
R = TypeVar("R")

# --- errors and exit codes ------------------------------------------------------------------


class CliError(click.ClickException):
    """An error shown as one ``chunkstore: error: ...`` line, with its exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code  # type: ignore[misc]  # click reads it per instance

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"{ERROR_PREFIX}{self.format_message()}", file=file, err=True)


class Interrupted(CliError):
    """Ctrl-C: exit 130 with one line; on a terminal, the line starts after the ``^C``."""

    def __init__(self) -> None:
        super().__init__("interrupted", EXIT_INTERRUPTED)

    def show(self, file: IO[Any] | None = None) -> None:
        if _isatty(file or sys.stderr):
            click.echo("", file=file, err=True)
        super().show(file)


def _isatty(stream: IO[Any]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        return False


#: Where a command records the exit code it decided on (in the click context's ``meta``,
#: which a group and its subcommand share).
_DECIDED_EXIT = "chunkstore.exit_code"


def set_exit_code(code: int) -> None:
    """Record the exit code the running command ends with, before it writes its answer.

    A reader that stops early (``chunkstore verify ckpts/ | head``) ends the command
    while it writes; it then exits with this code, so a check that found problems
    still exits 1.  A command that only lists records nothing and exits 0.
    """
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta[_DECIDED_EXIT] = code


def decided_exit_code(ctx: click.Context | None) -> int:
    """The code :func:`set_exit_code` recorded in ``ctx``; 0 where none was."""
    code = None if ctx is None else ctx.meta.get(_DECIDED_EXIT)
    return code if isinstance(code, int) else EXIT_OK


def exit_code_for(exc: BaseException) -> int:
    """2 for bad input (a package the location needs not installed included, as for the
    torch commands), 3 for integrity and format errors, 5 for a wrong password, 4 for
    anything else."""
    if isinstance(exc, WrongPasswordError):
        return EXIT_PASSWORD
    if isinstance(exc, (InvalidInputError, NotAStoreError, MissingDependencyError)):
        return EXIT_USAGE
    if isinstance(exc, (IntegrityError, FormatVersionError)):
        return EXIT_INTEGRITY
    return EXIT_FAILURE


#: The packages the torch commands import: their names, and the command that installs each
#: into any environment, however chunkstore got there (a clone, a wheel; README.md, "As a
#: library").  PyTorch's CPU build: plain ``pip install torch`` takes the CUDA one (~3 GB).
TORCH_PACKAGES = {
    "torch": ("PyTorch", "pip install torch --index-url https://download.pytorch.org/whl/cpu"
                         " (its CPU build; or the CUDA build you use)"),
    "safetensors": ("safetensors", "pip install safetensors"),
}


def missing_dependency(command: str, exc: ImportError, extra: str = "torch") -> CliError | None:
    """The one-line error for a torch command run without its packages (None: another
    cause): the package, the command that installs it, and the extra that would have."""
    package = (exc.name or "").partition(".")[0]
    if package not in TORCH_PACKAGES:
        return None
    name, install = TORCH_PACKAGES[package]
    return CliError(f"`chunkstore {command}` needs {name}, which is not installed (the"
                    f" [{extra}] extra installs it); install it with: {install}", EXIT_USAGE)


# --- sizes and words ------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse ``65536``, ``64K``, ``4MiB``, ``1M`` (binary) or ``1MB`` (decimal) into bytes."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 65536, 64KiB, 4MiB, 1M, 1MB)")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def format_size(n: float) -> str:
    """Bytes as a human size with binary units: ``512 B``, ``1.5 KiB``, ``4.0 MiB``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def format_duration(seconds: float) -> str:
    """``90`` -> ``1m30s``, ``3600`` -> ``1h``."""
    whole = round(seconds)
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if whole >= size or (unit == "s" and not parts):
            parts.append(f"{whole // size}{unit}")
            whole %= size
    return "".join(parts)


def format_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 version``, ``2 versions``, ``0 versions``; ``nouns`` for irregular plurals."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


class SizeParam(click.ParamType[int]):
    """A click parameter that accepts human sizes (see :func:`parse_size`)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


# --- stores, tables, versions ---------------------------------------------------------------


#: Environment variable holding storage options for every URL store the CLI opens, as
#: a JSON object (``--storage-option`` entries are merged over it).
STORAGE_OPTIONS_ENV_VAR = "CHUNKSTORE_STORAGE_OPTIONS"
_OPTIONS_META = "chunkstore.storage_options"


def parse_storage_options(pairs: Sequence[str], env_text: str | None) -> dict[str, Any]:
    """``KEY=VALUE`` entries (a dotted KEY nests: ``client_kwargs.endpoint_url=...``; a
    VALUE that reads as JSON (numbers, true, false, null, objects) is taken as such,
    anything else as text) merged over the JSON object of ``env_text``."""
    options: dict[str, Any] = {}
    if env_text:
        try:
            loaded = json.loads(env_text)
        except ValueError as exc:
            raise CliError(f"{STORAGE_OPTIONS_ENV_VAR} is not JSON: {exc}", EXIT_USAGE) from None
        if not isinstance(loaded, dict):
            raise CliError(f"{STORAGE_OPTIONS_ENV_VAR} must be a JSON object, like"
                           ' \'{"endpoint_url": "http://127.0.0.1:9000"}\'', EXIT_USAGE)
        options.update(loaded)
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise CliError(f"--storage-option {pair!r}: expected KEY=VALUE, like"
                           " endpoint_url=http://127.0.0.1:9000", EXIT_USAGE)
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        *parents, last = key.split(".")
        target = options
        for part in parents:
            child = target.setdefault(part, {})
            if not isinstance(child, dict):
                raise CliError(f"--storage-option {pair!r}: {part} is already set to a"
                               " value, not options", EXIT_USAGE)
            target = child
        target[last] = value
    return options


def set_storage_options(ctx: click.Context, pairs: Sequence[str]) -> None:
    """Keep the group's ``--storage-option`` entries (and the environment's) for
    every store the command opens."""
    ctx.meta[_OPTIONS_META] = parse_storage_options(pairs, os.environ.get(
        STORAGE_OPTIONS_ENV_VAR))


def _is_local(url: str) -> bool:
    scheme = url.partition("://")[0] if "://" in url else ""
    return scheme in ("", "file", "local")


def storage_options_for(url: str) -> dict[str, Any] | None:
    """The storage options the command line gives a store at ``url`` (None for a local
    path, which takes none).  A command run outside the ``chunkstore`` group (the torch
    commands, a process a command starts) takes those of the environment."""
    if _is_local(url):
        return None
    ctx = click.get_current_context(silent=True)
    options = ctx.meta.get(_OPTIONS_META) if ctx is not None else None
    if options is None:
        options = parse_storage_options((), os.environ.get(STORAGE_OPTIONS_ENV_VAR))
    return dict(options) if options else None


def storage_options_environment(url: str) -> dict[str, str]:
    """The environment that gives a process this command starts (drill's restore, the
    demo's training job) the command line's storage options for ``url``: it opens the
    store by URL alone, and ``--storage-option`` is this process's."""
    options = storage_options_for(url)
    return {} if options is None else {STORAGE_OPTIONS_ENV_VAR: json.dumps(options)}


def open_any(url: str, **kwargs: Any) -> Store:
    """``chunkstore.open`` with the command line's storage options for ``url``.  An
    encrypted store takes its password from the group's ``--password-file``,
    ``CHUNKSTORE_PASSWORD``, ``CHUNKSTORE_PASSWORD_FILE``, or a prompt on a terminal,
    in that order; an unencrypted one is never given one."""
    options = storage_options_for(str(url))
    if options is not None and kwargs.get("storage_options") is None:
        kwargs["storage_options"] = options
    if kwargs.get("password") is None and _password_file() is not None:
        try:
            return chunkstore.open(url, **{**kwargs, "password": command_line_password(url)})
        except NotEncryptedError:
            pass  # the option is for the encrypted stores a command opens
    try:
        return chunkstore.open(url, **kwargs)
    except PasswordRequiredError:
        if kwargs.get("password") is not None or not _stdin_is_a_terminal():
            raise
        kwargs["password"] = command_line_password(url)
        return chunkstore.open(url, **kwargs)


# --- passwords of encrypted stores (never echoed, logged or written to an answer) ----------

_PASSWORD_FILE_META = "chunkstore.password_file"
NEW_PASSWORD_ENV = "CHUNKSTORE_NEW_PASSWORD"


def set_password_file(ctx: click.Context, path: str | None) -> None:
    """Keep the group's ``--password-file`` for every encrypted store the command opens."""
    ctx.meta[_PASSWORD_FILE_META] = path


def _stdin_is_a_terminal() -> bool:
    return _isatty(sys.stdin)


def _password_file() -> str | None:
    ctx = click.get_current_context(silent=True)
    path = ctx.meta.get(_PASSWORD_FILE_META) if ctx is not None else None
    return path if isinstance(path, str) else None


def command_line_password(url: str, *, confirm: bool = False, new: bool = False,
                          new_password_file: str | None = None) -> str:
    """The password for the store at ``url``: the file ``--password-file`` names, else
    ``CHUNKSTORE_PASSWORD`` or ``CHUNKSTORE_PASSWORD_FILE``, else a prompt on a terminal
    (twice with ``confirm``); without any, :class:`PasswordRequiredError`.  ``new``: a
    new password (``--new-password-file``, ``CHUNKSTORE_NEW_PASSWORD``, a prompt twice)."""
    path = new_password_file if new else _password_file()
    if path:
        return read_password_file(path)
    found = os.environ.get(NEW_PASSWORD_ENV) if new else password_from_env()
    if found:
        return found
    if _stdin_is_a_terminal():
        what = "new password" if new else "password"
        entered = getpass.getpass(f"{what} for {url}: ")
        if (confirm or new) and getpass.getpass(f"{what} again: ") != entered:
            raise CliError("the two passwords differ; nothing changed", EXIT_USAGE)
        if entered:
            return entered
    if new:
        raise CliError(f"no new password: set {NEW_PASSWORD_ENV}, pass --new-password-file,"
                       " or run the command on a terminal to be asked", EXIT_USAGE)
    raise PasswordRequiredError(url)


@contextmanager
def open_store(path: str) -> Iterator[Store]:
    """Open an existing store (never creates one) and close it afterwards."""
    store = open_any(path, create=False)
    try:
        yield store
    except KeyboardInterrupt:
        # Not closed: Ctrl-C may have struck inside a lock of the worker pool (Python
        # raises it between any two bytecodes), and waiting for the workers could then
        # wait forever.  The process ends at once (see app.main), as a killed one
        # would, which no store state depends on.
        raise
    except BaseException:
        store.close()
        raise
    store.close()


def emit_json(doc: object) -> None:
    click.echo(json.dumps(doc, indent=2))


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 right: Sequence[int] = ()) -> list[str]:
    """Columns padded to their widest cell; columns listed in ``right`` right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    lines = []
    for row in (headers, *rows):
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return lines


def echo_lines(lines: Sequence[str]) -> None:
    for line in lines:
        click.echo(line)


def local_time(info: VersionInfo | float) -> str:
    """When a version was created (or a Unix time), in local time."""
    when = info if isinstance(info, float) else info.created
    stamp = dt.datetime.fromtimestamp(when, dt.timezone.utc).astimezone()
    return stamp.strftime("%Y-%m-%d %H:%M:%S")


def tags_by_version(store: Store) -> dict[str, list[str]]:
    result: dict[str, list[str]] = {}
    for tag, version_id in sorted(store.tags().items()):
        result.setdefault(version_id, []).append(tag)
    return result


def version_json(info: VersionInfo, tags: dict[str, list[str]],
                 holds: dict[str, Hold] | None = None) -> dict[str, Any]:
    """A version as every ``--json`` gives it; with ``holds``, also ``held`` and
    ``hold`` (what the hold records, or null)."""
    body = {**info.to_json(), "tags": tags.get(info.id, [])}
    if holds is not None:
        hold = holds.get(info.id)
        body["held"] = hold is not None
        body["hold"] = None if hold is None else hold.to_json()
    return body


def hold_text(hold: Hold | None) -> str:
    """A version's hold in a table cell: its reason (a damaged hold still holds)."""
    if hold is None:
        return "-"
    reason = "(damaged hold object)" if hold.reason is None else hold.reason
    return reason if len(reason) <= 40 else reason[:39] + "…"


def label(info: VersionInfo) -> str:
    return f"{info.short_id} ({info.run}@{info.step})"


#: The three sizes of a version, for every command that shows them: the name a table
#: shows (its JSON key, which the Python API, the commit record and every ``--json``
#: use, without ``_bytes``) and what it counts.
SIZE_MEANINGS = (
    ("logical", "the checkpoint as saved: tensor bytes plus plain-data bytes"),
    ("new", "tensor chunks no earlier version had, before compression"),
    ("new stored", "what the save added to storage: those chunks compressed, plus the"
     " manifest nodes it wrote, which hold the entry tree and the plain data"),
)


def size_key(name: str) -> str:
    """The JSON key of a size a table shows: ``new stored`` -> ``new_stored_bytes``."""
    return name.replace(" ", "_") + "_bytes"


_SIZES_HELP = """

    \b
    Sizes of a version (log, show and report agree; --json gives the same
    three as logical_bytes, new_bytes and new_stored_bytes, in bytes):
      LOGICAL     the checkpoint as saved: tensor bytes plus plain-data bytes
      NEW         tensor chunks no earlier version had, before compression
                  (raw bytes: what deduplication did not save)
      NEW STORED  what saving it added to storage: those chunks after
                  compression, plus the manifest nodes it wrote (the tree
                  of entries and the plain data: a few hundred bytes and
                  up, so for a small or unchanged checkpoint NEW STORED
                  can exceed NEW and even LOGICAL)
"""


def explains_sizes(command: Callable[P, R]) -> Callable[P, R]:
    """Append what LOGICAL, NEW and NEW STORED count to a command's help
    (apply it below ``@click.command()``, which reads the docstring); the text goes
    before the exit codes."""
    doc = (command.__doc__ or "").rstrip()
    head, marker, tail = doc.rpartition("\n\n    \b\n    Exit codes")
    command.__doc__ = (head + _SIZES_HELP.rstrip() + marker + tail if marker
                       else doc + _SIZES_HELP)
    return command


STORE_ARG = click.argument("store_path", metavar="STORE")
JSON_OPT = click.option("--json", "as_json", is_flag=True,
                        help="Print one JSON document on stdout instead of text.")
GRACE_OPT = click.option("--grace", default="1h", show_default=True, metavar="DURATION",
                         help="Grace period: an unreferenced object is deleted only after it"
                         " has been unreferenced this long (90, 30m, 1h, 2d, 1w).")
