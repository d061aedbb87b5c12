"""The comparison rule of coopt/verify/tolerances.py, one clause per test."""

from __future__ import annotations

import doctest

import pytest
import torch

from coopt.verify import tolerances
from coopt.verify.tolerances import compare


def test_module_docstring_examples():
    assert doctest.testmod(tolerances).failed == 0


def test_exact_match_passes():
    x = torch.randn(5, 7)
    verdict = compare(x, x.double(), x, dtype="float32")
    assert verdict.ok and verdict.max_abs_err == 0.0


@pytest.mark.parametrize("candidate, expected", [
    (torch.zeros(3, dtype=torch.float16), "dtype float16, expected float32"),
    (torch.zeros(4), "shape (4,), expected (3,)"),
    ("not a tensor", "expected a tensor, got str"),
])
def test_dtype_shape_and_type_mismatch_fail(candidate, expected):
    verdict = compare(candidate, torch.zeros(3, dtype=torch.float64), None, dtype="float32")
    assert not verdict.ok and verdict.reason == expected


def test_atol_scales_with_output_magnitude():
    # Values around 1e6: an absolute error of 1 on an element near zero is 1e-6 of S.
    hi = torch.tensor([1e6, -2e6, 0.5], dtype=torch.float64)
    candidate = torch.tensor([1e6, -2e6, 1.5], dtype=torch.float32)
    assert compare(candidate, hi, None, dtype="float32").ok
    # The same absolute error on an output of magnitude 1 fails.
    small = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    assert not compare(torch.tensor([1.0, -2.0, 1.5]), small, None, dtype="float32").ok


def test_relative_error_on_large_elements_is_bounded_by_rtol():
    hi = torch.tensor([1e6, 1.0], dtype=torch.float64)
    off = torch.tensor([1e6 * (1 + 1e-3), 1.0], dtype=torch.float32)
    verdict = compare(off, hi, None, dtype="float32")
    assert not verdict.ok
    assert verdict.max_rel_err == pytest.approx(1e-3, rel=1e-3)


def test_nan_where_reference_is_finite_fails_whatever_the_tolerance():
    hi = torch.tensor([1.0, 2.0], dtype=torch.float64)
    verdict = compare(torch.tensor([1.0, float("nan")]), hi, hi.float(), dtype="float32")
    assert not verdict.ok and "non-finite mismatch" in verdict.reason


def test_nan_where_reference_is_nan_passes():
    hi = torch.tensor([1.0, float("nan")], dtype=torch.float64)
    assert compare(torch.tensor([1.0, float("nan")]), hi, None, dtype="float32").ok


def test_overflow_of_the_output_dtype_is_expected_inf():
    hi = torch.tensor([1e39, 1.0], dtype=torch.float64)  # beyond fp32's range
    assert compare(torch.tensor([float("inf"), 1.0]), hi, None, dtype="float32").ok
    assert not compare(torch.tensor([float("-inf"), 1.0]), hi, None, dtype="float32").ok


def test_candidate_may_reproduce_eager_non_finite_values():
    # fp64 says finite, eager fp16 overflowed to inf inside the computation; a kernel that
    # does the same is not penalised for NaN/inf classes (its finite values are still judged).
    hi = torch.tensor([3.0, 1.0], dtype=torch.float64)
    native = torch.tensor([float("inf"), 1.0], dtype=torch.float16)
    assert compare(native.clone(), hi, native, dtype="float16").ok


