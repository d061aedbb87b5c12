"""matmul_epilogue's narrow tiles (TILE_N): a GEMV tl.dot program owns TILE_N of its BLOCK_N
columns, so that N's tiles fill one wave of SMs without splitting K (q|k|v's 6144 columns: 128
programs of 48, not 96 of 64). The lanes past TILE_N load no weight row and store nothing: every
output is the plain point's, bit for bit (the same K loop a column); the space offers the twin
only where it adds programs; the advisor ranks it right behind its plain twin, so that a build on
the GPU measures both.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
from template_helpers import compile_for_hopper
from template_helpers import run_candidate as _run_candidate
from test_matmul_gemv_fusions import consumer_region, fused_region, gemv, make_inputs, producer_region

from coopt.candidates import diverse_top_k
from coopt.llm_advisor.heuristic import HeuristicAdvisor
from coopt.llm_advisor.protocol import AdviceRequest
from coopt.targets import H200
from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

FAMILY = MatmulEpilogueFamily()
run_candidate = partial(_run_candidate, FAMILY, H200)
DOT = gemv(16, 64, 64, stages=2)
SWAP = {**DOT, "SWAP_AB": True}


def both(load_candidate, region, point, tile, inputs, stem):
    """(plain outputs, narrow outputs) of `point` and its TILE_N twin."""
    plain = run_candidate(load_candidate, region, point, inputs, stem=f"{stem}_plain")
    narrow = run_candidate(load_candidate, region, {**point, "TILE_N": tile}, inputs, stem=f"{stem}_narrow")
    return plain, narrow


@pytest.mark.parametrize("point", [DOT, SWAP], ids=["dot", "swap"])
@pytest.mark.parametrize("m,n", [(3, 96), (32, 100)])  # 100: the last narrow tile is ragged
def test_narrow_consumer_of_statistics_matches_the_plain_point_bit_for_bit(m, n, point, load_candidate):
    region = consumer_region(m, n, 256)
    inputs = make_inputs(region, seed=1)
    inputs[2] = inputs[2].abs() * 64  # sums of squares are positive
    plain, narrow = both(load_candidate, region, point, 48, inputs, f"consumer_{m}_{n}")
    assert len(plain) == len(narrow) == 1 and torch.equal(narrow[0], plain[0])


def test_narrow_glu_masks_both_halves_and_matches_the_plain_point(load_candidate):
    region = consumer_region(5, 80, 128, glu=True)
    inputs = make_inputs(region, seed=2)
    inputs[2] = inputs[2].abs() * 64
    plain, narrow = both(load_candidate, region, SWAP, 48, inputs, "glu")
    assert torch.equal(narrow[0], plain[0])


def test_narrow_producer_writes_every_chunk_sum_once(load_candidate):
    """A tile of whole 64-column chunks in BLOCK_N 128: h, h * g and the chunk sums as the plain
    point's (the lanes past the tile hold no chunk of their own)."""
    region = producer_region(4, 192, 128)
    inputs = make_inputs(region, 10.0, seed=3)
    point = {**gemv(16, 128, 64, stages=2), "SWAP_AB": True}
    plain, narrow = both(load_candidate, region, point, 64, inputs, "producer")
    assert len(narrow) == 3 and all(torch.equal(a, b) for a, b in zip(narrow, plain))


def test_narrow_tiles_are_legal_only_as_unsplit_gemv_dot_points():
    region = consumer_region(32, 6144, 4096)
    swap32 = {**gemv(32, 64, 64, stages=2), "SWAP_AB": True}
    assert FAMILY.check(region, {**swap32, "TILE_N": 48}, H200) is None
    refused = {
        "GEMV kernel's tl.dot": {**gemv(1, 64, 64), "TILE_N": 48},
        "SPLIT_K=1": {**gemv(32, 64, 64, split=2), "TILE_N": 48},
        "multiple of 16 under BLOCK_N": {**swap32, "TILE_N": 40},
        "under BLOCK_N=64": {**swap32, "TILE_N": 64},
        "one wave": {**swap32, "TILE_N": 32},  # 192 programs
        "more programs than 132": {**SWAP, "TILE_N": 48},  # two row tiles of 16: 256 programs
    }
    for why, point in refused.items():
        assert why in (FAMILY.check(region, point, H200) or ""), why
    stats = producer_region(32, 4096, 4096)  # chunks of 64: no narrower whole-chunk tile under 128
    assert "multiple of it" in FAMILY.check(stats, {**gemv(16, 128, 64), "SWAP_AB": True, "TILE_N": 48}, H200)


