"""Strategies and profiles: dims stay in (capped) ranges, edges come first, inputs are
deterministic."""

from __future__ import annotations

import doctest

import pytest
import torch
from hypothesis import given, settings
from verify_helpers import matrix_region, vector_region

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.verify import profiles, strategies
from coopt.verify.profiles import PROFILES, resolve_profile
from coopt.verify.strategies import (
    Example, anchor_examples, edge_values, examples, fit_dims, make_inputs,
)

CI = PROFILES["ci"]
THOROUGH = PROFILES["thorough"]


def test_docstring_examples():
    assert doctest.testmod(strategies).failed == 0
    assert doctest.testmod(profiles).failed == 0


def test_edge_values_start_at_the_minimum_and_include_odd_and_maximum():
    edges = edge_values(2, 48, 40)
    assert edges[0] == 2
    assert {3, 7, 17, 31, 33, 40, 47, 48} <= set(edges)
    assert all(2 <= e <= 48 for e in edges)
    assert edge_values(5, 5) == [5]


@settings(max_examples=150, database=None)
@given(examples(matrix_region(), CI))
def test_ci_profile_caps_every_symbolic_dim(example):
    dims = example.dim_values()
    assert set(dims) == {"rows", "cols"}
    assert all(1 <= v <= CI.dim_cap for v in dims.values())
    assert example.magnitude in strategies.MAGNITUDES


@settings(max_examples=100, database=None)
@given(examples(matrix_region(), THOROUGH))
def test_thorough_profile_uses_the_real_range(example):
    assert all(1 <= v <= 512 for v in example.dim_values().values())


def test_static_dims_are_never_drawn():
    spec = TensorSpec(("batch", 4096), "bfloat16")
    region = RegionSummary("r", "elementwise", (spec,), (spec,), dims={"batch": (1, 64)})
    example = Example((("batch", 3),), 0, 1.0)
    (x,) = make_inputs(region, example)
    assert x.shape == (3, 4096) and x.dtype == torch.bfloat16


def test_element_budget_halves_the_largest_symbolic_dim():
    spec = TensorSpec(("batch", "seq", 256), "float32")
    region = RegionSummary("r", "elementwise", (spec,), (spec,),
                           dims={"batch": (1, 48), "seq": (1, 48)})
    dims = fit_dims(region, {"batch": 48, "seq": 48}, CI)
    assert dims["batch"] * dims["seq"] * 256 <= CI.max_elements


def test_causal_attention_never_has_more_queries_than_keys():
    q = TensorSpec(("b", 4, "sq", 16), "float32")
    kv = TensorSpec(("b", 4, "sk", 16), "float32")
    region = RegionSummary("a", "attention", (q, kv, kv), (q,),
                           attrs={"causal": True, "scale": 0.25, "num_heads": 4,
                                  "num_kv_heads": 4},
                           dims={"b": (1, 4), "sq": (1, 64), "sk": (1, 64)})
    dims = fit_dims(region, {"b": 1, "sq": 30, "sk": 5}, CI)
    assert dims["sq"] <= dims["sk"]


def test_anchor_examples_cover_example_dims_each_minimum_and_the_maximum():
    anchors = anchor_examples(matrix_region(), THOROUGH, seed=5)
    assert [a.dim_values() for a in anchors] == [
        {"rows": 8, "cols": 32}, {"rows": 1, "cols": 32}, {"rows": 8, "cols": 1},
        {"rows": 512, "cols": 512}]
    assert {(a.seed, a.magnitude) for a in anchors} == {(5, 1.0)}
    capped = anchor_examples(vector_region(hi=4096), CI, seed=5)
    assert [a.dim_values()["n"] for a in capped] == [48, 1]  # example 64 capped to 48


def test_inputs_are_a_function_of_the_example_only():
    region = vector_region()
    example = Example((("n", 17),), seed=123, magnitude=30.0)
    first, second = make_inputs(region, example), make_inputs(region, example)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    other = make_inputs(region, Example((("n", 17),), seed=124, magnitude=30.0))
    assert not torch.equal(first[0], other[0])
    assert 5 < float(first[0].abs().max()) < 200  # magnitude 30


def test_fp8_inputs_are_clamped_not_nan_and_int_inputs_are_small():
    specs = (TensorSpec(("n",), "float8_e4m3fn"), TensorSpec(("n",), "int64"))
    region = RegionSummary("q", "elementwise", specs, (specs[0],), dims={"n": (1, 64)})
    fp8, ints = make_inputs(region, Example((("n", 64),), seed=0, magnitude=1e3))
    assert not torch.isnan(fp8.float()).any()
    assert ints.dtype == torch.int64 and 0 <= int(ints.min()) and int(ints.max()) < 8


