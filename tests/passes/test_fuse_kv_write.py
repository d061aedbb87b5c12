"""fuse-kv-write: a step's K and V cache writes (with K's rope and an fp8 quantize) become one
in-place kv_write region; what it cannot take is left alone and counted."""

from __future__ import annotations

import json

import pytest
import torch
from xdsl.context import Context
from xdsl.dialects.builtin import Float8E4M3FNType, TensorType, f32
from xdsl.rewriter import InsertPoint, Rewriter

from coopt.codegen.torch_lines import reference_module_source
from coopt.ir.dialect import QuantizeFp8Op, RopeOp, StateUpdateOp, WeightOp
from coopt.passes.registry import DEFAULT_PIPELINE, parse_pipeline_text
from coopt.passes.stats import collect_counters
from coopt.runtime.kernel_loader import load_module_from_source
from pass_helpers import kernels, run_pipeline
from test_paged_kv import PromptStep

UP_TO_RAISE = "inplace-state-writes,raise-patterns"
FUSE = "inplace-state-writes,raise-patterns,fuse-kv-write,fuse-rope"


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


class Step(torch.nn.Module):
    """One attention layer's cache write, gpt-fast style: cache[:B, :, pos] = rope(k), v."""

    def __init__(self, b_max=1, batch=None, k_rope_elsewhere=False, v_positions_offset=False):
        super().__init__()
        self.batch, self.k_rope_elsewhere, self.offset = batch, k_rope_elsewhere, v_positions_offset
        self.register_buffer("k_cache", torch.zeros(b_max, 2, 16, 8))
        self.register_buffer("v_cache", torch.zeros(b_max, 2, 16, 8))

    def forward(self, k, v, cos, sin, pos):
        k = k * cos + rotate_half(k) * sin
        b = self.batch or k.shape[0]
        self.k_cache[:b, :, pos] = k
        self.v_cache[:b, :, pos + 1 if self.offset else pos] = v
        out = self.k_cache.sum(-1) + self.v_cache.sum(-1)
        return out + k.sum() if self.k_rope_elsewhere else out


def inputs(b=1, t=1):
    torch.manual_seed(0)
    return [torch.randn(b, 2, t, 8), torch.randn(b, 2, t, 8), torch.randn(t, 8), torch.randn(t, 8), torch.arange(3, 3 + t)]


def kv_writes(module):
    return [k for k in kernels(module) if k.family.data == "kv_write"]


@pytest.mark.parametrize("b,t", [(1, 1), (2, 1), (1, 3)], ids=["batch1-view", "batch2", "prompt"])
def test_k_and_v_writes_and_ks_rope_become_one_region(b, t):
    module, counters = run_pipeline(Step(b_max=b), inputs(b, t), FUSE)
    (region,) = kv_writes(module)
    assert region.family_attrs == {"rope": True, "quant": "none", "inplace": [0, 1]}
    assert counters["fuse.kv_write"] == counters["fuse.kv_write.rope"] == 1 and not counters["fuse.rope"]
    body = list(region.body.block.ops)
    assert [type(op).__name__ for op in body] == ["RopeOp", "StateUpdateOp", "StateUpdateOp", "YieldOp"]
    # inputs in schema order: caches (weights), positions, k, v [B, Hkv, T, D], cos, sin
    assert [v.owner.ref.data for v in region.inputs[:2]] == ["k_cache", "v_cache"]
    assert [v.type.get_shape() for v in region.inputs[3:5]] == [(b, 2, t, 8)] * 2
    # no state_update outside the region, and the caches' readers read the region's results
    assert not [op for op in module.walk() if isinstance(op, StateUpdateOp) and op.parent_op() is not region]
    assert all(use.operation.parent_op() is not region for r in region.results for use in r.uses)
    assert len([u for r in region.results for u in r.uses]) >= 2


