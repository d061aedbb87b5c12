"""bench/tail_prefetch_probe.py on the CPU: the patch puts the next weight's prefetch after the K
loop of every GEMV form the probe chains (and compiles for sm_90), and the plan prefetches each
row's first bytes at every split's first K step, within the budget and inside the weight."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tail_prefetch_probe as probe
import torch
from gemv_timeline_probe import shapes

from coopt.templates.matmul_epilogue import MatmulEpilogueFamily


def patched(name: str) -> str:
    region, params = shapes()[name]
    return probe.patch(MatmulEpilogueFamily().render(region, params))


@pytest.mark.parametrize("name", probe.ORDER)
def test_the_prefetch_follows_the_k_loop_and_comes_before_the_meeting_and_the_epilogue(name):
    source = patched(name)
    kernel = source[source.index("def _gemv_kernel("):]
    lines = kernel.splitlines()
    loop = next(i for i, line in enumerate(lines) if line.lstrip().startswith("for k in tl.range("))
    at = [i for i, line in enumerate(lines) if "_tail_prefetch(pf_ptr" in line]
    first_store = next(i for i, line in enumerate(lines) if "tl.store(" in line or "_epilogue(" in line)
    assert len(at) == 1 and loop < at[0] < first_store
    assert "def run(" in source and "pf=None, evict_last=False):" in source
    assert "a2, b, *pf, " in source and "EVICT_LAST=evict_last" in source


@pytest.mark.parametrize("name", probe.ORDER)
def test_evict_first_marks_every_weight_load_of_the_k_loop(name):
    source = probe.evict_first(patched(name))
    loads = [line for line in source.splitlines() if "tl.load(b_ptrs" in line or "tl.load(b_hi_ptrs" in line]
    assert loads and all('eviction_policy="evict_first"' in line for line in loads)


def test_the_plan_takes_each_rows_first_bytes_at_every_split():
    weight = torch.zeros(4096, 14336, dtype=torch.bfloat16)
    pf = probe.plan(weight, split_k=2, block_k=256, budget=8 << 20)
    _, rows, row_stride, runs, run_stride, run_bytes = pf
    assert (rows, row_stride, runs) == (4096, 14336, 2)
    assert run_stride == 28 * 256  # 56 K steps of 256 in two splits of 28
    assert run_bytes % 16 == 0 and rows * runs * run_bytes <= 8 << 20 and run_bytes == 1024
    assert run_stride * (runs - 1) * 2 + run_bytes <= row_stride * 2  # inside each row
    # a budget past the splits' ranges stops at them; none (or too little) prefetches no row
    assert probe.plan(weight, 2, 256, 1 << 40)[5] == run_stride * 2
    assert probe.plan(weight, 2, 256, 0)[1] == 0 and probe.plan(weight, 2, 256, 1000)[1] == 0


def test_every_patched_form_compiles_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.compiler")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the probe compiles it for real")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "templates"))
    from template_helpers import compile_for_hopper

    jobs = []
    for name in ("o+", "gate_up+"):  # split 2 with the meeting; split 1 with GLU
        region, _ = shapes()[name]
        inputs = [torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in region.inputs]
        nxt = torch.zeros(4096, 4096, dtype=torch.bfloat16)
        jobs.append((name.rstrip("+"), patched(name), [*inputs, probe.plan(nxt, 2, 128, 8 << 20), True]))
    jobs.append(("o_evict_first", probe.evict_first(patched("o+")), jobs[0][2]))
    compiled = compile_for_hopper(jobs, tmp_path)
    assert set(compiled) == {"o", "gate_up", "o_evict_first"}
    assert all(facts["_gemv_kernel"]["launches"] == 1 for facts in compiled.values())
