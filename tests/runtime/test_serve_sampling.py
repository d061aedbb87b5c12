"""PagedDecoder's token choice against test_serve's fake paged build, given spread logits: greedy
by default and unchanged, seeded sampling reproducible, top_k=1 greedy, every sample within the
top_k of the logits it was drawn from, per-sequence overrides, and bad arguments refused before
anything changes."""

from __future__ import annotations

import math

import pytest
import torch

from coopt.runtime.serve import PagedDecoder
from test_serve import VOCAB, FakeStep, contract

# Row r: the logits after (last token t, position p) with (t + p + 1) % VOCAB == r (FakeStep's
# argmax). Continuous draws: no ties, so the top-k set of a row is well defined.
TABLE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))


def logits_after(token: int, position: int) -> torch.Tensor:
    return TABLE[(token + position + 1) % VOCAB]


class SpreadStep(FakeStep):
    """FakeStep (same calls recorded) whose logits are TABLE's rows instead of one-hots."""

    def forward(self, tokens, positions, table):
        return TABLE[super().forward(tokens, positions, table).argmax(-1)]


def sampling_decoder(**options) -> PagedDecoder:
    step = SpreadStep(contract())
    object.__setattr__(step, "entry_points", {"prefill": SpreadStep(contract(per_row=False, batch=3, prefill_chunk=16))})
    return PagedDecoder(step, **options)


PROMPTS = {"a": [1, 2, 3], "b": list(range(5, 25)), "c": [7]}  # through the entry; 16 + 4 through it; the step


def run(decoder: PagedDecoder, **overrides) -> dict[str, list[int]]:
    """One fixed sequence of calls: a and b added, two steps, c added, a step, a released, two
    steps. Each sequence's tokens: its prompt, then what it emitted (a 3, b 5, c 3).
    `overrides`: add() options by sequence name."""
    tokens = {name: list(prompt) for name, prompt in PROMPTS.items()}
    ids = {}

    def add(name):
        ids[name] = decoder.add(PROMPTS[name], **overrides.get(name, {}))

    def step():
        for seq_id, token in decoder.step().items():
            tokens[next(name for name, i in ids.items() if i == seq_id)].append(token)

    add("a")
    add("b")
    step()  # a and b emit their prefilled tokens
    step()
    add("c")
    step()  # c's prefilled token beside a's and b's decoded ones
    decoder.release(ids["a"])
    step()
    step()
    return tokens


def choices(prompt: list[int], tokens: list[int]):
    """(the logits each emitted token was chosen from, that token) along one sequence."""
    for i in range(len(prompt), len(tokens)):
        yield logits_after(tokens[i - 1], i - 1), tokens[i]


def greedy_tokens(prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(int(logits_after(tokens[-1], len(tokens) - 1).argmax()))
    return tokens


def test_greedy_is_the_default_draws_nothing_and_ignores_top_k():
    decoder = sampling_decoder()
    untouched = decoder.generator.get_state()
    tokens = run(decoder)
    assert all(tokens[name] == greedy_tokens(PROMPTS[name], len(tokens[name]) - len(PROMPTS[name])) for name in PROMPTS)
    assert [len(tokens[n]) - len(PROMPTS[n]) for n in "abc"] == [3, 5, 3]
    assert torch.equal(decoder.generator.get_state(), untouched)
    assert run(sampling_decoder(temperature=0, top_k=3, seed=7)) == tokens


def test_seeded_sampling_is_reproducible_and_the_seed_matters():
    options = {"temperature": 1.5, "top_k": 8}
    first = run(sampling_decoder(seed=3, **options))
    assert run(sampling_decoder(seed=3, **options)) == first
    assert run(sampling_decoder(seed=4, **options)) != first  # fixed seeds: the same outcome every run


def test_top_k_1_is_greedy():
    assert run(sampling_decoder(temperature=2.0, top_k=1, seed=5)) == run(sampling_decoder())


@pytest.mark.parametrize("seed", [0, 1])
def test_every_sample_lies_in_the_top_k_of_its_logits(seed):
    k = 4
    tokens = run(sampling_decoder(temperature=5.0, top_k=k, seed=seed))
    drawn = [(logits, token) for name in PROMPTS for logits, token in choices(PROMPTS[name], tokens[name])]
    assert len(drawn) == 11
    assert all(token in torch.topk(logits, k).indices.tolist() for logits, token in drawn)
    assert any(token != int(logits.argmax()) for logits, token in drawn)  # sampled, not greedy


def test_add_overrides_the_decoders_choice_per_sequence():
    decoder = sampling_decoder(seed=2)  # a greedy decoder where a samples
    untouched = decoder.generator.get_state()
    tokens = run(decoder, a={"temperature": 5.0, "top_k": 3})
    assert tokens["b"] == greedy_tokens(PROMPTS["b"], 5) and tokens["c"] == greedy_tokens(PROMPTS["c"], 3)
    assert all(token in torch.topk(logits, 3).indices.tolist() for logits, token in choices(PROMPTS["a"], tokens["a"]))
    assert not torch.equal(decoder.generator.get_state(), untouched)  # a drew from the generator
    decoder = sampling_decoder(temperature=5.0, top_k=3)  # a sampling decoder, every sequence greedy
    untouched = decoder.generator.get_state()
    greedy = run(decoder, **{name: {"temperature": 0} for name in PROMPTS})
    assert greedy == run(sampling_decoder()) and torch.equal(decoder.generator.get_state(), untouched)


BAD = [("temperature", -0.5), ("temperature", True), ("temperature", "1"), ("temperature", math.nan),
       ("temperature", math.inf), ("top_k", 0), ("top_k", -1), ("top_k", 2.5), ("top_k", True), ("top_k", "3")]


@pytest.mark.parametrize("name, value", BAD)
def test_bad_sampling_arguments_are_refused_before_anything_changes(name, value):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        sampling_decoder(**{name: value})
    decoder = sampling_decoder()
    held = decoder.add([1, 2])
    with pytest.raises(ValueError, match=f"^{name} must be"):
        decoder.add([3, 4, 5], **{name: value})
    assert decoder.live_sequences() == [held] and decoder.pages_in_use() == 1
    assert len(decoder.model.entry_points["prefill"].calls) == 1  # only the first prompt's prefill


def test_seed_and_cuda_graph_must_be_what_they_say():
    with pytest.raises(ValueError, match="seed must be an int"):
        sampling_decoder(seed="0")
    with pytest.raises(ValueError, match="cuda_graph must be True or False"):
        sampling_decoder(cuda_graph="yes")
