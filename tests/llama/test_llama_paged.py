"""Paged KV on the tiny Llama (Triton's interpreter): a ragged decode step built with
`--paged-kv 16` (and `--prefill-chunk 16` for its prefill entry) reads and writes its caches
through a page table, and `PagedDecoder` serves sequences of different lengths from it: three
prompts added at different times, stepped together, one released midway, each generating
exactly what eager greedy decoding of that prompt alone generates, and the pool back to no
pages in use once all are released. On the GPU, a decoder replaying its step as a CUDA graph
(`cuda_graph=True`, refused on the CPU) decodes what one making plain calls decodes.

One build per module (two entries, about a minute here).
"""

from __future__ import annotations

import json

import pytest
import torch

import coopt
from coopt.frontend.model_file import load_model_file
from coopt.runtime.paged_layout import identity_page_table
from coopt.runtime.serve import PagedDecoder, PoolExhausted, UnknownSequence
from llama_helpers import DEVICE, MODEL_PATH, llama_env

BATCH, MAX_SEQ, POS, PAGE, CHUNK = 2, 64, 40, 16, 16


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("paged") / "out"
    with llama_env(RAGGED=1, BATCH=BATCH, MAX_SEQ=MAX_SEQ, POS=POS, PREFILL=16):
        result = coopt.build(MODEL_PATH, out, top_k=1, paged_kv=PAGE, prefill_chunk=CHUNK)
        loaded = load_model_file(MODEL_PATH)
    assert result.e2e["ok"] and result.entries["prefill"].e2e["ok"]
    return out, loaded


def eager_model(llama_module, batch=1):
    model = llama_module.Transformer(llama_module.ModelArgs.from_preset("tiny"), seed=0).eval().to(DEVICE)
    model.setup_caches(batch, MAX_SEQ)
    return model


# ── slice 2: the build ────────────────────────────────────────────────────────────────────────────


def test_both_entries_read_and_write_through_the_page_table(built_dir):
    out, _ = built_dir
    main = json.loads((out / "build.json").read_text())
    prefill = json.loads((out / "entries" / "prefill" / "build.json").read_text())
    assert "paged-kv{page-size=16}" in main["pipeline"]
    for build in (main, prefill):
        counters = build["counters"]
        assert counters["paged_kv.caches"] == 4 and counters["paged_kv.writes"] == 4
        assert counters["fuse.kv_write.paged"] == 2
    assert main["counters"]["fuse.decode_attention.paged"] == 2  # the kernel reads pages through the table
    assert prefill["counters"]["fuse.attention.prompt_over_cache"] == 2  # over the gathered pages
    regions = json.loads((out / "selection.json").read_text())["regions"].values()
    paged = [r for r in regions if r["summary"]["attrs"].get("page_size") == PAGE]
    assert sorted(r["family"] for r in paged) == ["decode_attention"] * 2 + ["kv_write"] * 2
    for region in paged:  # verified kernels, selected
        chosen = next(c for c in region["candidates"] if c["label"] == region["selected"])
        assert chosen["verified"] and chosen["family"] == region["family"]
    assert "Paged KV: paged 4 caches into page pools" in (out / "report.md").read_text()
    built = coopt.load(out)
    assert built.paged["per_row"] and built.paged["num_pages"] == BATCH * MAX_SEQ // PAGE
    assert not built.entry_points["prefill"].paged["per_row"]
    assert built.state_tensor("layers.0.attention.k_cache").shape == (8, 2, PAGE, 16)


