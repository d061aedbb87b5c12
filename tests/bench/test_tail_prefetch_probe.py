"""bench/tail_prefetch_probe.py on the CPU: its regions are the build's (prefetch-next-weight's
form: o, gate|up and down take the next GEMV's weight, q|k|v does not), legal at the build's
points, their kernels prefetch after the K loop, and the evict_first variant marks every weight
load of the K loop."""

from __future__ import annotations

import pytest
import tail_prefetch_probe as probe
from gemv_timeline_probe import shapes

from coopt.targets import H200
from coopt.templates.matmul_epilogue import MatmulEpilogueFamily


def rendered(name: str) -> str:
    region, params = shapes()[name]
    if name in probe.PREFETCHING:
        following = probe.ORDER[(probe.ORDER.index(name) + 1) % len(probe.ORDER)]
        region = probe.with_prefetch(region, following)
    assert MatmulEpilogueFamily().check(region, params, H200) is None
    return MatmulEpilogueFamily().render(region, params)


def test_the_regions_take_the_next_weight_as_the_pass_would():
    every = shapes()
    for name, following in (("o+", "gate_up+"), ("gate_up+", "down+"), ("down+", "qkv+")):
        region = probe.with_prefetch(every[name][0], following)
        assert region.inputs[-1] == every[following][0].inputs[1]
        assert region.attrs["tail_prefetch"] == {"input": len(region.inputs) - 1, "layout": "nk"}
        assert region.bytes_moved({}) == every[name][0].bytes_moved({})
    assert probe.PREFETCHING == ("o+", "gate_up+", "down+")  # q|k|v is followed by the attention


@pytest.mark.parametrize("name", probe.ORDER)
def test_the_prefetch_follows_the_k_loop_in_the_prefetching_forms_only(name):
    source = rendered(name)
    kernel = source[source.index("def _gemv_kernel("):]
    lines = kernel.splitlines()
    loop = next(i for i, line in enumerate(lines) if line.lstrip().startswith("for k in tl.range("))
    at = [i for i, line in enumerate(lines) if "_tail_prefetch(pf_ptr" in line]
    first_store = next(i for i, line in enumerate(lines) if "tl.store(" in line or "_epilogue(" in line)
    if name in probe.PREFETCHING:
        assert len(at) == 1 and loop < at[0] < first_store and "next_weight):" in source
    else:
        assert not at and "use_tail_prefetch" not in source


@pytest.mark.parametrize("name", probe.ORDER)
def test_evict_first_marks_every_weight_load_of_the_k_loop(name):
    source = probe.evict_first(rendered(name))
    loads = [line for line in source.splitlines() if "tl.load(b_ptrs" in line or "tl.load(b_hi_ptrs" in line]
    assert loads and all('eviction_policy="evict_first"' in line for line in loads)


def test_the_evict_first_form_compiles_for_sm90(tmp_path):
    import sys
    from pathlib import Path

    import torch

    pytest.importorskip("triton.backends.compiler")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the probe compiles it for real")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "templates"))
    from template_helpers import compile_for_hopper

    region = probe.with_prefetch(shapes()["o+"][0], "gate_up+")
    inputs = [torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in region.inputs]
    compiled = compile_for_hopper([("o", probe.evict_first(rendered("o+")), inputs)], tmp_path)
    assert compiled["o"]["_gemv_kernel"]["launches"] == 1


def test_each_budget_is_timed_with_and_without_pdl_as_asked():
    mb = 2**20
    assert probe.variants_of([0, 16 * mb], False, "on") == [(0, False, True), (16 * mb, False, True)]
    both = probe.variants_of([0, 16 * mb], True, "both")
    assert len(both) == len(set(both)) == 8
    assert {v[2] for v in both} == {True, False} and {v[1] for v in both} == {True, False}
    assert all(not pdl for _, _, pdl in probe.variants_of([0], False, "off"))
