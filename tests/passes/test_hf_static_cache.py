"""A decode step over a static cache as transformers writes it: StaticCache writes the new rows with
`index_copy_(2, cache_position, ...)`, and the model builds its mask in the forward: in 4.x a
float one added to the scores (0 up to cache_position, the dtype's minimum after it), in 5.x a
boolean one from key positions against the query's, broadcast to [B, 1, 1, S]. Both build like
the gpt-fast form: one decode_attention region reading the valid keys only, the write folded in;
a mask that selects other keys is left to SDPA."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import kernel_families, run_pipeline

import coopt

FOLD = "inplace-state-writes,raise-patterns,fuse-attention,fuse-kv-write,fuse-kv-write-attention"


def repeat_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def transformers_mask(q, cache_position, length, fill=None, compare=torch.gt, start=0):
    """_prepare_4d_causal_attention_mask_with_cache_position for one query token; the keyword
    arguments give masks that select other keys (tests below)."""
    fill = torch.finfo(q.dtype).min if fill is None else fill
    mask = torch.full((q.shape[2], length), fill_value=fill, dtype=q.dtype, device=q.device)
    mask *= compare(torch.arange(start, start + length, device=q.device), cache_position.reshape(-1, 1))
    return mask[None, None, :, :].expand(q.shape[0], 1, -1, -1)


def transformers5_mask(q, cache_position, length, compare=torch.le, window=None):
    """transformers 5's sdpa_mask for one query token: a boolean [B, 1, 1, S] from key positions
    (arange + a kv offset of 0) against the query's (arange(1) + the first cache position); with
    a `window`, and-ed with Mistral's sliding window (keys > query - window)."""
    keys = torch.arange(length, device=q.device) + 0
    query = torch.arange(q.shape[2], device=q.device) + cache_position[0]
    keys, query = keys[None, None, None, :], query[None, None, :, None]
    mask = compare(keys, query)
    if window is not None:
        mask = query.new_ones((), dtype=torch.bool) & (keys > query - window) & mask
    return mask.expand(q.shape[0], -1, q.shape[2], length)


class StaticCacheStep(torch.nn.Module):
    def __init__(self, max_seq=32, dtype=torch.float32, version=4, **mask):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(2, 2, max_seq, 8, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(2, 2, max_seq, 8, dtype=dtype))
        self.make_mask, self.mask = (transformers_mask if version == 4 else transformers5_mask), mask

    def forward(self, q, k, v, cache_position):
        mask = self.make_mask(q, cache_position, self.k_cache.shape[2], **self.mask)
        self.k_cache.index_copy_(2, cache_position, k)
        self.v_cache.index_copy_(2, cache_position, v)
        mask = mask[:, :, :, : self.k_cache.shape[-2]]
        return F.scaled_dot_product_attention(q, repeat_kv(self.k_cache, 2), repeat_kv(self.v_cache, 2), attn_mask=mask)


def step_inputs(pos: int, dtype=torch.float32, seed: int = 1, tokens: int = 1):
    g = torch.Generator().manual_seed(seed + pos)
    shapes = [(2, 4, tokens, 8), (2, 2, tokens, 8), (2, 2, tokens, 8)]
    return [*(torch.randn(*s, generator=g).to(dtype) for s in shapes), torch.arange(pos, pos + tokens)]


@pytest.mark.parametrize("version, dtype, mask", [
    (4, torch.float32, {}), (4, torch.bfloat16, {}), (5, torch.float32, {}),
    (5, torch.float32, {"window": 32}),  # a sliding window as long as the cache hides no key
], ids=["4-f32", "4-bf16", "5-f32", "5-window-covers-the-cache"])
def test_the_step_is_one_decode_attention_with_the_write_folded(version, dtype, mask):
    module, counters = run_pipeline(StaticCacheStep(dtype=dtype, version=version, **mask), step_inputs(5, dtype), FOLD)
    assert counters["raise.attention.decode.additive_mask"] == (version == 4) and counters["raise.attention.decode"] == 1
    assert counters["inplace.index_copy"] == 2 and counters["fuse.kv_write_attention"] == 1
    assert kernel_families(module) == ["decode_attention"]
    text = str(module)  # neither the mask's comparisons nor an index_copy_ are left to run a step
    assert not [t for t in ("aten.full", "aten.gt", "aten.le", "aten.__and__", "index_copy") if t in text]
    # the key positions' arange went with the mask; 5's query position (arange(1) + the first
    # cache position) stays: the lengths are made from it
    assert text.count("aten.arange") == (version == 5)


@pytest.mark.parametrize("mask", [
    {"fill": -100.0},  # a soft mask: a score 100 above the rest would still count
    {"compare": torch.ge},  # the key at the position itself masked out
    {"start": 1},  # positions 1 .. S: the mask is one key off
    {"version": 5, "compare": torch.lt},  # transformers 5's form, the key at the position masked out
    {"version": 5, "compare": lambda keys, query: keys <= query + 1},  # one key past the position seen
    {"version": 5, "window": 31},  # a window one key shorter than the cache: the oldest key can hide
], ids=["soft-fill", "ge", "shifted-positions", "5-lt", "5-shifted-query", "5-short-window"])
def test_masks_that_select_other_keys_stay_sdpa(mask):
    _, counters = run_pipeline(StaticCacheStep(**mask), step_inputs(5), FOLD)
    assert counters["raise.attention.decode"] == 0 and counters["fuse.kv_write_attention"] == 0