def test_the_step_reads_pages_wherever_the_table_puts_them(built_dir):
    """The build against eager with the caches' contents in the identity layout, then with every
    page moved elsewhere in the pool and the table saying where: the same logits."""
    out, loaded = built_dir
    built, eager = coopt.load(out), loaded.model.to(DEVICE)
    tokens, positions = (x.to(DEVICE) for x in loaded.example_inputs)
    table = identity_page_table(BATCH, MAX_SEQ // PAGE, BATCH * MAX_SEQ // PAGE, device=DEVICE)
    moved = torch.randperm(8, generator=torch.Generator().manual_seed(5)).to(DEVICE)  # page p -> moved[p]
    with torch.no_grad():
        want = eager(tokens, positions)
        torch.testing.assert_close(built(tokens, positions, table), want, rtol=1e-4, atol=1e-4)
        tokens, positions = (tokens * 5 + 1) % 256, positions + torch.tensor([1, 3], device=DEVICE)
        want = eager(tokens, positions)
        for name in built.paged["pools"]:
            pool = built.state_tensor(name)
            pool[moved] = pool.clone()
        got = built(tokens, positions, moved[table.long()].to(torch.int32))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"page_table: holds 8, outside \[0, 8\)"):
        built.check_call(tokens, positions, torch.full_like(table, 8))


# ── slice 3: the runtime ──────────────────────────────────────────────────────────────────────────


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed))


