"""How closely a built decoder follows a reference over many decode steps.

Teacher-forced: both models get the same tokens each step (the reference's greedy choice), so
one early disagreement does not turn every later step into a comparison of different texts.
Reported: the largest absolute logit error of any step, top-1 agreement (the fraction of
steps whose argmax tokens agree) and the mean KL(reference || built) of the next-token
distributions. Used by tests (tiny model, fp32: exact agreement expected), by bench/decode.py
(bf16 build against an fp32 eager copy) and by lossy builds (fp8 KV cache against the original).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeAgreement:
    steps: int
    max_abs_err: float
    top1_agreement: float  # fraction of (step, sequence) pairs with the same argmax
    mean_kl: float = 0.0  # mean over (step, sequence) of KL(softmax(reference) || softmax(built)), nats

    def to_json(self) -> dict:
        return {"steps": self.steps, "max_abs_err": self.max_abs_err, "top1_agreement": self.top1_agreement,
                "mean_kl": self.mean_kl}


@torch.no_grad()
def decode_agreement(built, reference, tokens: torch.Tensor, start: int, steps: int) -> DecodeAgreement:
    """Run `steps` decode steps of `built` and `reference` (both `forward(tokens [B, 1],
    positions [1]) -> logits [B, 1, V]`, each with its own KV cache) from position `start`.

    `tokens` [B, 1] is the first input token; later tokens are the reference's argmax.
    """
    worst, agree, total, kl = 0.0, 0, 0, 0.0
    for step in range(steps):
        position = torch.tensor([start + step], device=tokens.device)
        want = reference(tokens, position).float()
        got = built(tokens, position).float()
        worst = max(worst, float((got - want).abs().max()))
        chosen = want[:, -1].argmax(-1)
        agree += int((got[:, -1].argmax(-1) == chosen).sum())
        total += chosen.numel()
        log_want, log_got = want[:, -1].double().log_softmax(-1), got[:, -1].double().log_softmax(-1)
        kl += float((log_want.exp() * (log_want - log_got)).sum())
        tokens = chosen[:, None].to(tokens.dtype)
    return DecodeAgreement(steps, worst, agree / max(total, 1), kl / max(total, 1))