@pytest.mark.parametrize("version", [4, 5])
def test_the_built_step_matches_transformers_form_over_several_steps(tmp_path, version):
    coopt.Pipeline(top_k=1).build(StaticCacheStep(version=version), tuple(step_inputs(3)), tmp_path / "out")
    built, eager = coopt.load(tmp_path / "out"), StaticCacheStep(version=version)
    device = built.w_k_cache.device
    eager.to(device)
    built.w_k_cache.zero_()
    built.w_v_cache.zero_()
    with torch.no_grad():
        for pos in (0, 1, 2, 7, 31):  # from the first row to the last; each reads what the earlier wrote
            step = [x.to(device) for x in step_inputs(pos)]
            torch.testing.assert_close(built(*step), eager(*step), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(built.w_k_cache, eager.k_cache)
    torch.testing.assert_close(built.w_v_cache, eager.v_cache)
    (attention,) = [r for r in json.loads((tmp_path / "out" / "selection.json").read_text())["regions"].values()
                    if r["family"] == "decode_attention"]
    chosen = next(c for c in attention["candidates"] if c["label"] == attention["selected"])
    assert chosen["verified"] and chosen["family"] == "decode_attention"  # the kernel ran, not the reference


def test_transformers5_prompt_chunks_attend_over_the_cache(tmp_path):
    """Several tokens at once (a prompt, or a chunk of one, after earlier chunks): 5's mask is the
    same comparison with T query positions, raised to an attention over the cache with one length
    per query position; two chunks built and run match transformers' form."""
    _, counters = run_pipeline(StaticCacheStep(version=5), step_inputs(4, tokens=3), FOLD)
    assert counters["raise.attention.prompt_over_cache"] == 1 and not counters["raise.attention.decode"]
    coopt.Pipeline(top_k=1).build(StaticCacheStep(version=5), tuple(step_inputs(0, tokens=3)), tmp_path / "out")
    built, eager = coopt.load(tmp_path / "out"), StaticCacheStep(version=5)
    device = built.w_k_cache.device
    eager.to(device)
    built.w_k_cache.zero_()
    built.w_v_cache.zero_()
    with torch.no_grad():
        for start in (0, 3, 29):  # the second chunk reads the first's rows; the last ends at the cache's end
            chunk = [x.to(device) for x in step_inputs(start, tokens=3)]
            torch.testing.assert_close(built(*chunk), eager(*chunk), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(built.w_k_cache, eager.k_cache)


def odd_mask(q, cache_position, length, form):
    """Masks that look like transformers' but select other keys (or other values)."""
    keys, query = torch.arange(length) + 0, torch.arange(q.shape[2]) + cache_position[0]
    if form == "one-column":  # cut to its first key: SDPA broadcasts that column over every key
        return (keys[None, None, None, :] <= query[None, None, :, None])[..., :1]
    if form == "one-column-float":
        mask = torch.full((1, length), torch.finfo(q.dtype).min) * (torch.arange(length) > cache_position.reshape(-1, 1))
        return mask[None, None, :, :][..., :1]
    if form == "query-on-batch":  # [T, S] with T moved to the batch dim: sequence b sees query b's keys
        return (keys[None, :] <= query[:, None])[:, None, None, :]
    if form == "query-on-heads":
        return (keys[None, :] <= query[:, None])[None, :, None, :]
    if form == "infinite-fill":  # -inf * False is NaN: the model's own output is NaN
        mask = torch.full((1, length), float("-inf")) * (torch.arange(length) > cache_position.reshape(-1, 1))
        return mask[None, None, :, :]
    if form == "float-positions":  # bf16 positions round: 301 and 302 are one value
        positions = torch.arange(length, dtype=torch.bfloat16)
        return positions[None, None, None, :] <= query[None, None, :, None]
    raise ValueError(form)


class OddMaskStep(torch.nn.Module):
    def __init__(self, form: str, batch: int = 1, heads: int = 2, length: int = 32):
        super().__init__()
        self.form = form
        self.register_buffer("k_cache", torch.zeros(batch, heads, length, 8))
        self.register_buffer("v_cache", torch.zeros(batch, heads, length, 8))

    def forward(self, q, k, v, cache_position):
        mask = odd_mask(q, cache_position, self.k_cache.shape[2], self.form)
        self.k_cache.index_copy_(2, cache_position, k)
        self.v_cache.index_copy_(2, cache_position, v)
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)


@pytest.mark.parametrize("form, batch, heads, tokens", [
    ("one-column", 1, 2, 1), ("one-column-float", 1, 2, 1), ("query-on-batch", 3, 2, 3), ("query-on-heads", 1, 2, 2),
    ("infinite-fill", 1, 2, 1), ("float-positions", 1, 2, 1),
])
def test_masks_that_look_alike_but_differ_stay_sdpa(form, batch, heads, tokens):
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(batch, heads, tokens, 8, generator=g) for _ in range(3)] + [torch.arange(2, 2 + tokens)]
    _, counters = run_pipeline(OddMaskStep(form, batch, heads), inputs, FOLD)
    assert not [name for name in counters if name.startswith("raise.attention")]