def test_reference_module_writes_its_inputs_in_place_and_returns_them(tmp_path):
    module, _ = run_pipeline(Step(), inputs(), FUSE)
    (region,) = kv_writes(module)
    reference = load_module_from_source(reference_module_source(region), tmp_path, "reference")
    k_cache, v_cache = torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16, 8)
    k, v, cos, sin, pos = inputs()
    out = reference.run(k_cache, v_cache, pos, k, v, cos, sin)
    assert out[0] is k_cache and out[1] is v_cache
    torch.testing.assert_close(k_cache[:, :, 3], (k * cos + rotate_half(k) * sin)[:, :, 0])
    torch.testing.assert_close(v_cache[:, :, 3], v[:, :, 0])
    assert not k_cache[:, :, 4:].any()


def test_rope_read_elsewhere_stays_its_own_region():
    module, counters = run_pipeline(Step(k_rope_elsewhere=True), inputs(), FUSE)
    (region,) = kv_writes(module)
    assert region.family_attrs["rope"] is False and counters["fuse.rope"] == 1
    assert isinstance(region.inputs[3].owner.body.block.first_op, RopeOp)  # k comes from the rope region


def test_default_pipeline_fuses_before_fuse_rope():
    assert DEFAULT_PIPELINE.index("fuse-kv-write") < DEFAULT_PIPELINE.index("fuse-rope")
    module, counters = run_pipeline(Step(), inputs())
    assert counters["fuse.kv_write.rope"] == 1 and len(kv_writes(module)) == 1


def test_unmatched_writes_are_left_alone_and_counted():
    module, counters = run_pipeline(Step(v_positions_offset=True), inputs(), FUSE)  # V at other positions
    assert not kv_writes(module)
    assert counters["fuse.kv_write.skipped.unpaired"] >= 1, counters
    assert len([op for op in module.walk() if isinstance(op, StateUpdateOp)]) >= 2


@pytest.mark.parametrize("dynamic", [False, True], ids=["first-row-of-two", "dynamic-batch"])
def test_a_write_of_the_first_rows_takes_the_whole_cache_and_slices_it_inside(dynamic, tmp_path):
    # cache[:B] of a bigger cache: B = 1 of 2 (static), or the dynamic batch (2 of at most 4)
    batch = torch.export.Dim("batch", min=1, max=4)
    shapes = ({0: batch}, {0: batch}, None, None, None) if dynamic else None
    model, b, b_max = (Step(b_max=4), 2, 4) if dynamic else (Step(b_max=2, batch=1), 1, 2)
    module, counters = run_pipeline(model, inputs(b), FUSE, dynamic_shapes=shapes)
    (region,) = kv_writes(module)
    assert counters["fuse.kv_write.batch_view"] == 1 and not counters.get("fuse.kv_write.skipped.sliced_cache")
    assert [v.owner.ref.data for v in region.inputs[:2]] == ["k_cache", "v_cache"]  # the whole buffers
    body = [getattr(op, "target", None) and op.target.data for op in region.body.block.ops]
    assert body.count("aten.slice.Tensor") == 2 and body.count("aten.sym_size.int") == (2 if dynamic else 0)
    # the reference writes the first B rows of its cache inputs in place, B from k
    reference = load_module_from_source(reference_module_source(region), tmp_path, "reference")
    k_cache, v_cache = torch.zeros(b_max, 2, 16, 8), torch.zeros(b_max, 2, 16, 8)
    k, v, cos, sin, pos = inputs(b)
    out = reference.run(k_cache, v_cache, pos, k, v, cos, sin)
    assert out[0] is k_cache and out[1] is v_cache
    torch.testing.assert_close(k_cache[:b, :, 3], (k * cos + rotate_half(k) * sin)[:, :, 0])
    torch.testing.assert_close(v_cache[:b, :, 3], v[:, :, 0])
    assert not k_cache[b:].any() and not v_cache[:, :, 4:].any()


