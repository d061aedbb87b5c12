"""bench/decode.py: what a row keeps of a build's build.json; bench/bandwidth.py: what its floors use."""

from __future__ import annotations

import json

import bandwidth
import decode
import pytest


def test_a_row_keeps_the_builds_seconds_and_its_checks_reference(tmp_path):
    (tmp_path / "build.json").write_text(json.dumps({
        "seconds": 163.3, "step_seconds": {"emit": 42.39, "end-to-end": 26.52},
        "end_to_end": {"ok": True, "reference_precision": "float64, streamed module by module", "max_abs_err": 0.18},
        "counters": {"fuse.kv_write": 32}, "unfused_ops": {"aten.embedding.default": 1},
        "launch": {"pdl": ["gemv"], "step_ms": {"none": 1.78, "gemv": 1.76}},
        "warnings": ["end-to-end check: the high-precision reference is float32"]}))
    assert decode.build_summary(tmp_path) == {
        "seconds": 163.3, "step_seconds": {"emit": 42.39, "end-to-end": 26.52},
        "reference_precision": "float64, streamed module by module", "check_max_abs_err": 0.18,
        "unfused_ops": {"aten.embedding.default": 1}, "launch": {"pdl": ["gemv"], "step_ms": {"none": 1.78, "gemv": 1.76}},
        "failed_verification": [], "warnings": ["end-to-end check: the high-precision reference is float32"],
        "selected": {}}


def test_a_row_names_each_leading_regions_selected_kernel(tmp_path):
    (tmp_path / "build.json").write_text(json.dumps({"seconds": 2.0}))
    candidates = [{"label": "reference", "params": {}, "latency_ms": 0.59},
                  {"label": "c0", "params": {"SPLIT_KV": 16}, "latency_ms": 0.032},
                  {"label": "c2", "params": {"SPLIT_KV": 32}, "latency_ms": 0.029}]
    (tmp_path / "selection.json").write_text(json.dumps({"regions": {
        "r1_decode_attention": {"selected": "c2", "same_as": None, "candidates": candidates},
        "r9_decode_attention": {"selected": "c2", "same_as": "r1_decode_attention", "candidates": candidates},
        "r2_matmul_epilogue": {"selected": "reference", "same_as": None, "candidates": candidates[:1]}}}))
    assert decode.build_summary(tmp_path)["selected"] == {
        "r1_decode_attention": {"label": "c2", "params": {"SPLIT_KV": 32}, "ms": 0.029, "reference_ms": 0.59},
        "r2_matmul_epilogue": {"label": "reference", "params": {}, "ms": 0.59, "reference_ms": 0.59}}


def test_candidates_that_failed_verification_are_named(tmp_path):
    (tmp_path / "build.json").write_text(json.dumps({"seconds": 2.0}))
    (tmp_path / "verify").mkdir()
    (tmp_path / "verify" / "results.json").write_text(json.dumps({
        "r1_decode_attention": {"c0": {"ok": False, "failure": "output 0: max abs err 229"}, "c1": {"ok": True}},
        "r0_kv_write": {"c0": {"ok": True}}, "r2_matmul_epilogue": {"c3": {"ok": False}}}))
    assert decode.build_summary(tmp_path)["failed_verification"] == ["r1_decode_attention c0", "r2_matmul_epilogue c3"]


def test_a_build_without_an_end_to_end_record_says_so(tmp_path):
    (tmp_path / "build.json").write_text(json.dumps({"seconds": 2.0, "end_to_end": None}))
    summary = decode.build_summary(tmp_path)
    assert summary["seconds"] == 2.0 and summary["reference_precision"] is None and summary["step_seconds"] is None
    assert summary["launch"] is None  # built without a GPU, or before the launch choice


def test_the_values_only_floor_reads_bf16_keys_and_fp8_values():
    """A model with two 1-element weights and bf16 caches [2, 2, 8, 4]: at position 3 with batch 2
    each cache's valid part is 2 x 2 x 4 x 4 elements (64)."""
    import torch

    class Caches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(1, 1, bias=False)
            self.register_buffer("k_cache", torch.zeros(2, 2, 8, 4, dtype=torch.bfloat16))
            self.register_buffer("v_cache", torch.zeros(2, 2, 8, 4, dtype=torch.bfloat16))

    model = Caches()
    to_bytes = bandwidth.H200_COPY_BYTES_PER_S / 1e3
    weights = 4
    assert decode.floor_ms(model, 2, 3) * to_bytes == pytest.approx(weights + 2 * 64 * 2)
    assert decode.floor_ms(model, 2, 3, kv_element_bytes=1) * to_bytes == pytest.approx(weights + 2 * 64)
    assert decode.floor_ms(model, 2, 3, kv_element_bytes=1, values_only=True) * to_bytes == pytest.approx(weights + 64 * 2 + 64)
    # another GPU's bandwidth: the same bytes over it
    assert decode.floor_ms(model, 2, 3, bandwidth=3.0e12) * 3.0e12 / 1e3 == pytest.approx(weights + 2 * 64 * 2)


def test_the_floor_reads_transformers_static_cache_as_the_projects_caches():
    """examples/transformers_llama/model.py (tiny preset, float32, cache 16, position 5): its
    floor counts the weights, the one looked-up embedding row, and the valid rows of every
    layer's key_cache_i / value_cache_i, as examples/llama's k_cache / v_cache are counted."""
    import os

    pytest.importorskip("transformers")
    knobs = {"COOPT_LLAMA_PRESET": "tiny", "COOPT_LLAMA_MAX_SEQ": "16", "COOPT_LLAMA_POS": "5",
             "COOPT_EXAMPLE_DTYPE": "float32", "COOPT_LLAMA_BATCH": "1"}
    saved = {k: os.environ.get(k) for k in knobs}
    os.environ.update(knobs)
    try:
        from coopt.frontend.model_file import load_model_file

        model = load_model_file(decode.ROOT / "examples" / "transformers_llama" / "model.py").model
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    embedding = model.wrapped.model.model.embed_tokens.weight
    params = sum(p.numel() for p in model.parameters()) - embedding.numel() + embedding.shape[1]
    kv = 2 * 2 * (1 * 2 * 6 * 16)  # 2 layers x (K, V) x [batch 1, 2 kv heads, positions 0..5, head dim 16]
    to_bytes = bandwidth.H200_COPY_BYTES_PER_S / 1e3
    assert decode.floor_ms(model, 1, 5) * to_bytes == pytest.approx(4 * (params + kv))


@pytest.mark.parametrize("gpu, expected", [("NVIDIA H200", bandwidth.H200_COPY_BYTES_PER_S), ("NVIDIA H100 80GB HBM3", 3.01e12)])
def test_floors_use_the_h200s_reference_there_and_the_measured_copy_elsewhere(gpu, expected):
    """On an H200 every session's floors share issue 3's 4.2 TB/s; an H100 (~3.0 TB/s) measured
    against it would look 1.4x further from its floor than it is."""
    used, what = bandwidth.floor_bandwidth(gpu, 3.01e12)
    assert used == expected and "3.01" in what
