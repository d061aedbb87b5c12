"""Which fp8 KV-cache quantization would reach issue 4's top-1 target? An eager experiment, not a
build: the accuracy harness's model (bench/accuracy.py's training, same config and seed), run in
bf16 with its attention's K and V rounded through float8_e4m3fn on the way in, each variant
against the plain bf16 model on the same held-out windows (coopt.accuracy.metrics.compare:
perplexity change, KL, top-1 agreement; no greedy runs).

Session 8's harness run measured the coopt fp8 per-head build at 98.83 % top-1 against the coopt
bf16 build (target >= 99 %). The variants here separate the K and V errors and try smoothing K:
subtracting each kv head's per-channel mean of K (from calibration text) before quantizing
changes every score of a query by the same amount (q . mean), which softmax ignores, so nothing
is added back, while the rounding error of channels with a large common offset shrinks.
Smoothing V (session 9) rounds v - mean and adds the mean back, which is what adding it to the
attention's output does (a query's probabilities sum to 1): fp8-kv-cache's smooth-v.
The rotated variants (session 10) store (x - mean) @ H, H the orthonormal Hadamard matrix of the
head dim, and read it back times H (in a build: q rotated as it is loaded, the output rotated
back): where a score rests on a few large channels, e4m3 rounds it like those few elements;
rotated, each element mixes all channels and the rounding errors average out.

    python bench/fp8_kv_probe.py --device cuda --out probe.json      # GPU, ~1 min with training
    python bench/fp8_kv_probe.py --config tiny --steps 30 --windows 4  # CPU smoke run
    python bench/fp8_kv_probe.py --per-layer   # the default with each layer's K in bf16 in turn
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from coopt.accuracy import metrics, train
from coopt.accuracy.corpus import load_corpus

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def fake_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x rounded through e4m3 with `scale` [Hkv, 1 or D] (saturating), back in x's dtype; scale
    None: one scale a row (each token and head its own absmax, fp8-kv-cache's dynamic per-token)."""
    if scale is None:
        scale = (x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX)
    else:
        scale = scale[None, :, None, :]
    scaled = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
    return (scaled.to(FP8).float() * scale).to(x.dtype)


@contextlib.contextmanager
def attention_hook(transform):
    """Every scaled_dot_product_attention call sees transform(layer, k, v) instead of k, v
    (layers counted in call order within one forward: the model calls attention once a layer)."""
    original = F.scaled_dot_product_attention
    calls = [0]

    def hooked(q, k, v, *args, **kwargs):
        k, v = transform(calls[0], k, v)
        calls[0] += 1
        return original(q, k, v, *args, **kwargs)

    F.scaled_dot_product_attention = hooked
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = original


@torch.no_grad()
def calibrate(model, windows: torch.Tensor, layers: int) -> list[dict]:
    """Per layer: K/V absmax per (kv head, channel) and K's per-channel mean, over `windows`."""
    stats = [dict(k_absmax=None, v_absmax=None, k_sum=None, v_sum=None, count=0) for _ in range(layers)]

    def record(call, k, v):
        layer = stats[call % layers]
        k32, v32 = k.float(), v.float()
        for name, value in (("k_absmax", k32.abs().amax(dim=(0, 2))), ("v_absmax", v32.abs().amax(dim=(0, 2)))):
            layer[name] = value if layer[name] is None else torch.maximum(layer[name], value)
        layer["k_sum"] = k32.sum(dim=(0, 2)) + (0 if layer["k_sum"] is None else layer["k_sum"])
        layer["v_sum"] = v32.sum(dim=(0, 2)) + (0 if layer["v_sum"] is None else layer["v_sum"])
        layer["count"] += k.shape[0] * k.shape[2]
        return k, v

    _run_calibration(model, windows, record)
    for layer in stats:
        count = layer.pop("count")
        layer["k_mean"], layer["v_mean"] = layer.pop("k_sum") / count, layer.pop("v_sum") / count
    return stats


