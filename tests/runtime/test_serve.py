"""PagedDecoder's bookkeeping against a fake paged build (no compiler, no kernels): which rows
each call gets, padding on the scratch page, chunked prefill through the entry, one token per
live sequence per step, and failures that change nothing."""

from __future__ import annotations

import pytest
import torch

from coopt.runtime.pages import PageAllocator, PoolExhausted, UnknownSequence
from coopt.runtime.serve import PagedDecoder

VOCAB = 50


class FakeStep(torch.nn.Module):
    """Logits whose argmax is (last token + position + 1) % VOCAB; records every call."""

    def __init__(self, paged: dict):
        super().__init__()
        self.paged = paged
        self.register_buffer("pool", torch.zeros(paged["num_pages"], 1, paged["page_size"], 1))
        self.calls = []

    def state_tensor(self, name):
        return self.pool

    def forward(self, tokens, positions, table):
        self.calls.append((tokens.clone(), positions.clone(), table.clone()))
        last = positions if positions.dim() == 1 and positions.numel() == tokens.shape[0] and tokens.shape[1] == 1 \
            else positions[None, :].expand(tokens.shape[0], -1)
        nxt = (tokens + last.reshape(tokens.shape[0], -1) + 1) % VOCAB
        return torch.nn.functional.one_hot(nxt, VOCAB).float()


def contract(per_row=True, batch=2, **extra):
    return {"tokens": 0, "positions": 1, "page_table": 2, "dtype": "int64", "per_row": per_row, "batch": batch,
            "length": [1, 1] if per_row else [2, 64], "token_range": [0, VOCAB], "page_size": 16, "num_pages": 9,
            "max_pages": 4, "max_seq": 64, "pools": ["pool"], **extra}


def decoder(with_prefill=True, chunk=None):
    step = FakeStep(contract())
    entries = {"prefill": FakeStep(contract(per_row=False, batch=3, **({"prefill_chunk": chunk} if chunk else {})))} \
        if with_prefill else {}
    object.__setattr__(step, "entry_points", entries)
    return PagedDecoder(step), step, entries.get("prefill")


def test_prefill_goes_through_the_entry_in_chunks_with_padding_on_scratch():
    dec, step, prefill = decoder(chunk=16)
    seq = dec.add(torch.arange(1, 38))  # 37 tokens: 16 + 16 through the entry, then 5 (>= its 2)
    assert [c[0].shape for c in prefill.calls] == [(3, 16), (3, 16), (3, 5)]
    assert [c[1][0].item() for c in prefill.calls] == [0, 16, 32] and not step.calls
    table = prefill.calls[0][2]
    assert (table[1:] == dec.scratch).all() and (table[0, 3:] == dec.scratch).all()  # 3 pages, then scratch
    assert len(set(table[0, :3].tolist()) | {dec.scratch}) == 4 and dec.pages_in_use() == 3
    assert dec.step() == {seq: (37 + 36 + 1) % VOCAB}  # the prompt's greedy token, no call
    assert not step.calls


def test_a_tail_shorter_than_the_entry_takes_goes_through_the_step():
    dec, step, prefill = decoder(chunk=16)
    dec.add(torch.arange(17))  # 16 through the entry, 1 through the step (the entry takes >= 2)
    assert len(prefill.calls) == 1 and len(step.calls) == 1
    tokens, positions, table = step.calls[0]
    assert tokens[:, 0].tolist() == [16, 0] and positions.tolist() == [16, 0] and (table[1] == dec.scratch).all()
    dec_plain, plain_step, _ = decoder(with_prefill=False)
    dec_plain.add([3, 4, 5])  # no prefill entry: token by token
    assert [c[1][0].item() for c in plain_step.calls] == [0, 1, 2]


def test_each_step_decodes_every_live_sequence_batch_rows_at_a_time():
    dec, step, _ = decoder()
    ids = [dec.add([i + 1] * (3 + i)) for i in range(3)]  # lengths 3, 4, 5
    first = dec.step()
    assert list(first) == ids and not step.calls  # prefilled tokens
    step.calls.clear()
    second = dec.step()
    assert len(step.calls) == 2  # batch 2: rows [0, 1], then [2, padding]
    tokens, positions, table = step.calls[1]
    assert positions.tolist() == [5, 0] and tokens[1, 0] == 0 and (table[1] == dec.scratch).all()
    assert second == {s: (first[s] + dec.length(s) - 1 + 1) % VOCAB for s in ids}
    dec.release(ids[1])
    assert list(dec.step()) == [ids[0], ids[2]]


def test_a_step_brings_its_tokens_to_the_host_once(monkeypatch):
    # 3 sequences at batch 2 make two calls; their tokens stay on the device until both are
    # queued (on a GPU each host read is a sync that would leave the GPU idle between calls)
    dec, step, _ = decoder()
    ids = [dec.add([i + 1] * (3 + i)) for i in range(3)]
    first = dec.step()
    reads = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _f=original, _n=name: reads.append(_n) or _f(self))
    step.calls.clear()
    second = dec.step()
    assert len(step.calls) == 2 and reads == ["tolist"]
    assert second == {s: (first[s] + dec.length(s) - 1 + 1) % VOCAB for s in ids}


def test_failures_change_nothing():
    dec, step, _ = decoder(with_prefill=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dec.add([1, VOCAB])
    with pytest.raises(ValueError, match="a sequence takes 1 to 63"):
        dec.add(torch.tensor([], dtype=torch.int64))
    a = dec.add([1] * 60)  # 4 pages
    b = dec.add([2] * 63)  # 4 pages: the pool's 8 usable pages are taken
    assert dec.pages_in_use() == 8
    calls = len(step.calls)
    with pytest.raises(PoolExhausted):
        dec.add([1])
    assert len(step.calls) == calls and dec.live_sequences() == [a, b]
    dec.step()  # the prefilled tokens
    dec.step()  # a: 60 -> 61, b: 63 -> 64, all a sequence can hold
    with pytest.raises(ValueError, match="holds 64 positions"):
        dec.step()
    assert (dec.length(a), dec.length(b)) == (61, 64)
    dec.release(b)
    dec.step()
    with pytest.raises(UnknownSequence):
        dec.release(b)
    with pytest.raises(TypeError, match="not a paged ragged decode step"):
        PagedDecoder(torch.nn.Linear(2, 2))


def test_the_allocator_keeps_reserved_pages_out_of_use():
    pool = PageAllocator(4, 16, reserved=1)
    seq = pool.add_sequence(20)
    assert pool.pages_in_use() == 2 and pool.free_pages() == 1 and pool.reserved_pages[0] not in pool.page_table([seq]).tolist()[0]
    assert pool.page_table([seq], 3, fill=pool.reserved_pages[0]).tolist()[0][2] == pool.reserved_pages[0]
    pool.release(seq)
    assert pool.pages_in_use() == 0 and pool.free_pages() == 3
    with pytest.raises(ValueError):
        PageAllocator(2, 16, reserved=2)
