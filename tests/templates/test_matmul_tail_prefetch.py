"""matmul_epilogue's tail prefetch (attrs "tail_prefetch", prefetch-next-weight): a GEMV region
takes the next GEMV's weight as its last input and, once its own weight is streamed, pulls that
weight's first bytes into L2. The input never changes a result; only GEMV points take it; the
plan says which bytes (each row's first bytes at every split's first K step of the next kernel,
within the budget); and the prefetch compiles for sm_90. In Triton's interpreter the prefetch is
off (inline PTX); on the GPU machine the outputs are compared with it on.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from template_helpers import compile_for_hopper, on_test_device
from template_helpers import run_candidate as _run_candidate
from test_matmul_gemv_fusions import STATS_POINTS, consumer_region, gemv, make_inputs, producer_region

from coopt.ir.region import TensorSpec
from coopt.targets import H200
from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

FAMILY = MatmulEpilogueFamily()
run_candidate = partial(_run_candidate, FAMILY, H200)
BUDGET = 8 << 20


def with_prefetch(region, next_shape=(256, 301), layout="nk"):
    """`region` taking the next GEMV's weight (bf16, `next_shape`) as its last input."""
    return dataclasses.replace(region, inputs=(*region.inputs, TensorSpec(next_shape, "bfloat16")),
                               attrs={**region.attrs, "tail_prefetch": {"input": len(region.inputs), "layout": layout}})


def test_the_next_weight_is_an_input_only_gemv_points_take_and_no_byte_of_the_region():
    producer = producer_region(32, 192, 301)
    region = with_prefetch(producer)
    assert FAMILY.matches(region)
    assert FAMILY.check(region, STATS_POINTS["dot_split"], H200) is None
    tile = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
    assert "GEMV kernel only" in FAMILY.check(region, tile, H200) and "prefetch" in FAMILY.check(region, tile, H200)
    assert region.bytes_moved({}) == producer.bytes_moved({})  # only pulled into L2 for the next kernel
    # the prefetched input is the last one, a matrix, in a layout the plan knows
    for attrs in ({"input": 0, "layout": "nk"}, {"input": len(region.inputs) - 1, "layout": "kk"}):
        assert not FAMILY.matches(dataclasses.replace(region, attrs={**region.attrs, "tail_prefetch": attrs}))


@pytest.mark.parametrize("point", ["fma", "dot_split", "swap", "dot_stream"])
def test_outputs_are_bit_for_bit_those_without_the_prefetch(point, load_candidate):
    m = 1 if STATS_POINTS[point]["BLOCK_M"] == 1 else 32
    producer = producer_region(m, 192, 301)
    inputs = make_inputs(producer, 30.0, seed=3)
    want = run_candidate(load_candidate, producer, STATS_POINTS[point], inputs, stem=f"plain_{point}")
    module = load_candidate(FAMILY.render(with_prefetch(producer), STATS_POINTS[point]), f"prefetch_{point}")
    # on: on a Hopper GPU only (inline PTX); under the interpreter the module says it is off
    assert module.use_tail_prefetch(BUDGET, split_k=2, block_k=64) == (torch.cuda.is_available() and
                                                                      torch.cuda.get_device_capability()[0] >= 9)
    following = make_inputs(consumer_region(m, 256, 301), seed=4)[1]
    got = module.run(*on_test_device([*inputs, following]))
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def load_plan_module(load_candidate, layout="nk", next_shape=(256, 301)):
    return load_candidate(FAMILY.render(with_prefetch(producer_region(32, 192, 301), next_shape, layout),
                                        STATS_POINTS["dot_split"]), f"plan_{layout}")


def test_the_plan_takes_each_rows_first_bytes_at_every_split_within_the_budget(load_candidate):
    module = load_plan_module(load_candidate)
    w = torch.zeros(4096, 14336, dtype=torch.bfloat16)  # down's weight ([N, K]), read in 2 splits of 256-steps
    module.PREFETCH.update(bytes=BUDGET, split_k=2, block_k=256)
    ptr, rows, row_stride, runs, run_stride, run_bytes = module._prefetch_plan(w)
    assert ptr is w and (rows, row_stride, runs, run_stride) == (4096, 14336, 2, 28 * 256)
    assert run_bytes == 1024 and rows * runs * run_bytes == BUDGET
    # a budget past the splits' ranges stops at them; off, or under 16 bytes a run: no rows
    module.PREFETCH.update(bytes=1 << 40)
    assert module._prefetch_plan(w)[5] == 28 * 256 * 2
    for budget in (0, 4096 * 2 * 15):
        module.PREFETCH.update(bytes=budget)
        assert module._prefetch_plan(w)[1] == 0
    module.PREFETCH.update(bytes=BUDGET)
    assert module._prefetch_plan(w.t())[1] == 0  # the K dim strided: no contiguous runs


def test_the_plan_of_a_kn_weight_takes_whole_rows_at_every_split(load_candidate):
    module = load_plan_module(load_candidate, "kn", (301, 256))
    w = torch.zeros(4096, 6144, dtype=torch.bfloat16)  # [K, N]
    module.PREFETCH.update(bytes=BUDGET, split_k=2, block_k=128)
    _, rows, row_stride, runs, run_stride, run_bytes = module._prefetch_plan(w)
    assert (row_stride, runs, run_stride, run_bytes) == (6144, 2, 2048 * 6144, 6144 * 2)
    assert rows == BUDGET // (6144 * 2 * 2) and rows * runs * run_bytes <= BUDGET


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile for real when they run")
def test_the_prefetch_compiles_for_hopper_and_only_when_on(tmp_path):
    jobs = []
    for point in ("dot32_split", "swap", "fma"):
        m = 1 if STATS_POINTS[point]["BLOCK_M"] == 1 else 32
        region = with_prefetch(producer_region(m, 512, 4096), (1024, 4096))
        inputs = make_inputs(region, seed=1)
        source = FAMILY.render(region, STATS_POINTS[point] if point != "dot32_split" else gemv(32, 64, 256, split=2))
        on = source.replace('PREFETCH = {"bytes": 0,', f'PREFETCH = {{"bytes": {BUDGET},', 1)
        assert on != source
        jobs += [(f"{point}_on", on, inputs), (f"{point}_off", source, inputs)]
    compiled = compile_for_hopper(jobs, tmp_path)
    for label, kernels in compiled.items():
        assert kernels["_gemv_kernel"]["bulk_prefetch"] == (1 if label.endswith("_on") else 0), label
