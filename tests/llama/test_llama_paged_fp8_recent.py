"""Paged KV with `--kv-cache fp8-recent` on the tiny Llama (Triton's interpreter): a bf16 ragged
decode step built with `--paged-kv 16` and `--prefill-chunk 16` for its prefill entry, each
sequence's newest 4 keys read unrounded from exact-recent rings. paged-kv turns the rings into
pools of ring slots the program reads through its last input, ring_slots [B]; `PagedDecoder`
gives each live sequence a slot of its own, so a sequence's window follows it whatever row it is
decoded in.

What is checked: the regions (the decode and prompt attentions read the rings through the slots,
verified kernels), and `PagedDecoder` serving three sequences over a batch-2 step (rows change as
sequences are added and released, a released slot is taken again) emitting what each sequence
gets decoded alone, within fp8 error of the eager fp32 model.

One build (two entries, about a minute here).
"""

from __future__ import annotations

import json

import pytest
import torch

import coopt
from coopt.runtime.serve import PagedDecoder, RingSlotsExhausted
from llama_helpers import DEVICE, MODEL_PATH, llama_env

BATCH, MAX_SEQ, POS, PAGE, CHUNK = 2, 64, 40, 16, 16


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("paged_fp8_recent") / "out"
    with llama_env("bfloat16", RAGGED=1, BATCH=BATCH, MAX_SEQ=MAX_SEQ, POS=POS, PREFILL=16):
        result = coopt.build(MODEL_PATH, out, top_k=1, kv_cache="fp8-recent", paged_kv=PAGE, prefill_chunk=CHUNK)
    for build in (result, result.entries["prefill"]):
        assert build.e2e["ok"] and build.e2e["lossy"] and build.e2e["kernels_vs_reference_program"]["ok"]
    return out


def test_the_attentions_read_the_rings_through_their_slots(built_dir):
    main = json.loads((built_dir / "build.json").read_text())
    assert "fp8-kv-cache{smooth-k=true,exact-recent=4},paged-kv{page-size=16}" in main["pipeline"]
    assert main["counters"]["paged_kv.rings"] == 4 and main["counters"]["fuse.decode_attention.paged_rings"] == 2
    assert main["counters"]["fuse.decode_attention.ring_write"] == 2  # the step's rows into the slots, in the kernel
    assert "4 exact-recent rings became pools of ring slots" in (built_dir / "report.md").read_text()
    for out, family in ((built_dir, "decode_attention"), (built_dir / "entries" / "prefill", "attention")):
        regions = [r for r in json.loads((out / "selection.json").read_text())["regions"].values()
                   if "ring_slots_input" in r["summary"]["attrs"]]
        assert len(regions) == 2
        for region in regions:  # each a verified kernel
            chosen = next(c for c in region["candidates"] if c["label"] == region["selected"])
            assert chosen["verified"] and chosen["family"] == family
    built = coopt.load(built_dir)
    assert built.paged["ring_slots"] == 3 and built.paged["num_ring_slots"] == 8  # a slot a page (8 pages)
    assert built.state_tensor("layers.0.attention.k_cache.recent").shape == (8, 2, 4, 16)
    assert built.entry_points["prefill"].paged["rings"] == built.paged["rings"]


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed))


def recorded(decoder):
    """The logits each of `decoder`'s tokens was chosen from: [(sequence, its length, logits)]."""
    chosen_from = []
    choose = decoder._choose

    def recording(seq_ids, logits):
        chosen_from.extend((s, decoder.length(s), logits[row].float().cpu()) for row, s in enumerate(seq_ids))
        return choose(seq_ids, logits)

    decoder._choose = recording
    return chosen_from


PROMPTS = {"a": prompt(5, 1), "b": prompt(21, 2), "c": prompt(3, 3)}  # b: a 16-token chunk, then 5


