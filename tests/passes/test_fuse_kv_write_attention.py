"""fuse-kv-write-attention: a decode step's kv_write region and the decode attention reading the
caches it wrote become one decode_attention region (the write folded in); the built step still
matches eager, caches included; what it cannot take is left alone and counted."""

from __future__ import annotations

import json

import pytest
import torch
from test_decode_attention_raise import (DecodeStep, RopedDecodeStep, TwoLayerDecodeStep, build_and_compare, inputs,
                                         rotary_tables, rotate_half)
from xdsl.context import Context
from xdsl.rewriter import InsertPoint, Rewriter

import coopt
from coopt.ir.dialect import KernelOp
from coopt.passes.fuse_kv_write_attention import FuseKvWriteAttention
from coopt.passes.registry import DEFAULT_PIPELINE, UNFOLDED_KV_WRITE_PIPELINE
from coopt.passes.stats import collect_counters
from pass_helpers import kernels, run_pipeline


class RopedKeyStep(RopedDecodeStep):
    """K rotated before its cache write too, as a Llama layer does (q's rope inside the attention)."""

    def forward(self, q, k, v, input_pos):
        cos, sin = self.cos[input_pos], self.sin[input_pos]
        return super().forward(q, k * cos + rotate_half(k) * sin, v, input_pos)


class OwnKeyTablesStep(RopedDecodeStep):
    """K rotated by tables of its own (not the query's), gathered at the same position."""

    def __init__(self):
        super().__init__()
        k_cos, k_sin = rotary_tables(seed=3)
        self.register_buffer("k_cos", k_cos)
        self.register_buffer("k_sin", k_sin)

    def forward(self, q, k, v, input_pos):
        cos, sin = self.k_cos[input_pos], self.k_sin[input_pos]
        return super().forward(q, k * cos + rotate_half(k) * sin, v, input_pos)


class SharedTablesStep(DecodeStep):
    """q and K rotated by the same gathered cos, sin (one gather, as the Llama model does)."""

    def __init__(self):
        super().__init__()
        cos, sin = rotary_tables()
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, q, k, v, input_pos):
        cos, sin = self.cos[input_pos], self.sin[input_pos]
        rope = lambda x: x * cos + rotate_half(x) * sin  # noqa: E731
        return super().forward(rope(q), rope(k), v, input_pos)


def assert_folded_kernel_selected(out):
    """The build's one decode attention has a verified kernel, the one it runs unless a GPU
    measured the reference faster (these steps are tiny), and no kv_write region is left."""
    selection = json.loads((out / "selection.json").read_text())
    regions = selection["regions"].values()
    (attention,) = [r for r in regions if r["family"] == "decode_attention"]
    (kernel,) = [c for c in attention["candidates"] if c["family"] == "decode_attention"]
    assert kernel["verified"], kernel["verify"].get("failure")  # the whole line: a dict's repr is cut
    assert attention["selected"] == kernel["label"] or selection["measured"]
    assert not [r for r in regions if r["family"] == "kv_write"]


def families(module) -> list[str]:
    return [k.family.data for k in kernels(module)]


def test_the_write_and_the_attention_become_one_region():
    module, counters = run_pipeline(OwnKeyTablesStep(), inputs(5), DEFAULT_PIPELINE)
    assert counters["fuse.kv_write_attention"] == 1 and "kv_write" not in families(module)
    (region,) = [k for k in kernels(module) if k.family.data == "decode_attention"]
    attrs = region.family_attrs
    assert attrs["kv_write"] == {"positions_input": 6, "rope": True, "rope_tables_input": 9,
                                 "gathered_tables": True} and attrs["inplace"] == [1, 2]
    assert attrs["rope"] is True  # q's rope stays inside too
    # inputs: q, the caches before the write, lengths, q's cos and sin, then the write's own;
    # the tables whole (cos[input_pos] gathered inside), the step's gathers gone
    assert [str(v.type.get_shape()) for v in region.inputs[6:9]] == ["(1,)", "(1, 2, 1, 16)", "(1, 2, 1, 16)"]
    assert [str(region.inputs[i].type.get_shape()) for i in (4, 5, 9, 10)] == ["(32, 16)"] * 4
    assert len(region.inputs) == 11 and len(set(region.inputs)) == 11 and len(region.results) == 3
    assert counters["fuse.kv_write_attention.gathered_tables"] == 1 and not unfused_gathers(module)
    # without the pass the two regions stay apart
    module, counters = run_pipeline(OwnKeyTablesStep(), inputs(5), UNFOLDED_KV_WRITE_PIPELINE)
    assert "kv_write" in families(module) and not counters["fuse.kv_write_attention"]


