"""HeuristicAdvisor: sensible first choices per family, determinism, legal order for unknowns."""

from __future__ import annotations

from dataclasses import replace

from advisor_support import product_points  # pytest's default import mode puts this folder on sys.path

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.llm_advisor import AdviceRequest, HeuristicAdvisor
from coopt.targets import H200

FACTS = H200.facts()


def first(request: AdviceRequest) -> dict:
    return HeuristicAdvisor().advise(request).ranked[0]


def test_decode_matmul_ranks_small_block_m_first(make_matmul_request):
    best = first(make_matmul_request(1))
    assert best["BLOCK_M"] == 16
    assert best["BLOCK_K"] == 128  # long contiguous weight reads
    assert best["BLOCK_N"] >= 32 and best["num_warps"] == 4


def test_large_matmul_ranks_128x128x64_8_warps_first(make_matmul_request):
    best = first(make_matmul_request(4096))
    assert (best["BLOCK_M"], best["BLOCK_N"], best["BLOCK_K"], best["num_warps"]) == (128, 128, 64, 8)
    assert best["num_stages"] in (3, 4)


def test_medium_matmul_prefers_tiles_that_fill_the_sms(make_matmul_request):
    best = first(make_matmul_request(256, n=1024, k=1024))
    tiles = -(-256 // best["BLOCK_M"]) * -(-1024 // best["BLOCK_N"])
    assert tiles >= 0.75 * FACTS["num_sms"]


def attention_request(sq: int, d: int, sk: int | None = None, batch: int = 4, heads: int = 32) -> AdviceRequest:
    sk = sk or sq
    space = {"BLOCK_M": [16, 32, 64, 128], "BLOCK_N": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3]}
    region = RegionSummary(
        "attn", "attention",
        (TensorSpec((batch, heads, sq, d), "bfloat16"), TensorSpec((batch, heads, sk, d), "bfloat16"),
         TensorSpec((batch, heads, sk, d), "bfloat16")),
        (TensorSpec((batch, heads, sq, d), "bfloat16"),),
        {"causal": True, "scale": d ** -0.5, "num_heads": heads, "num_kv_heads": heads},
    )
    return AdviceRequest(region, "attention", space, product_points(space), FACTS)


def test_attention_tiles_and_warps_follow_sq_and_head_dim():
    prefill64 = first(attention_request(2048, 64))
    assert (prefill64["BLOCK_M"], prefill64["BLOCK_N"], prefill64["num_warps"]) == (128, 64, 4)
    assert first(attention_request(2048, 128))["num_warps"] == 8
    assert first(attention_request(1, 128, sk=2048))["BLOCK_M"] == 16  # decode: one query row


def row_request(n: int, rows: int = 4096) -> AdviceRequest:
    space = {"BLOCK_N": [256, 512, 1024, 2048, 4096, 8192], "num_warps": [1, 2, 4, 8, 16]}
    x = TensorSpec((rows, n), "bfloat16")
    region = RegionSummary("norm", "row_reduction", (x, TensorSpec((n,), "bfloat16")), (x,),
                           {"kind": "rms_norm", "eps": 1e-6, "has_weight": True, "has_bias": False, "residual": False})
    return AdviceRequest(region, "row_reduction", space, product_points(space), FACTS)


def test_row_reduction_single_pass_smallest_block_covering_the_row():
    assert first(row_request(4096)) == {"BLOCK_N": 4096, "num_warps": 8}
    assert first(row_request(1000))["BLOCK_N"] == 1024
    assert first(row_request(300)) == {"BLOCK_N": 512, "num_warps": 2}
    assert first(row_request(32000))["BLOCK_N"] == 4096  # too long for one pass: looped


def elementwise_request(numel: int) -> AdviceRequest:
    space = {"BLOCK": [256, 512, 1024, 2048, 4096], "num_warps": [1, 2, 4, 8]}
    t = TensorSpec((numel,), "float32")
    attrs = {"program": [["o", "add", ["in0", "in1"]]], "outputs": ["o"]}
    region = RegionSummary("ew", "elementwise", (t, t), (t,), attrs)
    return AdviceRequest(region, "elementwise", space, product_points(space), FACTS)


def test_elementwise_block_1024_4_warps_bigger_for_large_tensors():
    assert first(elementwise_request(1 << 20)) == {"BLOCK": 1024, "num_warps": 4}
    assert first(elementwise_request(1 << 28))["BLOCK"] == 4096
    assert first(elementwise_request(100))["BLOCK"] == 256  # never far larger than the tensor


def rope_request(rows_t: int) -> AdviceRequest:
    space = {"BLOCK_R": [1, 2, 4, 8, 16, 32], "num_warps": [1, 2, 4, 8]}
    x = TensorSpec((1, 32, rows_t, 128), "bfloat16")
    table = TensorSpec((rows_t, 128), "bfloat16")
    region = RegionSummary("rope", "rope", (x, table, table), (x,))
    return AdviceRequest(region, "rope", space, product_points(space), FACTS)


def test_rope_one_row_per_program_in_decode_more_rows_for_a_prompt():
    assert first(rope_request(1)) == {"BLOCK_R": 1, "num_warps": 1}  # 32 rows: spread over SMs
    assert first(rope_request(2048)) == {"BLOCK_R": 8, "num_warps": 4}  # 65536 rows: ~1024 elements each


def test_unknown_family_keeps_legal_order():
    request = elementwise_request(1 << 20)
    request = replace(request, family="my_plugin_family", legal=tuple(reversed(request.legal)))
    advice = HeuristicAdvisor().advise(request)
    assert advice.ranked == list(request.legal) and advice.source == "heuristic"


def test_symbolic_dims_use_the_example_value(make_matmul_request):
    request = make_matmul_request(1)
    a, b = request.region.inputs
    region = replace(request.region, inputs=(TensorSpec(("batch", 4096), a.dtype), b),
                     dims={"batch": (1, 64)}, example_dims={"batch": 1})
    assert first(replace(request, region=region))["BLOCK_M"] == 16


def test_deterministic_and_a_full_permutation(make_matmul_request):
    request = make_matmul_request(8)
    one, two = HeuristicAdvisor().advise(request), HeuristicAdvisor().advise(request)
    assert one.ranked == two.ranked and one.rationale == two.rationale
    assert sorted(map(repr, one.ranked)) == sorted(map(repr, request.legal))


def test_ties_keep_legal_order():
    # Knobs the rules do not know cost nothing, so only legal order separates these points.
    request = elementwise_request(1 << 20)
    space = {"BLOCK": [1024], "num_warps": [4], "EVICTION": ["first", "last", "normal"]}
    request = replace(request, space=space, legal=product_points(space))
    assert [p["EVICTION"] for p in HeuristicAdvisor().advise(request).ranked] == ["first", "last", "normal"]
