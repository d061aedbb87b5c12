"""How far a candidate's next-token distributions are from a reference's, on held-out text.

A model is a `logits_fn(tokens [B, T] int64) -> logits [B, T, V]` (causal, every call from
position 0), so an eager model, a dtype variant or a coopt build all compare the same way:

    report = compare(model_logits_fn(reference), model_logits_fn(candidate), corpus.heldout)
    report.kl_mean, report.top1_agreement, report.perplexity_change, report.greedy_agreement
    print(report.to_json())

A model that decodes its own way (a coopt build: a prefill, then one-token steps over its KV
cache) is a `Candidate(logits_fn, generate)`: its greedy tokens come from `generate`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
GreedyFn = Callable[[torch.Tensor, int], torch.Tensor]  # (prompts [B, T0], n) -> new tokens [B, n] on the CPU


@dataclass
class Candidate:
    """A model as compare() measures it: teacher-forced `logits`, and greedy generation by
    `generate` when given (a build decoding through its KV cache), else a full forward of
    `logits` per token. `details` are reported beside the metrics (a build's KV bytes, ...);
    `model` is what runs (a loaded build), for inspection."""
    logits: LogitsFn
    generate: GreedyFn | None = None
    details: dict = field(default_factory=dict)
    model: object = None

    def greedy(self, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        if self.generate is not None:
            return self.generate(prompts, new_tokens)
        return greedy_generate(self.logits, prompts, new_tokens)


def as_candidate(model: LogitsFn | Candidate) -> Candidate:
    return model if isinstance(model, Candidate) else Candidate(model)


def remembered(model: LogitsFn | Candidate) -> Candidate:
    """The same candidate, its logits and greedy tokens kept per input: measured against several
    references (eager fp32, the bf16 build) on the same windows and prompts, it runs each once."""
    model = as_candidate(model)
    seen: dict = {}

    def once(kind: str, fn: Callable, tokens: torch.Tensor, *rest):
        key = (kind, tuple(tokens.shape), tokens.cpu().numpy().tobytes(), *rest)
        if key not in seen:
            seen[key] = fn(tokens, *rest)
        return seen[key]

    return Candidate(lambda tokens: once("logits", model.logits, tokens),
                     lambda prompts, n: once("greedy", model.greedy, prompts, n), model.details, model.model)


@dataclass
class AccuracyReport:
    """Candidate vs reference over `windows` held-out windows of `seq_len` predicted tokens."""
    reference_perplexity: float
    candidate_perplexity: float
    perplexity_change: float  # candidate / reference - 1
    kl_mean: float  # mean over predicted positions of KL(reference || candidate), nats
    kl_max: float  # the worst position
    top1_agreement: float  # fraction of positions whose argmax tokens agree
    # At the positions where the argmaxes differ, the reference's own margin between its top two
    # tokens (nats): how close to a tie each flip was. Median, and the share below NEAR_TIE_NATS.
    flip_margin_median: float
    flip_near_ties: float
    greedy_agreement: float  # mean number of leading greedy tokens that agree, of greedy_tokens
    greedy_tokens: int
    greedy_prompts: int
    windows: int
    seq_len: int

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


NEAR_TIE_NATS = 0.1  # a reference whose top two tokens are this close: ~10 % apart in probability


def wilson_interval(fraction: float, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95 % at z = 1.96) of a rate `fraction` seen over `trials`
    independent trials. Predictions of one held-out window are not independent (neighbouring
    positions share context), so for top-1 agreement it is a lower bound on the uncertainty."""
    if trials <= 0:
        return 0.0, 1.0
    centre = fraction + z * z / (2 * trials)
    spread = z * (fraction * (1 - fraction) / trials + z * z / (4 * trials * trials)) ** 0.5
    scale = 1 + z * z / trials
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


def heldout_windows(data: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """[count', seq_len + 1] int64 windows at evenly spaced offsets of `data` (deterministic;
    fewer than `count` when `data` is short, never overlapping)."""
    span = seq_len + 1
    count = max(1, min(count, data.numel() // span))
    if data.numel() < span:
        raise ValueError(f"{data.numel()} tokens are too few for one window of {span}")
    stride = (data.numel() - span) // max(1, count - 1) if count > 1 else 0
    starts = torch.arange(count) * stride
    return data[starts[:, None] + torch.arange(span)].long()


def model_logits_fn(model: torch.nn.Module) -> LogitsFn:
    """The cache-free forward of a Transformer as a logits_fn: tokens moved to the model's
    device, logits returned as fp32 on the CPU."""
    device = next(model.parameters()).device

    @torch.no_grad()
    def logits_fn(tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens.to(device)).float().cpu()

    return logits_fn


@torch.no_grad()
def greedy_generate(logits_fn: LogitsFn, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[B, new_tokens]: greedy continuation of `prompts` [B, T0], a full forward per token."""
    sequence = prompts
    for _ in range(new_tokens):
        next_token = logits_fn(sequence)[:, -1].argmax(dim=-1, keepdim=True)
        sequence = torch.cat([sequence, next_token.to(sequence.device)], dim=1)
    return sequence[:, prompts.shape[1]:]


def leading_agreement(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading tokens of a and b [B, N] agree."""
    return (a == b).long().cumprod(dim=1).sum(dim=1)


@torch.no_grad()
def compare(reference: LogitsFn | Candidate, candidate: LogitsFn | Candidate, heldout: torch.Tensor, seq_len: int = 128,
            windows: int = 32, batch: int = 8, greedy_prompts: int = 8, prompt_len: int = 32,
            greedy_tokens: int = 32) -> AccuracyReport:
    """Teacher-forced metrics over `windows` held-out windows (perplexity, KL, top-1), then greedy
    generation from the first `prompt_len` tokens of `greedy_prompts` windows. Example:
    `compare(fn, fn, corpus.heldout)` has KL 0, top-1 1.0 and greedy agreement `greedy_tokens`."""
    reference, candidate = as_candidate(reference), as_candidate(candidate)
    data = heldout_windows(heldout, seq_len, windows)
    nll = {"reference": 0.0, "candidate": 0.0}
    kl_sum = kl_max = 0.0
    flip_margins = []
    agree = positions = 0
    for chunk in data.split(batch):
        inputs, targets = chunk[:, :-1], chunk[:, 1:].flatten()
        # fp64 log-softmax: KL of near-identical distributions is a difference of close numbers
        ref_logp = F.log_softmax(reference.logits(inputs).double(), dim=-1).flatten(0, 1)
        cand_logp = F.log_softmax(candidate.logits(inputs).double(), dim=-1).flatten(0, 1)
        nll["reference"] += F.nll_loss(ref_logp, targets, reduction="sum").item()
        nll["candidate"] += F.nll_loss(cand_logp, targets, reduction="sum").item()
        kl = (ref_logp.exp() * (ref_logp - cand_logp)).sum(dim=-1).clamp_min(0.0)
        kl_sum, kl_max = kl_sum + kl.sum().item(), max(kl_max, kl.max().item())
        same = ref_logp.argmax(dim=-1) == cand_logp.argmax(dim=-1)
        agree += same.sum().item()
        top2 = ref_logp[~same].topk(2, dim=-1).values
        flip_margins.append(top2[:, 0] - top2[:, 1])
        positions += targets.numel()
    reference_ppl = math.exp(nll["reference"] / positions)
    candidate_ppl = math.exp(nll["candidate"] / positions)
    flip_margins = torch.cat(flip_margins)

    prompts = data[:greedy_prompts, :prompt_len]
    greedy = 0.0
    if greedy_tokens > 0 and len(prompts):
        ref_tokens = reference.greedy(prompts, greedy_tokens)
        cand_tokens = candidate.greedy(prompts, greedy_tokens)
        greedy = leading_agreement(ref_tokens, cand_tokens).double().mean().item()
    return AccuracyReport(
        reference_perplexity=reference_ppl,
        candidate_perplexity=candidate_ppl,
        perplexity_change=candidate_ppl / reference_ppl - 1.0,
        kl_mean=kl_sum / positions,
        kl_max=kl_max,
        top1_agreement=agree / positions,
        flip_margin_median=flip_margins.median().item() if flip_margins.numel() else 0.0,
        flip_near_ties=(flip_margins < NEAR_TIE_NATS).double().mean().item() if flip_margins.numel() else 0.0,
        greedy_agreement=greedy,
        greedy_tokens=greedy_tokens,
        greedy_prompts=len(prompts),
        windows=len(data),
        seq_len=seq_len,
    )
