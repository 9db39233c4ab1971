"""``chunkstore keygen``: a key pair that signs versions (docs/format.md §14) and exports.

The private key is written to PATH (PKCS#8 PEM, mode 0600, encrypted under a password
where one is given), the public key to PATH.pub (SubjectPublicKeyInfo PEM): the files
the OpenSSF model-signing tool's elliptic-curve signer takes.  Nothing is overwritten.
"""

from __future__ import annotations

import contextlib
import getpass
import os

import click

from chunkstore.cli.common import EXIT_USAGE, CliError, _stdin_is_a_terminal, emit_json
from chunkstore.errors import KeyFileExistsError
from chunkstore.handle.encryption import read_password_file
from chunkstore.objects.signing import (
    CURVES,
    DEFAULT_CURVE,
    KEY_PASSWORD_ENV,
    fingerprint,
    generate_key,
    load_public_key,
)


def _key_password(password_file: str | None, unencrypted: bool) -> str | None:
    """The password the private key is encrypted under: --password-file, else
    $CHUNKSTORE_KEY_PASSWORD, else a prompt (twice) on a terminal; none with
    --unencrypted, or off a terminal without either (the key is then not encrypted)."""
    if unencrypted:
        return None
    if password_file is not None:
        return read_password_file(password_file) or None
    if os.environ.get(KEY_PASSWORD_ENV):
        return os.environ[KEY_PASSWORD_ENV]
    if not _stdin_is_a_terminal():
        return None
    entered = getpass.getpass("password for the new key (empty: none): ")
    if entered and getpass.getpass("password again: ") != entered:
        raise CliError("the two passwords differ; no key was written", EXIT_USAGE)
    return entered or None


def _write_new(path: str, data: bytes, mode: int) -> None:
    """Create ``path`` holding ``data`` (never over an existing file), durably."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise KeyFileExistsError(path) from None
    try:
        os.fchmod(fd, mode)  # whatever the umask
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


@click.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--curve", type=click.Choice(list(CURVES)), default=DEFAULT_CURVE,
              show_default=True, help="The elliptic curve of the ECDSA key.")
@click.option("--password-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="A file whose first line is the password the private key is encrypted"
              f" under (else ${KEY_PASSWORD_ENV}, else a prompt on a terminal).")
@click.option("--unencrypted", is_flag=True, help="Write the private key unencrypted"
              " without asking.")
@click.option("--json", "as_json", is_flag=True, help="Answer in JSON.")
def keygen(path: str, curve: str, password_file: str | None, unencrypted: bool,
           as_json: bool) -> None:
    """Make a signing key pair: the private key at PATH, the public key at PATH.pub.

    The private key (PEM, mode 0600) signs versions (`Store.new_version(...,
    sign_with=PATH)`, `Checkpointer(..., sign_with=PATH)`) and exports; readers
    trust the public key (`chunkstore verify STORE --trust PATH.pub`,
    `chunkstore.open(url, trust=[PATH.pub])`). Its password comes from
    --password-file, $CHUNKSTORE_KEY_PASSWORD or a prompt; those who sign with
    it set $CHUNKSTORE_KEY_PASSWORD. ECDSA P-256 by default (P-384, P-521):
    the OpenSSF model-signing tool takes the same files. An existing file is
    never overwritten.

    \b
    Examples:
      chunkstore keygen ~/.keys/train
      CHUNKSTORE_KEY_PASSWORD=... chunkstore keygen release --curve P-384

    \b
    Exit codes: 0 written; 2 a file exists, passwords differ, bad option.
    """
    public_path = path + ".pub"
    for target in (path, public_path):
        if os.path.lexists(target):
            raise KeyFileExistsError(target)
    password = _key_password(password_file, unencrypted)
    private, public = generate_key(curve, password)
    _write_new(path, private, 0o600)
    try:
        _write_new(public_path, public, 0o644)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)  # a pair or nothing
        raise
    found = fingerprint(load_public_key(public_path))
    if as_json:
        emit_json({"private_key": path, "public_key": public_path, "curve": curve,
                   "encrypted": password is not None, "fingerprint": found})
        return
    click.echo(f"private key: {path} (ECDSA {curve},"
               f" {'encrypted' if password else 'not encrypted'}, mode 0600)")
    click.echo(f"public key:  {public_path}")
    click.echo(f"fingerprint: {found}")


COMMANDS = (keygen,)
