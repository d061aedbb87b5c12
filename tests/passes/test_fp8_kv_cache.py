"""fp8-kv-cache (docs/kv-cache.md): each KV cache becomes float8_e4m3fn, every write goes through
coopt.quantize_fp8, every cache attention gets k_scale / v_scale; per-token scales live in state
buffers written beside the cache. Illegal knob combinations and a model without a cache are
pipeline errors (exit 5), never a silent no-op."""

import json

import pytest
import torch
import torch.nn.functional as F
from xdsl.context import Context

import coopt
from coopt.errors import ConfigError
from coopt.fp8_cache import calibrate_kv_absmax, set_calibration
from coopt.frontend.capture import capture
from coopt.frontend.importer import import_program
from coopt.ir.dialect import DecodeAttentionOp, KernelOp, QuantizeFp8Op, StateUpdateOp, WeightOp
from coopt.passes.fp8_kv_cache import FP8_ATTR, FP8_MAX, SCALE_FLOOR
from coopt.passes.registry import parse_pipeline_text
from coopt.passes.stats import collect_counters

HEADS, KV_HEADS, DIM, MAX_SEQ = 4, 2, 16, 32
RAISE = "inplace-state-writes,raise-patterns"


class DecodeStep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.randn(1, KV_HEADS, MAX_SEQ, DIM))
        self.register_buffer("v_cache", torch.randn(1, KV_HEADS, MAX_SEQ, DIM) * 2)
        self.register_buffer("cache_positions", torch.arange(MAX_SEQ))

    def forward(self, q, k, v, input_pos):
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        mask = self.cache_positions[None, :] <= input_pos[:, None]
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)


def step(pos: int, generator=None):
    g = generator or torch.Generator().manual_seed(pos)
    return (torch.randn(1, HEADS, 1, DIM, generator=g), torch.randn(1, KV_HEADS, 1, DIM, generator=g),
            torch.randn(1, KV_HEADS, 1, DIM, generator=g), torch.tensor([pos]))


def run(pipeline: str, model=None, calibrate=True, inputs=None):
    torch.manual_seed(0)
    model = (model or DecodeStep()).eval()
    inputs = inputs or step(5)
    module = import_program(capture(model, inputs), inputs).module
    if calibrate:
        set_calibration(module, calibrate_kv_absmax(model, [inputs]))
    with collect_counters() as counters:
        for compiler_pass in parse_pipeline_text(pipeline):
            compiler_pass.apply(Context(allow_unregistered=True), module)
            module.verify()
    return module, counters, model


def ops(module, kind):
    return [op for op in module.walk() if isinstance(op, kind)]


def weight_types(module) -> dict:
    return {op.ref.data: str(op.result.type) for op in ops(module, WeightOp)}


def test_before_the_pass_caches_are_fp32_and_attention_has_no_scales():
    module, _, _ = run(RAISE)
    assert weight_types(module)["k_cache"] == "tensor<1x2x32x16xf32>"
    (attention,) = ops(module, DecodeAttentionOp)
    assert attention.k_scale is None and attention.kv_scale is None and not ops(module, QuantizeFp8Op)


def test_per_head_retypes_caches_quantizes_writes_and_attaches_scales():
    module, counters, model = run(RAISE + ",fp8-kv-cache")
    types = weight_types(module)
    assert types["k_cache"] == types["v_cache"] == "tensor<1x2x32x16xf8E4M3FN>"
    assert types["k_cache.scale"] == types["v_cache.scale"] == "tensor<2xf32>"
    quantized = ops(module, QuantizeFp8Op)
    assert [q.granularity.data for q in quantized] == ["per-head", "per-head"]
    for update in ops(module, StateUpdateOp):  # the write stores what quantize_fp8 made
        assert isinstance(update.inputs[2].owner, QuantizeFp8Op) and "f8E4M3FN" in str(update.results[0].type)
    (attention,) = ops(module, DecodeAttentionOp)
    assert attention.kv_scale.data == "per-head"
    assert attention.k_scale.owner.ref.data == "k_cache.scale" and attention.v_scale.owner.ref.data == "v_cache.scale"
    assert "f8E4M3FN" in str(attention.k.type) and "f8E4M3FN" in str(attention.v.type)
    assert counters["fp8_kv_cache.buffers"] == 2 and counters["fp8_kv_cache.attentions"] == 1
    record = json.loads(module.attributes[FP8_ATTR].data)
    assert record["caches"] == {"k_cache": "k_cache.scale", "v_cache": "v_cache.scale"}
    absmax = model.v_cache.abs().amax(dim=(0, 2, 3))  # calibrated after the step wrote row 5
    assert record["scales"]["v_cache.scale"] == pytest.approx((absmax / FP8_MAX).tolist())


