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


class EmbeddedDecoder(torch.nn.Module):
    """The two-block decoder behind a token embedding, as a Llama step starts: layer 0's norm
    reads the embedding's rows."""

    def __init__(self, vocab: int = 50):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, WIDTH)
        self.decoder = TwoLayerDecoder()

    def forward(self, ids):
        return self.decoder(self.embed(ids))


def tokens(batch, seed=0, vocab=50):
    return torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(seed))


def test_the_first_norm_reads_statistics_of_the_embedding_rows():
    module, counters = run_pipeline(EmbeddedDecoder(), [tokens(3)], WITH_STATS)
    assert counters["fuse.norm_statistics"] == 5 and "fuse.norm_statistics.skipped.producer" not in counters
    regions = kernels(module)
    gathers = [k for k in regions if k.family.data == "embedding_rows"]
    assert len(gathers) == 1
    gather = gathers[0]
    assert gather.family_attrs == {"row_squares": {"chunk": 64, "weight_input": 2, "output": 0},
                                   "index_input": 1, "index_bound": [0, 0]}
    table, ids, g = gather.inputs
    assert table.type.get_shape() == (50, WIDTH) and str(ids.type.element_type) == "i64" and g.type.get_shape() == (WIDTH,)
    h, hg, sq = gather.results
    consumer = next(iter(hg.uses)).operation  # layer 0's q|k|v reads hg and sq
    assert consumer.family_attrs["prologue"]["kind"] == "rms_norm_stats" and consumer.inputs[2] is sq
    # the residual stream: h goes on to layer 0's o + residual
    assert any(u.operation.family_attrs.get("epilogue") for u in h.uses)
    assert not any(k.family_attrs.get("prologue", {}).get("kind") == "rms_norm" for k in regions)
    _, counters = run_pipeline(EmbeddedDecoder(), [tokens(3)],
                               WITH_STATS.replace("fuse-norm-statistics", "fuse-norm-statistics{embedding=false}"))
    assert counters["fuse.norm_statistics"] == 4 and counters["fuse.norm_statistics.skipped.producer"] == 1


def test_built_decoder_with_embedding_rows_matches_eager(tmp_path):
    """The embedding_rows template (the interpreter without a GPU) verified and selected; the
    build matches eager on other tokens, with no ATen op left outside a region but views."""
    model = EmbeddedDecoder().eval()
    result = coopt.Pipeline(WITH_STATS, top_k=1).build(model, (tokens(3),), tmp_path / "out")
    gather = next(r for r in result.regions if r.summary.family == "embedding_rows")
    chosen = next(c for c in gather.candidates if c.label == gather.selected)
    assert chosen.family == "embedding_rows" and chosen.verified, gather.reason
    assert result.e2e["ok"]
    fresh = tokens(3, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(coopt.load(tmp_path / "out", device="cpu")(fresh), model(fresh), rtol=1e-4, atol=1e-4)
