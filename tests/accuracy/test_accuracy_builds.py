"""The harness's coopt configurations on the CPU: the tiny trained model built in bf16, losslessly
and with an fp8 KV cache of each granularity, loaded back and measured against the fp32 eager
model. The fast builds use the reference program (no kernel regions: seconds instead of minutes
in Triton's interpreter); one slow test builds per-head with the fp8 cache's kernels."""

from __future__ import annotations

import copy

import pytest
import torch

from coopt.accuracy import builds, metrics
from coopt.fp8_cache import quantize
from coopt.passes.registry import parse_pipeline_text

SETTING = builds.BuildSetting(batch=4, max_seq=64, calibration_calls=2)
EVAL = dict(seq_len=48, windows=8, batch=4, greedy_prompts=4, prompt_len=16, greedy_tokens=12)
GRANULARITIES = ("per-tensor", "per-head", "per-token")


@pytest.fixture(scope="module")
def measured(corpus, trained, tmp_path_factory):
    """{"bf16" | granularity: (Candidate, AccuracyReport)} of reference-program builds."""
    model, _ = trained
    root = tmp_path_factory.mktemp("accuracy_builds")
    calibration = builds.calibration_inputs(corpus.train, SETTING)
    pipelines = {"bf16": builds.REFERENCE_PIPELINE,
                 **{g: builds.fp8_kv_pipeline(g, builds.REFERENCE_PIPELINE) for g in GRANULARITIES},
                 "values-only": builds.fp8_kv_pipeline("per-head", builds.REFERENCE_PIPELINE, values_only=True)}
    reference = metrics.model_logits_fn(model)
    results = {}
    for name, pipeline in pipelines.items():
        candidate = builds.build_candidate(model, root / name, pipeline, SETTING, calibration)
        results[name] = (candidate, metrics.compare(reference, candidate, corpus.heldout, **EVAL))
    return results


def test_fp8_pipeline_puts_the_pass_after_raise_patterns():
    assert builds.fp8_kv_pipeline("per-head") == builds.DEFAULT_PIPELINE.replace(
        "raise-patterns,", "raise-patterns,fp8-kv-cache{granularity=per-head},")
    assert builds.fp8_kv_pipeline("per-token", "a,raise-patterns{x=1}") == \
        "a,raise-patterns{x=1},fp8-kv-cache{granularity=per-token,scale-source=dynamic}"
    with pytest.raises(ValueError, match="no raise-patterns"):
        builds.fp8_kv_pipeline("per-head", "inplace-state-writes")
    assert builds.fp8_kv_pipeline("per-head", "raise-patterns", headroom=2.0) == \
        "raise-patterns,fp8-kv-cache{granularity=per-head,headroom=2.0}"
    smoothed = builds.fp8_kv_pipeline("per-head", "raise-patterns", smooth_k=True)
    assert smoothed == "raise-patterns,fp8-kv-cache{granularity=per-head,smooth-k=true}"
    assert parse_pipeline_text(smoothed)[1].smooth_k is True


def test_headroom_widens_the_calibrated_scales(corpus, trained, measured, tmp_path):
    # the same calibration with headroom 2: every per-head scale twice the headroom-1 build's
    model, _ = trained
    calibration = builds.calibration_inputs(corpus.train, SETTING)
    wide = builds.build_candidate(model, tmp_path / "wide", builds.fp8_kv_pipeline(
        "per-head", builds.REFERENCE_PIPELINE, headroom=2.0), SETTING, calibration)
    name = "layers.0.attention.k_cache.scale"
    narrow = measured["per-head"][0].model.state_tensor(name)
    torch.testing.assert_close(wide.model.state_tensor(name), 2 * narrow, rtol=1e-6, atol=0)


def test_calibration_is_training_text_never_heldout(corpus):
    calls = builds.calibration_inputs(corpus.train, SETTING)
    assert len(calls) == SETTING.calibration_calls
    train_text, heldout_text = corpus.train.numpy().tobytes(), corpus.heldout.numpy().tobytes()
    for tokens, positions in calls:
        assert tokens.shape == (SETTING.batch, SETTING.max_seq) and torch.equal(positions, torch.arange(SETTING.max_seq))
        for row in tokens:
            text = row.to(torch.uint8).numpy().tobytes()
            assert text in train_text and text not in heldout_text


def test_fp8_builds_store_fp8_caches_and_count_their_bytes(measured, trained):
    model, _ = trained
    args = model.args
    slots = SETTING.batch * SETTING.max_seq
    per_token = args.n_layers * 2 * args.n_kv_heads * args.head_dim  # elements of K and V per cached token
    scales = {"per-tensor": args.n_layers * 2 * 4 / slots, "per-head": args.n_layers * 2 * args.n_kv_heads * 4 / slots,
              "per-token": args.n_layers * 2 * args.n_kv_heads * 4}
    assert measured["bf16"][0].details["kv_bytes_per_token"] == per_token * 2
    assert measured["bf16"][0].details["build_accuracy"] is None  # lossless: nothing to measure
    for granularity in GRANULARITIES:
        candidate = measured[granularity][0]
        assert candidate.details["kv_bytes_per_token"] == pytest.approx(per_token + scales[granularity])
        assert candidate.details["build_accuracy"]["passes"][0]["knobs"]["granularity"] == granularity
        assert candidate.model.state_tensor("layers.0.attention.k_cache").dtype == torch.float8_e4m3fn


