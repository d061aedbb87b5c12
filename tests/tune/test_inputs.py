"""Timing inputs: deterministic, right dtypes and shapes, independent sets, never zeros."""

from __future__ import annotations

import pytest
import torch

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.tune.inputs import make_input_sets, make_inputs, resolve_dims, rotation_count

from tune_helpers import add_region


def mixed_region() -> RegionSummary:
    return RegionSummary(
        name="mixed",
        family="elementwise",
        inputs=(
            TensorSpec(("B", 3), "bfloat16"),
            TensorSpec((5,), "float8_e4m3fn"),
            TensorSpec(("B",), "int64"),
            TensorSpec((2, 2), "bool"),
        ),
        outputs=(TensorSpec(("B", 3), "bfloat16"),),
        example_dims={"B": 7},
    )


def test_dtypes_and_shapes():
    region = mixed_region()
    tensors = make_inputs(region, resolve_dims(region))
    assert [t.dtype for t in tensors] == [torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool]
    assert [tuple(t.shape) for t in tensors] == [(7, 3), (5,), (7,), (2, 2)]


def test_deterministic_and_not_zero():
    region = add_region()
    first = make_inputs(region, {"B": 4}, seed=3)
    again = make_inputs(region, {"B": 4}, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(t.abs().sum() > 0 for t in first)
    assert not torch.equal(first[0], first[1])  # inputs within a set differ too


def test_sets_are_independent():
    sets = make_input_sets(add_region(), {"B": 4}, 3)
    assert len(sets) == 3
    assert not torch.equal(sets[0][0], sets[1][0])
    assert not torch.equal(sets[1][0], sets[2][0])


def test_resolve_dims():
    region = add_region()
    assert resolve_dims(region) == {"B": 4}
    assert resolve_dims(region, {"B": 9}) == {"B": 9}
    with pytest.raises(ValueError, match="no value for symbolic dims"):
        resolve_dims(RegionSummary("r", "elementwise", (TensorSpec(("S",), "float32"),), ()))


def test_expression_dims():
    region = RegionSummary(
        "r", "elementwise", (TensorSpec(("s0", "4*s0"), "float32"),), (TensorSpec(("s0", "4*s0"), "float32"),),
        example_dims={"s0": 3},
    )
    dims = resolve_dims(region)
    assert dims == {"s0": 3}
    assert tuple(make_inputs(region, dims)[0].shape) == (3, 12)
    with pytest.raises(ValueError, match=r"\['s1'\]"):
        resolve_dims(RegionSummary("r", "elementwise", (TensorSpec(("2*s1",), "float32"),), ()))


def test_rotation_count_bounded_by_budget():
    assert rotation_count(add_region(), {"B": 4}) == 4
    huge = {"B": 2**22}  # 2 inputs x 4 Mi x 64 x 4 B = 2 GiB a set
    assert rotation_count(add_region(), huge) == 1


def test_lengths_inputs_get_the_planned_length():
    from coopt.ir.region import RegionSummary, TensorSpec
    from coopt.tune.inputs import make_inputs

    kv = TensorSpec((2, 2, 64, 16), "float32")
    region = RegionSummary("d", "decode_attention", (TensorSpec((2, 4, 1, 16), "float32"), kv, kv, TensorSpec((2,), "int32")),
                           (TensorSpec((2, 4, 1, 16), "float32"),), attrs={"lengths_input": 3, "lengths_bound": [1, 2]})
    assert make_inputs(region, {})[3].tolist() == [64, 64]
    planned = RegionSummary(**{**region.__dict__, "attrs": {**region.attrs, "example_length": 40}})
    assert make_inputs(planned, {})[3].tolist() == [40, 40]
    # an input holding positions (attrs lengths_offset: fuse-attention's lengths_add) is timed at
    # the same planned length: the kernel adds the offset back
    positions = RegionSummary(**{**planned.__dict__, "attrs": {**planned.attrs, "lengths_offset": 1}})
    assert make_inputs(positions, {})[3].tolist() == [39, 39]


def test_index_inputs_are_rows_of_their_table():
    """embedding_rows' token ids: spread over the whole table (not the 8 rows random small
    integers would read, all of them L2-resident), and every one a row of it."""
    region = RegionSummary("r", "embedding_rows",
                           inputs=(TensorSpec((1000, 64), "bfloat16"), TensorSpec(("s0", 1), "int64"), TensorSpec((64,), "bfloat16")),
                           outputs=(TensorSpec(("s0", 1, 64), "bfloat16"),),
                           attrs={"index_input": 1, "index_bound": [0, 0]})
    ids = make_inputs(region, {"s0": 256})[1]
    assert ids.shape == (256, 1) and ids.dtype == torch.int64
    assert 0 <= int(ids.min()) and int(ids.max()) < 1000 and int(ids.max()) >= 8
