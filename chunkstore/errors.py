"""Every error chunkstore raises on purpose derives from :class:`ChunkStoreError`.

Leaves carry the data a caller needs to act (digest, path, expected/actual)
and a message that says what to do.  Backends raise the built-in
``FileNotFoundError``/``FileExistsError``; the store turns them into these.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The name to ``pip install`` (the import names are ``chunkstore`` and ``torch_bridge``:
#: "chunkstore" on the package index is another project).
DISTRIBUTION = "chunkstore-ckpt"


class ChunkStoreError(Exception):
    """Raised for any failure chunkstore detects itself (the root of the tree)."""


# --- bad input: nothing in the store changes -------------------------------------------


class InvalidInputError(ChunkStoreError, ValueError):
    """Raised when an argument is malformed; the store is left unchanged."""


class InvalidNameError(InvalidInputError):
    """Raised when an entry, run or tag name is empty, too long or path-like."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"invalid name {name!r}: {reason}")
        self.name = name
        self.reason = reason


class UnsupportedDtypeError(InvalidInputError):
    """Raised when an array's dtype has no stable byte representation here."""

    def __init__(self, dtype: str, hint: str = "") -> None:
        msg = f"unsupported dtype {dtype!r}"
        super().__init__(f"{msg}: {hint}" if hint else msg)
        self.dtype = dtype


class NotSerializableError(InvalidInputError):
    """Raised when plain data holds a value the safe encoding cannot represent."""

    def __init__(self, path: str, type_name: str, hint: str = "") -> None:
        msg = f"cannot store value at {path} of type {type_name}"
        super().__init__(f"{msg}: {hint}" if hint else msg)
        self.path = path
        self.type_name = type_name


class SelectorError(InvalidInputError):
    """Raised when a version selector matches no version."""

    #: Well formed, and named nothing the index holds (a record it has not counted in
    #: may: the store lists its records and looks again before it raises).
    missed = False

    def __init__(self, selector: str, reason: str, *, missed: bool = False) -> None:
        super().__init__(f"version selector {selector!r}: {reason}")
        self.selector = selector
        self.missed = missed


class AmbiguousSelectorError(SelectorError):
    """Raised when an id prefix matches more than one version."""


class DuplicateEntryError(InvalidInputError):
    """Raised when one version is given two entries with the same name."""


class EntryNotFoundError(InvalidInputError, KeyError):
    """Raised when a version has no entry of the requested name."""

    def __init__(self, name: str, version_id: str) -> None:
        super().__init__(f"version {version_id[:12]} has no entry {name!r}")
        self.name = name
        self.version_id = version_id

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ShapeMismatchError(InvalidInputError):
    """Raised when ``get_into`` is given a buffer of another shape or dtype."""

    def __init__(self, name: str, expected: str, actual: str) -> None:
        super().__init__(f"entry {name!r} is {expected}, but the buffer is {actual}")
        self.name = name
        self.expected = expected
        self.actual = actual


class InvalidSettingError(InvalidInputError):
    """Raised when a store setting (chunk size, codec policy, grace) is out of range."""


class SubsetError(InvalidInputError):
    """Raised when a verify data subset is neither ``N/M`` (1 <= N <= M) nor a
    percentage ``X%`` (0 < X <= 100)."""

    def __init__(self, subset: object, reason: str) -> None:
        super().__init__(f"invalid data subset {subset!r}: {reason} (give N/M, such as 1/5,"
                         " to read the objects of slice N of M, or X%, such as 10%, to read"
                         " a random sample)")
        self.subset = subset
        self.reason = reason


class VersionClosedError(ChunkStoreError):
    """Raised when a version writer is used after it committed or aborted."""


# --- the store's own state ----------------------------------------------------------------


