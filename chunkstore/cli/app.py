"""The ``chunkstore`` command group: its help, its commands, and how a run ends.

Whatever goes wrong, the user sees one line on stderr, ``chunkstore: error: ...``,
and an exit code from the table in the group's help:

1. Errors from the core (:class:`~chunkstore.errors.ChunkStoreError`) and I/O
   errors become :class:`~chunkstore.cli.common.CliError` with the exit code
   :func:`~chunkstore.cli.common.exit_code_for` picks.
2. Click's usage errors (three lines of usage, hint and message by default)
   become one line that names the ``--help`` to read.
3. Ctrl-C (``KeyboardInterrupt``) becomes ``interrupted`` and exit 130,
   caught before click would print ``Aborted!`` and exit 1.  While the command
   starts (its imports take half a second) :mod:`chunkstore.interrupts` prints
   the same line and exits 130 at once; the group's ``invoke`` hands Ctrl-C back.
4. A reader that stops early (``chunkstore log ckpts/ | head``) is not an
   error: stdout is pointed at the null device, so nothing more is written
   or flushed into the closed pipe, and the command exits quietly: 0, or the
   code it decided on before it wrote (:func:`~chunkstore.cli.common.set_exit_code`),
   so ``chunkstore verify ckpts/ | head`` on a damaged store still exits 1.

Both the group's option parsing and its ``invoke`` (which parses and runs the
subcommand) go through :func:`one_line_errors`, so ``chunkstore --help | head``
and ``chunkstore log --frob`` are covered as well as the commands' own work.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click

import chunkstore
from chunkstore import interrupts
from chunkstore.cli import (
    audit,
    inspection,
    keys,
    maintenance,
    recovery,
    signing,
    transfer,
    versions,
)
from chunkstore.cli.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    CliError,
    Interrupted,
    decided_exit_code,
    exit_code_for,
    missing_dependency,
    set_password_file,
    set_storage_options,
)
from chunkstore.collector import collector_paused
from chunkstore.errors import ChunkStoreError

#: Commands that need PyTorch live in torch_bridge and are imported only when run,
#: so the core CLI (and ``chunkstore --help``) never imports torch.  The last field
#: is the extra that installs what the command imports.
LAZY_COMMANDS = {
    "demo": ("torch_bridge.tools.cli", "demo",
             "Train a small model with async saves, SIGKILL it, resume bit-exactly.", "torch"),
    "export": ("torch_bridge.tools.cli", "export",
               "Write a version's weights as a safetensors file.", "export"),
    "plan": ("torch_bridge.tools.cli", "plan",
             "The checkpoint interval that minimises pause cost plus lost work.", "torch"),
}


@contextmanager
def one_line_errors(ctx: click.Context | None = None) -> Iterator[None]:
    """Turn every way a command can fail into a one-line error (see the module docstring);
    ``ctx`` holds the exit code a command decided on before its reader left."""
    try:
        yield
    except (CliError, click.exceptions.NoArgsIsHelpError, click.exceptions.Exit):
        raise  # already one line, or help the user asked for by giving no arguments
    except click.UsageError as exc:
        command = f"`{exc.ctx.command_path} --help`" if exc.ctx is not None else ""
        message = exc.format_message().rstrip(".")
        suggestion = re.fullmatch(r"(.*?)\.? \((Did you mean .*\?)\)", message)
        if suggestion:  # click's "No such option '--rn'. (Did you mean one of: ...?)"
            message, hint = f"{suggestion[1]}. {suggestion[2]}", f" See {command}."
        else:
            hint = f"; see {command}"
        hint = hint if command else ""
        raise CliError(message + hint, exc.exit_code) from exc
    except click.ClickException as exc:
        raise CliError(exc.format_message(), exc.exit_code) from exc
    except ChunkStoreError as exc:
        raise CliError(str(exc), exit_code_for(exc)) from exc
    except BrokenPipeError:
        _silence_stdout()
        raise click.exceptions.Exit(decided_exit_code(ctx)) from None
    except OSError as exc:
        raise CliError(str(exc), EXIT_FAILURE) from exc
    except (KeyboardInterrupt, click.Abort):
        raise Interrupted from None


def _silence_stdout() -> None:
    """Point stdout at the null device: what is still buffered for the closed pipe
    (and the interpreter's flush at exit) goes nowhere instead of failing again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # not a real file (a test's capture)
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