def _quantize_writes(module, granularity):
    """What fp8-kv-cache does to each write: value -> quantize_fp8(value, <cache>.scale)."""
    for update in [op for op in module.walk() if isinstance(op, StateUpdateOp)]:
        index = update.call["args"][2]["$t"]
        value = update.inputs[index]
        heads = update.inputs[0].type.get_shape()[1]
        scale_shape = {"per-tensor": [1], "per-head": [heads], "per-token": list(value.type.get_shape())[:-1]}[granularity]
        scale = WeightOp(update.ref.data + ".scale", TensorType(f32, scale_shape))
        fp8 = TensorType(Float8E4M3FNType(), value.type.get_shape(), value.type.encoding)
        quantize = QuantizeFp8Op(value, scale.result, granularity, fp8)
        Rewriter.insert_op([scale, quantize], InsertPoint.before(update))
        operands = list(update.operands)
        operands[index] = quantize.results[0]
        update.operands = operands


def _fuse(module):
    with collect_counters() as counters:
        for compiler_pass in parse_pipeline_text("fuse-kv-write,fuse-rope"):
            compiler_pass.apply(Context(allow_unregistered=True), module)
        module.verify()
    return counters


@pytest.mark.parametrize("granularity", ["per-tensor", "per-head"])
def test_quantized_writes_are_absorbed(granularity):
    module, _ = run_pipeline(Step(), inputs(), UP_TO_RAISE)  # batch 1: the write's value is a [Hkv, T, D] view
    _quantize_writes(module, granularity)
    counters = _fuse(module)
    (region,) = kv_writes(module)
    assert region.family_attrs == {"rope": True, "quant": granularity, "inplace": [0, 1]}
    assert counters["fuse.kv_write.quantized"] == 1
    assert [v.owner.ref.data for v in region.inputs[7:]] == ["k_cache.scale", "v_cache.scale"]
    quantizes = [op for op in region.body.block.ops if isinstance(op, QuantizeFp8Op)]
    # rebuilt on the [B, Hkv, T, D] value the schema names (the leading-1 view is gone)
    assert [q.x.type.get_shape() for q in quantizes] == [(1, 2, 1, 8)] * 2
    assert not [op for op in module.walk() if isinstance(op, QuantizeFp8Op) and op.parent_op() is not region]


def test_per_token_scales_that_are_not_computed_from_the_rows_are_left_alone():
    module, _ = run_pipeline(Step(), inputs(), UP_TO_RAISE)
    _quantize_writes(module, "per-token")  # scales from a weight, written nowhere
    counters = _fuse(module)
    assert not kv_writes(module) and counters["fuse.kv_write.skipped.per_token"] == 2


# -- per-token fp8 (fp8-kv-cache{granularity=per-token}): the scales' computation and write absorbed

PER_TOKEN = UP_TO_RAISE + ",fp8-kv-cache{granularity=per-token,scale-source=dynamic,headroom=1.5}"


class DynamicBatchPromptStep(PromptStep):
    """A prompt over the first B rows of caches for up to 4 sequences, B the dynamic batch."""

    def __init__(self):
        super().__init__(b_max=4)

    def forward(self, q, k, v, pos):
        b = k.shape[0]
        self.k_cache[:b, :, pos] = k
        self.v_cache[:b, :, pos] = v
        mask = self.cache_positions[None, :] <= pos[:, None]
        return torch.nn.functional.scaled_dot_product_attention(q, self.k_cache[:b], self.v_cache[:b], attn_mask=mask,
                                                                enable_gqa=True)


def per_token_steps():
    """(name, model, inputs, dynamic shapes): a prompt over a batch-1 cache (the export writes
    [Hkv, T, D] views), a batch-2 prompt, a ragged step (per-row writes with K's rope), a prompt
    of a dynamic batch (2 of at most 4: the caches and scale buffers written through [:B])."""
    from test_paged_kv import prompt_inputs
    from test_ragged_decode import RaggedStep, inputs as ragged_inputs

    torch.manual_seed(1)
    batch1 = [torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.arange(4, 7)]
    batch = torch.export.Dim("batch", min=1, max=4)
    return [("batch1-prompt", PromptStep(b_max=1), batch1, None), ("prompt", PromptStep(), prompt_inputs(), None),
            ("ragged", RaggedStep(), ragged_inputs(), None),
            ("dynamic-batch", DynamicBatchPromptStep(), prompt_inputs(), ({0: batch}, {0: batch}, {0: batch}, None))]