def test_the_space_offers_the_one_wave_tile_where_it_adds_programs():
    assert FAMILY.param_space(consumer_region(32, 6144, 4096), H200)["TILE_N"] == [0, 48]  # q|k|v: 128 programs
    assert FAMILY.param_space(consumer_region(32, 14336, 4096, glu=True), H200)["TILE_N"] == [0, 112]  # gate|up
    for region in (producer_region(32, 4096, 4096),  # o, down: 64 = a plain BLOCK_N (64-column chunks)
                   fused_region((32,), 128256, 4096, "bfloat16", norm=False),  # the head: already many tiles
                   consumer_region(32, 96, 256)):  # a tile under 32 columns
        assert "TILE_N" not in FAMILY.param_space(region, H200)
    # o and down with their statistics in 32-column chunks: 128 programs of 32 on SWAP_AB's 64-row side
    o32 = producer_region(32, 4096, 4096)
    o32 = dataclasses.replace(o32, attrs={**o32.attrs, "row_squares": {**o32.attrs["row_squares"], "chunk": 32}})
    assert FAMILY.param_space(o32, H200)["TILE_N"] == [0, 32]
    assert FAMILY.check(o32, {**gemv(32, 64, 128, stages=5), "SWAP_AB": True, "TILE_N": 32}, H200) is None
    legal = FAMILY.legal_points(consumer_region(32, 6144, 4096), H200)
    narrow = [p for p in legal if p.get("TILE_N")]
    assert narrow and all(p["SPLIT_K"] == 1 and p["BLOCK_M"] >= 16 and p["BLOCK_N"] > 48 for p in narrow)
    plain = [p for p in legal if not p.get("TILE_N")]
    assert all({k: v for k, v in p.items() if k != "TILE_N"} in plain for p in narrow)  # each has its plain twin


def test_the_advisor_ranks_each_narrow_twin_right_behind_its_plain_twin_and_builds_measure_it():
    region = consumer_region(32, 6144, 4096)
    space = FAMILY.param_space(region, H200)
    legal = FAMILY.legal_points(region, H200, space)
    ranked = HeuristicAdvisor().advise(AdviceRequest(region, FAMILY.name, space, tuple(legal), H200.facts(), 3)).ranked
    first_narrow = next(i for i, p in enumerate(ranked) if p.get("TILE_N"))
    twin = {k: v for k, v in ranked[first_narrow].items() if k != "TILE_N"}
    assert not ranked[0].get("TILE_N")  # a build that measures nothing keeps a plain point
    assert any({k: v for k, v in p.items() if k != "TILE_N"} == twin for p in ranked[:first_narrow])
    assert any(p.get("TILE_N") for _, p in diverse_top_k(ranked, 3))  # a distinct kernel: among those timed


def test_a_narrow_point_compiles_for_sm90_pipelined_on_wgmma(tmp_path):
    pytest.importorskip("triton.backends.compiler")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the GPU tests compile it for real")
    region = consumer_region(32, 6144, 4096)
    point = {**gemv(32, 64, 128, stages=5), "SWAP_AB": True, "TILE_N": 48}
    assert FAMILY.check(region, point, H200) is None
    inputs = [torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in region.inputs]
    facts = compile_for_hopper([("narrow", FAMILY.render(region, point), inputs)], tmp_path)["narrow"]["_gemv_kernel"]
    assert facts["launches"] == 1 and facts["wgmma"] and facts["pipelined"]