def test_values_only_keeps_the_keys_in_bf16_and_costs_less_than_both_in_fp8(measured, trained):
    """fp8-kv-cache{values-only}: 3/4 of the bf16 cache's bytes (plus both caches' per-head
    scales), the keys stored as bf16, and less KL to the fp32 model than rounding both caches."""
    model, _ = trained
    args = model.args
    slots = SETTING.batch * SETTING.max_seq
    per_cache = args.n_layers * args.n_kv_heads * args.head_dim  # elements of K (or V) per cached token
    candidate, report = measured["values-only"]
    scales = args.n_layers * 2 * args.n_kv_heads * 4 / slots
    assert candidate.details["kv_bytes_per_token"] == pytest.approx(2 * per_cache + per_cache + scales)
    assert candidate.model.state_tensor("layers.0.attention.k_cache").dtype == torch.bfloat16
    assert candidate.model.state_tensor("layers.0.attention.v_cache").dtype == torch.float8_e4m3fn
    assert candidate.details["build_accuracy"]["passes"][0]["knobs"]["values-only"] is True
    assert measured["bf16"][1].kl_mean < report.kl_mean < measured["per-head"][1].kl_mean


def test_logits_come_from_the_built_prefill_through_its_fp8_cache(corpus, trained, measured):
    """The per-head candidate's logits_fn runs the loaded artifact: afterwards its cache holds the
    window's keys quantized with the build's scales (layer 0's keys depend on the embedding alone,
    so the bf16 eager model computes the same rows)."""
    model, _ = trained
    candidate = measured["per-head"][0]
    window = metrics.heldout_windows(corpus.heldout, EVAL["seq_len"], SETTING.batch)[:, :-1]
    candidate.logits(window)
    eager = copy.deepcopy(model).to(torch.bfloat16)
    eager.setup_caches(SETTING.batch, SETTING.max_seq)
    with torch.no_grad():
        eager(window, torch.arange(window.shape[1]))
    name = "layers.0.attention.k_cache"
    scale = candidate.model.state_tensor(name + ".scale")
    expected = quantize(eager.layers[0].attention.k_cache[:, :, :window.shape[1]], scale, "per-head")
    written = candidate.model.state_tensor(name)[:, :, :window.shape[1]]
    assert torch.equal(written.view(torch.uint8), expected.view(torch.uint8))


def test_fp8_costs_more_than_bf16_but_little(measured):
    """e4m3 keeps 3 mantissa bits to bf16's 7: its KL to the fp32 model is several times the bf16
    build's (measured 4-6x), yet small next to a broken cache (wrong scale or layout: top-1 near
    chance)."""
    bf16 = measured["bf16"][1]
    assert 0 < bf16.kl_mean < 1e-3 and bf16.top1_agreement > 0.97
    for granularity in GRANULARITIES:
        report = measured[granularity][1]
        assert 2 * bf16.kl_mean < report.kl_mean < 1e-2, (granularity, bf16.kl_mean, report.kl_mean)
        assert report.top1_agreement > 0.9 and abs(report.perplexity_change) < 0.02, (granularity, report)


def test_greedy_tokens_come_from_the_built_prefill_and_decode_step(corpus, measured):
    candidate, report = measured["per-head"]
    prompts = metrics.heldout_windows(corpus.heldout, EVAL["seq_len"], EVAL["windows"])[:6, :EVAL["prompt_len"]]
    tokens = candidate.generate(prompts, 5)  # 6 prompts: two calls of the build's batch of 4
    assert tokens.shape == (6, 5) and tokens.dtype == torch.int64
    # the first token is the prefill's choice, the same call the teacher-forced logits make
    assert torch.equal(tokens[:, 0], candidate.logits(prompts)[:, -1].argmax(-1))
    assert 0 <= report.greedy_agreement <= EVAL["greedy_tokens"] and report.greedy_prompts == 4


# The default pipeline's passes that make the fp8 cache's kernels (quantizing write, dequantizing
# attention); the linears stay ATen ops. With the default pipeline's GEMVs too, the build and its
# measurement took 11 minutes in the interpreter (tests/llama/test_llama_fp8.py builds them over an
# fp8 cache).
CACHE_KERNELS_PIPELINE = "inplace-state-writes,raise-patterns,fuse-attention,fuse-kv-write,fuse-kv-write-attention,fuse-rope"


@pytest.mark.slow
def test_per_head_build_with_kernels_measures_like_its_reference_program(corpus, trained, measured, tmp_path):
    """The cache's kernels (run in the interpreter: about 3 minutes): the prompt's attention and the
    decode attention read the fp8 cache in generated kernels, and the accuracy matches the
    reference program's."""
    model, _ = trained
    calibration = builds.calibration_inputs(corpus.train, SETTING)
    candidate = builds.build_candidate(model, tmp_path / "out", builds.fp8_kv_pipeline("per-head", CACHE_KERNELS_PIPELINE),
                                       SETTING, calibration)
    kernels = candidate.details["kernels"]
    assert kernels["prefill"]["attention"][1] >= 1 and kernels["decode"]["decode_attention"][1] >= 1, kernels
    report = metrics.compare(metrics.model_logits_fn(model), candidate, corpus.heldout, **EVAL)
    reference_program = measured["per-head"][1]
    assert reference_program.kl_mean / 3 < report.kl_mean < 3 * reference_program.kl_mean
    assert abs(report.top1_agreement - reference_program.top1_agreement) < 0.05