PER_TOKEN_CASES = ["batch1-prompt", "prompt", "ragged", "dynamic-batch"]


@pytest.mark.parametrize("case", range(len(PER_TOKEN_CASES)), ids=PER_TOKEN_CASES)
def test_per_token_scales_are_computed_and_written_in_the_region(case):
    name, model, args, shapes = per_token_steps()[case]
    module, counters = run_pipeline(model, args, PER_TOKEN + ",fuse-attention,fuse-kv-write,fuse-rope",
                                    dynamic_shapes=shapes)
    (region,) = kv_writes(module)
    rope = name == "ragged"
    assert region.family_attrs["quant"] == "per-token" and region.family_attrs["headroom"] == 1.5
    assert region.family_attrs["inplace"] == [0, 1, 5 + 2 * rope, 6 + 2 * rope] and region.family_attrs["rope"] == rope
    assert counters["fuse.kv_write.per_token"] == 1 and not [k for k in counters if "skipped" in k]
    assert [v.owner.ref.data for v in region.inputs[5 + 2 * rope:7 + 2 * rope]] == ["k_cache.scale", "v_cache.scale"]
    # the region's outputs replace the scale buffers' writes too: the attention reads them
    (attention,) = [k for k in kernels(module) if k.family.data != "kv_write"]
    read = [*attention.inputs[1:3], *attention.inputs[4:6]]  # caches and scales (ragged: through [:B] slices)
    assert all(v.owner is region or v.owner.inputs[0].owner is region for v in read)
    body = [getattr(op, "target", None) and op.target.data or type(op).__name__ for op in region.body.block.ops]
    assert body.count("aten.amax.default") == 2 and body.count("QuantizeFp8Op") == 2
    assert body.count("aten.index_put_.default") == 4
    # nothing of the per-token chain is left outside
    assert not [op for op in module.walk() if getattr(op, "target", None) is not None and op.parent_op() is not region
                and op.target.data in ("aten.abs.default", "aten.amax.default", "aten.clamp_min.default")]
    assert not [op for op in module.walk() if isinstance(op, (QuantizeFp8Op, StateUpdateOp)) and op.parent_op() is not region]
    if name == "dynamic-batch":  # the whole buffers in, each sliced inside to the value's batch
        assert counters["fuse.kv_write.batch_view"] == 1
        assert body.count("aten.slice.Tensor") == 4 and body.count("aten.sym_size.int") == 4


@pytest.mark.parametrize("case", range(len(PER_TOKEN_CASES)), ids=PER_TOKEN_CASES)
def test_per_token_reference_writes_what_the_unfused_program_writes(case, tmp_path):
    """The region's reference module (its eager fallback) against the unfused ops: the same fp8
    rows and scales in the caches and scale buffers, nothing else written."""
    from test_paged_kv import run_program

    name, model, args, shapes = per_token_steps()[case]
    state = {n: b.clone() for n, b in model.named_buffers()}
    fp8 = {"k_cache": torch.zeros(state["k_cache"].shape).to(torch.float8_e4m3fn),
           "v_cache": torch.zeros(state["v_cache"].shape).to(torch.float8_e4m3fn),
           "k_cache.scale": torch.rand(state["k_cache"].shape[:3]), "v_cache.scale": torch.rand(state["k_cache"].shape[:3])}
    results = []
    for pipeline in (PER_TOKEN + ",fuse-attention", PER_TOKEN + ",fuse-attention,fuse-kv-write,fuse-rope"):
        module, _ = run_pipeline(type(model)(), args, pipeline, dynamic_shapes=shapes)
        weights = {"cache_positions": state["cache_positions"], **{n: t.clone() for n, t in fp8.items()}}
        out = run_program(module, weights, args, tmp_path / str(len(results)))
        results.append((out, weights))
    (unfused, before), (fused, after) = results
    torch.testing.assert_close(fused, unfused, rtol=0, atol=0)
    for name in fp8:
        assert torch.equal(after[name].float(), before[name].float()), name
    assert (before["k_cache.scale"] != fp8["k_cache.scale"]).sum() > 0  # the step did write scales


