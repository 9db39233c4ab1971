"""A long-lived handle's cache of moved records never makes a stored chunk missing.

A moved record is written once, but GC deletes it once nothing reaches its pack,
and a later repack of the same pack writes another: a handle that cached the first
must follow the second when the first leads to a pack that is gone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import chunkstore
from chunkstore.codecs import PACK
from chunkstore.format.chunkobj import HEADER, ChunkHeader
from chunkstore.format.digest import Digest
from chunkstore.objects.kinds import CHUNKS, MOVED
from chunkstore.protocol.moved import MovedRecord, read_moved
from tests.test_repack import check, moved, three_versions

# Every test here runs with reads as they come and with every ranged read mapped.
pytestmark = pytest.mark.usefixtures("read_mode")

PAD = 4096


def test_a_record_rewritten_since_it_was_cached_is_read_again(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ids, first = three_versions(root)
    with chunkstore.open(root) as reader, \
            chunkstore.open(root, index_dir=str(tmp_path / "elsewhere")) as other:
        reader.delete(ids[0])
        assert reader.gc(grace=0).packs_repacked == 1
        check(reader, ids[1], 2)  # reads through the record: cached by this handle
        assert first in reader.moved_cache
        # Elsewhere the pack it moved to is itself rewritten (its members at other
        # offsets) and the record of the first pack replaced, as a GC deleting the
        # record and a later repack writing another would leave it.
        (record_json,) = moved(root).values()
        old = read_moved(other.objects, first)
        assert old is not None
        content = other.objects.get(CHUNKS, old.to)[HEADER.size:]
        new_content = b"\0" * PAD + content
        header = ChunkHeader(PACK.id, 1, len(new_content), len(new_content)).pack()
        to = Digest.of(new_content)
        other.objects.put(CHUNKS, to, header + new_content)
        members = {offset: (length, new + PAD) for offset, (length, new) in old.members.items()}
        other.objects.put(MOVED, first, MovedRecord(first, to, members).encode())
        other.objects.delete(CHUNKS, old.to)
        assert record_json["to"] == old.to.hex
        # The reader's cached record leads to a pack that is gone: it reads the new one.
        for vid, step in zip(ids[1:], (2, 3), strict=True):
            check(reader, vid, step)
        assert reader.verify(ids[1]).ok