def test_k_rows_gathered_apart_from_the_querys_tables_share_them():
    """q and K each gather cos[input_pos] from the same tables: once whole, one input."""
    module, counters = run_pipeline(RopedKeyStep(), inputs(5), DEFAULT_PIPELINE)
    (region,) = [k for k in kernels(module) if k.family.data == "decode_attention"]
    assert region.family_attrs["kv_write"] == {"positions_input": 6, "rope": True, "rope_tables_input": 4,
                                               "gathered_tables": True}
    assert len(region.inputs) == 9 and len(set(region.inputs)) == 9 and not unfused_gathers(module)


def unfused_gathers(module) -> list:
    """aten.index ops left outside every region."""
    return [op for op in module.walk() if not isinstance(op.parent_op(), KernelOp)
            and "aten.index.Tensor" in str(getattr(op, "target", ""))]


class TablesAtAnotherRow(RopedKeyStep):
    """Rotary rows gathered at input_pos - 1, not at the written position: left as rows."""

    def forward(self, q, k, v, input_pos):
        cos, sin = self.cos[input_pos - 1], self.sin[input_pos - 1]
        rope = lambda x: x * cos + rotate_half(x) * sin  # noqa: E731
        return DecodeStep.forward(self, rope(q), rope(k), v, input_pos)


def test_tables_gathered_elsewhere_stay_rows():
    module, counters = run_pipeline(TablesAtAnotherRow(), inputs(5), DEFAULT_PIPELINE)
    (region,) = [k for k in kernels(module) if k.family.data == "decode_attention"]
    assert counters["fuse.kv_write_attention"] == 1 and "gathered_tables" not in region.family_attrs["kv_write"]
    assert str(region.inputs[4].type.get_shape()) == "(1, 16)" and unfused_gathers(module)


def test_k_and_q_sharing_their_tables_pass_them_once():
    module, counters = run_pipeline(SharedTablesStep(), inputs(5), DEFAULT_PIPELINE)
    (region,) = [k for k in kernels(module) if k.family.data == "decode_attention"]
    assert counters["fuse.kv_write_attention"] == 1
    assert region.family_attrs["kv_write"]["rope_tables_input"] == 4 and len(region.inputs) == 9
    assert len(set(region.inputs)) == len(region.inputs)  # no value twice


def test_a_write_without_k_rope_folds_too():
    module, counters = run_pipeline(DecodeStep(), inputs(5), DEFAULT_PIPELINE)
    (region,) = [k for k in kernels(module) if k.family.data == "decode_attention"]
    assert counters["fuse.kv_write_attention"] == 1 and region.family_attrs["kv_write"]["rope"] is False
    assert len(region.inputs) == 7  # q, k, v, lengths, positions, k, v


def test_each_layer_folds_its_own_write():
    module, counters = run_pipeline(TwoLayerDecodeStep(), inputs(5), DEFAULT_PIPELINE)
    assert counters["fuse.kv_write_attention"] == 2 and families(module).count("decode_attention") == 2


def test_caches_read_elsewhere_keep_their_kv_write():
    class AlsoReturnsTheCache(DecodeStep):
        def forward(self, q, k, v, input_pos):
            return super().forward(q, k, v, input_pos), self.k_cache.sum(-1)

    module, counters = run_pipeline(AlsoReturnsTheCache(), inputs(5), DEFAULT_PIPELINE)
    assert counters["fuse.kv_write_attention.skipped.read_elsewhere"] == 1 and "kv_write" in families(module)