def test_profile_is_chosen_by_argument_then_environment(monkeypatch):
    monkeypatch.delenv(profiles.ENV_VAR, raising=False)
    assert resolve_profile().name == "ci"
    monkeypatch.setenv(profiles.ENV_VAR, "thorough")
    assert resolve_profile().name == "thorough"
    assert resolve_profile("ci").name == "ci"
    with pytest.raises(ValueError, match="unknown verify profile"):
        resolve_profile("fast")


def test_profiles_are_registered_without_replacing_hypothesis_ci_profile():
    assert settings.get_profile("coopt-ci").max_examples == CI.max_examples
    assert settings.get_profile("coopt-thorough").max_examples == THOROUGH.max_examples
    assert settings.get_profile("coopt-ci").database is None
    assert settings.get_profile("ci") is not settings.get_profile("coopt-ci")


# -- an fp8 KV cache: fp8 values filling e4m3's range, positive scales -----------------------

def fp8_decode_region(granularity: str) -> RegionSummary:
    q = TensorSpec(("B", 4, 1, 16), "bfloat16")
    cache = TensorSpec(("B", 2, "S", 16), "float8_e4m3fn")
    shape = {"per-tensor": (1,), "per-head": (2,), "per-token": ("B", 2, "S")}[granularity]
    scale = TensorSpec(shape, "float32")
    return RegionSummary(
        "attn0", "decode_attention", (q, cache, cache, TensorSpec(("B",), "int32"), scale, scale), (q,),
        attrs={"scale": 0.25, "num_heads": 4, "num_kv_heads": 2, "lengths_input": 3, "lengths_bound": [1, 2],
               "kv_scale": granularity},
        dims={"B": (1, 4), "S": (1, 4096)}, example_dims={"B": 2, "S": 40})


@pytest.mark.parametrize("granularity", ["per-tensor", "per-head", "per-token"])
def test_fp8_caches_fill_the_range_and_scales_are_positive(granularity):
    region = fp8_decode_region(granularity)
    assert strategies.scale_inputs(region) == (4, 5)
    zero_heads = 0
    for seed in range(16):
        magnitude = strategies.MAGNITUDES[seed % 4]
        q, k, v, lengths, k_scale, v_scale = make_inputs(region, Example((("B", 3), ("S", 40)), seed, magnitude))
        for cache in (k, v):
            values = cache.float()
            assert cache.dtype == torch.float8_e4m3fn and not torch.isnan(values).any()
            assert float(values.max()) == 448.0 and float(values.min()) == -448.0  # outliers at the limits
            assert float(values.abs().median()) > 16  # the range is used, whatever the magnitude
            zero_heads += int((values.abs().amax(dim=(2, 3)) == 0).any())
        for scale in (k_scale, v_scale):
            assert scale.dtype == torch.float32 and scale.shape == region.inputs[4].concrete({"B": 3, "S": 40})
            # positive, dequantized values of the example's magnitude (within a factor of two)
            assert bool((scale > 0).all())
            assert magnitude / 2 <= float(scale.min()) * 112 and float(scale.max()) * 112 <= magnitude * 2
        assert 1 <= int(lengths.min()) and int(lengths.max()) <= 40
    assert 4 <= zero_heads <= 28  # an all-zero (sequence, kv head) in about half the caches


def test_scale_inputs_of_a_quantizing_kv_write_and_of_plain_regions():
    plain = RegionSummary("a", "decode_attention", (), (), {"lengths_input": 3})
    assert strategies.scale_inputs(plain) == ()
    write = RegionSummary("w", "kv_write", (), (), {"rope": False, "quant": "per-head", "inplace": [0, 1]})
    assert strategies.scale_inputs(write) == (5, 6)
    assert strategies.scale_inputs(RegionSummary("w", "kv_write", (), (), {"rope": True, "quant": "none"})) == ()


def test_fp8_inputs_are_deterministic_and_other_inputs_unchanged():
    region = fp8_decode_region("per-token")
    example = Example((("B", 2), ("S", 33)), seed=5, magnitude=30.0)
    first, second = make_inputs(region, example), make_inputs(region, example)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(first, second))
    # q is drawn first, exactly as for a bf16 cache
    bf16 = RegionSummary(region.name, region.family, (region.inputs[0], *(TensorSpec(s.shape, "bfloat16")
                         for s in region.inputs[1:3]), region.inputs[3]), region.outputs,
                         {k: v for k, v in region.attrs.items() if k != "kv_scale"}, region.dims)
    assert torch.equal(make_inputs(bf16, example)[0], first[0])