def test_per_tensor_scale_is_the_largest_head_with_headroom():
    module, _, model = run(RAISE + ",fp8-kv-cache{granularity=per-tensor headroom=1.5}")
    assert weight_types(module)["k_cache.scale"] == "tensor<1xf32>"
    record = json.loads(module.attributes[FP8_ATTR].data)
    assert record["scales"]["k_cache.scale"] == pytest.approx([float(model.k_cache.abs().max()) * 1.5 / FP8_MAX])
    assert {q.granularity.data for q in ops(module, QuantizeFp8Op)} == {"per-tensor"}


def test_per_token_adds_scale_buffers_written_at_the_same_positions():
    module, _, _ = run(RAISE + ",fp8-kv-cache{granularity=per-token,scale-source=dynamic}", calibrate=False)
    types = weight_types(module)
    assert types["k_cache.scale"] == types["v_cache.scale"] == "tensor<1x2x32xf32>"
    updates = {u.ref.data: u for u in ops(module, StateUpdateOp)}
    assert set(updates) == {"k_cache", "v_cache", "k_cache.scale", "v_cache.scale"}
    for name in ("k_cache", "v_cache"):
        cache, scale = updates[name], updates[name + ".scale"]
        assert cache.inputs[1] is scale.inputs[1]  # the same positions
        quantize = cache.inputs[2].owner
        assert isinstance(quantize, QuantizeFp8Op) and quantize.granularity.data == "per-token"
        assert quantize.scale is scale.inputs[2]  # the rows' scales are written and used
    (attention,) = ops(module, DecodeAttentionOp)
    assert attention.kv_scale.data == "per-token" and str(attention.k_scale.type) == "tensor<1x2x32xf32>"
    assert json.loads(module.attributes[FP8_ATTR].data)["scales"] == {}


def test_regions_carry_the_scales():
    module, counters, _ = run(RAISE + ",fp8-kv-cache,fuse-attention")
    (kernel,) = [k for k in ops(module, KernelOp) if k.family.data == "decode_attention"]
    assert kernel.family_attrs["kv_scale"] == "per-head" and len(kernel.inputs) == 6
    assert [str(v.type) for v in kernel.inputs[4:]] == ["tensor<2xf32>", "tensor<2xf32>"]
    assert counters["fuse.attention.fp8_cache"] == 1


@pytest.mark.parametrize("knobs, culprit", [
    ("granularity=per-token", "granularity=per-token does not go with scale-source=calibration"),
    ("scale-source=dynamic", "granularity=per-head does not go with scale-source=dynamic"),
    ("granularity=per-tensor,scale-source=dynamic", "granularity=per-tensor"),
    ("granularity=per-row", "granularity='per-row'"),
    ("scale-source=online", "scale-source='online'"),
    ("headroom=0.5", "headroom=0.5"),
    ("granularity=per-token,scale-source=dynamic,smooth-k=true", "smooth-k needs calibrated scales"),
    ("granularity=per-token,scale-source=dynamic,smooth-v=true", "smooth-v needs calibrated scales"),
    ("granularity=per-token,scale-source=dynamic,values-only=true", "values-only keeps the keys"),
    ("values-only=true,smooth-k=true", "not with scale-source=dynamic or smooth-k"),
])
def test_illegal_knob_combinations_are_pipeline_errors_naming_the_knob(knobs, culprit):
    with pytest.raises(ConfigError, match="fp8-kv-cache") as error:
        parse_pipeline_text(f"raise-patterns,fp8-kv-cache{{{knobs}}}")
    assert culprit in error.value.message and error.value.exit_code == 5


def test_a_model_without_a_kv_cache_is_an_error():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    inputs = (torch.randn(2, 8),)
    module = import_program(capture(mlp.eval(), inputs), inputs).module
    with pytest.raises(ConfigError, match="no KV cache"):
        for compiler_pass in parse_pipeline_text(RAISE + ",fp8-kv-cache"):
            compiler_pass.apply(Context(allow_unregistered=True), module)


