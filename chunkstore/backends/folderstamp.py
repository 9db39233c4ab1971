"""A local folder's stamp: what tells an opener, without listing, that no file was
added to or removed from a folder since it last listed it (``LocalBackend.listing_stamp``).

A directory's modification time changes whenever a name in it is created, renamed
in or unlinked, and its change time whenever anything about it changes (an
``utime`` that sets the modification time back included).  The stamp is both, with
the device and inode (another folder put in its place, a copy of the store).  Three
things make an equal stamp trustworthy, as git's "racily clean" index entries do:

1. **Settled only.**  A timestamp has a granularity (a kernel tick, a few ms): a
   name added in the same tick as the stamp was read leaves the stamp as it was.
   A folder changed less than :data:`SETTLE_S` ago has no stamp (None), so any
   change after a stamp was read falls in a later tick and changes it.  The same
   margin covers a power cut: ext4 commits its journal every 5 s by default, and a
   name operation lost in a power cut takes its timestamp update with it, so a
   stamp read after the margin names a folder whose names are on disk.
2. **File systems that keep the times.**  Only on the local file systems named
   in :data:`KEEPS_TIMES`: a network file system (another machine's writes reach
   this one's attribute cache late) or a FUSE mount of an object store (which may
   not update a folder's times at all) have no stamp, and openers list them.
3. **Read before** the listing it vouches for: whatever changes after the stamp
   was read changes it, so a listing that started after it holds at least what
   the stamp describes.
"""

from __future__ import annotations

import os
import stat
import time

#: The stamp of a folder that does not exist (yet).
ABSENT = "absent"

#: Seconds a folder must have been left alone before its stamp is given.
SETTLE_S = 10.0

#: File systems whose folder times change with every name created or removed in them,
#: on this machine alone (/proc/self/mountinfo's type field).
KEEPS_TIMES = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs",
                         "f2fs", "bcachefs", "jfs", "reiserfs"})


def folder_stamp(folder: str, file_system: str | None,
                 now: float | None = None) -> str | None:
    """The stamp of ``folder`` (see the module's docstring), :data:`ABSENT` where there
    is no such folder; None where it has none: on a file system not in
    :data:`KEEPS_TIMES`, unreadable, or changed within :data:`SETTLE_S`."""
    if file_system not in KEEPS_TIMES:
        return None
    try:
        found = os.stat(folder)
    except FileNotFoundError:
        # No folder, so no key under it: creating the first one makes it, which gives
        # it a stamp of its own.
        return ABSENT
    except OSError:
        return None
    if not stat.S_ISDIR(found.st_mode):
        return None
    now = time.time() if now is None else now
    if max(found.st_mtime_ns, found.st_ctime_ns) > (now - SETTLE_S) * 1e9:
        return None
    return f"{found.st_dev}:{found.st_ino}:{found.st_mtime_ns}:{found.st_ctime_ns}"


def file_system_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the file system ``path`` lies on, from the mount table (the mount
    point nearest to it); None where the table cannot be read."""
    target = os.path.realpath(path)
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        # mount-id parent major:minor root mount-point options... - type source super
        before, _, after = line.partition(" - ")
        fields = before.split(" ")
        if len(fields) < 5 or not after:
            continue
        point = _unescaped(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, after.split(" ", 1)[0]
    return kind


def _unescaped(field: str) -> str:
    """A mountinfo path field, its octal escapes (``\\040`` for a space) undone."""
    if "\\" not in field:
        return field
    return field.encode().decode("unicode_escape")
