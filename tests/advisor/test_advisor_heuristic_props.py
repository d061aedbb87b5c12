"""Property: for any region and any legal subset, the heuristic returns a permutation of legal."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from coopt.ir.region import RegionSummary, TensorSpec
from coopt.llm_advisor import AdviceRequest, HeuristicAdvisor
from coopt.llm_advisor.protocol import point_key

KNOBS = {
    "BLOCK_M": [16, 32, 64, 128],
    "BLOCK_N": [16, 32, 64, 128, 256, 1024, 8192],
    "BLOCK_K": [32, 64, 128],
    "BLOCK": [128, 1024, 4096],
    "num_warps": [1, 2, 4, 8, 16],
    "num_stages": [1, 2, 3, 4, 5],
    "GROUP_M": [1, 8],
    "EVICTION": ["first", "last"],
    "USE_TMA": [False, True],
}

dim = st.integers(min_value=1, max_value=70000)


@st.composite
def regions(draw) -> RegionSummary:
    family = draw(st.sampled_from(["matmul_epilogue", "attention", "row_reduction", "elementwise", "plugin_x"]))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    if family == "matmul_epilogue":
        m, n, k = draw(dim), draw(dim), draw(dim)
        layout = draw(st.sampled_from(["nk", "kn"]))
        b = (n, k) if layout == "nk" else (k, n)
        return RegionSummary("r", family, (TensorSpec(("batch", k), dtype), TensorSpec(b, dtype)),
                             (TensorSpec(("batch", n), dtype),), {"b_layout": layout},
                             dims={"batch": (1, m)}, example_dims=draw(st.sampled_from([{"batch": m}, {}])))
    if family == "attention":
        b, h, sq, sk, d = (draw(st.integers(1, 4096)) for _ in range(5))
        q = TensorSpec((b, h, sq, d), dtype)
        kv = TensorSpec((b, h, sk, d), dtype)
        return RegionSummary("r", family, (q, kv, kv), (q,), {"causal": True})
    shape = tuple(draw(st.lists(dim, min_size=0, max_size=3)))
    x = TensorSpec(shape, dtype)
    return RegionSummary("r", family, (x,), (x,), {})


@st.composite
def requests(draw) -> AdviceRequest:
    region = draw(regions())
    names = draw(st.lists(st.sampled_from(sorted(KNOBS)), min_size=0, max_size=4, unique=True))
    space = {n: draw(st.lists(st.sampled_from(KNOBS[n]), min_size=1, max_size=4, unique=True)) for n in names}
    keys = sorted(space)
    points = [dict(zip(keys, values)) for values in itertools.product(*(space[k] for k in keys))]
    legal = tuple(draw(st.lists(st.sampled_from(points), unique_by=point_key, max_size=40)))
    target = draw(st.sampled_from([{"num_sms": 132}, {"num_sms": 8}, {}]))
    return AdviceRequest(region, region.family, space, legal, target)


@settings(max_examples=300, deadline=None)
@given(requests())
def test_ranking_is_a_permutation_of_legal(request):
    advice = HeuristicAdvisor().advise(request)
    legal_keys = [point_key(p) for p in request.legal]
    assert sorted(point_key(p) for p in advice.ranked) == sorted(legal_keys)
    assert all(p in request.legal for p in advice.ranked)
    assert advice.source == "heuristic" and advice.rejected == []
    assert HeuristicAdvisor().advise(request).ranked == advice.ranked  # deterministic