def test_calibration_data_is_required_for_calibrated_scales():
    with pytest.raises(ConfigError, match="no calibration absmax"):
        run(RAISE + ",fp8-kv-cache", calibrate=False)


def test_kv_cache_option_inserts_the_pass_after_raise_patterns():
    pipe = coopt.Pipeline("inplace-state-writes,raise-patterns,fuse-elementwise{max-ops=4}", kv_cache="fp8")
    assert pipe.pipeline_text == "inplace-state-writes,raise-patterns,fp8-kv-cache{smooth-k=true},fuse-elementwise{max-ops=4}"
    assert [p.name for p in pipe.passes][2] == "fp8-kv-cache" and pipe.config().lossy_passes
    assert coopt.Pipeline(kv_cache="bf16").pipeline_text == coopt.Pipeline().pipeline_text
    with pytest.raises(ConfigError, match="raise-patterns"):
        coopt.Pipeline("fuse-elementwise", kv_cache="fp8")
    values = coopt.Pipeline("inplace-state-writes,raise-patterns,fuse-attention", kv_cache="fp8-values")
    assert values.pipeline_text == "inplace-state-writes,raise-patterns,fp8-kv-cache{values-only=true},fuse-attention"
    assert values.passes[2].values_only is True
    recent = coopt.Pipeline("inplace-state-writes,raise-patterns,fuse-attention", kv_cache="fp8-recent")
    assert recent.pipeline_text == "inplace-state-writes,raise-patterns,fp8-kv-cache{smooth-k=true,exact-recent=4},fuse-attention"
    assert recent.passes[2].exact_recent == 4
    with pytest.raises(ConfigError, match="choices: none, bf16, fp8, fp8-recent, fp8-values"):
        coopt.Pipeline(kv_cache="fp4")