def test_each_sequence_decodes_as_it_would_alone(built_dir, llama):
    model = coopt.load(built_dir, device=DEVICE)
    decoder = PagedDecoder(model)
    chosen_from = recorded(decoder)
    ids, tokens = {"a": decoder.add(PROMPTS["a"])}, {}
    for step in range(6):
        if step == 1:
            ids["b"] = decoder.add(PROMPTS["b"])
        if step == 2:
            ids["c"] = decoder.add(PROMPTS["c"])  # three sequences over a batch-2 step: c in row 0 of a second call
        for seq_id, token in decoder.step().items():
            tokens.setdefault(seq_id, []).append(token)
        if step == 3:
            decoder.release(ids["a"])  # c moves to row 1 of the first call; a's slot is free again
    assert {decoder._slot[ids[n]] for n in "bc"} == {1, 2}  # a had slot 0
    reused = decoder.add(prompt(2, 4))
    assert decoder._slot[reused] == 0  # the released slot, taken again
    got = {}
    for seq_id, length, logits in chosen_from:
        got.setdefault(seq_id, []).append((length, logits))
    eager = llama.Transformer(llama.ModelArgs.from_preset("tiny"), seed=0).eval().to(DEVICE)
    eager.setup_caches(1, MAX_SEQ)
    for name in "abc":
        seq_id = ids[name]
        alone = PagedDecoder(model)  # the sequence alone: row 0 of every call, slot 0
        alone_from = recorded(alone)
        own = alone.add(PROMPTS[name])
        for _ in tokens[seq_id]:  # the first step emits the prefill's token
            alone.step()
        sequence = PROMPTS[name].tolist() + tokens[seq_id]
        assert len(alone_from) == len(got[seq_id])
        for (length, logits), (_, alone_length, alone_logits) in zip(got[seq_id], alone_from):
            assert length == alone_length
            scale = alone_logits.abs().max()
            assert (logits - alone_logits).abs().max() <= 1e-3 * scale, (name, length)
            with torch.no_grad():  # teacher-forced: the eager fp32 model over the same tokens
                want = eager(torch.tensor(sequence[:length], device=DEVICE)[None])[0, -1].float().cpu()
            assert (logits - want).abs().max() <= 0.1 * want.abs().max(), (name, length)  # bf16, fp8 history
        alone.release(own)
        assert alone.pages_in_use() == 0
        del alone


def test_a_decoder_without_a_free_slot_refuses_a_sequence_and_changes_nothing(built_dir):
    decoder = PagedDecoder(coopt.load(built_dir, device=DEVICE))
    assert decoder.ring_bytes() == 2 * 8 * 2 * 4 * 16 * (4 + 2)  # 2 layers x 8 slots x 2 kv heads x 4 rows x D, K fp32 + V bf16
    held = [decoder.add([1]) for _ in range(7)]  # 8 slots: 7 for sequences, 1 for padding rows
    pages = decoder.pages_in_use()
    with pytest.raises(RingSlotsExhausted, match="all 7 are held"):
        decoder.add([1, 2])
    assert decoder.pages_in_use() == pages and decoder.live_sequences() == held
    decoder.release(held[3])
    assert decoder._slot[decoder.add([1, 2])] == 3


@pytest.mark.gpu
def test_a_graph_replayed_decoder_emits_the_same_tokens(built_dir):
    """cuda_graph=True: the step's ring_slots are a static input of the graph, copied each call."""
    model = coopt.load(built_dir, device="cuda")
    emitted = []
    for graph in (False, True):
        decoder = PagedDecoder(model, cuda_graph=graph)
        ids = [decoder.add(PROMPTS[name]) for name in "abc"]
        tokens = [decoder.step() for _ in range(3)]
        decoder.release(ids[0])
        tokens += [decoder.step() for _ in range(3)]
        emitted.append([[t[i] for i in ids if i in t] for t in tokens])
        for seq_id in decoder.live_sequences():
            decoder.release(seq_id)
    assert emitted[0] == emitted[1]
