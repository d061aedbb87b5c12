"""Build-time data of fp8 KV caches (the fp8-kv-cache pass, docs/kv-cache.md): calibration
before the passes, and the tensors the emitter stores after them.

The pass itself touches no data. The build (coopt/compile.py) calls:
- `calibrate_kv_absmax` before the passes: the original model (a deep copy) runs on the
  calibration inputs, and each 4-D floating buffer's absmax per kv head (dim 1), mean per
  (head, channel) and centred range are recorded in the module attribute `coopt.kv_calibration`
  ({buffer ref: {"absmax", "mean", "centred_absmax"}}). The buffers' contents after those calls are what the model wrote plus what they held before, which is
  quantized with the same scales.
- `fp8_weights` in `program_weights`: the scale weights from the values the pass recorded in
  `coopt.fp8_kv_cache`, per-token scale buffers from each cache's existing rows, smoothed
  caches' offsets (smooth-v: also what the attentions add back), and each cache (less its offset) quantized with its scales (stored as
  float8_e4m3fn in weights.pt).

    stats = calibrate_kv_absmax(model, [(tokens, positions)])   # {"layers.0.attention.k_cache": {"absmax": [3.1, 2.7], "mean": ..., ...}}
"""

from __future__ import annotations

import copy
import json

import torch

from coopt.passes.fp8_kv_cache import CALIBRATION_ATTR, FP8_ATTR, FP8_MAX, SCALE_FLOOR, Fp8KvCache

def needs_calibration(passes) -> bool:
    return any(isinstance(p, Fp8KvCache) and p.scale_source == "calibration" for p in passes)


@torch.no_grad()
def calibrate_kv_absmax(model: torch.nn.Module, calibration_inputs) -> dict[str, dict]:
    """Per 4-D floating buffer, what a deep copy of `model` held in it before or after any call
    on each input tuple (the caller's model and its buffers stay as they are):
    {"absmax": [per kv head (dim 1)], "mean": [[per head and channel (dim 3)]], "centred_absmax":
    [per head: the largest |x - mean| of its channels]}. Mean and centred range are over the
    rows that hold something (a row of zeros is a position nothing wrote yet): fp8-kv-cache's
    smooth-k subtracts the mean from the keys before rounding and scales by the centred range."""
    model = copy.deepcopy(model)
    device = next((b.device for b in model.buffers()), torch.device("cpu"))
    buffers = {name: b for name, b in model.named_buffers() if b.dim() == 4 and b.is_floating_point()}
    stats: dict[str, dict] = {}

    def observe() -> None:
        # running statistics: calls at the same positions (several prompts) overwrite each other's rows
        for name, buffer in buffers.items():
            x = buffer.detach().float()
            rows = x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])  # [rows, H, D]
            held = rows.abs().amax(dim=-1) > 0  # [rows, H]
            now = {"absmax": x.abs().amax(dim=(0, 2, 3)),
                   "sum": torch.where(held[..., None], rows, 0.0).sum(dim=0), "count": held.sum(dim=0),
                   "low": torch.where(held[..., None], rows, float("inf")).amin(dim=0),
                   "high": torch.where(held[..., None], rows, float("-inf")).amax(dim=0)}
            seen = stats.get(name)
            stats[name] = now if seen is None else {
                "absmax": torch.maximum(seen["absmax"], now["absmax"]), "sum": seen["sum"] + now["sum"],
                "count": seen["count"] + now["count"], "low": torch.minimum(seen["low"], now["low"]),
                "high": torch.maximum(seen["high"], now["high"])}

    observe()
    for inputs in calibration_inputs:
        model(*[x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs])
        observe()
    result = {}
    for name, s in stats.items():
        mean = s["sum"] / s["count"].clamp_min(1)[:, None]  # [H, D]; a head with no rows: 0
        spread = torch.maximum(s["high"] - mean, mean - s["low"])
        centred = torch.where(s["count"][:, None] > 0, spread, 0.0).amax(dim=-1)
        result[name] = {"absmax": [float(v) for v in s["absmax"].cpu()],
                        "mean": [[float(v) for v in head] for head in mean.cpu()],
                        "centred_absmax": [float(v) for v in centred.cpu()]}
    return result


def set_calibration(module, absmax: dict) -> None:
    from xdsl.dialects.builtin import StringAttr

    module.attributes[CALIBRATION_ATTR] = StringAttr(json.dumps(absmax, sort_keys=True))


def fp8_record(module) -> dict | None:
    """What the fp8-kv-cache pass recorded (None when it did not run)."""
    attr = module.attributes.get(FP8_ATTR)
    return json.loads(attr.data) if attr is not None else None


def row_scales(cache: torch.Tensor, headroom: float) -> torch.Tensor:
    """Per-token scales [B, Hkv, S] of a cache's rows, as the program computes them on a write."""
    return cache.detach().float().abs().amax(dim=-1).clamp_min(SCALE_FLOOR) * (headroom / FP8_MAX)