class ChunkstoreGroup(click.Group):
    """The top-level group: one-line errors for everything below it, and the torch
    commands loaded on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            module_name, attr, summary, extra = LAZY_COMMANDS[cmd_name]
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                return _missing_dependency_command(cmd_name, summary, extra, exc)
            command: click.Command = getattr(module, attr)
            return command
        return super().get_command(ctx, cmd_name)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        with one_line_errors(ctx):
            return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        with one_line_errors(ctx):
            # From here a Ctrl-C is a KeyboardInterrupt this turns into one line; before
            # it (the imports, the group's options) chunkstore.interrupts ended the
            # process with that line.
            interrupts.command_started()
            return super().invoke(ctx)


def _missing_dependency_command(name: str, summary: str, extra: str,
                                exc: ImportError) -> click.Command:
    def run() -> None:
        error = missing_dependency(name, exc, extra)
        raise error or CliError(f"`chunkstore {name}` cannot start: {exc}", EXIT_FAILURE)

    return click.Command(name, callback=run, help=summary, short_help=summary)


@click.group(cls=ChunkstoreGroup)
@click.version_option(chunkstore.__version__, prog_name="chunkstore")
@click.option("--storage-option", "storage_option", multiple=True, metavar="KEY=VALUE",
              help="An fsspec storage option for s3:// (and other URL) stores, e.g."
              " endpoint_url=http://127.0.0.1:9000 or profile=backup; repeatable; a dotted"
              " KEY nests (client_kwargs.region_name=eu-west-1). Merged over the JSON"
              " object in $CHUNKSTORE_STORAGE_OPTIONS. Credentials are better left to the"
              " AWS variables and profiles (see docs/s3.md).")
@click.option("--password-file", type=click.Path(dir_okay=False), default=None,
              help="A file whose first line is the password of the encrypted stores the"
              " command opens (also $CHUNKSTORE_PASSWORD_FILE, or $CHUNKSTORE_PASSWORD;"
              " on a terminal, without either, the command asks). Never echoed, logged or"
              " shown in JSON answers.")
@click.pass_context
def cli(ctx: click.Context, storage_option: tuple[str, ...], password_file: str | None
        ) -> None:
    """Incremental, deduplicated storage for training checkpoints.

    A store is a directory (or an fsspec URL such as s3://bucket/ckpts) that
    holds tensors cut into content-addressed chunks, so each saved checkpoint
    (a "version") only adds the chunks that changed since earlier saves.
    Programs save versions through the Python API (chunkstore.open); these
    commands inspect, check and maintain a store.

    \b
    Selectors (wherever a command takes SELECTOR):
      latest       the newest version in the store
      RUN@latest   the newest version of run RUN
      RUN@STEP     the version of run RUN saved at step STEP
      NAME         a tag (see `chunkstore tag`)
      3fa9c1d2     a version id, or a unique prefix of at least 4 hex digits

    \b
    Getting started:
      chunkstore demo               # train, SIGKILL, resume bit-exactly, show the savings
      chunkstore log ckpts/         # list the versions in a store
      chunkstore report ckpts/      # where the bytes go
      chunkstore verify ckpts/      # check every chunk
      chunkstore prune ckpts/ --keep-last 3 && chunkstore gc ckpts/

    \b
    Errors are one line on stderr, starting "chunkstore: error:".
    Exit codes:
      0    success (also when a reader such as `head` stops reading early)
      1    a check found problems (verify, index rebuild), even when its
           reader stops early
      2    bad usage or bad input: unknown option, bad selector or name,
           a path that is not a store, a command's packages not installed
      3    integrity error: corrupt or missing data, unsupported format version
      4    any other failure (storage backend, I/O)
      6    wrong password for an encrypted store
      130  interrupted (Ctrl-C)

    \b
    S3 and other URL stores (docs/s3.md):
      AWS_ENDPOINT_URL=http://127.0.0.1:9000 chunkstore log s3://bucket/ckpts
      chunkstore --storage-option profile=backup log s3://bucket/ckpts
    """
    set_storage_options(ctx, storage_option)
    set_password_file(ctx, password_file)


for _command in (*inspection.COMMANDS, *versions.COMMANDS, *maintenance.COMMANDS,
                 *transfer.COMMANDS, *recovery.COMMANDS, *keys.COMMANDS,
                 *signing.COMMANDS, *audit.COMMANDS):
    # The store's own commands run with the cyclic garbage collector paused
    # (chunkstore.collector); the torch commands (the demo trains) do not.
    if _command.callback is not None:
        _command.callback = collector_paused()(_command.callback)
    cli.add_command(_command)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``chunkstore`` console script."""
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name="chunkstore")
    except SystemExit as exc:
        if exc.code != EXIT_INTERRUPTED or argv is not None:  # argv: called from Python
            raise
        # Interrupted: end now, without the interpreter's wait for worker threads (a
        # Ctrl-C that struck inside one of their locks would make it wait forever).
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(EXIT_INTERRUPTED)
