"""Codec 4 (chunk format version 3): a pack of small chunk objects.

The payload is the pack's raw content, stored as it is: complete member chunk
objects (header and payload each, exactly as the member would be stored on
its own) laid end to end.  The pack's key is the digest of that content, so a
pack is stored, claimed, marked, condemned and deleted as any chunk object is.
A reader reaches a member through the location a manifest lists for it
(docs/format.md §3.5); decoding a pack whole only checks its digest.
"""

from __future__ import annotations

from chunkstore.codecs.raw import RawCodec


class PackCodec(RawCodec):
    """Stored as it is, like raw; its own id says the content is member objects."""

    id = 4
    name = "pack"


PACK = PackCodec()