def test_a_dynamic_batch_per_token_build_writes_its_rows_and_scales_through_the_kernel(tmp_path):
    # built twice (kv_write kernel / the writes unfused), then called with 2, 4, 1 and 3 rows:
    # the same fp8 rows and scales land in the first B rows, the rows past B keep what they held
    import re

    import coopt
    from test_paged_kv import prompt_inputs

    batch = torch.export.Dim("batch", min=1, max=4)
    shapes = ({0: batch}, {0: batch}, {0: batch}, None)
    per_token = "fp8-kv-cache{granularity=per-token,scale-source=dynamic}"
    built = {}
    for name, drop in (("fused", ""), ("unfused", "fuse-kv-write")):
        passes = [p for p in DEFAULT_PIPELINE.split(",") if p != drop]
        pipeline = re.sub(r"(^|,)raise-patterns", lambda m: f"{m.group(0)},{per_token}", ",".join(passes), count=1)
        torch.manual_seed(0)  # the same cache contents for both builds
        coopt.Pipeline(pipeline, top_k=1, kv_cache="fp8").build(DynamicBatchPromptStep(), tuple(prompt_inputs()),
                                                                tmp_path / name, dynamic_shapes=shapes)
        built[name] = coopt.load(tmp_path / name)
    selection = json.loads((tmp_path / "fused" / "selection.json").read_text())["regions"]
    (kv,) = [r for r in selection.values() if r["family"] == "kv_write"]
    assert [c["verified"] for c in kv["candidates"] if c["family"] == "kv_write"] == [True]
    assert "kv_write" not in json.dumps(json.loads((tmp_path / "unfused" / "selection.json").read_text()))
    names = ("k_cache", "v_cache", "k_cache.scale", "v_cache.scale")
    initial = {n: built["fused"].state_tensor(n).clone() for n in names}
    torch.manual_seed(2)
    for rows, start in ((2, 10), (4, 20), (1, 25), (3, 30)):
        args = [torch.randn(rows, 4, 5, 8), torch.randn(rows, 2, 5, 8), torch.randn(rows, 2, 5, 8),
                torch.arange(start, start + 5)]
        outs = [built[name](*args) for name in ("fused", "unfused")]
        torch.testing.assert_close(outs[0], outs[1], rtol=0.05, atol=0.05)
        for n in names:
            fused, unfused = (built[name].state_tensor(n).float() for name in ("fused", "unfused"))
            torch.testing.assert_close(fused, unfused, rtol=0.07, atol=1e-6)  # e4m3: one rounding step at most
        written = built["fused"].state_tensor("k_cache.scale")[:rows, :, start:start + 5]
        assert (written != initial["k_cache.scale"][:rows, :, start:start + 5]).all()
    for n in names:  # row 3 was written only by the 4-row call, at positions 20..24
        later = built["fused"].state_tensor(n)[3].float()
        assert torch.equal(later[:, :20], initial[n][3].float()[:, :20]), n


def test_quantize_knob_off_leaves_quantized_writes():
    module, _ = run_pipeline(Step(), inputs(), UP_TO_RAISE)
    _quantize_writes(module, "per-head")
    with collect_counters() as counters:
        parse_pipeline_text("fuse-kv-write{quantize=false}")[0].apply(Context(allow_unregistered=True), module)
    assert not kv_writes(module) and counters["fuse.kv_write.skipped.quantized"] == 2
