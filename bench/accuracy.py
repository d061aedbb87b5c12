"""Accuracy of each configuration against the fp32 eager baseline, on held-out Python stdlib
source, with a byte-level Llama trained here (no downloads): held-out perplexity and its change,
mean KL(baseline || configuration), top-1 agreement, greedy-generation agreement.

    python bench/accuracy.py --config tiny --steps 30                  # CPU, seconds
    python bench/accuracy.py --config small --steps 2000 --save runs/stdlib-small --out accuracy.json
    python bench/accuracy.py --checkpoint runs/stdlib-small --out accuracy.json

A configuration is a name -> function(baseline model) -> logits_fn (CONFIGURATIONS below); a
coopt build (e.g. with an fp8 KV cache, once that pass exists) is one more entry.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from coopt.accuracy import metrics, train
from coopt.accuracy.corpus import load_corpus

BASELINE = "eager fp32"


def eager_in(dtype: torch.dtype):
    """The baseline's weights, RoPE tables and caches cast to `dtype`, run eagerly."""
    def build(model):
        return metrics.model_logits_fn(copy.deepcopy(model).to(dtype))
    return build


@torch.no_grad()
def fp8_rounded_weights(model):
    """A lossy configuration for demonstration: every linear weight (projections, MLP, output head)
    rounded through float8_e4m3fn with one fp32 scale per output channel (amax / 448), then
    computed in fp32. This is weight rounding; it says nothing about an fp8 KV cache."""
    rounded = copy.deepcopy(model)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for module in rounded.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight
            scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / fp8_max
            weight.copy_((weight / scale).to(torch.float8_e4m3fn).float() * scale)
    return metrics.model_logits_fn(rounded)


CONFIGURATIONS = {
    BASELINE: lambda model: metrics.model_logits_fn(model),
    "eager bf16": eager_in(torch.bfloat16),
    "eager fp32, weights rounded to fp8-e4m3 per output channel (not KV-cache fp8)": fp8_rounded_weights,
    # next: "coopt build --kv-cache fp8": a logits_fn over the built artifact's prefill entry point
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(train.CONFIGS), default="small")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--train-seq-len", type=int, default=None, help="default: max_position_embeddings")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--checkpoint", type=Path, default=None, help="load this HF directory instead of training")
    parser.add_argument("--save", type=Path, default=None, help="save the trained model (HF format) here")
    parser.add_argument("--seq-len", type=int, default=128, help="evaluation window length")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--greedy-prompts", type=int, default=8)
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--only", default=None, help="comma-separated configuration names (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    return parser.parse_args()


def baseline_model(options, corpus) -> tuple[torch.nn.Module, dict | None]:
    """The trained fp32 model: loaded from --checkpoint, or trained now (and saved with --save)."""
    if options.checkpoint is not None:
        model = train.load_checkpoint(options.checkpoint, options.device)
        trained = options.checkpoint / "training.json"
        return model, json.loads(trained.read_text()).get("history") if trained.is_file() else None
    seq_len = options.train_seq_len or train.CONFIGS[options.config]["max_position_embeddings"]
    model, history = train.train(options.config, options.steps, options.batch, seq_len, options.device,
                                 options.seed, log_every=max(1, options.steps // 10), lr=options.lr, corpus=corpus)
    if options.save is not None:
        train.save_hf_checkpoint(model, options.save, extra={"corpus": corpus.describe(), "history": asdict(history)})
    # evaluation windows may be longer than the training crops: RoPE tables for every position
    model.setup_caches(max_batch_size=1, max_seq_length=model.args.max_position_embeddings)
    return model, asdict(history)


def print_table(results: dict) -> None:
    width = max(len("configuration"), *(len(name) for name in results))
    print(f"\n{'configuration':<{width}} {'ppl':>8} {'Δppl':>9} {'KL mean':>10} {'KL max':>9} {'top-1':>7} {'greedy':>9}")
    for name, report in results.items():
        print(f"{name:<{width}} {report['candidate_perplexity']:8.4f} {report['perplexity_change']:+9.2%} "
              f"{report['kl_mean']:10.2e} {report['kl_max']:9.2e} {report['top1_agreement']:7.2%} "
              f"{report['greedy_agreement']:5.1f}/{report['greedy_tokens']}")


def main() -> None:
    options = parse_args()
    corpus = load_corpus()
    model, history = baseline_model(options, corpus)
    if options.seq_len + 1 > model.max_seq_length:
        raise SystemExit(f"--seq-len {options.seq_len} exceeds the model's {model.max_seq_length - 1} positions")
    reference = CONFIGURATIONS[BASELINE](model)
    chosen = options.only.split(",") if options.only else list(CONFIGURATIONS)
    if unknown := [name for name in chosen if name not in CONFIGURATIONS]:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {list(CONFIGURATIONS)}")
    results = {}
    for name in chosen:
        start = time.perf_counter()
        report = metrics.compare(reference, CONFIGURATIONS[name](model), corpus.heldout, options.seq_len,
                                 options.windows, greedy_prompts=options.greedy_prompts,
                                 greedy_tokens=options.greedy_tokens)
        results[name] = {**report.to_dict(), "seconds": time.perf_counter() - start}
    print_table(results)
    if options.out is not None:
        options.out.write_text(json.dumps({
            "baseline": BASELINE, "corpus": corpus.describe(), "model": asdict(model.args),
            "training": history, "device": options.device, "results": results,
        }, indent=2) + "\n")
        print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
