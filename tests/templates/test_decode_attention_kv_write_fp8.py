"""decode_attention with an fp8 cache's write folded in (fuse-kv-write-attention over
fp8-kv-cache's per-tensor / per-head scales): the kernel quantizes the step's K / V row as the
kv_write template does (the rope's result rounded to k_new's dtype, less the smooth-k / smooth-v
offset, over the attention's own scale, rounded to e4m3 nearest-even, saturating at +-448),
stores it at the position, leaves every other row alone, and attends to the stored e4m3 row as to
any cached one. Values-only caches (K in q's dtype) store K unquantized."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decode_attention import (DEVICE, E4M3_MAX, FAMILY, FP8_DOT, FP8_FMA, check_close, fp8_reference, fp8_region,
                                   make_fp8_inputs, run_candidate)
from test_decode_attention_kv_write import folded, write_inputs
from test_decode_attention_rope import rope_tables, rotated, with_rope

from coopt.ir.region import TensorSpec
from coopt.targets import H200

POSITION, LENGTHS = 45, [46, 17, 46]  # the new row the last key of sequences 0 and 2, past sequence 1's
OFFSETS = {"none": (), "smooth-k and smooth-v": ("k", "v"), "smooth-v": ("v",)}


def fp8_folded(granularity: str, offsets=(), dtype="bfloat16", values_only=False):
    base = with_rope(fp8_region(3, 8, 2, 80, 64, granularity, dtype), (1, 64))
    if values_only:  # K kept in q's dtype beside fp8 V
        base = dataclasses.replace(base, inputs=(base.inputs[0], TensorSpec(base.inputs[1].shape, dtype), *base.inputs[2:]))
    return base, folded(base, offsets=offsets)


def quantized(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8-kv-cache's quantization of rows [B, Hkv, D] with per-kv-head (or one) scale."""
    return (x.float() / scale.float().reshape(1, -1, 1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def run_folded(granularity, params, offsets=(), dtype="bfloat16", values_only=False, seed=0, stem="candidate",
               load_candidate=None):
    """Run the folded kernel; return (k_out, v_out, out) and what each should be."""
    base, region = fp8_folded(granularity, offsets, dtype, values_only)
    torch_dtype = getattr(torch, dtype)
    q, k, v, lengths, k_scale, v_scale = make_fp8_inputs(fp8_region(3, 8, 2, 80, 64, granularity, dtype), LENGTHS, seed=seed)
    if values_only:
        k, k_scale = torch.randn(k.shape, generator=torch.Generator().manual_seed(seed)).to(torch_dtype).to(DEVICE), torch.ones_like(k_scale)
    cos, sin = rope_tables((1, 64), torch_dtype)
    k_cos, k_sin = rope_tables((1, 64), torch_dtype, seed=2)
    k_new, v_new = write_inputs(3, 2, 64, torch_dtype, seed=seed + 5)
    k_new[0, 1, 0, 3] = 1e4 * k_scale.max()  # far past e4m3's range: stored saturated (v's too)
    v_new[2, 0, 0, :5] = -1e4 * v_scale.max()
    v_new[1, 1] = 0.0  # an all-zero head row: zeros
    gen = torch.Generator().manual_seed(seed + 9)
    centres = {name: torch.randn(1, 2, 1, 64, generator=gen).to(DEVICE) for name in offsets}
    # the expected caches: the rope in fp32, rounded to k_new's dtype, less the offset, quantized
    roped = rotated(k_new.float(), k_cos.float(), k_sin.float())[:, :, 0]
    k_rows = [roped.to(torch_dtype).float(), truncated(roped, torch_dtype)]
    v_row = v_new[:, :, 0].float() - (centres["v"][:, :, 0] if "v" in centres else 0.0)
    k_rows = [row - (centres["k"][:, :, 0] if "k" in centres else 0.0) for row in k_rows]
    k_expected, v_expected = k.clone(), v.clone()
    v_expected[:, :, POSITION] = quantized(v_row, v_scale).to(DEVICE)
    inputs = [q, k.clone(), v.clone(), lengths, cos, sin, k_scale, v_scale, torch.tensor([POSITION], device=DEVICE),
              k_new, v_new, k_cos, k_sin, *centres.values()]
    k_out, v_out, out = run_candidate(load_candidate, region, params, inputs, stem=stem)
    # the new K row as rounded to nearest (the GPU) or, Triton's interpreter, truncated
    # (/work/shared/TRITON-INTERPRETER.md: with an offset taken off, that bf16 ulp can be
    # several e4m3 steps), element by element
    stored = [row.to(k.dtype) if values_only else quantized(row, k_scale).to(DEVICE) for row in k_rows]
    new_row = k_out[:, :, POSITION].float()
    assert ((new_row == stored[0].float()) | (new_row == stored[1].float())).all()
    k_expected[:, :, POSITION] = k_out[:, :, POSITION]
    expected_out = fp8_reference(base, rotated(q, cos, sin), k_expected, v_expected, lengths, k_scale, v_scale)
    return (k_out, v_out, out), (k_expected, v_expected, expected_out.to(out.dtype) if dtype == "float32" else expected_out)


def truncated(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `x` rounded toward zero to bf16 (as Triton's interpreter converts); other dtypes as torch rounds."""
    if dtype != torch.bfloat16:
        return x.to(dtype).float()
    return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32)


def assert_rows(k_out, v_out, k_expected, v_expected):
    """Every row but the new one untouched; V's new row exactly as torch quantizes it (no rope:
    the same division), saturated where past e4m3's range. (K's new row: run_folded.)"""
    assert torch.equal(k_out.float(), k_expected.float())
    assert torch.equal(v_out.float(), v_expected.float())
    assert v_out.dtype == torch.float8_e4m3fn and v_out[:, :, POSITION].float().abs().max() == E4M3_MAX


@pytest.mark.parametrize("offsets", OFFSETS)
@pytest.mark.parametrize("params", [FP8_FMA, FP8_DOT], ids=["one-split-fma", "four-splits-dot"])
@pytest.mark.parametrize("granularity", ["per-tensor", "per-head"])
def test_the_kernel_quantizes_writes_and_attends_to_the_row(granularity, params, offsets, load_candidate):
    (k_out, v_out, out), (k_expected, v_expected, expected) = run_folded(
        granularity, params, OFFSETS[offsets], load_candidate=load_candidate)
    assert_rows(k_out, v_out, k_expected, v_expected)
    # the outlier saturated (rotated: one of its two elements); the zero row zeros unless centred
    assert k_out[0, 1, POSITION].float().abs().max() == E4M3_MAX
    assert (v_out[1, 1, POSITION].float() == 0).all() != ("v" in OFFSETS[offsets])
    check_close(out, expected)


def test_values_only_stores_k_in_its_dtype(load_candidate):
    (k_out, v_out, out), (k_expected, v_expected, expected) = run_folded(
        "per-head", FP8_FMA, values_only=True, seed=1, load_candidate=load_candidate)
    assert k_out.dtype == torch.bfloat16
    assert_rows(k_out, v_out, k_expected, v_expected)
    check_close(out, expected)


@pytest.mark.parametrize("params", [{**FP8_DOT, "TILE_FP16": True}, {**FP8_DOT, "TILE_FP16": True, "V_WORDS": True}],
                         ids=["fp16-tiles", "v-words"])
def test_fp16_tiles(params, load_candidate):
    """The new row's score from the shifted fp16 query, as the tiles'; V read as words alike."""
    (k_out, v_out, out), (k_expected, v_expected, expected) = run_folded(
        "per-head", params, ("k",), seed=1, load_candidate=load_candidate)
    assert_rows(k_out, v_out, k_expected, v_expected)
    check_close(out, expected)


def test_fp32_queries(load_candidate):
    (k_out, v_out, out), (k_expected, v_expected, expected) = run_folded(
        "per-head", FP8_FMA, ("k",), dtype="float32", seed=2, load_candidate=load_candidate)
    assert_rows(k_out, v_out, k_expected, v_expected)
    check_close(out, expected)


def test_schema():
    base, region = fp8_folded("per-head", ("k", "v"))
    assert FAMILY.matches(region) and FAMILY.check(region, FP8_DOT, H200) is None
    source = FAMILY.render(region, FP8_DOT)
    assert "_quantize(k_new, k_scale)" in source and "_quantize(v_new, v_scale)" in source
    # per-token scales: the write computes and stores them (not this form)
    per_token = fp8_region(3, 8, 2, 80, 64, "per-token")
    assert not FAMILY.matches(folded(with_rope(per_token, (1, 64))))
    # k_new in q's dtype, offsets fp32 [1, Hkv, 1, D] and last, an offset only for an fp8 cache
    at = region.attrs["kv_write"]["positions_input"]
    wrong_new = (*region.inputs[:at + 1], TensorSpec(region.inputs[at + 1].shape, "float32"), *region.inputs[at + 2:])
    assert not FAMILY.matches(dataclasses.replace(region, inputs=wrong_new))
    wrong_offset = (*region.inputs[:-1], TensorSpec((1, 2, 1, 32), "float32"))
    assert not FAMILY.matches(dataclasses.replace(region, inputs=wrong_offset))
    _, values_only = fp8_folded("per-head", ("k",), values_only=True)
    assert not FAMILY.matches(values_only)
    swapped = {**region.attrs["kv_write"], "k_offset_input": region.attrs["kv_write"]["v_offset_input"],
               "v_offset_input": region.attrs["kv_write"]["k_offset_input"]}
    assert not FAMILY.matches(dataclasses.replace(region, attrs={**region.attrs, "kv_write": swapped}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_fp8_folded_kernels_compile_for_hopper(tmp_path):
    """Llama-3-8B's step over fp8 caches (32 heads over 8 kv heads, D 128), --kv-cache fp8's form
    (per-head, K centred) at the heuristic's fp16-tile point, with V read as words too, and
    values-only at a bf16-tile one: the quantizing write must not stop the K/V loads from
    pipelining, nor make the kernel spill."""
    from template_helpers import compile_for_hopper

    base = with_rope(fp8_region(2, 32, 8, "S", 128, "per-head", dims={"S": (1, 8192)}), (1, 128))
    q, k, v, lengths, k_scale, v_scale = make_fp8_inputs(fp8_region(2, 32, 8, 256, 128, "per-head"), [256, 100])
    cos, sin = rope_tables((1, 128), torch.bfloat16)
    k_new, v_new = write_inputs(2, 8, 128, torch.bfloat16)
    common = [q, k, v, lengths, cos, sin, k_scale, v_scale, torch.tensor([99], device=DEVICE), k_new, v_new, cos, sin]
    centred = folded(base, offsets=("k",))
    values_only = folded(dataclasses.replace(base, inputs=(base.inputs[0], TensorSpec(base.inputs[1].shape, "bfloat16"),
                                                           *base.inputs[2:])))
    fp16_tiles = {"BLOCK_N": 64, "SPLIT_KV": 16, "USE_DOT": True, "num_warps": 4, "num_stages": 3, "TILE_FP16": True}
    bf16_tiles = {"BLOCK_N": 64, "SPLIT_KV": 16, "USE_DOT": True, "num_warps": 4, "num_stages": 2}
    assert FAMILY.check(centred, fp16_tiles, H200) is None and FAMILY.check(values_only, bf16_tiles, H200) is None
    words = {**fp16_tiles, "V_WORDS": True}
    assert FAMILY.check(centred, words, H200) is None
    jobs = [("centred", FAMILY.render(centred, fp16_tiles), [*common, torch.zeros(1, 8, 1, 128)]),
            ("centred-v-words", FAMILY.render(centred, words), [*common, torch.zeros(1, 8, 1, 128)]),
            ("values-only", FAMILY.render(values_only, bf16_tiles), [q, k.to(torch.bfloat16), *common[2:]])]
    compiled = compile_for_hopper(jobs, tmp_path, machine_code=True)
    for label in ("centred", "centred-v-words", "values-only"):
        (kernel,) = compiled[label].values()
        assert kernel["pdl"] and kernel["pipelined"], label
        if kernel.get("spill_instructions") is not None:  # the SASS, where cuobjdump runs
            assert kernel["spill_instructions"] == 0, f"{label}: spills ({kernel['registers']} registers)"
    if compiled["centred-v-words"]["_decode_split_kernel"].get("loop_byte_shared_loads") is not None:
        assert compiled["centred-v-words"]["_decode_split_kernel"]["loop_byte_shared_loads"] == 0