class NotAStoreError(ChunkStoreError):
    """Raised when a location exists but holds no chunkstore store."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url} is not a chunkstore store: {reason}")
        self.url = url


class NoStoreError(NotAStoreError):
    """Raised when nothing is stored at a location (no such directory, an empty one, an
    empty prefix): reading never creates a store, only ``chunkstore init``, a save or
    ``chunkstore.open(..., create=True)`` do.  ``url`` names the location."""

    def __init__(self, url: str, reason: str, hint: str = "") -> None:
        ChunkStoreError.__init__(self, f"no store at {url}: {reason}{hint}")
        self.url = url
        self.reason = reason


class StoreLocationError(InvalidInputError):
    """Raised when a location cannot hold a store (a path under ``/proc``, a file where a
    directory must be, a directory that cannot be created); nothing was written."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot create a store at {url}: {reason}")
        self.url = url


class FormatVersionError(ChunkStoreError):
    """Raised when an object carries a format version this release cannot read."""

    def __init__(self, what: str, found: object, supported: object) -> None:
        super().__init__(
            f"{what} has format version {found!r}; this chunkstore reads {supported!r}"
            " (upgrade chunkstore to read it)"
        )
        self.what = what
        self.found = found
        self.supported = supported


class BackendError(ChunkStoreError):
    """Raised when the storage backend fails in a way the store cannot recover."""


class MissingDependencyError(ChunkStoreError):
    """Raised when a URL scheme needs a package that is not installed."""


# --- integrity: corruption is detected, never returned ------------------------------------


class IntegrityError(ChunkStoreError):
    """Raised when stored bytes are missing or do not match their content address."""


class CorruptChunkError(IntegrityError):
    """Raised when a chunk object is damaged: bad header, truncated, or wrong hash."""

    def __init__(self, digest: str, reason: str) -> None:
        super().__init__(f"chunk {digest[:16]} is corrupt: {reason}")
        self.digest = digest
        self.reason = reason


class MissingChunkError(IntegrityError):
    """Raised when a chunk a manifest references is not in the store."""

    def __init__(self, digest: str) -> None:
        super().__init__(f"chunk {digest[:16]} is missing from the store")
        self.digest = digest


class StagedChunkMissingError(MissingChunkError):
    """Raised when the process publishing a sharded save finds a chunk that another
    process of the save reported stored missing from the store; nothing is published."""

    def __init__(self, digest: str, missing: int, total: int) -> None:
        IntegrityError.__init__(
            self, f"chunk {digest[:16]} (and {missing - 1} more of the {total} this sharded"
            " save references), reported stored by a process of the save, is missing from"
            " the store; nothing was published. Save again; if it recurs, check that every"
            " process writes to the same store")
        self.digest = digest
        self.missing = missing
        self.total = total

    def __reduce__(self) -> tuple[type, tuple[str, int, int]]:  # crosses processes (DCP)
        return type(self), (self.digest, self.missing, self.total)


class CorruptNodeError(IntegrityError):
    """Raised when a manifest node is missing, unparsable or does not match its hash."""

    def __init__(self, digest: str, reason: str) -> None:
        super().__init__(f"manifest node {digest[:16]} is corrupt: {reason}")
        self.digest = digest
        self.reason = reason


class CorruptRecordError(IntegrityError):
    """Raised when a commit record is unparsable or does not match its version id."""

    def __init__(self, version_id: str, reason: str) -> None:
        super().__init__(f"commit record {version_id[:16]} is corrupt: {reason}")
        self.version_id = version_id
        self.reason = reason


# --- garbage collection and concurrency -----------------------------------------------------


class SessionExpiredError(ChunkStoreError):
    """Raised at commit when the save could not keep its session alive in the store
    for half the lease (a GC elsewhere may have counted it dead).

    The chunks the save deduplicated against may have been collected, so the
    version is not published; save it again.
    """


class GcBusyError(ChunkStoreError):
    """Raised when another garbage collection is already running on the store."""


class GcAbortedError(ChunkStoreError):
    """Raised when a GC run outlives half the grace period and stops, as it must.

    What it deleted before stopping stays deleted; the rest waits for the next run.
    """


# --- damaged and hostile stores -------------------------------------------------------------


class CorruptConfigError(NotAStoreError):
    """Raised when ``chunkstore.json`` is this store's but a field is missing or malformed."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(url, f"chunkstore.json is damaged: {reason}")
        self.reason = reason


def recover_command(url: str) -> str:
    """The command that writes a store's config back from what its objects carry."""
    return f"chunkstore init --recover {url}"


