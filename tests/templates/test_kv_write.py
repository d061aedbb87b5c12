"""Template family "kv_write": the fused KV-cache write (rope on K, fp8 quantization) against a
torch reference that rounds to float8_e4m3fn correctly (torch's own cast), in place."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from template_helpers import on_test_device

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.targets import H200
from coopt.templates.kv_write import KvWriteFamily

FAMILY = KvWriteFamily()
FP8 = torch.float8_e4m3fn
SCALE_FLOOR = 1e-12


def region(b_max, heads, s_max, b, t, d, *, rope=False, quant="none", dtype="float32", headroom=None, k_offset=False,
           v_offset=False):
    cache_dtype = "float8_e4m3fn" if quant != "none" else dtype
    cache = TensorSpec((b_max, heads, s_max, d), cache_dtype)
    row = TensorSpec((b, heads, t, d), dtype)
    inputs = [cache, cache, TensorSpec((t,), "int64"), row, row]
    if rope:
        inputs += [TensorSpec((t, d), "float32")] * 2
    inplace = [0, 1]
    if quant in ("per-tensor", "per-head"):
        inputs += [TensorSpec((1,) if quant == "per-tensor" else (heads,), "float32")] * 2
    elif quant == "per-token":
        inputs += [TensorSpec((b_max, heads, s_max), "float32")] * 2
        inplace = [0, 1, len(inputs) - 2, len(inputs) - 1]
    attrs = {"rope": rope, "quant": quant, "inplace": inplace}
    # fp8-kv-cache's smooth-k / smooth-v: K / V less a per-(head, channel) offset before quantizing
    for knob, on in (("k_offset", k_offset), ("v_offset", v_offset)):
        if on:
            inputs.append(TensorSpec((1, heads, 1, d), "float32"))
            attrs[knob] = True
    if headroom is not None:
        attrs["headroom"] = headroom
    return RegionSummary("kv", "kv_write", tuple(inputs), tuple(inputs[i] for i in inplace), attrs)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    out = x.float() * cos + torch.cat((-x[..., half:], x[..., :half]), -1).float() * sin
    return out.to(x.dtype)


def quantize(x, scale, granularity):
    """coopt.quantize_fp8's semantics: clamp(x / s, -448, 448), round to nearest even (torch's cast)."""
    s = {"per-tensor": lambda: scale.view(1, 1, 1, 1), "per-head": lambda: scale.view(1, -1, 1, 1),
         "per-token": lambda: scale[..., None]}[granularity]()
    return (x.float() / s).clamp(-448, 448).to(FP8)


def reference(inputs, *, rope_on, quant, headroom=1.0, k_offset=False, v_offset=False):
    """What the unfused ops do: rope, (smooth-k / smooth-v: minus the offset, in fp32), quantize,
    index_put_ of the first B rows."""
    k_cache, v_cache, positions, k, v, *extra = [t.clone() for t in inputs]
    if rope_on:
        cos, sin, *extra = extra
        k = rope(k, cos, sin)
    if v_offset:
        *extra, offset = extra
        v = v.float() - offset
    if k_offset:
        *extra, offset = extra
        k = k.float() - offset
    written = [k_cache, v_cache]
    b = k.shape[0]
    if quant == "per-token":
        k_scale, v_scale = extra
        scales = []
        for x, buffer in ((k, k_scale), (v, v_scale)):
            s = x.float().abs().amax(-1).clamp_min(SCALE_FLOOR) * (headroom / 448)
            buffer[:b, :, positions] = s
            scales.append(s)
        k, v = quantize(k, scales[0], quant), quantize(v, scales[1], quant)
        written += [k_scale, v_scale]
    elif quant != "none":
        k, v = quantize(k, extra[0], quant), quantize(v, extra[1], quant)
    k_cache[:b, :, positions] = k
    v_cache[:b, :, positions] = v
    return written


def make_inputs(summary, positions, seed=0, magnitude=1.0):
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for i, spec in enumerate(summary.inputs):
        if i == 2:
            tensors.append(torch.tensor(positions, dtype=torch.int64))
            continue
        values = torch.randn(spec.shape, generator=generator) * magnitude
        if spec.dtype == "float8_e4m3fn":
            tensors.append(values.clamp(-448, 448).to(FP8))
        elif i in (5 + 2 * summary.attrs["rope"], 6 + 2 * summary.attrs["rope"]) \
                and summary.attrs["quant"] in ("per-tensor", "per-head"):
            tensors.append(values.abs() * 0.05 + 0.01)  # positive scales
        else:
            tensors.append(values.to(getattr(torch, spec.dtype)))
    return tensors


def check(load_candidate, summary, positions, params=None, seed=0, magnitude=1.0, strided=False):
    params = params or FAMILY.legal_points(summary, H200)[0]
    inputs = make_inputs(summary, positions, seed, magnitude)
    if strided:  # k and v as [B, T, H, D] projections viewed [B, H, T, D]
        inputs[3] = inputs[3].transpose(1, 2).contiguous().transpose(1, 2)
        inputs[4] = inputs[4].transpose(1, 2).contiguous().transpose(1, 2)
    expected = reference(inputs, rope_on=summary.attrs["rope"], quant=summary.attrs["quant"],
                         headroom=summary.attrs.get("headroom", 1.0), k_offset=summary.attrs.get("k_offset", False),
                         v_offset=summary.attrs.get("v_offset", False))
    module = load_candidate(FAMILY.render(summary, params))
    device_inputs = on_test_device([t.clone() for t in inputs])
    outputs = module.run(*device_inputs)
    # in place: the outputs are the written inputs themselves
    assert [o.data_ptr() for o in outputs] == [device_inputs[i].data_ptr() for i in summary.attrs["inplace"]]
    for got, want in zip(outputs, expected):
        assert got.dtype == want.dtype
        if got.dtype == FP8:
            assert torch.equal(got.cpu().float(), want.float()), (got.cpu().float() - want.float()).abs().max()
        else:
            torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-6, atol=2e-6)
    return inputs, outputs


@pytest.mark.parametrize("rope_on", [False, True])
@pytest.mark.parametrize("positions", [[0], [15], [3, 9, 4], list(range(16))], ids=["first", "last", "scattered", "all"])
def test_unquantized_positions(load_candidate, rope_on, positions):
    summary = region(2, 3, 16, 2, len(positions), 8, rope=rope_on)
    inputs, outputs = check(load_candidate, summary, positions)
    untouched = [p for p in range(16) if p not in positions]
    assert torch.equal(outputs[0].cpu()[:, :, untouched], inputs[0][:, :, untouched])


@pytest.mark.parametrize("params", FAMILY.legal_points(region(1, 4, 32, 1, 3, 16, rope=True), H200),
                         ids=lambda p: f"R{p['BLOCK_R']}w{p['num_warps']}")
def test_every_point_strided_k_and_v(load_candidate, params):
    check(load_candidate, region(1, 4, 32, 1, 3, 16, rope=True), [7, 8, 9], params, strided=True)


def test_batch_smaller_than_the_cache_leaves_other_sequences_untouched(load_candidate):
    summary = region(4, 2, 8, 2, 1, 16, rope=True)
    inputs, outputs = check(load_candidate, summary, [5])
    assert torch.equal(outputs[0].cpu()[2:], inputs[0][2:]) and torch.equal(outputs[1].cpu()[2:], inputs[1][2:])


@pytest.mark.parametrize("quant", ["per-tensor", "per-head", "per-token"])
@pytest.mark.parametrize("rope_on", [False, True])
@pytest.mark.parametrize("magnitude", [1.0, 30.0])
def test_fp8_quantization_rounds_like_torch(load_candidate, quant, rope_on, magnitude):
    """Bit-exact against torch's correctly rounding cast, including values whose rounding carries
    into the exponent (where the interpreter's own fp8 cast is wrong) and saturation at 448."""
    summary = region(2, 2, 8, 2, 3, 32, rope=rope_on, quant=quant,
                     headroom=1.25 if quant == "per-token" else None)
    inputs, outputs = check(load_candidate, summary, [1, 6, 2], magnitude=magnitude, seed=3)
    untouched = [0, 3, 4, 5, 7]
    assert torch.equal(outputs[0].cpu()[:, :, untouched].float(), inputs[0][:, :, untouched].float())


@pytest.mark.parametrize("quant", ["per-tensor", "per-head"])
@pytest.mark.parametrize("rope_on", [False, True])
@pytest.mark.parametrize("centred", ["k", "v", "kv"])
def test_smooth_subtracts_each_offset_from_its_rows_only_before_rounding(load_candidate, quant, rope_on, centred):
    """K and / or V rows around a large per-channel offset (a different one each): the stored
    rows are quant(rope(k) - k_offset), quant(v - v_offset) bit for bit; a cache without an
    offset is stored as without smoothing."""
    k_on, v_on = "k" in centred, "v" in centred
    summary = region(2, 2, 8, 2, 3, 32, rope=rope_on, quant=quant, k_offset=k_on, v_offset=v_on)
    inputs = make_inputs(summary, [1, 6, 2], seed=5)
    offsets = len(centred)
    for i in range(offsets):  # large offsets, a different one for K and V
        inputs[len(inputs) - offsets + i] = torch.randn(1, 2, 1, 32, generator=torch.Generator().manual_seed(9 + i)) * 20
    module = load_candidate(FAMILY.render(summary, FAMILY.legal_points(summary, H200)[0]))
    outputs = module.run(*on_test_device([t.clone() for t in inputs]))
    expected = reference(inputs, rope_on=rope_on, quant=quant, k_offset=k_on, v_offset=v_on)
    plain = reference(inputs[:len(inputs) - offsets], rope_on=rope_on, quant=quant)
    for got, want in zip(outputs, expected):
        assert torch.equal(got.cpu().float(), want.float())
    for cache, on in ((0, k_on), (1, v_on)):
        assert torch.equal(outputs[cache].cpu().float(), plain[cache].float()) != on
    per_token = region(2, 2, 8, 2, 3, 32, quant="per-token", k_offset=k_on, v_offset=v_on)
    assert FAMILY.matches(summary) and not FAMILY.matches(per_token)


def test_e4m3_grid_rounding_edge_values(load_candidate):
    """Ties, carries into the exponent, subnormals and saturation, through per-tensor scale 1."""
    summary = region(1, 1, 4, 1, 1, 16, quant="per-tensor")
    values = torch.tensor([31.0, -1.94, 17.0, 19.0, 0.0019, 2 ** -10, 3 * 2 ** -10, 447.0, 460.0, -1000.0,
                           0.1, 240.0, 15.5, -0.0, 1.0625, 1.1875]).view(1, 1, 1, 16)
    inputs = make_inputs(summary, [2])
    inputs[3], inputs[5] = values, torch.ones(1)
    module = load_candidate(FAMILY.render(summary, {"BLOCK_R": 2, "num_warps": 1}))
    k_cache, _ = module.run(*on_test_device([t.clone() for t in inputs]))
    assert torch.equal(k_cache.cpu()[0, 0, 2].float(), values.view(16).clamp(-448, 448).to(FP8).float())


def test_bf16_rows_with_rope(load_candidate):
    summary = region(1, 2, 8, 1, 2, 16, rope=True, dtype="bfloat16")
    inputs = make_inputs(summary, [3, 4])
    expected = reference(inputs, rope_on=True, quant="none")
    module = load_candidate(FAMILY.render(summary, FAMILY.legal_points(summary, H200)[0]))
    outputs = module.run(*on_test_device([t.clone() for t in inputs]))
    # the interpreter truncates fp32 -> bf16: one bf16 ulp
    torch.testing.assert_close(outputs[0].cpu().float(), expected[0].float(), rtol=1.6e-2, atol=1e-2)
    assert torch.equal(outputs[1].cpu(), expected[1])


def test_matches_and_space():
    assert FAMILY.matches(region(1, 8, 4096, 1, 1, 128, rope=True))
    assert FAMILY.matches(region(1, 8, 64, 1, 1, 7))  # odd D without rope: masked
    assert not FAMILY.matches(region(1, 8, 64, 1, 1, 7, rope=True))  # rope needs an even D
    odd = region(1, 8, 64, 1, 1, 8, quant="per-head")
    assert not FAMILY.matches(RegionSummary(odd.name, odd.family, odd.inputs, odd.outputs, {**odd.attrs, "inplace": [0]}))
    decode = region(1, 8, 4096, 1, 1, 128, rope=True)
    points = FAMILY.legal_points(decode, H200)
    assert points and all(p["BLOCK_R"] <= 8 for p in points)  # 8 rows (b, head, t) in a decode step
    assert FAMILY.check(decode, {"BLOCK_R": 64, "num_warps": 1}, H200) == "BLOCK_R=64 is not in the space"
    # a tiny step still has a legal point
    assert FAMILY.legal_points(region(1, 1, 8, 1, 1, 16), H200) == [{"BLOCK_R": 1, "num_warps": 1}]


def test_compiles_for_hopper(compile_for_sm90):
    jobs = []
    for quant, offset in (("none", False), ("per-head", False), ("per-token", False), ("per-head", True)):
        summary = region(1, 2, 16, 1, 2, 32, rope=True, quant=quant, dtype="bfloat16", k_offset=offset, v_offset=offset)
        inputs = make_inputs(summary, [0, 1])
        jobs.append((quant + ("-smooth-kv" if offset else ""), FAMILY.render(summary, FAMILY.legal_points(summary, H200)[0]),
                     inputs, "kv_write_kernel"))
    compile_for_sm90(jobs)


@pytest.mark.parametrize("quant", ["per-tensor", "per-head"])
@pytest.mark.parametrize("rope_on", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_values_only_stores_keys_as_they_are_and_quantizes_the_values(load_candidate, quant, rope_on, dtype):
    """fp8-kv-cache{values-only}: K rows (roped) stored in the key cache's own dtype as the
    unfused ops store them, V rows rounded to e4m3 with V's scale, the one scale input."""
    both = region(2, 2, 8, 2, 3, 32, rope=rope_on, quant=quant, dtype=dtype)
    key_cache = TensorSpec(both.inputs[0].shape, dtype)
    inputs_spec = (key_cache, *both.inputs[1:-2], both.inputs[-1])  # K's scale dropped
    summary = RegionSummary("kv", "kv_write", inputs_spec, (key_cache, both.inputs[1]),
                            {**both.attrs, "values_only": True})
    assert FAMILY.matches(summary)
    inputs = make_inputs(both, [1, 6, 2], seed=7, magnitude=30.0)
    inputs[0] = torch.randn(key_cache.shape, generator=torch.Generator().manual_seed(8)).to(getattr(torch, dtype))
    del inputs[-2]  # K's scale
    module = load_candidate(FAMILY.render(summary, FAMILY.legal_points(summary, H200)[0]))
    k_out, v_out = module.run(*on_test_device([t.clone() for t in inputs]))
    k_cache, v_cache, positions, k, v, *extra = inputs
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k[:, :, positions] = rope(k, extra[0], extra[1]) if rope_on else k
    expected_v[:, :, positions] = quantize(v, extra[-1], quant)
    assert k_out.dtype == getattr(torch, dtype) and v_out.dtype == FP8
    # (the fused rope rounds its fp32 result once, the unfused one after each op: an ulp apart)
    torch.testing.assert_close(k_out.cpu().float(), expected_k.float(), rtol=2e-6 if dtype == "float32" else 8e-3, atol=1e-5)
    assert torch.equal(v_out.cpu().float(), expected_v.float())
    # the K offset and per-token scales are the both-fp8 form's only
    assert not FAMILY.matches(dataclasses.replace(summary, attrs={**summary.attrs, "quant": "per-token"}))


@pytest.mark.parametrize("quant", ["per-head", "per-token"])
def test_fp32_keys_beside_bf16_values_each_round_from_their_own_dtype(load_candidate, quant):
    """exact-recent's write: keys already centred in fp32 (the sub's result, which the attention
    also reads unrounded) beside the step's bf16 values. Both caches bit-exact against torch; a
    write that stores rows as they are still needs one dtype (index_put_'s)."""
    summary = region(2, 2, 8, 2, 1, 32, quant=quant, dtype="bfloat16", headroom=1.25 if quant == "per-token" else None)
    k_row = TensorSpec(summary.inputs[3].shape, "float32")
    mixed = dataclasses.replace(summary, inputs=(*summary.inputs[:3], k_row, *summary.inputs[4:]))
    assert FAMILY.matches(mixed)
    check(load_candidate, mixed, [5], seed=4, magnitude=7.0)
    plain = region(2, 2, 8, 2, 1, 32, dtype="bfloat16")
    assert not FAMILY.matches(dataclasses.replace(plain, inputs=(*plain.inputs[:3], k_row, *plain.inputs[4:])))


@pytest.mark.parametrize("centred", ["k", "kv"])
def test_exact_outputs_are_the_rows_before_rounding(load_candidate, centred):
    """exact-recent's write (attrs "exact_outputs"): beside the caches, the rows as they are
    before rounding, rope(k) in k's dtype less K's offset (fp32) and v less V's, bit for bit as
    the unfused ops compute them; the caches as without the outputs."""
    k_on, v_on = True, "v" in centred
    # (fp32 rows: the interpreter truncates a bf16 rounding, TRITON-INTERPRETER.md)
    plain = region(2, 2, 8, 2, 1, 32, rope=True, quant="per-head", k_offset=k_on, v_offset=v_on)
    row = plain.inputs[3]
    names = ["k", "v"] if v_on else ["k"]
    summary = dataclasses.replace(plain, outputs=(*plain.outputs, *(TensorSpec(row.shape, "float32") for _ in names)),
                                  attrs={**plain.attrs, "exact_outputs": names})
    assert FAMILY.matches(summary)
    assert not FAMILY.matches(dataclasses.replace(summary, outputs=(*plain.outputs, TensorSpec(row.shape, "bfloat16"),
                                                                      *summary.outputs[3:])))  # centred rows are fp32
    inputs = make_inputs(summary, [5], seed=7)
    module = load_candidate(FAMILY.render(summary, FAMILY.legal_points(summary, H200)[0]))
    outputs = module.run(*on_test_device([t.clone() for t in inputs]))
    expected = reference(inputs, rope_on=True, quant="per-head", k_offset=k_on, v_offset=v_on)
    for got, want in zip(outputs[:2], expected):
        assert torch.equal(got.cpu().float(), want.float())
    k, v, cos, sin = inputs[3], inputs[4], inputs[5], inputs[6]
    k_rows = rope(k, cos, sin).float() - inputs[-1 - v_on]
    # (on a GPU the fp32 rope may contract into an FMA: an ulp; the interpreter matches torch exactly)
    assert outputs[2].dtype == torch.float32
    torch.testing.assert_close(outputs[2].cpu(), k_rows, rtol=1e-6, atol=1e-6)
    if v_on:
        assert torch.equal(outputs[3].cpu(), v.float() - inputs[-1])
