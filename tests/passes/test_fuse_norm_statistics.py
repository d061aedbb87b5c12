"""fuse-norm-statistics: a decode GEMV's RMSNorm prologue takes the sums of squares of its rows
(and h * g) from the GEMV region that produced h; batch-1 steps keep the in-loop norm; the built
model still matches eager."""

import pytest
import torch

from pass_helpers import kernels, run_pipeline
from test_fuse_decode_gemv import DecoderBlock

import coopt
from coopt.codegen.torch_lines import reference_module_source
from coopt.ir.dialect import RMSNormOp
from coopt.passes.registry import DEFAULT_PIPELINE, ROW_NORMS_PIPELINE

WITH_STATS = DEFAULT_PIPELINE  # fuse-norm-statistics is in the default since session 15
WIDTH = 64  # one chunk of the default 64 columns


def TwoLayerDecoder() -> DecoderBlock:
    """fuse-decode-gemv's two-block decoder (q * v stands for attention, SwiGLU MLPs, a final norm
    and lm_head) at hidden size 64, every norm weight random."""
    return DecoderBlock(width=WIDTH, ffn=96, weight_scale=8.0, random_out_norm=True)


def step(batch):
    return torch.randn(batch, 1, WIDTH, generator=torch.Generator().manual_seed(batch))


def test_norms_after_a_gemv_read_its_statistics():
    module, counters = run_pipeline(TwoLayerDecoder(), [step(3)], WITH_STATS)
    # layer 0's attention norm reads the step's input, not a GEMV region: it keeps its norm
    # (gate|up 0, q|k|v 1, gate|up 1 and lm_head's final norm take statistics)
    assert counters["fuse.norm_statistics"] == 4 and counters["fuse.norm_statistics.skipped.producer"] == 1
    regions = kernels(module)
    consumers = [k for k in regions if (k.family_attrs.get("prologue") or {}).get("kind") == "rms_norm_stats"]
    producers = [k for k in regions if k.family_attrs.get("row_squares")]
    assert len(consumers) == len(producers) == 4
    assert [k.family_attrs["prologue"]["kind"] for k in regions if k.family_attrs.get("prologue")].count("rms_norm") == 1
    for consumer in consumers:
        producer = consumer.inputs[0].owner
        assert producer in producers and consumer.inputs[2] is producer.results[-1]  # hg, then sq at squares_input
        assert consumer.inputs[0] is producer.results[-2]
        assert consumer.family_attrs["prologue"] == {"kind": "rms_norm_stats", "eps": 1e-5, "squares_input": 2}
        assert not any(isinstance(o, RMSNormOp) for o in consumer.body.block.ops)  # the norm is gone
        # the residual stream (h) still flows to the next residual add and to the output
        assert len(producer.results) == 3 and producer.results[-1].type.get_shape() == (1, 3)
    for producer in producers:
        assert producer.family_attrs["row_squares"] == {"chunk": 64, "weight_input": 3, "output": 0}
        assert [fn for _, fn, _ in producer.family_attrs["epilogue"]] == ["add"]  # o / down + residual
        source = reference_module_source(producer)
        assert "aten.sum.dim_IntList" in source and "aten.permute" in source


def test_batch_one_steps_keep_the_in_loop_norm():
    module, counters = run_pipeline(TwoLayerDecoder(), [step(1)], WITH_STATS)
    assert "fuse.norm_statistics" not in counters and counters["fuse.norm_statistics.skipped.rows"] == 5
    assert not any(k.family_attrs.get("row_squares") for k in kernels(module))
    _, counters = run_pipeline(TwoLayerDecoder(), [step(1)], WITH_STATS.replace("fuse-norm-statistics", "fuse-norm-statistics{min-rows=1}"))
    assert counters["fuse.norm_statistics"] == 4


def test_widths_off_the_chunk_are_left_alone():
    _, counters = run_pipeline(TwoLayerDecoder(), [step(3)], WITH_STATS.replace("fuse-norm-statistics", "fuse-norm-statistics{chunk=48}"))
    assert "fuse.norm_statistics" not in counters and counters["fuse.norm_statistics.skipped.shape"] == 4


@pytest.mark.parametrize("chunk", [64, 32])
def test_built_decoder_with_statistics_matches_eager(chunk, tmp_path):
    """Every region verified on a GEMV kernel (the interpreter without a GPU), the build matches
    eager; with 32-column chunks too (two sums a 64-wide row, BLOCK_N 32 legal in the producers:
    bench/decode.py mode coopt-normstats32)."""
    model = TwoLayerDecoder().eval()
    pipeline = WITH_STATS.replace("fuse-norm-statistics", f"fuse-norm-statistics{{chunk={chunk}}}")
    result = coopt.Pipeline(pipeline, top_k=1).build(model, (step(3),), tmp_path / "out")
    assert result.counters["fuse.norm_statistics"] == 4
    stats = [r for r in result.regions if r.summary.attrs.get("row_squares")
             or (r.summary.attrs.get("prologue") or {}).get("kind") == "rms_norm_stats"]
    assert len(stats) == 8
    assert {r.summary.attrs["row_squares"]["chunk"] for r in stats if r.summary.attrs.get("row_squares")} == {chunk}
    for region in stats:
        chosen = next((c for c in region.candidates if c.label == region.selected), None)
        assert chosen is not None and chosen.verified and chosen.params["GEMV"], (region.summary.name, region.reason)
    assert result.e2e["ok"]
    fresh = torch.randn(3, 1, WIDTH)
    with torch.no_grad():
        torch.testing.assert_close(coopt.load(tmp_path / "out", device="cpu")(fresh), model(fresh), rtol=1e-4, atol=1e-4)


def test_the_default_runs_it_after_every_gemv_region_exists():
    order = DEFAULT_PIPELINE.split(",")
    assert order.index("fuse-decode-gemv") < order.index("fuse-linear-epilogue") < order.index("fuse-norm-statistics")
    _, counters = run_pipeline(TwoLayerDecoder(), [step(3)], ROW_NORMS_PIPELINE)
    assert "fuse.norm_statistics" not in counters  # the pipeline it is measured against leaves the norms alone