def quantize(x: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """x [B, Hkv, T, D] → float8_e4m3fn with `scale` broadcast by granularity (as the program)."""
    return torch.clamp(x.float() / broadcast_scale(scale, granularity), -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def broadcast_scale(scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """A scale against [B, Hkv, T, D]: [1] as is, per-head [Hkv] → [Hkv, 1, 1], per-token [B, Hkv, T] → [B, Hkv, T, 1]."""
    if granularity == "per-head":
        return scale[:, None, None]
    return scale[..., None] if granularity == "per-token" else scale


def fp8_weights(record: dict, state: dict) -> dict[str, torch.Tensor]:
    """The fp8 caches and their scales by state name, from the pass's record and the model's state."""
    granularity, headroom = record["granularity"], record["headroom"]
    offsets = record.get("offsets", {})  # smooth-k / smooth-v: key / value caches store x - offset
    tensors = {}
    for cache_ref, scale_ref in record["caches"].items():
        cache = state[cache_ref]
        if granularity == "per-token":
            scale = row_scales(cache, headroom)
        else:
            scale = torch.tensor(record["scales"][scale_ref], dtype=torch.float32, device=cache.device)
        tensors[scale_ref] = scale
        if cache_ref in offsets:
            offset = torch.tensor(record["offset_values"][offsets[cache_ref]], dtype=torch.float32,
                                  device=cache.device)[None, :, None, :]  # [1, Hkv, 1, D]
            tensors[offsets[cache_ref]] = offset
            cache = cache.float() - offset
        tensors[cache_ref] = quantize(cache, scale, granularity)
    for cache_ref, scale_ref in record.get("unit_scales", {}).items():  # values-only: keys as they are, scale 1
        tensors[scale_ref] = torch.tensor(record["scales"][scale_ref], dtype=torch.float32, device=state[cache_ref].device)
    for output_ref, of in record.get("output_offsets", {}).items():  # smooth-v: added to attention outputs
        offset = tensors[of["offset"]].repeat_interleave(of["repeat"], dim=1)  # [1, H, 1, D]
        tensors[output_ref] = offset.to(getattr(torch, of["dtype"]))
    recent = record.get("recent") or {}
    for cache_ref, ring_ref in recent.get("rings", {}).items():  # exact-recent: the newest rows unrounded
        cache = state[cache_ref].float()
        if cache_ref in offsets:
            cache = cache - tensors[offsets[cache_ref]]
        tensors[ring_ref] = newest_rows_ring(state[cache_ref], cache, recent["window"]).to(
            getattr(torch, recent["dtypes"][ring_ref]))
    return tensors


def newest_rows_ring(held: torch.Tensor, rows: torch.Tensor, window: int) -> torch.Tensor:
    """exact-recent's ring [B, Hkv, window, D] at build time: for each sequence the rows of
    `rows` [B, Hkv, S, D] at its newest `window` positions, each at slot position % window. A
    sequence's newest position is the last one whose row of `held` (the cache as the model holds
    it) is not all zeros: what a cache written in order up to there holds; zeros where none is."""
    batch, heads, _, head_dim = rows.shape
    ring = rows.new_zeros(batch, heads, window, head_dim)
    written = held.detach().abs().amax(dim=(1, 3)) > 0  # [B, S]
    for b in range(batch):
        filled = written[b].nonzero()
        end = int(filled[-1]) + 1 if len(filled) else 0
        for position in range(max(0, end - window), end):
            ring[b, :, position % window] = rows[b, :, position]
    return ring


def kv_cache_bytes(record: dict, state: dict) -> dict:
    """Bytes of the KV caches as the model had them and as stored in fp8 with their scales (with
    values-only, the key caches at their own size in both, plus their unit scales after)."""
    kept = record.get("unit_scales", {})
    before = sum(state[c].numel() * state[c].element_size() for c in [*record["caches"], *kept])
    after = sum(state[c].numel() * state[c].element_size() + 4 * len(record["scales"][s]) for c, s in kept.items())
    for cache_ref, scale_ref in record["caches"].items():
        cache = state[cache_ref]  # one byte an element in fp8, plus its fp32 scales
        scales = cache[..., 0].numel() if record["granularity"] == "per-token" else torch.tensor(record["scales"][scale_ref]).numel()
        after += cache.numel() + 4 * scales
    for offset_ref in record.get("offset_values", {}):  # smooth-k / smooth-v: fp32 [Hkv, D] a cache
        after += 4 * sum(len(head) for head in record["offset_values"][offset_ref])
    recent = record.get("recent") or {}
    for cache_ref, ring_ref in recent.get("rings", {}).items():  # exact-recent: [B, Hkv, window, D] a cache
        batch, heads, _, head_dim = state[cache_ref].shape
        after += batch * heads * recent["window"] * head_dim * getattr(torch, recent["dtypes"][ring_ref]).itemsize
    return {"before": before, "after": after, "saved": before - after}
