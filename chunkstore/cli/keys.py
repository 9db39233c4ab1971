"""``chunkstore key``: the passwords of an encrypted store (docs/format.md §13.2).

Each password is a key object that wraps the store's one master key; adding or
changing a password writes a key object (and for a change removes the old one) and
re-encrypts no data.  No command prints a password or a key.
"""

from __future__ import annotations

import datetime as dt

import click

from chunkstore.cli.common import (
    EXIT_USAGE,
    CliError,
    command_line_password,
    echo_lines,
    emit_json,
    open_store,
    render_table,
)
from chunkstore.errors import KeyObjectError
from chunkstore.handle.encryption import add_password, change_password, list_keys, remove_key

_NEW_PASSWORD_FILE = click.option(
    "--new-password-file", type=click.Path(dir_okay=False), default=None,
    help="A file whose first line is the new password (else $CHUNKSTORE_NEW_PASSWORD, else"
    " a prompt, twice, on a terminal).")
_JSON = click.option("--json", "as_json", is_flag=True, help="Answer in JSON.")


@click.group()
def key() -> None:
    """List, add, remove and change the passwords of an encrypted store.

    The store's own password comes from --password-file (before the command
    name), $CHUNKSTORE_PASSWORD, $CHUNKSTORE_PASSWORD_FILE or a prompt; a new
    one from --new-password-file, $CHUNKSTORE_NEW_PASSWORD or a prompt.

    \b
    Examples:
      chunkstore key list ckpts/
      CHUNKSTORE_NEW_PASSWORD=... chunkstore key add ckpts/
      chunkstore key passwd ckpts/             # change the password given
      chunkstore key remove ckpts/ 3f9a0c1d2e4b5a69

    \b
    Exit codes: 0 done; 2 not an encrypted store, an unknown key, the last
    key, or no password given; 6 wrong password.
    """


@key.command("list")
@click.argument("store_path", metavar="STORE")
@_JSON
def list_command(store_path: str, as_json: bool) -> None:
    """List the key objects of STORE (the one the password opened marked)."""
    with open_store(store_path) as store:
        found = list_keys(store.url, store.objects)
    if as_json:
        emit_json({"keys": [{"id": info.id, "created": info.created, "kdf": info.kdf,
                             **info.parameters, "current": current}
                            for info, current in found]})
        return
    rows = [[info.id, dt.datetime.fromtimestamp(info.created).strftime("%Y-%m-%d %H:%M:%S"),
             f"{info.kdf} n={info.parameters['n']} r={info.parameters['r']}"
             f" p={info.parameters['p']}", "*" if current else ""]
            for info, current in found]
    echo_lines(render_table(["ID", "CREATED", "KDF", "CURRENT"], rows))


@key.command("add")
@click.argument("store_path", metavar="STORE")
@_NEW_PASSWORD_FILE
@_JSON
def add_command(store_path: str, new_password_file: str | None, as_json: bool) -> None:
    """Add a password to STORE: a key object wrapping the same master key."""
    with open_store(store_path) as store:
        password = command_line_password(store.url, new=True,
                                         new_password_file=new_password_file)
        key_id = add_password(store.url, store.objects, store.config, password)
    emit_json({"added": key_id}) if as_json else click.echo(f"added key {key_id}")


@key.command("passwd")
@click.argument("store_path", metavar="STORE")
@_NEW_PASSWORD_FILE
@_JSON
def passwd_command(store_path: str, new_password_file: str | None, as_json: bool) -> None:
    """Change the password that opened STORE: its key is replaced by a new one."""
    with open_store(store_path) as store:
        password = command_line_password(store.url, new=True,
                                         new_password_file=new_password_file)
        new, old = change_password(store.url, store.objects, store.config, password)
    if as_json:
        emit_json({"added": new, "removed": old})
    else:
        click.echo(f"replaced key {old} by {new}")


@key.command("remove")
@click.argument("store_path", metavar="STORE")
@click.argument("key_id", metavar="ID")
@_JSON
def remove_command(store_path: str, key_id: str, as_json: bool) -> None:
    """Remove the key ID from STORE (never its last key)."""
    with open_store(store_path) as store:
        try:
            remove_key(store.url, store.objects, key_id)
        except KeyObjectError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    emit_json({"removed": key_id}) if as_json else click.echo(f"removed key {key_id}")


COMMANDS = (key,)
