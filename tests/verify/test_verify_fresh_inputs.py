"""The end-to-end check's fresh integer inputs keep what the example's values promise: distinct
stay distinct, ascending stay ascending. A prompt's positions drawn with repeats made the Llama
prefill's cache write an index_put with duplicate indices, whose winner a GPU leaves undefined:
eager, its float64 copy and the build each kept another row (session 51, H100: the fp8 prefill's
kernels all fell back on noise)."""

from __future__ import annotations

import torch

from coopt.verify.end_to_end import _fresh_like


def draws(example, sizes=None, count=20):
    return [_fresh_like(example, sizes, torch.Generator().manual_seed(seed)) for seed in range(count)]


def test_a_prompts_positions_stay_a_range():
    example = torch.arange(16)
    for positions in draws(example):
        assert torch.equal(positions, example)


def test_distinct_ascending_values_are_drawn_distinct_and_ascending_in_their_range():
    example = torch.tensor([3, 9, 20], dtype=torch.int32)
    seen = set()
    for values in draws(example):
        assert values.dtype == torch.int32 and values.shape == (3,)
        assert bool((values[1:] > values[:-1]).all()) and 3 <= int(values.min()) and int(values.max()) <= 20
        seen.add(tuple(values.tolist()))
    assert len(seen) > 5  # still random draws, not the example again


def test_distinct_unordered_values_stay_distinct_but_not_sorted():
    example = torch.tensor([7, 2, 5, 0])
    results = draws(example)
    assert all(int(v.unique().numel()) == 4 for v in results)
    assert any(not bool((v[1:] > v[:-1]).all()) for v in results)


def test_a_larger_dynamic_size_widens_the_range_upwards():
    for positions in draws(torch.arange(4, 8), {0: 10}):
        assert positions.shape == (10,) and torch.equal(positions, torch.arange(4, 14))


def test_values_with_repeats_may_repeat():
    example = torch.tensor([[5, 5, 1, 2, 3, 4]])
    assert any(int(v.unique().numel()) < v.numel() for v in draws(example))
    assert all(1 <= int(v.min()) and int(v.max()) <= 5 for v in draws(example))
