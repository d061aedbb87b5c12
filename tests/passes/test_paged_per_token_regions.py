"""Per-token fp8 scales with and without pages, end to end through the passes: the regions
fuse-attention and fuse-kv-write make of a bf16 ragged decode step and of a prompt over the
cache (fp8-kv-cache{granularity=per-token}, optionally paged-kv) verified by the build's own
Hypothesis differential fuzzing (coopt.verify.runner.verify_candidate, profile "ci", Triton's
interpreter): the advisor's first kernel of each region against the region's reference module,
the eager fallback the build keeps. The fuzzer draws shuffled page tables (a permutation of the
pool), lengths and positions over what the table addresses (page edges among them), fp8 pools
filling e4m3's range with outliers at +-448 and all-zero heads, positive scales; in-place
writes are compared on the whole written buffers (caches, scale buffers or pools)."""

from __future__ import annotations

import pytest
import torch
from pass_helpers import kernels, run_pipeline
from test_paged_kv import PromptStep, prompt_inputs
from test_ragged_decode import RaggedStep, inputs as ragged_inputs

from coopt.codegen.torch_lines import reference_module_source
from coopt.ir.summary import name_regions, summarize, symbol_table
from coopt.llm_advisor.heuristic import HeuristicAdvisor
from coopt.llm_advisor.protocol import AdviceRequest
from coopt.targets import H200
from coopt.templates.registry import template_families
from coopt.verify.runner import verify_candidate

PER_TOKEN = "inplace-state-writes,raise-patterns,fp8-kv-cache{granularity=per-token,scale-source=dynamic}"
FUSION = ",fuse-attention,fuse-kv-write,fuse-rope"
STEPS = {"ragged": (RaggedStep, ragged_inputs), "prompt": (PromptStep, prompt_inputs)}


def regions(step: str, paged: bool):
    """{family: (summary, reference source)} of the step built in bf16."""
    model, args = STEPS[step]
    inputs = [a.to(torch.bfloat16) if a.is_floating_point() else a for a in args()]
    pipeline = PER_TOKEN + (",paged-kv{page-size=16}" if paged else "") + FUSION
    module, _ = run_pipeline(model().to(torch.bfloat16), inputs, pipeline)
    name_regions(module)
    symbols = symbol_table(module)
    return {k.family.data: (summarize(k, symbols), reference_module_source(k)) for k in kernels(module)}


def advised(family, summary) -> list[dict]:
    """The advisor's first and last legal points (its choice, and one far from it)."""
    request = AdviceRequest(summary, family.name, family.param_space(summary, H200),
                            tuple(family.legal_points(summary, H200)), H200.facts())
    ranked = HeuristicAdvisor().advise(request).ranked
    return [ranked[0], ranked[-1]]


def verify(summary, reference: str, candidate: str, tmp_path, label: str):
    (tmp_path / f"{label}__reference.py").write_text(reference)
    (tmp_path / f"{label}.py").write_text(candidate)
    return verify_candidate(summary, tmp_path / f"{label}__reference.py", tmp_path / f"{label}.py",
                            profile="ci", seed=0, device="cpu")


@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize("step", STEPS)
def test_kernels_verify_against_their_references(step, paged, tmp_path):
    found = regions(step, paged)
    assert set(found) == {"kv_write", "decode_attention" if step == "ragged" else "attention"}
    families = template_families()
    for name, (summary, reference) in found.items():
        assert summary.attrs.get("kv_scale", summary.attrs.get("quant")) == "per-token"
        assert (summary.attrs.get("page_size") == 16) == paged
        family = families[name]
        assert family.matches(summary), name
        for i, params in enumerate(advised(family, summary)):
            result = verify(summary, reference, family.render(summary, params), tmp_path, f"{name}_c{i}")
            assert result.ok and result.examples >= 12, f"{name} {params}: {result.failure}"


@pytest.mark.parametrize("name,good,bad", [
    # scales read as if the pools were per sequence: position p at row p of "page" b
    ("decode_attention", "k_scale_row + page * stride_ksb + rows * stride_kss", "k_scale_row + keys * stride_kss"),
    # a row's scale stored at [b, head, position] of the pool, not at its page and slot
    ("kv_write", "k_scale_ptr + cache_seq * ks_s0 + h * ks_s1 + cache_pos * ks_s2", "k_scale_ptr + b * ks_s0 + h * ks_s1 + pos * ks_s2"),
], ids=["decode-unpaged-scale-reads", "kv-write-unpaged-scale-stores"])
def test_the_fuzzer_catches_scales_that_miss_the_page(name, good, bad, tmp_path):
    summary, reference = regions("ragged", paged=True)[name]
    family = template_families()[name]
    source = family.render(summary, advised(family, summary)[0])
    assert good in source
    result = verify(summary, reference, source.replace(good, bad), tmp_path, f"{name}_bad")
    assert not result.ok