class ConfigRecoveredWarning(UserWarning):
    """Given when a store is opened with a config recovered from its commit records and
    manifests, because ``chunkstore.json`` is damaged or missing (docs/format.md §2.1):
    the store is read-only until :func:`recover_command` writes the config back.
    ``url``, ``reason`` (what is wrong with the stored config) and ``recovered`` (what
    was derived, and from what) say what happened."""

    def __init__(self, url: str, reason: str, recovered: str) -> None:
        super().__init__(
            f"{url}: chunkstore.json {reason}; opened read-only with a config recovered from"
            f" the commit records and manifests ({recovered}). Reads, log, show, verify,"
            f" report and export work; saves, gc, rm, prune and tags are refused until"
            f" `{recover_command(url)}` writes chunkstore.json back")
        self.url = url
        self.reason = reason
        self.recovered = recovered


class RecoveredConfigError(ChunkStoreError):
    """Raised when a store opened with a recovered config (``chunkstore.json`` damaged or
    missing: :class:`ConfigRecoveredWarning`) is asked to change, or when its config
    cannot be written back as asked; nothing was changed.  ``url`` and ``operation``
    (what was refused) say where; the message names the command that fixes it."""

    def __init__(self, url: str, operation: str, reason: str) -> None:
        super().__init__(f"{url}: cannot {operation}: {reason}")
        self.url = url
        self.operation = operation
        self.reason = reason


class CorruptTagError(IntegrityError):
    """Raised when a tag object cannot be parsed or does not name a version id."""

    def __init__(self, tag: str, reason: str) -> None:
        super().__init__(f"tag {tag!r} is corrupt: {reason}")
        self.tag = tag
        self.reason = reason


#: What a user can do about a full disk: removing versions and collecting works on a
#: full disk (the index keeps a reserve of space for it), so say so.
FREE_SPACE_ADVICE = ("free space: remove versions (`chunkstore rm`) and run `chunkstore gc`,"
                     " which work on a full disk, or delete other files there; then try again")


class StorageFullError(BackendError):
    """Raised when the storage (or the index's filesystem) has no space or quota left;
    nothing is published.  ``key`` is the object, or the path, that could not be written."""

    def __init__(self, key: str, detail: str, *, what: str | None = None) -> None:
        super().__init__(f"no space left to write {what or repr(key)}: {detail};"
                         f" {FREE_SPACE_ADVICE}")
        self.key = key
        self.detail = detail


class BackendUnavailableError(BackendError):
    """Raised when a remote backend fails (network, server or credentials error) for a key."""

    def __init__(self, url: str, key: str, detail: str) -> None:
        super().__init__(f"storage at {url} failed on {key!r}: {detail}")
        self.url = url
        self.key = key
        self.detail = detail


class SavesInProgressError(ChunkStoreError):
    """Raised when an operation that must not run during saves (``index rebuild``)
    finds save sessions in progress in the store; ``sessions`` says how many."""

    def __init__(self, message: str, *, sessions: int) -> None:
        super().__init__(message)
        self.sessions = sessions


class DuplicateStepError(InvalidInputError):
    """Raised when a save names a ``RUN@STEP`` the run already has, with other content
    (or the same content signed by another key than the save's), and was not asked to
    replace it; ``existing`` is that version's id."""

    def __init__(self, run: str, step: int, existing: str,
                 differs: str = "with other content") -> None:
        super().__init__(
            f"run {run!r} already has a version at step {step} ({existing[:12]}) {differs}"
            "; nothing was published. Save under another step, remove that version"
            " first, or pass replace=True to publish this one in its place")
        self.run = run
        self.step = step
        self.existing = existing


class UnknownMetricError(InvalidSettingError):
    """Raised when ``keep_best`` names a metric that no version of a run records.

    Ranking by it would keep none, so a misspelt metric would let the other
    rules remove nearly everything; nothing is removed instead.
    """

    def __init__(self, metric: str, run: str, recorded: Sequence[str]) -> None:
        known = ", ".join(recorded) if recorded else "none"
        super().__init__(f"no version of run {run!r} records the metric {metric!r} to keep"
                         f" the best versions by (metrics its versions record: {known});"
                         " nothing was removed")
        self.metric = metric
        self.run = run
        self.recorded = list(recorded)


