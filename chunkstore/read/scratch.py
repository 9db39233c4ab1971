"""Per-thread scratch buffers for a read's transient bytes.

A restore decodes a delta chunk through its chain: the chain's root and every
link before the last are decoded in full, each only to be the base of the next,
and only the last goes into the caller's buffer.  Fresh memory for each of them
costs a page fault per 4 KiB on first touch (and a chunk's worth of it is given
back to the system when freed); two buffers per read thread, used in turn, cost
that once per read call (with the next change, runs split by decoded bytes: 0.119
against 0.143 CPU seconds, medians, for the 126 MB state of an MLP with AdamW
read through delta chains; benchmarks/results/restore.json).
Reading runs of pack members into such a buffer instead of fresh bytes gained
nothing measurable, so reads still return fresh bytes.  In an encrypted store of
version 13 each member is decrypted on its own, and there fresh memory for it costs
as much as the decryption: a read job opens each member into a buffer per depth of
the chain it decodes (:func:`member_buffer`; the suite's 261 MB sparse-embedding state,
434 MB of members opened per restore: 384-408 against 510-530 ms of CPU with one read
job, where a plain store's restore takes 290-309).

The buffers live for one read call: each pool job of :func:`chunkstore.read.reader.run_jobs`
releases its thread's when the call's jobs run out, so a long-lived handle's idle
threads hold nothing.

Nothing may keep a view of a scratch buffer past the call that asked for it: the
thread's next use overwrites it.  So only the member and chain decoders of a read
job use it (never verify's, whose decoded bases go to the handle's base cache).
"""

from __future__ import annotations

import functools
import threading

from chunkstore.objects.crypto import scratch as fresh_buffer
from chunkstore.objects.objectstore import MemberBuffer

#: A thread keeps a slot's buffer up to this size (a larger request gets memory of
#: its own, freed with it).
KEEP_BYTES = 16 * 1024 * 1024
#: The grain of the buffers sealed members are opened into (:func:`member_buffer`), whose
#: sizes run from a bias's few hundred bytes to a chunk's
MEMBER_GRAIN = 1024 * 1024

_local = threading.local()


def scratch(slot: str, size: int, grain: int = 0) -> memoryview:
    """``size`` writable bytes of this thread's buffer ``slot`` (uninitialised: what
    the last use left), valid until the thread's next call with the same slot.
    ``grain``: a buffer the thread keeps is allocated in whole multiples of it and not
    zero-filled, so that a slot asked for sizes of every kind grows a few times per
    call, not with each request a little larger than the last (pages never written
    cost nothing)."""
    buffers: dict[str, memoryview] | None = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    held = buffers.get(slot)
    if held is None or len(held) < size:
        if grain and size <= KEEP_BYTES:
            held = fresh_buffer(-(-size // grain) * grain)
        else:
            held = memoryview(bytearray(size))
        if size <= KEEP_BYTES:
            buffers[slot] = held
    return held[:size]


def member_buffer(depth: int) -> MemberBuffer:
    """Where a read job opens the sealed member object at ``depth`` of the chain it
    decodes (0: the chunk's own, then each base): a slot of its own per depth, since a
    chain's objects are all held until its last link is applied.  Fresh memory for each
    would cost as much as decrypting it."""
    return functools.partial(scratch, f"member-{depth}", grain=MEMBER_GRAIN)


def release() -> None:
    """Drop this thread's buffers (the end of a read call's jobs on this thread)."""
    _local.buffers = {}
