"""Reading a chunk through its delta chain (docs/format.md §3.4).

A delta object (codec ``xor-delta`` or ``sub-delta``) names its base in its header; the base
may itself be a delta.  The manifest lists, for every chunk, the bases its
object may need, nearest first (:attr:`chunkstore.format.manifest.Shard.bases`), so
GC keeps them without reading chunk objects.  A reader follows the headers
and checks each step against that list:

1. read the object; a standalone object decodes as before;
2. a delta's base MUST be the next digest of the listed chain: a base the
   manifest does not list is one GC would not protect, so it is refused
   (``CorruptChunkError``) even when it happens to be present;
3. the base's raw bytes come from the cache or from steps 1-4 on the base
   (so a chain of depth d reads at most d+1 objects, and never more than
   the listed chain allows);
4. the payload is decoded, the base applied (XORed or added in), and the
   result hash-checked, so every base on the way is verified as the chunk
   itself is.

A base may lie inside a pack (docs/format.md §3.5): the manifest then lists
where (:meth:`chunkstore.format.manifest.Shard.chain_locations`), and the base's
member object is read by range from the pack (following moved records) and
decoded exactly as an object of its own would be.

Decoded bases are kept in a small LRU of bounded bytes (:class:`BaseCache`),
so a restore or a save decodes a base shared by several chunks once.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np

from chunkstore import codecs
from chunkstore.codecs import zstd
from chunkstore.codecs.planes import join, split
from chunkstore.codecs.shuffle import plane_table, planes_into
from chunkstore.codecs.sparsedelta import SparseDeltaCodec
from chunkstore.errors import ChunkStoreError, CorruptChunkError
from chunkstore.format.chunkobj import (
    HEADER,
    MAX_PAYLOAD_OVERHEAD,
    ChunkHeader,
    check_digest,
    decode_object,
    decode_payload,
    parse_header,
)
from chunkstore.format.digest import DIGEST_SIZE, ChunkIds, Digest
from chunkstore.format.manifest import PackLocation
from chunkstore.handle.caches import BaseCache
from chunkstore.objects.kinds import CHUNKS
from chunkstore.objects.objectstore import MemberBuffer
from chunkstore.read.members import (
    Locations,
    Prefetched,
    member_object,
    missing_chunk,
    page_in,
    page_out,
)
from chunkstore.read.scratch import member_buffer, scratch

if TYPE_CHECKING:
    from chunkstore.handle.handle import StoreHandle


def _get(store: StoreHandle, digest: Digest, location: PackLocation | None, raw_length: int,
         prefetched: Prefetched | None = None, buffer: MemberBuffer | None = None, *,
         paged: bool = False) -> bytes | memoryview:
    """The object of ``digest`` (of ``raw_length`` raw bytes): stored under its key, or
    the member object at ``location`` inside a pack (bounded by that length before it
    is read; from ``prefetched`` where it was read ahead; a sealed one opened into
    ``buffer`` where given)."""
    if location is not None:
        return member_object(store, digest, location, raw_length, prefetched, buffer,
                             paged=paged)
    try:
        # At most one byte more than any object of raw_length bytes can be: a padded
        # object is refused by its header check without being read whole.
        return store.objects.view_range(CHUNKS, digest, 0, HEADER.size + DIGEST_SIZE
                                        + raw_length + MAX_PAYLOAD_OVERHEAD + 1)
    except FileNotFoundError:
        raise missing_chunk(store, digest) from None


def _at(locations: Locations, i: int) -> PackLocation | None:
    return locations[i] if i < len(locations) else None


#: For reads that must see the objects as stored now (verify): caches nothing.
NO_CACHE = BaseCache(0)


def _check_base(digest: Digest, header: ChunkHeader, chain: tuple[Digest, ...]) -> None:
    if header.base is None or not chain or chain[0] != header.base:
        listed = chain[0].short(16) if chain else "none"
        named = header.base.short(16) if header.base else "none"
        raise CorruptChunkError(digest.hex, f"delta against {named}, but the manifest lists"
                                f" {listed} as its base")


def decode_chain(store: StoreHandle, digest: Digest, data: bytes | memoryview,
                 chain: tuple[Digest, ...], out: memoryview | None = None,
                 cache: BaseCache | None = None, *, check_links: bool = False,
                 locations: Locations = (), prefetched: Prefetched | None = None,
                 transient: bool = False) -> bytes | memoryview:
    """Decode the object ``data`` of ``digest``, following its listed ``chain``
    (whose bases lie where ``locations`` says, their member objects in ``prefetched``
    where a reader read them ahead); decoded bases come from and go to ``cache``
    (default: the store's).

    The result is always hash-checked.  With ``check_links`` every base on the
    way is hash-checked too, so a damaged base is named as such (verify);
    otherwise only the result is checked, which proves every base on the way
    right as well (a wrong base changes the result), and the bases decoded on
    the way are not cached: a chain of XOR links is decoded in the plane
    domain, other chains link by link from the root (a sparse-delta link adds
    its runs in place, onto a buffer of this decode's own).  ``transient`` (a read job
    of :func:`chunkstore.read.reader.run_jobs`): the links before the last are
    decoded into the thread's scratch buffers (:mod:`chunkstore.read.scratch`).

    ``data`` and the bases a reader read ahead may be mapped and populated no further
    than their headers (:func:`chunkstore.read.packs.read_members_into`): each object
    is populated just before its payload is decoded and its pages released once it
    is applied, so one job holds about one link's mapped pages, not the chain's.
    """
    header = parse_header(digest, data)
    if header.base is None or not _is_delta(header.codec_id):
        page_in(data)
        return decode_object(digest, data, out, header=header, ids=store.objects.chunk_ids)
    _check_base(digest, header, chain)
    if out is not None and header.raw_length != len(out):  # before any base is read
        raise CorruptChunkError(digest.hex, f"holds {header.raw_length} bytes, the manifest"
                                f" expects {len(out)}")
    if check_links:
        base = base_bytes(store, chain[0], chain[1:], header.raw_length, cache,
                          check_links=True, location=_at(locations, 0),
                          locations=locations[1:], prefetched=prefetched)
        page_in(data)
        return decode_object(digest, data, out, base, ids=store.objects.chunk_ids)
    transient = transient and out is not None  # else the result is returned, not copied
    links, root, root_raw = _chain_objects(store, digest, header, memoryview(data), chain, cache,
                                           locations, prefetched, transient)
    if all(link[1].codec_id == codecs.XOR_DELTA.id
           and link[1].element_size == header.element_size for link in links):
        return _decode_planes(digest, links, root, root_raw, out, transient,
                              store.objects.chunk_ids)
    return _decode_links(digest, links, root, root_raw, out, transient, store.objects.chunk_ids)


Link = tuple[Digest, ChunkHeader, memoryview]


def _chain_objects(store: StoreHandle, digest: Digest, header: ChunkHeader, view: memoryview,
                   chain: tuple[Digest, ...], cache: BaseCache | None, locations: Locations,
                   prefetched: Prefetched | None = None, transient: bool = False
                   ) -> tuple[list[Link], Link | None, bytes | memoryview | None]:
    """The delta objects from the chunk down its chain (nearest first), then either
    the standalone object that ends it or the bytes of a base found in the cache
    (``transient``: sealed members opened into the thread's scratch buffers, one per
    depth, as the decode holds them all)."""
    cache = store.base_cache if cache is None else cache
    links: list[Link] = []
    current, rest = digest, chain
    while True:
        if len(view) - header.size != header.payload_length:
            raise CorruptChunkError(current.hex, f"payload is {len(view) - header.size} bytes,"
                                    f" header says {header.payload_length}")
        if links and header.raw_length != links[0][1].raw_length:
            raise CorruptChunkError(current.hex, "a delta base of another length")
        if header.base is None or not _is_delta(header.codec_id):
            return links, (current, header, view), None
        _check_base(current, header, rest)
        links.append((current, header, view))
        cached = cache.get(rest[0])
        if cached is not None:
            return links, None, cached
        at = _at(locations, len(links) - 1)
        current, rest = rest[0], rest[1:]
        view = memoryview(_get(store, current, at, links[0][1].raw_length, prefetched,
                               member_buffer(len(links)) if transient else None, paged=True))
        header = parse_header(current, view)


def _decode_planes(digest: Digest, links: list[Link], root: Link | None,
                   root_raw: bytes | memoryview | None, out: memoryview | None,
                   transient: bool, ids: ChunkIds) -> bytes | memoryview:
    """XOR the chain's byte planes together, unshuffle once, hash-check the result
    (``transient``: the planes in the thread's scratch buffer)."""
    head = links[0][1]
    size, length = head.element_size, head.raw_length
    if size < 1 or length % size:
        raise CorruptChunkError(digest.hex, f"raw length {length} is not a multiple of the"
                                f" element size {size}")
    planes = (np.frombuffer(scratch("chain-0", length), dtype=np.uint8).reshape(size, -1)
              if transient else np.empty((size, length // size), dtype=np.uint8))
    if root_raw is None:
        assert root is not None
        root_digest, root_header, root_view = root
        page_in(root_view)
        if root_header.codec_id == codecs.SHUFFLE_ZSTD.id and root_header.element_size == size:
            _planes_of(root_digest, root_view[root_header.size:], planes, xor=False)
        else:
            root_raw = decode_payload(root_digest, root_header, root_view, None)
    if root_raw is not None:
        if len(root_raw) != length:
            raise CorruptChunkError(digest.hex, "a delta base of another length")
        split(root_raw, planes, size)
    if root is not None:
        page_out(root[2])
    for link_digest, link_header, link_view in reversed(links):
        page_in(link_view)
        _planes_of(link_digest, link_view[link_header.size:], planes, xor=True)
        page_out(link_view)
    if out is None:
        out = memoryview(bytearray(length))
    elif len(out) != length:
        raise CorruptChunkError(digest.hex, f"holds {length} bytes, the manifest expects"
                                f" {len(out)}")
    join(planes, out)
    check_digest(digest, out, ids)
    return out


def _decode_links(digest: Digest, links: list[Link], root: Link | None,
                  root_raw: bytes | memoryview | None, out: memoryview | None,
                  transient: bool, ids: ChunkIds) -> bytes | memoryview:
    """Decode the chain's root, apply each link's image to it with the link's codec,
    nearest the root first, and hash-check the result only.  ``transient``: the
    root and the links before the last go to the thread's scratch buffers (each
    link reads the buffer before and writes another)."""
    if out is not None and not any(
            isinstance(codecs.by_id(link[1].codec_id), SparseDeltaCodec) for link in links):
        return _decode_links_through(digest, links, root, root_raw, out, transient, ids)
    length = links[0][1].raw_length
    #: whether ``current`` is a buffer of this decode's own (a scratch buffer or one
    #: allocated here), which a sparse-delta link may change in place
    owned = False
    # A chain of sparse-delta links alone is decoded in the caller's buffer: the root
    # straight into it, then each link's runs added in place (no copy of the chunk).
    in_out = out is not None and all(
        isinstance(codecs.by_id(link[1].codec_id), SparseDeltaCodec) for link in links)
    if root_raw is None:
        assert root is not None
        _, root_header, _ = root
        into = (out if in_out else scratch("chain-0", length)
                if transient and root_header.codec_id != codecs.RAW.id else None)
        page_in(root[2])
        root_raw = decode_payload(*root, into)
        owned = into is not None
    if len(root_raw) != length:
        raise CorruptChunkError(digest.hex, "a delta base of another length")
    current: bytes | memoryview = root_raw
    spare = 1  # the scratch buffer current is not in
    for i, (link_digest, link_header, link_view) in enumerate(reversed(links)):
        codec = codecs.by_id(link_header.codec_id)
        assert codec is not None  # parse_header checked it
        last = i == len(links) - 1
        payload = link_view[link_header.size:]
        page_in(link_view)
        # _chain_objects checked the payload's length and every link's raw length.
        try:
            if owned and isinstance(codec, SparseDeltaCodec) and (
                    not (last and out is not None) or current is out):
                assert isinstance(current, memoryview)
                codec.apply_in_place(payload, current, link_header.element_size)
                _done_with(link_view, root, i)
                continue
            if last and out is not None:
                into = out
            elif transient:
                into = scratch(f"chain-{spare}", length)
                spare = 1 - spare
            else:
                into = memoryview(bytearray(length))
            codec.decode_onto(payload, current, into, link_header.element_size)
        except (ValueError, struct.error) as exc:
            raise CorruptChunkError(link_digest.hex, f"{codec.name} payload does not decode:"
                                    f" {exc}") from exc
        _done_with(link_view, root, i)
        current, owned = into, True
    check_digest(digest, current, ids)
    return current


def _done_with(link_view: memoryview, root: Link | None, i: int) -> None:
    """Release the mapped pages of a link just applied, and after the first link those
    of the root (a raw root is read in place until then)."""
    page_out(link_view)
    if i == 0 and root is not None:
        page_out(root[2])


def _decode_links_through(digest: Digest, links: list[Link], root: Link | None,
                          root_raw: bytes | memoryview | None, out: memoryview,
                          transient: bool, ids: ChunkIds) -> memoryview:
    """:func:`_decode_links` into the caller's ``out`` for a chain whose every link
    writes a new buffer (no sparse-delta link): the root and the links go to ``out``
    and to one other buffer in turn, so that the last lands in ``out``.  One scratch
    buffer per read job, not two: a chunk's worth less memory per job in a restore
    through chains of two links or more (python -m benchmarks.bench_memory_table).
    ``out`` holds bytes of the chain's bases until the last link is applied; an error
    leaves partial data in it, as any failed read does."""
    length = links[0][1].raw_length
    other: memoryview | None = None

    def buffer(writes_after: int) -> memoryview:
        """Where a write goes that ``writes_after`` more writes follow."""
        nonlocal other
        if writes_after % 2 == 0:
            return out
        if other is None:
            other = scratch("chain-0", length) if transient \
                else memoryview(bytearray(length))
        return other

    if root_raw is None:
        assert root is not None
        _, root_header, _ = root
        # A raw root is read where it lies (a view, no copy); any other is decoded.
        into = buffer(len(links)) if root_header.codec_id != codecs.RAW.id else None
        page_in(root[2])
        root_raw = decode_payload(*root, into)
        if into is not None:  # decoded: its mapped pages are done with
            page_out(root[2])
    if len(root_raw) != length or len(out) != length:
        raise CorruptChunkError(digest.hex, "a delta base of another length")
    current: bytes | memoryview = root_raw
    for i, (link_digest, link_header, link_view) in enumerate(reversed(links)):
        codec = codecs.by_id(link_header.codec_id)
        assert codec is not None  # parse_header checked it
        into = buffer(len(links) - 1 - i)
        page_in(link_view)
        try:
            codec.decode_onto(link_view[link_header.size:], current, into,
                              link_header.element_size)
        except (ValueError, struct.error) as exc:
            raise CorruptChunkError(link_digest.hex, f"{codec.name} payload does not decode:"
                                    f" {exc}") from exc
        _done_with(link_view, root, i)
        current = into
    check_digest(digest, out, ids)
    return out


def _planes_of(digest: Digest, payload: memoryview, planes: np.ndarray, *, xor: bool) -> None:
    try:
        planes_into(payload, planes, 1, xor=xor)
    except (ValueError, struct.error) as exc:
        raise CorruptChunkError(digest.hex, f"payload does not decode: {exc}") from exc


def base_bytes(store: StoreHandle, digest: Digest, chain: tuple[Digest, ...], raw_length: int,
               cache: BaseCache | None = None, *, check_links: bool = False,
               location: PackLocation | None = None, locations: Locations = (),
               prefetched: Prefetched | None = None) -> bytes | memoryview:
    """The verified raw bytes of ``digest`` (a base of ``raw_length`` bytes, inside a
    pack at ``location`` or an object of its own), from the cache or decoded."""
    cache = store.base_cache if cache is None else cache
    raw = cache.get(digest)
    if raw is None:
        data = _get(store, digest, location, raw_length, prefetched)
        # Before its own bases are read: they are bounded by the length it claims.
        claimed = parse_header(digest, data).raw_length
        if claimed != raw_length:
            raise CorruptChunkError(digest.hex, f"a delta base of {raw_length} bytes holds"
                                    f" {claimed}")
        raw = decode_chain(store, digest, data, chain, None, cache, check_links=check_links,
                           locations=locations, prefetched=prefetched)
        cache.put(digest, raw)
    return raw


def base_prefix(store: StoreHandle, digest: Digest, chain: tuple[Digest, ...], length: int,
                raw_length: int, locations: Locations = ()) -> bytes | None:
    """The first ``length`` raw bytes of the chunk ``digest`` (a would-be base), decoding
    only what they need: enough to judge whether a delta pays before the whole base is
    read, decoded and verified.  Not hash-checked: use it to decide, never to encode.
    None where the objects are not plane-coded alike (the caller decodes in full).
    ``raw_length``: the raw length the base must have; ``locations``: where ``digest``
    and then each base of ``chain`` lie in packs.
    """
    try:
        digests, objects = (digest, *chain), []
        for i, current in enumerate(digests):
            view = memoryview(_get(store, current, _at(locations, i), raw_length))
            header = parse_header(current, view)
            objects.append((header, view[header.size:]))
            if header.base is None or not _is_delta(header.codec_id):
                break
        else:
            return None  # the listed chain ends in a delta: let the full decode refuse it
        size = objects[0][0].element_size
        deltas = (codecs.XOR_DELTA.id, codecs.SUB_DELTA.id, codecs.SPARSE_DELTA.id)
        if size < 1 or length % size or any(
                h.element_size != size or h.raw_length != objects[0][0].raw_length
                or h.codec_id not in (codecs.SHUFFLE_ZSTD.id, *deltas) for h, _ in objects):
            return None
        elements = length // size
        prefix: memoryview | None = None
        for header, payload in reversed(objects):  # the root first, then each delta on it
            if header.codec_id == codecs.SPARSE_DELTA.id:
                if prefix is None:
                    return None
                codecs.SPARSE_DELTA.apply_prefix(payload, prefix, header.raw_length, size)
                continue
            planes = np.empty((size, elements), dtype=np.uint8)
            minimum = 1 if _is_delta(header.codec_id) else 2
            for i, (mode, start, count) in enumerate(
                    plane_table(payload, header.raw_length, size, minimum)):
                body = payload[start : start + count]
                part = (body[:elements] if mode == 0
                        else zstd.decompress_prefix(body, elements))
                planes[i] = np.frombuffer(part, dtype=np.uint8)
            image = memoryview(bytearray(size * elements))
            join(planes, image)
            if prefix is not None:
                codec = codecs.by_id(header.codec_id)
                assert codec is not None
                codec.apply_base(image, prefix, size)
            prefix = image
        return None if prefix is None else bytes(prefix)
    except (ChunkStoreError, ValueError, struct.error):
        return None


def header_chain(store: StoreHandle, digest: Digest, limit: int) -> tuple[Digest, ...] | None:
    """The bases of the stored object of ``digest`` as its headers name them (nearest
    first), reading headers only; None when an object is missing, damaged, or the
    chain is longer than ``limit``."""
    chain: list[Digest] = []
    current = digest
    while True:
        try:
            head = store.objects.get_range(CHUNKS, current, 0, HEADER.size + DIGEST_SIZE)
            header = parse_header(current, head)
        except (FileNotFoundError, ChunkStoreError):
            return None
        if header.base is None or not _is_delta(header.codec_id):
            return tuple(chain)
        if len(chain) == limit or header.base in chain or header.base == digest:
            return None
        chain.append(header.base)
        current = header.base


def _is_delta(codec_id: int) -> bool:
    codec = codecs.by_id(codec_id)
    return codec is not None and codec.needs_base
