"""Paged KV with per-token fp8 scales on the tiny Llama (Triton's interpreter): a bf16 ragged
decode step built with `--paged-kv 16`, `--kv-cache fp8` per token (fp8-kv-cache{granularity=
per-token,scale-source=dynamic}) and `--prefill-chunk 16` for its prefill entry. Every cache and
its scale buffer become pools paged alike; the kv_write kernels compute each row's scale and
write it through the page table beside the row, the decode and prompt attention kernels read
each row's scale through the same page. `PagedDecoder` then serves prompts of different lengths
(one across a page boundary, one released midway), and every token it emits comes from logits
within fp8 error of the eager fp32 model's on the same tokens.

One build (two entries, about a minute here).
"""

from __future__ import annotations

import json

import pytest
import torch

import coopt
from coopt.accuracy.builds import fp8_kv_pipeline
from coopt.passes.registry import DEFAULT_PIPELINE
from coopt.runtime.serve import PagedDecoder
from llama_helpers import DEVICE, MODEL_PATH, llama_env

BATCH, MAX_SEQ, POS, PAGE, CHUNK = 2, 64, 40, 16, 16
HEAD_DIM, KV_HEADS, LAYERS = 16, 2, 2  # the tiny preset


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("paged_fp8_per_token") / "out"
    # bf16: an fp32 query over an fp8 cache has no prompt attention kernel
    with llama_env("bfloat16", RAGGED=1, BATCH=BATCH, MAX_SEQ=MAX_SEQ, POS=POS, PREFILL=16):
        result = coopt.build(MODEL_PATH, out, top_k=1, pipeline=fp8_kv_pipeline("per-token", DEFAULT_PIPELINE),
                             kv_cache="fp8", paged_kv=PAGE, prefill_chunk=CHUNK)
    for build in (result, result.entries["prefill"]):
        assert build.e2e["ok"] and build.e2e["lossy"] and build.e2e["kernels_vs_reference_program"]["ok"]
    return out


def test_caches_and_scales_are_paged_alike_and_read_and_written_by_kernels(built_dir):
    main = json.loads((built_dir / "build.json").read_text())
    prefill = json.loads((built_dir / "entries" / "prefill" / "build.json").read_text())
    assert "fp8-kv-cache{granularity=per-token,scale-source=dynamic},paged-kv{page-size=16}" in main["pipeline"]
    for build in (main, prefill):
        counters = build["counters"]
        assert counters["paged_kv.caches"] == counters["paged_kv.scale_buffers"] == 4  # K and V, 2 layers
        assert counters["paged_kv.writes"] == 8  # the scales' too
        assert counters["fuse.kv_write.paged"] == counters["fuse.kv_write.per_token"] == 2
    assert main["counters"]["fuse.decode_attention.paged"] == 2 and prefill["counters"]["fuse.attention.paged"] == 2
    assert "paged 4 caches into page pools (and their 4 per-token scale buffers into scale pools)" in (
        built_dir / "report.md").read_text()
    for out in (built_dir, built_dir / "entries" / "prefill"):
        regions = json.loads((out / "selection.json").read_text())["regions"].values()
        paged = [r for r in regions if r["summary"]["attrs"].get("page_size") == PAGE]
        assert len(paged) == 4
        for region in paged:  # every one a verified kernel, none left to its reference
            attrs = region["summary"]["attrs"]
            assert attrs.get("kv_scale", attrs.get("quant")) == "per-token"
            chosen = next(c for c in region["candidates"] if c["label"] == region["selected"])
            assert chosen["verified"] and chosen["family"] == region["family"]
    built = coopt.load(built_dir)
    pools = built.paged["pools"]
    assert len(pools) == 8 and built.entry_points["prefill"].paged["pools"] == pools
    assert built.state_tensor("layers.0.attention.k_cache").shape == (8, KV_HEADS, PAGE, HEAD_DIM)
    assert built.state_tensor("layers.0.attention.k_cache").dtype == torch.float8_e4m3fn
    scale = built.state_tensor("layers.1.attention.v_cache.scale")
    assert scale.shape == (8, KV_HEADS, PAGE) and scale.dtype == torch.float32


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed))


def test_paged_decoder_matches_eager_within_fp8_error(built_dir, llama):
    decoder = PagedDecoder(coopt.load(built_dir, device=DEVICE))
    # K and V pages of 2 layers: [Hkv, P, D] fp8 rows plus [Hkv, P] fp32 scales each
    assert decoder.bytes_per_page() == LAYERS * 2 * (KV_HEADS * PAGE * HEAD_DIM + KV_HEADS * PAGE * 4)
    chosen_from = []  # (sequence, its length then, the logits its next token was chosen from)
    choose = decoder._choose

    def recording(seq_ids, logits):
        chosen_from.extend((s, decoder.length(s), logits[row].float().cpu()) for row, s in enumerate(seq_ids))
        return choose(seq_ids, logits)

    decoder._choose = recording
    prompts = {"a": prompt(5, 1), "b": prompt(21, 2), "c": prompt(11, 3)}  # b: a 16-token chunk, then 5
    ids, tokens = {"a": decoder.add(prompts["a"])}, {}
    for step in range(6):
        if step == 1:
            ids["b"] = decoder.add(prompts["b"])
        if step == 2:
            ids["c"] = decoder.add(prompts["c"])  # three sequences over a batch-2 step: two calls
        for seq_id, token in decoder.step().items():
            tokens.setdefault(seq_id, []).append(token)
        if step == 3:
            decoder.release(ids["b"])
    assert len(chosen_from) == 6 + 3 + 4 and decoder.pages_in_use() == 2
    eager = llama.Transformer(llama.ModelArgs.from_preset("tiny"), seed=0).eval().to(DEVICE)
    eager.setup_caches(1, MAX_SEQ)
    sequences = {ids[name]: prompts[name].tolist() + tokens[ids[name]] for name in ids}
    for seq_id, length, logits in chosen_from:
        with torch.no_grad():  # teacher-forced: the eager fp32 model over the same tokens
            want = eager(torch.tensor(sequences[seq_id][:length], device=DEVICE)[None])[0, -1].float().cpu()
        scale = want.abs().max()
        assert (logits - want).abs().max() <= 0.1 * scale, (seq_id, length)  # bf16 model, fp8 history
        token = sequences[seq_id][length]  # the token the decoder emitted from these logits
        assert want.max() - want[token] <= 0.02 * scale, (seq_id, length)  # eager's choice, or as good as
    for seq_id in list(decoder.live_sequences()):
        decoder.release(seq_id)
    assert decoder.pages_in_use() == 0 and decoder.bytes_held() == 0