def eager_greedy(llama_module, tokens: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy generation of one prompt alone, in eager fp32 (the example model file's reference)."""
    model = eager_model(llama_module)
    generated = llama_module.generate_reference(model, tokens[None].to(DEVICE), new_tokens)
    return generated[0, tokens.numel():].tolist()


def test_sequences_of_different_lengths_added_stepped_and_released(built_dir, llama):
    out, _ = built_dir
    decoder = PagedDecoder(coopt.load(out))
    prompts = {"a": prompt(5, 1), "b": prompt(21, 2), "c": prompt(11, 3)}  # b: a 16-token chunk, then 5
    new_tokens = {"a": 8, "b": 4, "c": 6}
    expected = {name: eager_greedy(llama, tokens, new_tokens[name]) for name, tokens in prompts.items()}
    got = {name: [] for name in prompts}
    ids = {"a": decoder.add(prompts["a"])}
    for step in range(8):
        if step == 1:
            ids["b"] = decoder.add(prompts["b"])  # joins a running batch
        if step == 2:
            ids["c"] = decoder.add(prompts["c"])  # three sequences over a batch-2 step: two calls
        emitted = decoder.step()
        assert list(emitted) == decoder.live_sequences()  # one token for every live sequence, oldest first
        for name, seq_id in ids.items():
            if seq_id in emitted:
                got[name].append(emitted[seq_id])
        if step == 4:
            decoder.release(ids["b"])  # midway: a and c go on without it
    assert got == expected
    assert decoder.length(ids["a"]) == 5 + 7 and decoder.length(ids["c"]) == 11 + 5  # the last token not fed yet
    assert decoder.pages_in_use() == 2 and decoder.bytes_held() == 2 * decoder.bytes_per_page()
    assert decoder.bytes_per_page() == 2 * 2 * (2 * PAGE * 16 * 4)  # K and V, 2 layers, [Hkv, P, D] fp32
    decoder.release(ids["a"])
    decoder.release(ids["c"])
    assert decoder.pages_in_use() == 0 and decoder.bytes_held() == 0 and not decoder.live_sequences()


def test_an_exhausted_pool_changes_nothing_and_released_ids_are_unknown(built_dir, llama):
    out, _ = built_dir
    decoder = PagedDecoder(coopt.load(out))
    assert decoder.pages.free_pages() == 7  # 8 pages, one kept as the padding rows' scratch
    big = decoder.add(prompt(48, 4))  # 3 pages
    small = decoder.add(prompt(47, 5))  # 3 pages
    with pytest.raises(PoolExhausted) as failure:
        decoder.add(prompt(17, 6))  # 2 pages: only 1 is free, and nothing is taken
    assert (failure.value.needed, failure.value.free) == (2, 1)
    assert decoder.live_sequences() == [big, small] and decoder.pages_in_use() == 6
    assert set(decoder.step()) == {big, small}  # both emit their prefilled token: no new position needed
    decoder.step()  # big's position 48 takes the last free page, small's 47 fits its third
    with pytest.raises(PoolExhausted):  # small's position 48 needs a fourth page: none is free
        decoder.step()
    assert (decoder.length(big), decoder.length(small)) == (49, 48)  # the failed step changed nothing
    decoder.release(big)  # recoverable: free pages and go on
    assert list(decoder.step()) == [small] and decoder.length(small) == 49
    with pytest.raises(UnknownSequence, match="released already"):
        decoder.release(big)
    with pytest.raises(UnknownSequence, match="never added"):
        decoder.length(99)
    with pytest.raises(ValueError, match="a sequence takes 1 to 63"):
        decoder.add(prompt(64, 7))
    decoder.release(small)
    assert decoder.pages_in_use() == 0


def test_cuda_graph_is_refused_off_the_gpu(built_dir):
    out, _ = built_dir
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, but the model is on cpu"):
        PagedDecoder(coopt.load(out, device="cpu"), cuda_graph=True)


@pytest.mark.gpu
def test_graph_replay_decodes_what_plain_calls_decode(built_dir):
    """Two loads of one build (each its own pools), one decoder replaying its step as a CUDA
    graph: the same tokens at every step, and the same pages written, over sequences added and
    released between steps (b's 5-token tail after its 16-token chunk goes through the step)."""
    out, _ = built_dir
    plain_model, graphed_model = coopt.load(out, device="cuda"), coopt.load(out, device="cuda")
    plain, graphed = PagedDecoder(plain_model), PagedDecoder(graphed_model, cuda_graph=True)
    assert plain.graph is None and graphed.graph.enabled

    def both(call):  # the same call on each decoder: the same result
        from_plain, from_graphed = call(plain), call(graphed)
        assert from_plain == from_graphed
        return from_plain

    a, b = both(lambda d: d.add(prompt(5, 1))), both(lambda d: d.add(prompt(21, 2)))
    for _ in range(3):
        both(PagedDecoder.step)
    both(lambda d: d.release(a))
    both(lambda d: d.add(prompt(11, 3)))
    for _ in range(2):
        both(PagedDecoder.step)
    assert len(plain.live_sequences()) == 2 and plain.length(b) == 21 + 4
    # every page but the padding rows' scratch page, which capture's warm-up writes too
    keep = torch.arange(plain.contract["num_pages"], device="cuda") != plain.scratch
    for name in plain_model.paged["pools"]:
        torch.testing.assert_close(graphed_model.state_tensor(name)[keep], plain_model.state_tensor(name)[keep],
                                   rtol=0, atol=0)


def test_fp8_pages(tmp_path):
    """--paged-kv with --kv-cache fp8 (per-head): fp8 pools, the paged kernels quantize and read
    fp8, checked against the build's own reference program and measured against the original."""
    out = tmp_path / "fp8"
    with llama_env(RAGGED=1, BATCH=BATCH, MAX_SEQ=MAX_SEQ, POS=POS, PREFILL=0):
        result = coopt.build(MODEL_PATH, out, top_k=1, paged_kv=PAGE, kv_cache="fp8")
    assert result.e2e["lossy"] and result.e2e["kernels_vs_reference_program"]["ok"]
    assert result.accuracy["max_rel_err"] < 0.2  # measured, not judged: fp8 rounding of the history
    assert "fp8-kv-cache{smooth-k=true},paged-kv{page-size=16}" in json.loads((out / "build.json").read_text())["pipeline"]
    regions = json.loads((out / "selection.json").read_text())["regions"].values()
    paged = [r for r in regions if r["summary"]["attrs"].get("page_size") == PAGE]
    assert sorted((r["family"], r["summary"]["attrs"].get("kv_scale") or r["summary"]["attrs"].get("quant"))
                  for r in paged) == [("decode_attention", "per-head")] * 2 + [("kv_write", "per-head")] * 2
    assert all(next(c for c in r["candidates"] if c["label"] == r["selected"])["verified"] for r in paged)
    # the paged writes centre the keys too (smooth-k: the offset is an input of the kv_write region)
    assert all(r["summary"]["attrs"].get("k_offset") for r in paged if r["family"] == "kv_write")
    built = coopt.load(out)
    assert built.state_tensor("layers.0.attention.k_cache").dtype == torch.float8_e4m3fn
    assert built.state_tensor("layers.0.attention.k_cache").shape == (8, 2, PAGE, 16)