class RunInUseError(ChunkStoreError):
    """Raised when another live process holds the run's writer lease: a run has one
    writer, so two launches of one job never mix their histories.  ``holder`` is what
    the lease object says of it (host, pid, since, heartbeat)."""

    def __init__(self, run: str, holder: dict[str, object], message: str) -> None:
        super().__init__(message)
        self.run = run
        self.holder = holder


class RunLeaseLostError(ChunkStoreError):
    """Raised when a writer finds that its run's lease is now another process's (taken
    over, or expired while this one was stalled): it publishes nothing more."""

    def __init__(self, run: str, holder: dict[str, object] | None) -> None:
        who = (f"{holder.get('host')} pid {holder.get('pid')}" if holder
               else "nobody (the lease was removed)")
        super().__init__(f"run {run!r} is no longer this process's to write: its lease is"
                         f" held by {who}; nothing more is published by this process")
        self.run = run
        self.holder = holder


class LeaseSetAsideWarning(UserWarning):
    """Warned when a run-lease object (docs/format.md §11.5) cannot be read as one (not
    JSON, not an object, a directory, a commit intent whose record does not check): it is
    ignored, so a damaged or crafted object never holds a run.  ``path`` names it."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path} is not a lease object ({reason}); it is set aside")
        self.path = path
        self.reason = reason


class MirrorError(ChunkStoreError):
    """Raised when versions are still unmirrored because copying them to the mirror keeps
    failing (or a wait for it timed out); ``pending`` names them, the message says why."""

    def __init__(self, message: str, pending: list[str]) -> None:
        super().__init__(message)
        self.pending = pending


class VersionRemovedError(SelectorError):
    """Raised when a version is removed while it is being opened for reading: its commit
    record was gone once the reader's lease was stored, so nothing protects its data."""

    def __init__(self, version_id: str) -> None:
        super().__init__(version_id[:12], "the version was removed while it was being opened"
                         " (retention or `chunkstore rm`); open another version")
        self.version_id = version_id


class UnprotectedReadWarning(UserWarning):
    """Warned when a reader cannot store its read lease (a read-only store, a full disk):
    the version is read without one, protected only by the GC grace period."""


# --- encrypted stores (docs/format.md §13) --------------------------------------------------


class CorruptObjectError(IntegrityError, ValueError):
    """Raised when a stored object of an encrypted store (other than a chunk, node, commit
    record or tag, which raise their own errors) fails authentication.  A ValueError too:
    the readers of protocol objects (sessions, journal entries, leases, tombstones) take
    it as they take bytes that do not parse, as damage they outlive (a power cut leaves
    an unsynced session object empty or half written)."""

    def __init__(self, kind: str, name: str, reason: str) -> None:
        super().__init__(f"{kind} {name[:40]} is corrupt: {reason}")
        self.kind = kind
        self.name = name
        self.reason = reason


