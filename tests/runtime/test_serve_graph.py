"""PagedDecoder(cuda_graph=True): refused off the GPU; on it, the replayed decode step emits what
the plain step emits and leaves the same pools, over sequences added and released between steps.

The model is a fake paged build with real state (torch ops only): each call writes its tokens
into the page slots its table and positions name, and its logits mix the tokens its pages hold
up to each position, so a replay that missed a write, or read a stale table, decodes otherwise.
"""

from __future__ import annotations

import pytest
import torch

from coopt.runtime.serve import PagedDecoder
from test_serve import VOCAB, contract
from test_serve_sampling import run


class PoolStep(torch.nn.Module):
    """A paged step (or, per_row False, its prefill entry) over `pool` [num_pages, page_size]."""

    def __init__(self, paged: dict, pool, weight, freq, phase):
        super().__init__()
        self.paged, self.calls = paged, 0
        for name, tensor in {"pool": pool, "weight": weight, "freq": freq, "phase": phase}.items():
            self.register_buffer(name, tensor)  # the same tensors in the step and its entry: one pool

    def state_tensor(self, name):
        return self.pool

    def forward(self, tokens, positions, table):
        self.calls += 1  # Python calls: a replay makes none
        rows, length = tokens.shape
        page_size = self.paged["page_size"]
        at = positions[:, None] if self.paged["per_row"] else positions[None, :].expand(rows, length)  # [B, T]
        self.pool[table.long().gather(1, at // page_size), at % page_size] = tokens.to(self.pool.dtype)
        held = self.pool[table.long()].reshape(rows, 1, -1)  # [B, 1, max_pages * page_size], by position
        seen = torch.arange(held.shape[-1], device=held.device) <= at[..., None]  # causal: [B, T, slots]
        mix = (held * self.weight * seen).sum(-1)
        return torch.sin(mix[..., None] * self.freq + self.phase)  # [B, T, VOCAB]


def pool_model(device: str, with_prefill: bool = True) -> PoolStep:
    paged = contract()
    draws = torch.Generator().manual_seed(0)
    pool = torch.zeros(paged["num_pages"], paged["page_size"], device=device)
    weight = (torch.randn(paged["max_pages"] * paged["page_size"], generator=draws) / 64).to(device)
    freq, phase = (torch.randn(2, VOCAB, generator=draws) * 3).to(device)
    step = PoolStep(paged, pool, weight, freq, phase)
    entry = PoolStep(contract(per_row=False, batch=3, prefill_chunk=16), pool, weight, freq, phase)
    object.__setattr__(step, "entry_points", {"prefill": entry} if with_prefill else {})
    return step


def test_off_the_gpu_cuda_graph_is_refused():
    with pytest.raises(ValueError, match=r"^cuda_graph=True: CUDA graphs need a CUDA device, but the model is on cpu"):
        PagedDecoder(pool_model("cpu"), cuda_graph=True)


def test_the_fake_decodes_alike_through_its_entry_and_token_by_token():
    """The fake the GPU tests rely on, checked on the CPU: prefill and step compute one function."""
    with_entry, without = pool_model("cpu"), pool_model("cpu", with_prefill=False)
    assert run(PagedDecoder(with_entry)) == run(PagedDecoder(without))
    assert with_entry.entry_points["prefill"].calls == 3 and without.calls > with_entry.calls
    assert torch.equal(with_entry.pool, without.pool)


@pytest.mark.gpu
@pytest.mark.parametrize("with_prefill", [True, False], ids=["prefill-entry", "token-by-token"])
@pytest.mark.parametrize("options", [{}, {"temperature": 1.0, "top_k": 10, "seed": 3}], ids=["greedy", "sampled"])
def test_graph_replay_emits_what_the_plain_step_emits(with_prefill, options):
    plain_model, graphed_model = pool_model("cuda", with_prefill), pool_model("cuda", with_prefill)
    plain = PagedDecoder(plain_model, **options)
    graphed = PagedDecoder(graphed_model, cuda_graph=True, **options)
    assert plain.graph is None and graphed.graph.enabled
    captured = graphed_model.calls  # warm-up and capture, over padding rows on the scratch page
    assert not graphed_model.pool.any()  # padding writes token 0: nothing a sequence reads changed
    assert run(graphed) == run(plain)
    assert graphed_model.calls == captured  # every decode call after capture was a replay
    assert torch.equal(graphed_model.pool, plain_model.pool)
