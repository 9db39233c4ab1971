"""A save's pack builder holds a bounded amount while an early member stalls.

Members are packed in the order of the state (so the same save makes the same
packs); workers hand them over out of order, and those that arrive before an
earlier one wait.  Past a bound, the waiting members are packed out of order.
"""

from __future__ import annotations

from chunkstore.format.chunkobj import HEADER
from chunkstore.format.digest import Digest
from chunkstore.objects.objectstore import PackEncoding
from chunkstore.read.packs import PackBuilder

MEMBER = 64 << 10


def member(i: int) -> tuple[Digest, tuple[bytes, bytes]]:
    payload = i.to_bytes(4, "little") * (MEMBER // 4)
    return Digest.of(payload), (b"h" * 8, payload)


def test_members_behind_a_stalled_one_are_packed_within_the_bound() -> None:
    written: dict[Digest, bytes] = {}

    def write(digest: Digest, pack: PackEncoding) -> int:
        written[digest] = b"".join(pack.pieces())
        return len(written[digest])

    limit = 1 << 20
    builder = PackBuilder(write, target=256 << 10, waiting_bytes=limit)
    places = [builder.reserve() for _ in range(200)]
    most_held = 0
    for seq in places[1:]:  # place 0 stalls: its member arrives last
        digest, encoded = member(seq)
        builder.add(seq, digest, encoded, MEMBER)
        held = sum(len(m[0]) + len(m[1]) for _, m, _, _ in builder._waiting.values()
                   if m is not None)
        held += sum(len(part) for _, pieces in builder._parts for part in pieces)
        most_held = max(most_held, held)
    assert most_held <= limit + (256 << 10) + MEMBER  # waiting, and one open pack
    assert written, "nothing was packed while place 0 stalled"
    digest, encoded = member(0)
    builder.add(0, digest, encoded, MEMBER)
    builder.finish()
    # Every member packed exactly once, where the builder says, with its bytes.
    assert len(builder.written) == 200
    for i in range(200):
        digest, (header, payload) = member(i)
        location = builder.written[digest]
        data = written[location.pack]
        start = HEADER.size + location.offset  # after the pack object's header
        assert data[start:start + location.length] == header + payload


def test_in_order_members_are_packed_in_the_order_of_the_state() -> None:
    packs: list[bytes] = []
    builder = PackBuilder(lambda d, pack: packs.append(b"".join(pack.pieces())) or len(packs[-1]),
                          target=1 << 30)
    places = [builder.reserve() for _ in range(20)]
    for seq in reversed(places):  # all waiting, within the bound
        digest, encoded = member(seq)
        builder.add(seq, digest, encoded, MEMBER)
    builder.finish()
    offsets = [builder.written[member(i)[0]].offset for i in range(20)]
    assert offsets == sorted(offsets) and len(packs) == 1