def hadamard(size: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix [size, size] (size a power of two): symmetric, so
    x @ H @ H == x. Rotating K and V rows by it spreads a few large channels over all of them."""
    if size & (size - 1):
        raise ValueError(f"head dim {size} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / size ** 0.5


@torch.no_grad()
def calibrate_rotated(model, windows: torch.Tensor, layers: int, stats: list[dict]) -> None:
    """Adds to `stats` the absmax per (kv head, channel) of K and V rotated by hadamard(D), plain
    ("k_rot_absmax") and centred on calibrate()'s means ("k_rot_centred_absmax")."""
    def record(call, k, v):
        layer = stats[call % layers]
        rotation = hadamard(k.shape[-1]).to(k.device)
        for name, x in (("k", k.float()), ("v", v.float())):
            mean = layer[f"{name}_mean"][None, :, None, :]
            for key, value in ((f"{name}_rot_absmax", x @ rotation), (f"{name}_rot_centred_absmax", (x - mean) @ rotation)):
                value = value.abs().amax(dim=(0, 2))
                layer[key] = value if key not in layer else torch.maximum(layer[key], value)
        return k, v

    _run_calibration(model, windows, record)


def _run_calibration(model, windows: torch.Tensor, record) -> None:
    """The model over `windows`, 8 at a time, every attention's K and V passing through `record`."""
    with attention_hook(record):
        for chunk in windows.split(8):
            model(chunk.to(next(model.parameters()).device))


def variant(stats: list[dict], layers: int, *, k: str | None, v: str | None, smooth_k: bool = False,
            smooth_v: bool = False, rotate: bool = False, bf16_k_layers: frozenset = frozenset(),
            k_mean_back: bool = False):
    """transform for attention_hook: K and V each None (kept bf16), "head" (one scale per kv head),
    "channel" (one per kv head and channel) or "token" (one per row, from the row itself); smooth_k subtracts K's calibrated channel means;
    smooth_v rounds v - mean and adds the mean back (what adding it to the attention's output
    does: the probabilities of a query sum to 1); rotate stores (x - mean) @ H (H: hadamard(D))
    and reads it back times H, which attention does by rotating q and its output alike. The
    layers in bf16_k_layers keep their K in bf16 (V as the others'). k_mean_back adds a smoothed
    K's mean back after rounding: where some keys of a query are read exact and others rounded
    (the recent-window variants), the shift softmax ignores must be the same for all of them."""
    def scale(absmax, granularity):
        if granularity == "token":
            return None  # fake_fp8 takes each row's own
        per = absmax if granularity == "channel" else absmax.amax(dim=1, keepdim=True)
        return per.clamp_min(1e-12) / FP8_MAX

    def centred(x, absmax, mean, granularity):
        """(x - mean rounded, mean): the rounding's absmax over (x - mean), bounded by |x| + |mean|."""
        mean_x = mean[None, :, None, :].to(x.dtype)
        return fake_fp8(x - mean_x, scale(absmax + mean.abs(), granularity)), mean_x

    def rotated(x, layer, name, granularity, smooth):
        """x rounded as (x - mean) @ H, read back as rounded @ H (+ mean for V: K's is ignored)."""
        rotation = hadamard(x.shape[-1]).to(x.device)
        mean = layer[f"{name}_mean"][None, :, None, :].to(x.device) if smooth else 0.0
        absmax = layer[f"{name}_rot_centred_absmax" if smooth else f"{name}_rot_absmax"]
        rounded = fake_fp8((x.float() - mean) @ rotation, scale(absmax, granularity)).float() @ rotation
        return (rounded + (mean if name == "v" else 0.0)).to(x.dtype)

    # the spared layers' transform, made once: K kept, V as the others'
    spared = variant(stats, layers, k=None, v=v, smooth_v=smooth_v, rotate=rotate) if bf16_k_layers else None

    def transform(call, key, value):
        if call % layers in bf16_k_layers:
            return spared(call, key, value)
        layer = stats[call % layers]
        if rotate:
            return (key if k is None else rotated(key, layer, "k", k, smooth_k),
                    value if v is None else rotated(value, layer, "v", v, smooth_v))
        if k is not None and smooth_k:
            key, mean = centred(key, layer["k_absmax"], layer["k_mean"], k)  # nothing added back: softmax ignores q . mean
            key = key + mean if k_mean_back else key
        elif k is not None:
            key = fake_fp8(key, scale(layer["k_absmax"], k))
        if v is not None and smooth_v:
            rounded, mean = centred(value, layer["v_absmax"], layer["v_mean"], v)
            value = rounded + mean
        elif v is not None:
            value = fake_fp8(value, scale(layer["v_absmax"], v))
        return key, value
    return transform


@contextlib.contextmanager
def recent_exact_hook(transform, window: int):
    """attention_hook's form for the recent-window variants: each query reads the `window` keys
    nearest it (itself included) exact and older ones through `transform` (K and V rounded): what
    a cache whose newest rows stay bf16 until they age into fp8 gives (KIVI's full-precision
    residual). Per query, so not one transformed K: the attention is computed here, in fp32
    (causal, the kv heads repeated for their query heads); the control row (a window past the
    sequence) measures what that fp32 attention alone changes against the model's SDPA."""
    calls = [0]

    def hooked(q, k, v, *args, **kwargs):
        k_hat, v_hat = transform(calls[0], k, v)
        calls[0] += 1
        repeat = q.shape[1] // k.shape[1]
        k, v, k_hat, v_hat = (x.float().repeat_interleave(repeat, dim=1) for x in (k, v, k_hat, v_hat))
        positions = torch.arange(q.shape[2], device=q.device)
        distance = positions[:, None] - positions[None, :]  # query t - key j
        causal, near = distance >= 0, (distance >= 0) & (distance < window)
        qf = q.float() * q.shape[-1] ** -0.5
        scores = torch.where(near, qf @ k.transpose(-1, -2), qf @ k_hat.transpose(-1, -2))
        weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out = (weights * near) @ v + (weights * (causal & ~near)) @ v_hat
        return out.to(q.dtype)

    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = hooked
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = original


VARIANTS = {
    "K+V per-head (the build's per-head)": dict(k="head", v="head"),
    "K per-head only": dict(k="head", v=None),
    "V per-head only": dict(k=None, v="head"),
    "K+V per-head, K smoothed": dict(k="head", v="head", smooth_k=True),
    "K+V per-head, K and V smoothed": dict(k="head", v="head", smooth_k=True, smooth_v=True),
    "V per-head only, smoothed": dict(k=None, v="head", smooth_v=True),
    "K per-channel, V per-head": dict(k="channel", v="head"),
    "K per-channel smoothed, V per-head": dict(k="channel", v="head", smooth_k=True),
    "K+V per-head, rotated": dict(k="head", v="head", rotate=True),
    "K+V per-head, K smoothed, rotated": dict(k="head", v="head", smooth_k=True, rotate=True),
    "K+V per-head, K and V smoothed, rotated": dict(k="head", v="head", smooth_k=True, smooth_v=True, rotate=True),
    "K per-head only, smoothed, rotated": dict(k="head", v=None, smooth_k=True, rotate=True),
    # session 41: dynamic per-token scales (the pass's granularity=per-token), plain and with K centred
    "K+V per-token": dict(k="token", v="token"),
    "K+V per-token, K smoothed": dict(k="token", v="token", smooth_k=True),
    "K+V per-token, K and V smoothed": dict(k="token", v="token", smooth_k=True, smooth_v=True),
    "K per-token smoothed, V per-head": dict(k="token", v="head", smooth_k=True),
    # session 42: the newest rows exact (a bf16 residual window before they age into fp8), against
    # a reference through the same fp32 attention with every row exact (main: its noise against
    # the model's own SDPA is not the rounding's)
    "K+V per-head, K smoothed, newest 1 exact": dict(k="head", v="head", smooth_k=True, k_mean_back=True,
                                                    recent=1),
    "K+V per-head, K smoothed, newest 2 exact": dict(k="head", v="head", smooth_k=True, k_mean_back=True,
                                                    recent=2),
    "K+V per-head, K smoothed, newest 4 exact": dict(k="head", v="head", smooth_k=True, k_mean_back=True,
                                                    recent=4),
    "K+V per-head, K smoothed, newest 16 exact": dict(k="head", v="head", smooth_k=True, k_mean_back=True,
                                                    recent=16),
    "K+V per-head, K smoothed, newest 32 exact": dict(k="head", v="head", smooth_k=True, k_mean_back=True,
                                                    recent=32),
}
# --per-layer: the build's default (K smoothed) with one layer's K kept in bf16 at a time, which
# says whether K's cost sits in a few layers that a mixed cache could spare
PER_LAYER_BASE = dict(k="head", v="head", smooth_k=True)


def per_layer_variants(layers: int) -> dict:
    return {f"K+V per-head, K smoothed, layer {layer}'s K bf16": {**PER_LAYER_BASE, "bf16_k_layers": frozenset({layer})}
            for layer in range(layers)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small", choices=sorted(train.CONFIGS))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--windows", type=int, default=128, help="held-out windows of --seq-len (the harness's 128)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--calibration-windows", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--per-layer", action="store_true",
                        help="only the build's default and it with each layer's K in bf16 in turn")
    parser.add_argument("--only", default=None, help="only the variants whose names contain this text")
    args = parser.parse_args(argv)
    corpus = load_corpus()
    seq_len = train.CONFIGS[args.config]["max_position_embeddings"]
    model, _ = train.train(args.config, args.steps, args.batch, seq_len, args.device, args.seed,
                           log_every=max(1, args.steps // 5), corpus=corpus)
    model.setup_caches(max_batch_size=1, max_seq_length=model.args.max_position_embeddings)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    layers = bf16.args.n_layers
    calibration = metrics.heldout_windows(corpus.train, args.seq_len - 1, args.calibration_windows)
    stats = calibrate(bf16, calibration, layers)
    calibrate_rotated(bf16, calibration, layers, stats)
    reference = metrics.remembered(metrics.model_logits_fn(bf16))
    results = {}
    print(f"\n| variant (vs eager bf16, {args.windows} windows x {args.seq_len}) | Δppl | KL mean | top-1 "
          f"| flips under {metrics.NEAR_TIE_NATS} nats |")
    print("| --- | ---: | ---: | ---: | ---: |")
    plain = metrics.model_logits_fn(bf16)
    variants = ({"K+V per-head, K smoothed (--kv-cache fp8)": PER_LAYER_BASE, **per_layer_variants(layers)}
                if args.per_layer else VARIANTS)
    if args.only:
        variants = {name: knobs for name, knobs in variants.items() if args.only in name}
    def exact_fp32_attention(tokens):  # the recent-window variants' reference: no row rounded
        with recent_exact_hook(lambda call, key, value: (key, value), window=1 << 30):
            return plain(tokens)

    recent_reference = metrics.remembered(exact_fp32_attention)
    for name, knobs in variants.items():
        knobs = dict(knobs)
        recent = knobs.pop("recent", None)
        hook = (lambda t, window=recent: recent_exact_hook(t, window)) if recent else attention_hook

        def quantized(tokens, transform=variant(stats, layers, **knobs), hook=hook):
            with hook(transform):  # only the candidate's calls: the reference stays plain bf16
                return plain(tokens)
        report = metrics.compare(recent_reference if recent else reference, quantized, corpus.heldout,
                                 seq_len=args.seq_len, windows=args.windows, greedy_tokens=0)
        results[name] = {"perplexity_change": report.perplexity_change, "kl_mean": report.kl_mean,
                         "top1_agreement": report.top1_agreement, "positions": report.windows * report.seq_len,
                         "flip_margin_median": report.flip_margin_median, "flip_near_ties": report.flip_near_ties}
        print(f"| {name} | {report.perplexity_change:+.3%} | {report.kl_mean:.2e} | {report.top1_agreement:.2%} "
              f"| {report.flip_near_ties:.0%} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