def with_fp8(knobs: str, pipeline: str = DEFAULT_PIPELINE) -> str:
    return pipeline.replace("fuse-attention,", f"fp8-kv-cache{knobs},fuse-attention,")


def test_per_token_fp8_scales_keep_their_kv_write():
    """Per-token scales are computed and stored by the write: not the folded form."""
    module, counters = run_pipeline(DecodeStep(), inputs(5), with_fp8("{granularity=per-token,scale-source=dynamic}"))
    assert counters["fuse.kv_write_attention.skipped.fp8"] == 1 and "kv_write" in families(module)


FP8_KNOBS = {"per-head": "", "per-tensor": "{granularity=per-tensor}", "smooth-k": "{smooth-k=true}",
             "smooth-k and smooth-v": "{smooth-k=true smooth-v=true}", "values-only": "{values-only=true}"}


@pytest.mark.parametrize("knobs", FP8_KNOBS)
def test_an_fp8_write_with_the_attentions_scales_folds(knobs):
    """Per-tensor / per-head scales: the write quantizes with the attention's own k_scale /
    v_scale (one input each) and its offsets (smooth-k / smooth-v) come last."""
    module, counters = run_pipeline(RopedKeyStep(), inputs(5), with_fp8(FP8_KNOBS[knobs]), calibrate=True)
    assert counters["fuse.kv_write_attention"] == counters["fuse.kv_write_attention.fp8"] == 1
    (region,) = [k for k in kernels(module) if k.family.data == "decode_attention"]
    assert "kv_write" not in families(module) and len(set(region.inputs)) == len(region.inputs)
    folded = region.family_attrs["kv_write"]
    assert folded["positions_input"] == 8  # after q, the caches, lengths, q's tables, the two scales
    names = [region.inputs[i].owner.ref.data for i in (6, 7)]
    assert names == ["k_cache.scale", "v_cache.scale"]
    offsets = {name: folded.get(f"{name}_offset_input") for name in "kv"}
    centred = {"smooth-k": "k", "smooth-k and smooth-v": "kv"}.get(knobs, "")
    assert [name for name, at in offsets.items() if at is not None] == list(centred)
    assert [region.inputs[at].owner.ref.data for at in offsets.values() if at is not None] == \
        [f"{name}_cache.offset" for name in centred]
    assert sorted(at for at in offsets.values() if at is not None) == list(range(len(region.inputs) - len(centred), len(region.inputs)))


def test_a_write_with_scales_of_its_own_is_left_alone():
    """One value, one input: a write quantizing with another scale than the attention reads with
    would need two (and would not be the same cache contract)."""
    pipeline = with_fp8("", DEFAULT_PIPELINE.split(",fuse-kv-write-attention")[0])
    module, _ = run_pipeline(RopedKeyStep(), inputs(5), pipeline, calibrate=True)
    (write,) = [k for k in kernels(module) if k.family.data == "kv_write"]
    other = write.inputs[7].owner.clone()
    Rewriter.insert_op(other, InsertPoint.before(write))
    write.operands = [other.results[0] if i == 7 else v for i, v in enumerate(write.operands)]
    with collect_counters() as counters:
        FuseKvWriteAttention().apply(Context(allow_unregistered=True), module)
    assert counters["fuse.kv_write_attention.skipped.scales_differ"] == 1 and "kv_write" in families(module)