def test_per_token_build_writes_quantized_rows_and_their_scales(tmp_path):
    """The reference program of a per-token build: rows quantized with their own scale, the
    scale stored beside them, and attention within fp8 error of the fp32 model."""
    torch.manual_seed(0)
    eager = DecodeStep()
    build_model = DecodeStep()
    build_model.load_state_dict(eager.state_dict())
    pipeline = "inplace-state-writes,raise-patterns,fp8-kv-cache{granularity=per-token,scale-source=dynamic},fuse-attention"
    result = coopt.Pipeline(pipeline, top_k=1).build(build_model, step(3), tmp_path / "out")
    assert result.accuracy["kv_cache_bytes"]["saved"] > 0 and result.e2e["lossy"]
    built = coopt.load(tmp_path / "out")
    assert built.state_tensor("k_cache").dtype == torch.float8_e4m3fn
    for pos in (3, 9):
        inputs = step(pos, torch.Generator().manual_seed(100 + pos))
        got = built(*inputs)
        want = eager(*inputs)
        torch.testing.assert_close(got, want, rtol=0.1, atol=0.1)
        row = inputs[1][0, :, 0]  # k written at pos: [Hkv, D]
        scale = row.abs().amax(-1).clamp_min(SCALE_FLOOR) / FP8_MAX
        torch.testing.assert_close(built.state_tensor("k_cache.scale")[0, :, pos], scale)
        expected = torch.clamp(row / scale[:, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        assert torch.equal(built.state_tensor("k_cache")[0, :, pos].view(torch.uint8), expected.view(torch.uint8))


class OffsetKeys(DecodeStep):
    """Keys with a large common offset on half their channels (as real K projections have), the
    cache's history with them too."""

    OFFSET = torch.cat([torch.full((DIM // 2,), 24.0), torch.zeros(DIM // 2)])

    def __init__(self):
        super().__init__()
        self.k_cache += self.OFFSET


def offset_step(pos: int, seed: int):
    q, k, v, positions = step(pos, torch.Generator().manual_seed(seed))
    return q, k + OffsetKeys.OFFSET, v, positions


def test_calibration_records_means_and_centred_ranges_over_written_rows_only():
    class Sparse(torch.nn.Module):  # rows never written stay zero: they must not pull the mean
        def __init__(self):
            super().__init__()
            self.register_buffer("k", torch.zeros(1, 2, 6, 3))

        def forward(self, x, pos):
            self.k[:, :, pos] = x
            return self.k.sum()

    rows = torch.tensor([[5.0, 1.0, 0.0], [7.0, -1.0, 2.0]])[None, :, None, :]  # [1, Hkv, 1, D]
    stats = calibrate_kv_absmax(Sparse(), [(rows, torch.tensor([0])), (rows + 2, torch.tensor([1]))])["k"]
    # after the calls: rows 0 and 0, 1 (row 0 seen twice), never the four zero rows
    expected_mean = (3 * rows[0, :, 0] + 2) / 3
    torch.testing.assert_close(torch.tensor(stats["mean"]), expected_mean)
    assert stats["absmax"] == pytest.approx([7.0, 9.0])
    spread = torch.maximum(rows[0, :, 0] + 2 - expected_mean, expected_mean - rows[0, :, 0]).amax(-1)
    assert stats["centred_absmax"] == pytest.approx(spread.tolist())


def test_smooth_k_centres_the_key_writes_and_scales_keys_by_their_centred_range():
    torch.manual_seed(0)
    model, inputs = OffsetKeys(), offset_step(5, 5)
    calibration = calibrate_kv_absmax(model, [inputs])
    module, counters, _ = run(RAISE + ",fp8-kv-cache{smooth-k=true}", model, inputs=inputs)
    assert weight_types(module)["k_cache.offset"] == "tensor<1x2x1x16xf32>" and "v_cache.offset" not in weight_types(module)
    quantized = {q.results[0].uses.__iter__().__next__().operation.ref.data: q for q in ops(module, QuantizeFp8Op)}
    centred = quantized["k_cache"].x.owner
    assert centred.target.data == "aten.sub.Tensor" and centred.inputs[1].owner.ref.data == "k_cache.offset"
    assert not hasattr(quantized["v_cache"].x.owner, "target") or quantized["v_cache"].x.owner.target.data != "aten.sub.Tensor"
    record = json.loads(module.attributes[FP8_ATTR].data)
    assert record["offsets"] == {"k_cache": "k_cache.offset"} and counters["fp8_kv_cache.smoothed_keys"] == 1
    assert record["offset_values"]["k_cache.offset"] == calibration["k_cache"]["mean"]
    centred_range = torch.tensor(calibration["k_cache"]["centred_absmax"])
    assert record["scales"]["k_cache.scale"] == pytest.approx((centred_range / FP8_MAX).tolist())
    assert float(centred_range.max()) < 0.5 * max(calibration["k_cache"]["absmax"])  # the offset left the range


def built_errors(tmp_path, model_class, make_step, smooth_knobs: str, passes: str) -> dict[str, float]:
    """{"plain", "smooth"}: the largest |built - eager| over decode steps at three positions of
    a build with fp8-kv-cache, without and with `smooth_knobs`."""
    errors = {}
    for name, knobs in (("plain", ""), ("smooth", "{" + smooth_knobs + "}")):
        torch.manual_seed(0)
        eager, build_model = model_class(), model_class()
        build_model.load_state_dict(eager.state_dict())
        pipeline = f"inplace-state-writes,raise-patterns,fp8-kv-cache{knobs},{passes}"
        coopt.Pipeline(pipeline, top_k=1).build(build_model, make_step(3, 3), tmp_path / name,
                                                calibration_inputs=[make_step(p, p) for p in (1, 2, 3)])
        built = coopt.load(tmp_path / name)
        errors[name] = max(float((built(*inputs) - eager(*inputs)).abs().max())
                           for inputs in (make_step(pos, 100 + pos) for pos in (4, 9, 17)))
    return errors


def test_smooth_k_brings_an_offset_keys_attention_closer_to_fp32(tmp_path):
    """Keys offset by 24 on half their channels: e4m3's 3 mantissa bits round them to steps of 2,
    which smoothing removes; attention reads the centred cache as it is (softmax ignores q . mean)."""
    errors = built_errors(tmp_path, OffsetKeys, offset_step, "smooth-k=true", "fuse-attention")
    assert errors["smooth"] < 0.5 * errors["plain"], errors


def test_fuse_kv_write_takes_the_key_centring_into_its_region():
    module, counters, _ = run(RAISE + ",fp8-kv-cache{smooth-k=true},fuse-kv-write")
    (kernel,) = [k for k in ops(module, KernelOp) if k.family.data == "kv_write"]
    assert kernel.family_attrs["k_offset"] is True and kernel.family_attrs["quant"] == "per-head"
    assert str(kernel.inputs[-1].type) == "tensor<1x2x1x16xf32>" and kernel.inputs[-1].owner.ref.data == "k_cache.offset"
    assert counters["fuse.kv_write.smooth_k"] == 1 and counters["fuse.kv_write.quantized"] == 1
    assert not [o for o in module.walk() if getattr(o, "target", None) is not None
                and o.target.data == "aten.sub.Tensor" and not isinstance(o.parent_op(), KernelOp)]


class OffsetValues(DecodeStep):
    """Values with a large common offset on half their channels, the cache's history too."""

    def __init__(self):
        super().__init__()
        self.v_cache += OffsetKeys.OFFSET


def offset_value_step(pos: int, seed: int):
    q, k, v, positions = step(pos, torch.Generator().manual_seed(seed))
    return q, k, v + OffsetKeys.OFFSET, positions


def test_smooth_v_centres_the_value_writes_and_adds_the_offset_to_the_attention_output():
    torch.manual_seed(0)
    model, inputs = OffsetValues(), offset_value_step(5, 5)
    calibration = calibrate_kv_absmax(model, [inputs])
    module, counters, _ = run(RAISE + ",fp8-kv-cache{smooth-v=true}", model, inputs=inputs)
    types = weight_types(module)
    assert types["v_cache.offset"] == "tensor<1x2x1x16xf32>" and "k_cache.offset" not in types
    # the output offset: each kv head's repeated for its HEADS // KV_HEADS query heads, in q's dtype
    assert types["v_cache.output_offset"] == "tensor<1x4x1x16xf32>"
    (attention,) = ops(module, DecodeAttentionOp)
    (use,) = list(attention.result.uses)
    add = use.operation
    assert add.target.data == "aten.add.Tensor" and add.inputs[1].owner.ref.data == "v_cache.output_offset"
    record = json.loads(module.attributes[FP8_ATTR].data)
    assert record["offsets"] == {"v_cache": "v_cache.offset"}
    assert record["output_offsets"] == {"v_cache.output_offset": {"offset": "v_cache.offset", "repeat": 2,
                                                                  "dtype": "float32"}}
    assert counters["fp8_kv_cache.smoothed_values"] == 1 and counters["fp8_kv_cache.output_offsets"] == 1
    centred_range = torch.tensor(calibration["v_cache"]["centred_absmax"])
    assert record["scales"]["v_cache.scale"] == pytest.approx((centred_range / FP8_MAX).tolist())


def test_smooth_v_brings_an_offset_values_attention_closer_to_fp32(tmp_path):
    """Values offset by 24 on half their channels: without smoothing e4m3 rounds them to steps of
    2; centred, the rounding is of the spread alone, and the mean comes back exactly (a query's
    probabilities sum to 1)."""
    errors = built_errors(tmp_path, OffsetValues, offset_value_step, "smooth-k=true smooth-v=true",
                          "fuse-attention,fuse-kv-write")
    assert errors["smooth"] < 0.5 * errors["plain"], errors


def test_fuse_kv_write_takes_both_centrings_into_its_region():
    module, counters, _ = run(RAISE + ",fp8-kv-cache{smooth-k=true smooth-v=true},fuse-kv-write")
    (kernel,) = [k for k in ops(module, KernelOp) if k.family.data == "kv_write"]
    assert kernel.family_attrs["k_offset"] is True and kernel.family_attrs["v_offset"] is True
    assert [v.owner.ref.data for v in kernel.inputs[-2:]] == ["k_cache.offset", "v_cache.offset"]
    assert counters["fuse.kv_write.smooth_k"] == 1 and counters["fuse.kv_write.smooth_v"] == 1


def test_fuse_kv_write_takes_a_value_centring_alone():
    module, counters, _ = run(RAISE + ",fp8-kv-cache{smooth-v=true},fuse-kv-write")
    (kernel,) = [k for k in ops(module, KernelOp) if k.family.data == "kv_write"]
    assert "k_offset" not in kernel.family_attrs and kernel.family_attrs["v_offset"] is True
    assert kernel.inputs[-1].owner.ref.data == "v_cache.offset" and counters["fuse.kv_write.smooth_v"] == 1


def test_values_only_keeps_the_keys_and_reads_them_with_unit_scales():
    module, counters, model = run(RAISE + ",fp8-kv-cache{values-only=true}")
    types = weight_types(module)
    assert types["k_cache"] == "tensor<1x2x32x16xf32>" and types["v_cache"] == "tensor<1x2x32x16xf8E4M3FN>"
    assert types["k_cache.scale"] == types["v_cache.scale"] == "tensor<2xf32>"
    (quantized,) = ops(module, QuantizeFp8Op)  # only the value write
    (attention,) = ops(module, DecodeAttentionOp)
    assert attention.k_scale.owner.ref.data == "k_cache.scale" and "f32" in str(attention.k.type)
    record = json.loads(module.attributes[FP8_ATTR].data)
    assert record["caches"] == {"v_cache": "v_cache.scale"} and record["unit_scales"] == {"k_cache": "k_cache.scale"}
    assert record["scales"]["k_cache.scale"] == [1.0, 1.0]
    assert counters["fp8_kv_cache.buffers"] == 1 and counters["fp8_kv_cache.unit_scales"] == 1


def test_values_only_build_matches_eager_within_the_values_rounding(tmp_path):
    """Built (the write and the attention on kernels that take bf16 / fp32 keys beside fp8
    values) and run over three steps: the key cache holds eager's keys exactly, the value cache
    e4m3 values of eager's, and the output differs from eager by no more than the same build
    with both caches in fp8."""
    errors = {}
    for name, knobs in (("both", ""), ("values", "{values-only=true}")):
        torch.manual_seed(0)
        eager, build_model = DecodeStep(), DecodeStep()
        build_model.load_state_dict(eager.state_dict())
        pipeline = f"inplace-state-writes,raise-patterns,fp8-kv-cache{knobs},fuse-attention,fuse-kv-write"
        coopt.Pipeline(pipeline, top_k=1).build(build_model, step(3), tmp_path / name,
                                                calibration_inputs=[step(p) for p in (1, 2, 3)])
        built = coopt.load(tmp_path / name)
        errors[name] = 0.0
        for pos in (4, 9, 17):
            inputs = step(pos, torch.Generator().manual_seed(100 + pos))
            out, expected = built(*inputs), eager(*inputs)
            errors[name] = max(errors[name], float((out - expected).abs().max()))
        if name == "values":
            # the write and the attention each one verified kernel (mixed K / V dtypes)
            regions = json.loads((tmp_path / name / "selection.json").read_text())["regions"].values()
            assert sorted(r["family"] for r in regions) == ["decode_attention", "kv_write"]
            (write,) = [r for r in regions if r["family"] == "kv_write"]
            assert write["summary"]["attrs"]["values_only"] is True
            assert all(r["selected"] != "reference" for r in regions)
            accuracy = json.loads((tmp_path / name / "build.json").read_text())["accuracy"]["kv_cache_bytes"]
            keys, values = eager.k_cache.numel() * 4, eager.v_cache.numel() * 4
            assert accuracy["before"] == keys + values and accuracy["after"] == keys + 4 * 2 + values // 4 + 4 * 2
            assert torch.equal(built.state_tensor("k_cache"), eager.k_cache)  # the keys untouched, new rows too
            stored = built.state_tensor("v_cache")
            assert stored.dtype == torch.float8_e4m3fn
            scale = built.state_tensor("v_cache.scale")[None, :, None, None]
            torch.testing.assert_close(stored.float() * scale, eager.v_cache, rtol=0.07, atol=1e-6 + float(scale.max()) / 8)
    assert 0 < errors["values"] <= errors["both"], errors


def test_exact_recent_reads_what_each_write_stores_before_its_rounding_and_keeps_a_ring():
    module, counters, _ = run(RAISE + ",fp8-kv-cache{smooth-k=true,exact-recent=4}")
    (attention,) = ops(module, DecodeAttentionOp)
    quantizes = {q.scale.owner.ref.data: q for q in ops(module, QuantizeFp8Op)}
    # this call's rows: the quantizes' inputs, K's centred as the cache stores it, V's as written
    assert attention.k_exact is quantizes["k_cache.scale"].x and attention.v_exact is quantizes["v_cache.scale"].x
    assert attention.recent.value.data == 4
    assert [attention.k_recent.owner.ref.data, attention.v_recent.owner.ref.data] == ["k_cache.recent", "v_cache.recent"]
    assert str(attention.k_recent.type) == "tensor<1x2x4x16xf32>"
    # each ring written after the attention with this call's rows, at their positions
    rings = [op for op in ops(module, StateUpdateOp) if op.target.data == "coopt.ring_write_"]
    block = attention.parent_block()
    assert sorted(r.ref.data for r in rings) == ["k_cache.recent", "v_cache.recent"]
    assert all(block.get_operation_index(r) > block.get_operation_index(attention) for r in rings)
    (k_ring,) = [r for r in rings if r.ref.data == "k_cache.recent"]
    assert k_ring.inputs[2] is attention.k_exact and k_ring.call["args"][3:] == [4, False]
    recent = json.loads(module.attributes[FP8_ATTR].data)["recent"]
    assert recent["window"] == 4 and recent["rings"] == {"k_cache": "k_cache.recent", "v_cache": "v_cache.recent"}
    assert counters["fp8_kv_cache.exact_recent"] == 1
    # one row: no ring
    module, _, _ = run(RAISE + ",fp8-kv-cache{exact-recent=1}")
    (attention,) = ops(module, DecodeAttentionOp)
    assert attention.k_recent is None and attention.k_exact is not None
    assert json.loads(module.attributes[FP8_ATTR].data)["recent"]["rings"] == {}


class ShiftedWrite(DecodeStep):
    """Writes the row at input_pos + 1 but reads input_pos + 1 positions: the row a query reads
    last is not the one its step wrote."""

    def forward(self, q, k, v, input_pos):
        self.k_cache[:, :, input_pos + 1] = k
        self.v_cache[:, :, input_pos + 1] = v
        mask = self.cache_positions[None, :] <= input_pos[:, None]
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("window", [65, -1])
def test_an_exact_recent_window_outside_0_to_64_is_a_pipeline_error(window):
    with pytest.raises(ConfigError, match=f"exact-recent={window} must be a whole number of rows from 0 to 64"):
        run(RAISE + f",fp8-kv-cache{{exact-recent={window}}}")


def test_exact_recent_needs_writes_at_the_queries_own_positions():
    with pytest.raises(ConfigError, match="exact-recent found no attention"):
        run(RAISE + ",fp8-kv-cache{exact-recent=2}", model=ShiftedWrite())


def dequantized(built, name: str, offset: bool) -> torch.Tensor:
    """A built fp8 cache as its attention reads it (x scale, + the offset of a smoothed cache)."""
    stored, scale = built.state_tensor(name).float(), built.state_tensor(name + ".scale")
    scale = scale[None, :, None, None] if scale.dim() == 1 else scale[..., None]
    return stored * scale + (built.state_tensor(name + ".offset") if offset else 0)


@pytest.mark.parametrize("knobs", ["", ",smooth-k=true,smooth-v=true", ",granularity=per-token,scale-source=dynamic"])
@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("fusions", ["fuse-attention", "fuse-attention,fuse-kv-write,fuse-kv-write-attention"],
                         ids=["attention", "folded-write"])
def test_exact_recent_build_reads_its_newest_rows_exact_over_several_steps(tmp_path, knobs, window, fusions):
    """Steps 4..9 built with exact-recent: each equals eager over a cache holding what the build
    stored (rounded) but its newest `window` rows as eager wrote them. Without the knob the same
    build differs from that by the newest rows' rounding. (The caches hold rows 0..3 at build
    time: the build fills each ring with the newest rows held.) With the write fused (its centring
    inside, the centred rows an output) and folded into the attention where it can be, the same."""
    errors = {}
    for recent in (window, 0):
        torch.manual_seed(0)
        eager, build_model = DecodeStep(), DecodeStep()
        with torch.no_grad():
            eager.k_cache[:, :, 4:], eager.v_cache[:, :, 4:] = 0.0, 0.0
        build_model.load_state_dict(eager.state_dict())
        pipeline = f"inplace-state-writes,raise-patterns,fp8-kv-cache{{exact-recent={recent}{knobs}}},{fusions}"
        out = tmp_path / str(recent)
        coopt.Pipeline(pipeline, top_k=1).build(build_model, step(3), out, calibration_inputs=[step(p) for p in (1, 2, 3)])
        built = coopt.load(out)
        exact = {name: getattr(eager, name).clone() for name in ("k_cache", "v_cache")}  # every row as written
        errors[recent] = 0.0
        for pos in range(4, 10):
            inputs = step(pos, torch.Generator().manual_seed(100 + pos))
            with torch.no_grad():
                for name in ("k_cache", "v_cache"):
                    history = dequantized(built, name, f"smooth-{name[0]}=true" in knobs)
                    newest = slice(max(0, pos - window + 1), pos)
                    history[:, :, newest] = exact[name][:, :, newest]
                    getattr(eager, name).copy_(history)
                want = eager(*inputs)
                exact["k_cache"][:, :, pos], exact["v_cache"][:, :, pos] = inputs[1][:, :, 0], inputs[2][:, :, 0]
            errors[recent] = max(errors[recent], float((built(*inputs) - want).abs().max()))
    assert errors[window] < 1e-5 < errors[0], errors


def test_exact_recent_prompt_reads_its_own_rows_then_the_ring(tmp_path):
    """A 4-token chunk at positions 5..8 over a history of rows 0..4, built with exact-recent=3:
    query p reads positions p-2..p unrounded (the chunk's own rows as written, the history's
    newest rows 3 and 4 from the ring the build filled), older ones as the build stored them."""
    window, start, chunk = 3, 5, 4
    torch.manual_seed(0)
    model = DecodeStep()
    with torch.no_grad():
        model.k_cache[:, :, start:], model.v_cache[:, :, start:] = 0.0, 0.0
    history = {name: getattr(model, name).clone() for name in ("k_cache", "v_cache")}
    g = torch.Generator().manual_seed(7)
    inputs = (torch.randn(1, HEADS, chunk, DIM, generator=g), torch.randn(1, KV_HEADS, chunk, DIM, generator=g),
              torch.randn(1, KV_HEADS, chunk, DIM, generator=g), torch.arange(start, start + chunk))
    pipeline = f"inplace-state-writes,raise-patterns,fp8-kv-cache{{smooth-k=true,exact-recent={window}}},fuse-attention"
    result = coopt.Pipeline(pipeline, top_k=1).build(model, inputs, tmp_path / "out")
    assert result.counters["fp8_kv_cache.exact_recent"] == 1 and result.counters["raise.attention.prompt_over_cache"] == 1
    built = coopt.load(tmp_path / "out")
    cached = {name: dequantized(built, name, name == "k_cache") for name in ("k_cache", "v_cache")}  # before the call
    out = built(*inputs)
    q, (k_new, v_new) = inputs[0], inputs[1:3]
    exact = {name: history[name].clone() for name in history}
    exact["k_cache"][:, :, start:start + chunk], exact["v_cache"][:, :, start:start + chunk] = k_new, v_new
    for name, rows in (("k_cache", k_new), ("v_cache", v_new)):  # the chunk's rows as the build stores them
        cached[name][:, :, start:start + chunk] = dequantized(built, name, name == "k_cache")[:, :, start:start + chunk]
    for i in range(chunk):
        p = start + i
        keys, values = cached["k_cache"].clone(), cached["v_cache"].clone()
        keys[:, :, p - window + 1:p + 1] = exact["k_cache"][:, :, p - window + 1:p + 1]
        values[:, :, p - window + 1:p + 1] = exact["v_cache"][:, :, p - window + 1:p + 1]
        want = F.scaled_dot_product_attention(q[:, :, i:i + 1], keys[:, :, :p + 1], values[:, :, :p + 1], enable_gqa=True)
        torch.testing.assert_close(out[:, :, i:i + 1], want, rtol=1e-5, atol=1e-5)
    # the rings now hold the chunk's last 3 rows (positions 6, 7, 8 at slots 0, 1, 2), centred keys
    ring = built.state_tensor("k_cache.recent")
    offset = built.state_tensor("k_cache.offset")
    torch.testing.assert_close(ring[:, :, [6 % window, 7 % window, 8 % window]], (k_new - offset)[:, :, 1:])


def test_rings_start_with_each_sequences_newest_held_rows_and_count_in_the_bytes():
    from coopt.fp8_cache import kv_cache_bytes, newest_rows_ring

    cache = torch.zeros(2, 1, 10, 2)
    cache[0, :, :6] = torch.arange(1, 7.0)[None, :, None]  # sequence 0 holds rows 0..5, sequence 1 none
    ring = newest_rows_ring(cache, cache * 10, 4)
    assert ring[0, 0, :, 0].tolist() == [50.0, 60.0, 30.0, 40.0]  # positions 4, 5, 2, 3 at slots p % 4
    assert not ring[1].any()
    record = {"granularity": "per-head", "caches": {"k": "k.scale"}, "scales": {"k.scale": [1.0]},
              "recent": {"window": 4, "rings": {"k": "k.recent"}, "dtypes": {"k.recent": "bfloat16"}}}
    sizes = kv_cache_bytes(record, {"k": cache})
    assert sizes["after"] == cache.numel() + 4 + 2 * 1 * 4 * 2 * 2  # fp8 rows, the scale, the bf16 ring