def test_bf16_is_judged_against_what_eager_bf16_achieves():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = torch.randn(4096, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def f(a, b):
        return torch.tanh(a) * b + a * a

    hi, native = f(x.double(), y.double()), f(x, y)
    assert compare(native.clone(), hi, native, dtype="bfloat16").ok
    assert not compare((native.float() * 1.1).to(torch.bfloat16), hi, native,
                       dtype="bfloat16").ok


def test_native_test_rescues_what_the_floor_rejects():
    hi = torch.linspace(-1, 1, 101, dtype=torch.float64)
    native = (hi + 0.05).to(torch.bfloat16)  # eager itself is 0.05 off
    as_bad_as_eager = (hi - 0.1).to(torch.bfloat16)  # 2x eager's error: allowed
    far_worse = (hi + 0.3).to(torch.bfloat16)  # 6x: not allowed
    assert compare(as_bad_as_eager, hi, native, dtype="bfloat16").ok
    verdict = compare(far_worse, hi, native, dtype="bfloat16")
    assert not verdict.ok and "4x eager bfloat16 error" in verdict.reason


def test_eager_one_ulp_away_rescues_an_ill_conditioned_fp32_output():
    # eager exact on the drawn inputs by luck (native error 0), but one input ulp away it is
    # 3e-4 off: a kernel 2e-4 off is as right as fp32 allows there, one 2e-3 off is not
    hi = torch.linspace(-1, 1, 101, dtype=torch.float64)
    native = hi.float()
    near = (hi + 3e-4).float()
    kernel = (hi + 2e-4).float()
    assert not compare(kernel, hi, native, dtype="float32").ok  # the floor alone: 1e-5 of S
    assert compare(kernel, hi, native, dtype="float32", ref_near=near).ok
    verdict = compare((hi + 2e-3).float(), hi, native, dtype="float32", ref_near=near)
    assert not verdict.ok and "4x eager float32 error 0.0003" in verdict.reason


def test_eager_one_bf16_ulp_away_counts_only_where_it_misses_the_floor():
    # bf16 floor: 8e-3 * S + 1.6e-2 * |ref| (S = 1 here): a kernel 3 % off misses it
    hi = torch.ones(4, dtype=torch.float64)
    native = hi.to(torch.bfloat16)
    kernel = (hi * 1.03).to(torch.bfloat16)
    assert not compare(kernel, hi, native, dtype="bfloat16").ok
    # eager one ulp away 1 % off meets the floor: a well-conditioned example, no slack (counted,
    # 4x its error would pass the kernel)
    within = (hi * 1.01).to(torch.bfloat16)
    verdict = compare(kernel, hi, native, dtype="bfloat16", ref_near_low=(within, within))
    assert not verdict.ok and "exceeds the bfloat16 floor" in verdict.reason
    # one draw 30 % off (a near tie flipped): ill-conditioned, 4x that error bounds the kernel
    flipped = (hi * 1.3).to(torch.bfloat16)
    assert compare(kernel, hi, native, dtype="bfloat16", ref_near_low=(within, flipped)).ok
    assert not compare((hi * 3).to(torch.bfloat16), hi, native, dtype="bfloat16", ref_near_low=(flipped,)).ok


def test_integer_outputs_must_be_exact():
    hi = torch.tensor([1, 2, 3], dtype=torch.float64)
    assert compare(torch.tensor([1, 2, 3]), hi, None, dtype="int64").ok
    verdict = compare(torch.tensor([1, 2, 4]), hi, None, dtype="int64")
    assert not verdict.ok and "first at (2,)" in verdict.reason


def test_every_region_dtype_has_a_tolerance():
    for name in ("float32", "bfloat16", "float16", "float8_e4m3fn"):
        tol = tolerances.tolerance_for(name)
        assert 0 < tol.atol < 1 and 0 < tol.rtol < 1


def test_saturating_fp8_cast_is_correct():
    hi = torch.tensor([1000.0, 3.3, -0.01], dtype=torch.float64)  # 1000 > e4m3fn's 448
    saturated = hi.to(torch.float8_e4m3fn)
    assert float(saturated[0]) == 448.0
    assert compare(saturated, hi, None, dtype="float8_e4m3fn").ok


def test_family_slack_widens_only_the_floor():
    """Attention's slack admits 8x the fp32 floor, not an arbitrary error."""
    import torch

    from coopt.verify.tolerances import FAMILY_SLACK, compare

    hi = torch.full((4,), 100.0, dtype=torch.float64)
    off = (hi + 100.0 * 4e-5).float()  # 4x the fp32 floor at S=100
    assert not compare(off, hi, None, dtype="float32").ok
    assert compare(off, hi, None, dtype="float32", slack=FAMILY_SLACK["attention"]).ok
    far = (hi + 100.0 * 1e-3).float()
    assert not compare(far, hi, None, dtype="float32", slack=FAMILY_SLACK["attention"]).ok


# -- a region reading an fp8 cache is judged at its output's (q's) dtype ----------------------

FP8_DECODE_REFERENCE = """
    import torch

    def run(q, k_cache, v_cache, lengths, k_scale, v_scale):
        # as codegen writes it: dequantize (k.float() * s) in q's dtype, then SDPA
        k = (k_cache.float() * k_scale.view(1, -1, 1, 1)).to(q.dtype)
        v = (v_cache.float() * v_scale.view(1, -1, 1, 1)).to(q.dtype)
        group = q.shape[1] // k.shape[1]
        visible = torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None]
        return (torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
            attn_mask=visible[:, None, None, :], scale=0.25),)
"""


def fp8_decode_region():
    from coopt.ir.region import RegionSummary, TensorSpec

    q = TensorSpec(("B", 4, 1, 16), "bfloat16")
    cache = TensorSpec(("B", 2, "S", 16), "float8_e4m3fn")
    scale = TensorSpec((2,), "float32")
    return RegionSummary(
        "attn0", "decode_attention", (q, cache, cache, TensorSpec(("B",), "int32"), scale, scale), (q,),
        attrs={"scale": 0.25, "num_heads": 4, "num_kv_heads": 2, "lengths_input": 3, "lengths_bound": [1, 2],
               "kv_scale": "per-head"},
        dims={"B": (1, 3), "S": (1, 4096)}, example_dims={"B": 2, "S": 40})


def test_fp8_cache_regions_are_judged_at_the_output_dtype(tmp_path):
    """A 4% error passes fp8's floor (6.25e-2) but not bf16's: the output's dtype decides."""
    from verify_helpers import write_module

    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.verify.check import check_example
    from coopt.verify.strategies import Example

    region = fp8_decode_region()
    reference = load_module_from_file(write_module(tmp_path, "ref", FP8_DECODE_REFERENCE))
    off = load_module_from_file(write_module(tmp_path, "off", FP8_DECODE_REFERENCE.replace(
        "scale=0.25),)", "scale=0.25) * 1.04,)")))
    example = Example((("B", 2), ("S", 40)), seed=0, magnitude=1.0)
    assert check_example(region, reference, reference, example, "cpu").ok
    outcome = check_example(region, reference, off, example, "cpu")
    assert not outcome.ok and "bfloat16 floor" in outcome.failure


def test_fp8_decode_kernel_verifies_and_one_ignoring_the_v_scale_fails(tmp_path):
    from verify_helpers import write_module

    from coopt.templates.decode_attention import DecodeAttentionFamily
    from coopt.verify.runner import verify_candidate

    region = fp8_decode_region()
    reference = write_module(tmp_path, "attn0__reference", FP8_DECODE_REFERENCE)
    params = {"BLOCK_N": 16, "SPLIT_KV": 2, "USE_DOT": True, "num_warps": 2, "num_stages": 2}
    source = DecodeAttentionFamily().render(region, params)
    good = tmp_path / "attn0__c0.py"
    good.write_text(source)
    result = verify_candidate(region, reference, good, profile="ci", seed=1, device="cpu")
    assert result.ok, result.failure
    signature = "def run(q, k_cache, v_cache, lengths, k_scale, v_scale):"
    bad = tmp_path / "attn0__c1.py"
    bad.write_text(source.replace(signature, signature + "\n    v_scale = torch.ones_like(v_scale)"))
    assert not verify_candidate(region, reference, bad, profile="ci", seed=1, device="cpu").ok