@pytest.mark.parametrize("knobs", ["smooth-k", "values-only"])
def test_built_fp8_folded_steps_write_the_caches_their_unfolded_build_writes(knobs, tmp_path):
    """The folded kernel (Triton's interpreter here) stores the same e4m3 rows (fp32 keys: no
    rounding before the quantize) and attends as the build with kv_write apart: three steps, the
    last at the cache's end."""
    pipelines = {"folded": with_fp8(FP8_KNOBS[knobs]),
                 "unfolded": with_fp8(FP8_KNOBS[knobs], UNFOLDED_KV_WRITE_PIPELINE)}
    built = {}
    for name, pipeline in pipelines.items():
        torch.manual_seed(0)
        coopt.Pipeline(pipeline, top_k=1).build(RopedKeyStep(), inputs(3), tmp_path / name,
                                                calibration_inputs=[inputs(p) for p in (1, 2, 3)])
        built[name] = coopt.load(tmp_path / name)
    assert_folded_kernel_selected(tmp_path / "folded")
    device = built["folded"].w_k_cache.device
    for pos in (3, 4, 31):
        step = [x.to(device) for x in inputs(pos)]
        torch.testing.assert_close(built["folded"](*step), built["unfolded"](*step), rtol=1e-5, atol=1e-5)
        for cache in ("w_k_cache", "w_v_cache"):
            folded, unfolded = (getattr(built[name], cache) for name in pipelines)
            assert folded.dtype == unfolded.dtype and torch.equal(folded.float(), unfolded.float()), cache
    assert built["folded"].w_v_cache.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("step_class", [RopedKeyStep, OwnKeyTablesStep, SharedTablesStep, TablesAtAnotherRow])
def test_built_folded_steps_match_eager_and_write_the_caches(step_class, tmp_path):
    """The folded kernel (Triton's interpreter here) writes each step's K / V row as eager does
    and attends over it: three steps, the last at the cache's end."""
    out = tmp_path / "out"
    built = build_and_compare(step_class, out, DEFAULT_PIPELINE)
    assert_folded_kernel_selected(out)
    # the write's bounds still come from the state_update in the folded body: refused at call time
    with pytest.raises(ValueError, match=r"holds 32, outside \[0, 32\).*'k_cache'"):
        built.check_call(*[x.to(built.w_k_cache.device) for x in inputs(32)])


class BatchViewStep(torch.nn.Module):
    """2 sequences over a cache of 3: writes and attention through cache[:2], the batch views the
    fold takes inside the region (the kernel indexes the whole cache's first rows)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(4)
        self.register_buffer("k_cache", torch.randn(3, 2, 32, 16, generator=gen))
        self.register_buffer("v_cache", torch.randn(3, 2, 32, 16, generator=gen))
        self.register_buffer("cache_positions", torch.arange(32))

    def forward(self, q, k, v, input_pos):
        b = q.shape[0]
        self.k_cache[:b, :, input_pos] = k
        self.v_cache[:b, :, input_pos] = v
        mask = self.cache_positions[None, :] <= input_pos[:, None]
        return torch.nn.functional.scaled_dot_product_attention(
            q, self.k_cache[:b], self.v_cache[:b], attn_mask=mask, enable_gqa=True)


def batch_inputs(pos: int):
    gen = torch.Generator().manual_seed(pos)
    return (torch.randn(2, 4, 1, 16, generator=gen), torch.randn(2, 2, 1, 16, generator=gen),
            torch.randn(2, 2, 1, 16, generator=gen), torch.tensor([pos]))


def test_a_batch_view_of_a_larger_cache_folds(tmp_path):
    module, counters = run_pipeline(BatchViewStep(), batch_inputs(5), DEFAULT_PIPELINE)
    (region,) = [k for k in kernels(module) if k.family.data == "decode_attention"]
    assert counters["fuse.kv_write_attention"] == 1 and counters["fuse.kv_write.batch_view"] == 1
    assert region.inputs[1].type.get_shape()[0] == 3 and region.inputs[0].type.get_shape()[0] == 2
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where coopt.load puts the build
    eager, out = BatchViewStep().to(device), tmp_path / "out"
    coopt.Pipeline(DEFAULT_PIPELINE, top_k=1).build(BatchViewStep(), batch_inputs(5), out)
    assert_folded_kernel_selected(out)
    built = coopt.load(out)
    for pos in (6, 7, 31):
        step = [x.to(device) for x in batch_inputs(pos)]
        torch.testing.assert_close(built(*step), eager(*step), rtol=1e-4, atol=1e-4)
        # rows 0 and 1 written, row 2 (no sequence this step) untouched
        torch.testing.assert_close(built.w_k_cache, eager.k_cache, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(built.w_v_cache, eager.v_cache, rtol=1e-5, atol=1e-5)
