"""A chain of sub-delta links applied in one pass over the chunk (docs/format.md §3.4).

Link by link (:mod:`chunkstore.read.chain`), each sub-delta link's image is joined
from its planes and added to the chunk the link before wrote: the chunk is written
out and read back once per link, through a scratch buffer.  Where the native loops
are built, a chain of sub-delta links alone goes through
``sub_delta_chain`` instead: the root's planes (or bytes), then every link's image,
added block by block into the caller's buffer while the block is in the core's
cache; the result is hash-checked as every read's is.  The same bytes as link by
link (tests/test_restore_paths.py compares them).
"""

from __future__ import annotations

import struct

from chunkstore import codecs
from chunkstore.codecs import native
from chunkstore.codecs.shuffle import ShuffleZstdCodec
from chunkstore.codecs.subdelta import LANES
from chunkstore.errors import CorruptChunkError
from chunkstore.format.chunkobj import ChunkHeader, check_digest, decode_payload
from chunkstore.format.digest import ChunkIds, Digest
from chunkstore.read.members import page_in, page_out

#: A delta object of a chain: its digest, header and bytes (mapped ones populated no
#: further than the header until decoded).
Link = tuple[Digest, ChunkHeader, memoryview]


#: Sub-delta links one native pass applies.  Their decoded planes are held together (up
#: to a chunk's worth each), so a longer chain is applied in groups: with two, a read
#: job holds no more than link by link did (a scratch buffer and one link's planes).
#: Dense updates make chains of about two links (CHAIN_BYTES of chunkstore.write.delta).
FUSED_LINKS = 2


def sub_deltas_alone(links: list[Link]) -> bool:
    """Whether every link is a sub-delta of the head's element size, one with a lane."""
    size = links[0][1].element_size
    return size in LANES and all(link[1].codec_id == codecs.SUB_DELTA.id
                                 and link[1].element_size == size for link in links)


def decode_sub_deltas(digest: Digest, links: list[Link], root: Link | None,
                      root_raw: bytes | memoryview | None, out: memoryview,
                      ids: ChunkIds) -> memoryview:
    """Decode the chunk ``digest`` through ``links`` (nearest first, every one a
    sub-delta: :func:`sub_deltas_alone`; the native loops built) into ``out``: the
    root's planes (a plane-coded root of the links' element size; else its bytes,
    ``root_raw`` where the base cache held them) and the links' planes are added into
    ``out`` in one pass per :data:`FUSED_LINKS` links, then the result is
    hash-checked.  A link whose payload does not decode is a
    :class:`~chunkstore.errors.CorruptChunkError` naming it."""
    head = links[0][1]
    size, length = head.element_size, head.raw_length
    if len(out) != length:
        raise CorruptChunkError(digest.hex, f"holds {length} bytes, the manifest expects"
                                f" {len(out)}")
    base: bytes | memoryview | list[bytes | memoryview]
    if root_raw is not None:
        base = root_raw
    else:
        assert root is not None
        root_digest, root_header, root_view = root
        page_in(root_view)
        if root_header.codec_id == codecs.SHUFFLE_ZSTD.id and root_header.element_size == size:
            base = _plane_bodies(root_digest, codecs.SHUFFLE_ZSTD, root_view[root_header.size:],
                                 length, size)
        else:  # a raw root is read where it lies; any other is decoded into out
            into = None if root_header.codec_id == codecs.RAW.id else out
            base = decode_payload(root_digest, root_header, root_view, into)
    if not isinstance(base, list) and len(base) != length:
        raise CorruptChunkError(digest.hex, "a delta base of another length")
    ordered = links[::-1]  # nearest the root first
    for first in range(0, len(ordered), FUSED_LINKS):
        group = ordered[first : first + FUSED_LINKS]
        planes = []
        for link_digest, link_header, link_view in group:
            page_in(link_view)
            planes.append(_plane_bodies(link_digest, codecs.SUB_DELTA,
                                        link_view[link_header.size:], length, size))
        assert native.MODULE is not None  # the caller checked
        native.MODULE.sub_delta_chain(base, planes, out)
        for link in group:
            page_out(link[2])
        if first == 0 and root is not None:
            page_out(root[2])
        base = out
    check_digest(digest, out, ids)
    return out


def _plane_bodies(digest: Digest, codec: ShuffleZstdCodec, payload: memoryview,
                  length: int, size: int) -> list[bytes | memoryview]:
    try:
        return codec.plane_bodies(payload, length, size)
    except (ValueError, struct.error) as exc:
        raise CorruptChunkError(digest.hex, f"{codec.name} payload does not decode:"
                                f" {exc}") from exc
