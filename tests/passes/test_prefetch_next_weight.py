"""prefetch-next-weight: a batched decode GEMV region takes the weight of the GEMV launched right
after it as its last input (for its kernel's L2 prefetch), only where nothing else runs between
them; its body never reads it; the built model still matches eager."""

import torch

from pass_helpers import kernels, run_pipeline
from test_fuse_norm_statistics import TwoLayerDecoder, step

import coopt
from coopt.codegen.torch_lines import reference_module_source
from coopt.ir.dialect import KernelOp, WeightOp
from coopt.passes.registry import DEFAULT_PIPELINE

PREFETCHING = DEFAULT_PIPELINE + ",prefetch-next-weight"


def matmul_regions(module) -> list[KernelOp]:
    return [k for k in kernels(module) if k.family.data == "matmul_epilogue"]


def test_each_gemv_followed_by_a_gemv_takes_its_weight():
    module, counters = run_pipeline(TwoLayerDecoder(), [step(3)], PREFETCHING)
    regions = matmul_regions(module)
    # per layer q|v -> (q * v, an elementwise region) -> o -> gate|up -> down -> the next layer's
    # q|v (the last down -> lm_head): o, gate|up and down take the next weight, q|v and lm_head
    # (nothing after it) do not
    assert counters["prefetch.next_weight"] == 6 and counters["prefetch.next_weight.skipped.next"] == 3
    linked = [k for k in regions if "tail_prefetch" in k.family_attrs]
    assert len(linked) == 6 and "tail_prefetch" not in regions[-1].family_attrs  # lm_head: nothing after it
    order = list(kernels(module))
    for producer in linked:
        consumer = order[order.index(producer) + 1]
        weight = producer.inputs[-1]
        assert consumer.family.data == "matmul_epilogue" and weight is consumer.inputs[1]
        assert isinstance(weight.owner, WeightOp)
        assert producer.family_attrs["tail_prefetch"] == {"input": len(producer.inputs) - 1, "layout": "nk"}
        # the body leaves the prefetched weight alone: its block argument has no use
        assert not producer.body.block.args[-1].uses
        assert "row_squares" not in producer.family_attrs or \
            producer.family_attrs["row_squares"]["weight_input"] == len(producer.inputs) - 2
    skipped = [k for k in regions if "tail_prefetch" not in k.family_attrs][:-1]
    assert all(order[order.index(k) + 1].family.data != "matmul_epilogue" for k in skipped)


def test_batch_one_and_the_default_pipeline_take_nothing():
    module, counters = run_pipeline(TwoLayerDecoder(), [step(1)], PREFETCHING)
    assert "prefetch.next_weight" not in counters
    assert counters["prefetch.next_weight.skipped.rows"] == len(matmul_regions(module)) >= 8
    module, counters = run_pipeline(TwoLayerDecoder(), [step(3)], DEFAULT_PIPELINE)
    assert not any("tail_prefetch" in k.family_attrs for k in kernels(module))


def test_a_region_with_the_next_weight_keeps_its_reference():
    plain, _ = run_pipeline(TwoLayerDecoder(), [step(3)], DEFAULT_PIPELINE)
    linked, _ = run_pipeline(TwoLayerDecoder(), [step(3)], PREFETCHING)
    before = {i: reference_module_source(k) for i, k in enumerate(matmul_regions(plain))}
    after = {i: reference_module_source(k) for i, k in enumerate(matmul_regions(linked))}
    for i, k in enumerate(matmul_regions(linked)):
        if "tail_prefetch" in k.family_attrs:  # one argument more, the same computation
            assert after[i].count("aten.") == before[i].count("aten.") and after[i] != before[i]
        else:
            assert after[i] == before[i]


def test_built_decoder_with_the_next_weights_matches_eager(tmp_path):
    """Every linked region verified on a GEMV kernel (the interpreter: the prefetch itself off),
    the build matches eager."""
    model = TwoLayerDecoder().eval()
    result = coopt.Pipeline(PREFETCHING, top_k=1).build(model, (step(3),), tmp_path / "out")
    linked = [r for r in result.regions if r.summary.attrs.get("tail_prefetch")]
    assert len(linked) == 6
    for region in linked:
        chosen = next((c for c in region.candidates if c.label == region.selected), None)
        assert chosen is not None and chosen.verified and chosen.params["GEMV"], (region.summary.name, region.reason)
    assert result.e2e["ok"]
    x = torch.randn(3, 1, x_width := step(3).shape[-1], generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(coopt.load(tmp_path / "out")(x), model(x), rtol=2e-2, atol=2e-2 * x_width ** 0.5)