@pytest.mark.parametrize("per_row,pages,tokens", [(True, 6, 1), (False, 10, 2)], ids=["ragged-step", "prompt"])
def test_paged_writes_get_pages_of_their_own_in_a_small_pool(per_row, pages, tokens):
    """A pool smaller than 4 rows x 4 table slots: valid_page_table repeats pages across columns
    (row 2's slot j and row 0's slot j + 1 of a 6-page pool); the entries a paged kv_write
    writes through still name distinct pages."""
    pool = TensorSpec((pages, 2, 16, 8), "float32")
    row = TensorSpec((4, 2, tokens, 8), "float32")
    inputs = [pool, pool, TensorSpec((4 if per_row else tokens,), "int64"), row, row, TensorSpec((4, 4), "int32")]
    attrs = {"rope": False, "quant": "none", "inplace": [0, 1], "page_size": 16, "page_table_input": 5,
             "pool_input": 0, "index_input": 2, "index_bound": [5, 1]}
    if per_row:
        attrs["positions"] = "per-row"
    region = RegionSummary("kv", "kv_write", tuple(inputs), (pool, pool), attrs)
    for seed in range(12):
        tensors = strategies.make_inputs(region, Example((), seed, 1.0))
        positions, table = tensors[2], tensors[5]
        assert table.min() >= 0 and table.max() < pages and positions.min() >= 0 and positions.max() < 64
        columns = (positions // 16).tolist()
        written = [int(table[b, c]) for b, c in (enumerate(columns) if per_row else
                                                 {(b, c) for b in range(4) for c in columns})]
        assert len(written) == len(set(written)), (seed, table.tolist(), positions.tolist())


def test_rotary_tables_are_cos_and_sin_of_one_angle_at_every_magnitude():
    """A decode attention's rotary tables (the query's and a folded write's K tables) stay on the
    unit circle whatever the example's magnitude; the data around them scale with it."""
    q = TensorSpec((1, 4, 1, 16), "float32")
    cache = TensorSpec((1, 2, 32, 16), "float32")
    table, row = TensorSpec((1, 16), "float32"), TensorSpec((1, 2, 1, 16), "float32")
    pos = TensorSpec((1,), "int64")
    region = RegionSummary("r", "decode_attention", (q, cache, cache, pos, table, table, pos, row, row, table, table),
                           (cache, cache, q), {"rope": True, "lengths_input": 3, "lengths_bound": [1, 2],
                           "kv_write": {"positions_input": 6, "rope": True, "rope_tables_input": 9}})
    assert strategies.rotary_tables(region) == (4, 9)
    for magnitude in strategies.MAGNITUDES:
        inputs = make_inputs(region, Example((), seed=3, magnitude=magnitude))
        for cos, sin in ((inputs[4], inputs[5]), (inputs[9], inputs[10])):
            torch.testing.assert_close(cos ** 2 + sin ** 2, torch.ones_like(cos))
            assert float(sin.abs().max()) > 0.5  # drawn, not a constant
        assert not torch.equal(inputs[4], inputs[9])  # each pair its own angles
        assert float(inputs[0].abs().max()) > magnitude  # q: N(0, 1) * magnitude as before
    unroped = RegionSummary("r", "decode_attention", (), (), {"lengths_input": 3})
    assert strategies.rotary_tables(unroped) == ()


# -- norm statistics (fuse-norm-statistics): chunk sums of squares are positive -------------------

def test_sums_of_squares_of_a_statistics_norm_are_positive():
    region = RegionSummary(
        "qkv", "matmul_epilogue",
        (TensorSpec(("B", 256), "bfloat16"), TensorSpec((96, 256), "bfloat16"), TensorSpec((4, "B"), "float32")),
        (TensorSpec(("B", 96), "bfloat16"),),
        attrs={"b_layout": "nk", "has_bias": False, "epilogue": [], "outputs": ["acc"],
               "prologue": {"kind": "rms_norm_stats", "eps": 1e-5, "squares_input": 2}},
        dims={"B": (1, 32)})
    assert strategies.squares_input(region) == 2
    for seed, magnitude in ((0, 1.0), (1, 1e-3), (2, 30.0), (3, 1e3)):
        hg, _, sq = make_inputs(region, Example((("B", 5),), seed, magnitude))
        assert sq.shape == (4, 5) and (sq > 0).all()
        # rows of the example's magnitude: each chunk of 64 columns sums ~64 * magnitude^2
        per_element = sq / 64 / magnitude**2
        assert per_element.min() >= 0.5 and per_element.max() <= 2.0
        assert (hg < 0).any()  # the activation stays a normal draw
