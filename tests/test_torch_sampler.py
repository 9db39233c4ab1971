"""ResumableSampler: seeded per-epoch shuffles, resumed mid-epoch without repeats or gaps."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader  # noqa: E402

from chunkstore.errors import InvalidInputError  # noqa: E402
from torch_bridge import ResumableSampler  # noqa: E402

DATA = list(range(23))


def _take(sampler: ResumableSampler, n: int) -> list[int]:
    return list(itertools.islice(iter(sampler), n))


def test_each_epoch_is_a_different_permutation() -> None:
    sampler = ResumableSampler(DATA, seed=3)
    first, second = list(sampler), list(sampler)
    assert sorted(first) == sorted(second) == DATA
    assert first not in (second, DATA)
    assert list(ResumableSampler(DATA, seed=3)) == first  # same seed, same order
    assert list(ResumableSampler(DATA, shuffle=False)) == DATA


def test_resumes_mid_epoch_without_repeating_or_skipping() -> None:
    full = ResumableSampler(DATA, seed=7)
    expected = list(full) + list(full)
    sampler = ResumableSampler(DATA, seed=7)
    head = _take(sampler, 9)
    state = sampler.state_dict()
    assert state == {"epoch": 0, "offset": 9, "seed": 7, "shuffle": True, "size": 23}
    resumed = ResumableSampler(DATA, seed=0)
    resumed.load_state_dict(state)
    assert head + list(resumed) + list(resumed) == expected


def test_resumes_exactly_at_an_epoch_end() -> None:
    sampler = ResumableSampler(DATA, seed=1)
    first = list(sampler)
    resumed = ResumableSampler(DATA)
    resumed.load_state_dict(sampler.state_dict())
    assert list(resumed) == list(sampler)
    assert resumed.epoch == 1 and list(ResumableSampler(DATA, seed=1)) == first


def test_with_a_dataloader_mid_epoch() -> None:
    sampler = ResumableSampler(DATA, seed=2)
    loader = DataLoader(DATA, batch_size=4, sampler=sampler)
    batches = iter(loader)
    seen = [next(batches).tolist() for _ in range(3)]
    resumed = ResumableSampler(DATA)
    resumed.load_state_dict(sampler.state_dict())
    rest = [b.tolist() for b in DataLoader(DATA, batch_size=4, sampler=resumed)]
    flat = [i for b in seen + rest for i in b]
    assert flat == list(ResumableSampler(DATA, seed=2))


def test_refuses_state_of_another_data_source() -> None:
    state = ResumableSampler(DATA).state_dict()
    with pytest.raises(InvalidInputError, match="23 examples"):
        ResumableSampler(DATA[:5]).load_state_dict(state)


@pytest.mark.parametrize("stop_after", [3, 6, 9, 12])
def test_the_set_epoch_loop_resumes_exactly_even_at_an_epoch_end(stop_after: int) -> None:
    """The usual loop: for epoch in range(sampler.epoch, E): set_epoch(epoch); iterate."""
    data = list(range(12))  # 3 batches of 4 per epoch

    def batches(sampler: ResumableSampler, limit: int | None) -> list[list[int]]:
        seen: list[list[int]] = []
        for epoch in range(sampler.epoch, 4):
            sampler.set_epoch(epoch)
            for batch in DataLoader(data, batch_size=4, sampler=sampler):
                seen.append(batch.tolist())
                if limit is not None and len(seen) == limit:
                    return seen
        return seen

    reference = batches(ResumableSampler(data, seed=5), None)
    sampler = ResumableSampler(data, seed=5)
    head = batches(sampler, stop_after)  # stops right after batch `stop_after` (3, 6, 9: ends)
    resumed = ResumableSampler(data)
    resumed.load_state_dict(sampler.state_dict())
    assert head + batches(resumed, None) == reference