class EncryptionError(InvalidInputError):
    """Raised when a store's encryption and what was asked of it do not fit (a password
    for an unencrypted store, none for an encrypted one, keys of a plain store)."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


class PasswordRequiredError(EncryptionError):
    """Raised when an encrypted store is opened without a password."""

    def __init__(self, url: str) -> None:
        super().__init__(url, "the store is encrypted and no password was given; pass"
                         " password=..., or on the command line set CHUNKSTORE_PASSWORD,"
                         " CHUNKSTORE_PASSWORD_FILE or --password-file, or run it on a"
                         " terminal to be asked")


class NotEncryptedError(EncryptionError):
    """Raised when a password (or a key command) is given for an unencrypted store."""

    def __init__(self, url: str, what: str = "a password was given") -> None:
        super().__init__(url, f"the store is not encrypted, but {what}; encryption is"
                         " chosen when a store is created (`chunkstore init --encrypt`):"
                         " open it without a password, or sync it into a new encrypted store")


class WrongPasswordError(ChunkStoreError):
    """Raised when the password opens none of an encrypted store's key objects; nothing
    was read or changed."""

    def __init__(self, url: str, keys: int, damaged: Sequence[str] = ()) -> None:
        note = f"; damaged key objects, skipped: {', '.join(damaged)}" if damaged else ""
        super().__init__(f"{url}: wrong password: it opens none of the store's {keys} key"
                         f"{'' if keys == 1 else 's'} (`chunkstore key list` shows them)"
                         + note)
        self.url = url
        self.keys = keys
        self.damaged = tuple(damaged)


class KeyObjectError(EncryptionError):
    """Raised when a key command cannot do what it was asked (an unknown key id, the
    removal of a store's last key) or an encrypted store holds no key object."""


# --- signed versions (docs/format.md §14) -----------------------------------------------------


class CorruptSignatureError(IntegrityError):
    """Raised when a version's signature object is unparsable, oversized, names another
    version, or its key fingerprint does not match the public key it carries."""

    def __init__(self, version_id: str, reason: str) -> None:
        super().__init__(f"signature of version {version_id[:16]} is corrupt: {reason}")
        self.version_id = version_id
        self.reason = reason


class UntrustedVersionError(IntegrityError):
    """Raised when a restore that requires signed versions meets one that is not signed
    by a trusted key (unsigned, signed by another key, or with a bad signature)."""

    def __init__(self, version_id: str, status: str, reason: str | None = None) -> None:
        super().__init__(f"version {version_id[:12]} is {status}, not signed by a trusted"
                         f" key{f' ({reason})' if reason else ''}")
        self.version_id = version_id
        self.status = status
        self.reason = reason


class SigningKeyError(InvalidInputError):
    """Raised when a signing or trusted key cannot be used: an unreadable or non-PEM file,
    a wrong or missing password, a key type or curve other than ECDSA P-256/384/521,
    or ``require_signed`` without any trusted key."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what}: {reason}")
        self.what = what
        self.reason = reason


class KeyFileExistsError(InvalidInputError):
    """Raised when ``keygen`` would overwrite an existing key file; nothing is written."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path} exists; keygen never overwrites a key: choose another"
                         " path or remove the old key (and its .pub) first")
        self.path = path


# --- legal holds -----------------------------------------------------------------------------


class HeldVersionError(InvalidInputError):
    """Raised when a removal (``rm``, a replacement, a retention policy asked to remove
    one version) names a version under a legal hold; ``holds`` maps each held version id
    to the hold's reason (None for a damaged hold object, which still holds).  Versions
    the message names as held were not removed."""

    def __init__(self, holds: dict[str, str | None], removed: Sequence[str] = ()) -> None:
        held = "; ".join(f"version {vid[:12]} is held ("
                         + (f"reason: {reason!r}" if reason is not None
                            else "hold object damaged, still a hold") + ")"
                         for vid, reason in sorted(holds.items()))
        note = (f"; {len(removed)} other version{'' if len(removed) == 1 else 's'} of the"
                " request were removed") if removed else "; nothing was removed"
        super().__init__(f"{held}{note}; release it first (`chunkstore release STORE ID`)"
                         " if the hold is no longer needed")
        self.holds = dict(holds)
        self.removed = tuple(removed)


class HoldUnconfirmedError(ChunkStoreError):
    """Raised when a hold was stored but a removal of the version started before it (its
    tombstone is in the store) had not finished or given up within the wait, so whether
    the hold stopped it cannot be known yet; the hold object stays.  Run ``hold`` again."""

    def __init__(self, version_id: str, waited_s: float) -> None:
        super().__init__(f"version {version_id[:12]}: the hold is stored, but a removal of"
                         f" the version that started before it was still under way after"
                         f" {waited_s:.0f}s (its tombstone is in the store), so the hold may"
                         " not stop it; run `chunkstore hold` again to confirm, or `chunkstore"
                         " show` to see whether the version is still there")
        self.version_id = version_id


class HeldVersionWarning(UserWarning):
    """Warned when retention (``keep_last``, a mirror's ``keep_last``) leaves a version it
    would remove because it is under a legal hold; the message names the hold's reason."""
