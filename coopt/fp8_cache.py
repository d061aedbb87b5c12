"""Build-time data of fp8 KV caches (the fp8-kv-cache pass, docs/kv-cache.md): calibration
before the passes, and the tensors the emitter stores after them.

The pass itself touches no data. The build (coopt/compile.py) calls:
- `calibrate_kv_absmax` before the passes: the original model (a deep copy) runs on the
  calibration inputs, and each 4-D floating buffer's absmax per kv head (dim 1) is recorded in
  the module attribute `coopt.kv_calibration` ({buffer ref: [absmax per head]}). The buffers'
  contents after those calls are what the model wrote plus what they held before, which is
  quantized with the same scales.
- `fp8_weights` in `program_weights`: the scale weights from the values the pass recorded in
  `coopt.fp8_kv_cache`, per-token scale buffers from each cache's existing rows, and each
  cache quantized with its scales (stored as float8_e4m3fn in weights.pt).

    absmax = calibrate_kv_absmax(model, [(tokens, positions)])   # {"layers.0.attention.k_cache": [3.1, 2.7], ...}
"""

from __future__ import annotations

import copy
import json

import torch

from coopt.passes.fp8_kv_cache import CALIBRATION_ATTR, FP8_ATTR, FP8_MAX, SCALE_FLOOR, Fp8KvCache

def needs_calibration(passes) -> bool:
    return any(isinstance(p, Fp8KvCache) and p.scale_source == "calibration" for p in passes)


@torch.no_grad()
def calibrate_kv_absmax(model: torch.nn.Module, calibration_inputs) -> dict[str, list[float]]:
    """{buffer name: [absmax of dim-1 slice h]} for every 4-D floating buffer, the largest it held
    before or after any call of a deep copy of `model` on each input tuple (the caller's model and
    its buffers stay as they are)."""
    model = copy.deepcopy(model)
    device = next((b.device for b in model.buffers()), torch.device("cpu"))

    def head_absmax() -> dict[str, torch.Tensor]:
        return {name: buffer.detach().float().abs().amax(dim=(0, 2, 3))
                for name, buffer in model.named_buffers() if buffer.dim() == 4 and buffer.is_floating_point()}

    # a running maximum: calls at the same positions (several prompts) overwrite each other's rows
    absmax = head_absmax()
    for inputs in calibration_inputs:
        model(*[x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs])
        absmax = {name: torch.maximum(absmax[name], now) for name, now in head_absmax().items()}
    return {name: [float(v) for v in values.cpu()] for name, values in absmax.items()}


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
    tensors = {}
    for cache_ref, scale_ref in record["caches"].items():
        cache = state[cache_ref]
        if granularity == "per-token":
            scale = row_scales(cache, headroom)
        else:
            scale = torch.tensor(record["scales"][scale_ref], dtype=torch.float32, device=cache.device)
        tensors[scale_ref] = scale
        tensors[cache_ref] = quantize(cache, scale, granularity)
    return tensors


def kv_cache_bytes(record: dict, state: dict) -> dict:
    """Bytes of the KV caches as the model had them and as stored in fp8 with their scales."""
    before = sum(state[c].numel() * state[c].element_size() for c in record["caches"])
    after = 0
    for cache_ref, scale_ref in record["caches"].items():
        cache = state[cache_ref]  # one byte an element in fp8, plus its fp32 scales
        scales = cache[..., 0].numel() if record["granularity"] == "per-token" else torch.tensor(record["scales"][scale_ref]).numel()
        after += cache.numel() + 4 * scales
    return {"before": before, "after": after, "saved": before - after}
