"""coopt builds of the trained model as accuracy candidates.

The trained Transformer (examples/llama/model.py's) is copied to the dtype a GPU would serve it in
(bf16), given a KV cache, built through the public API with two entry points sharing that cache
(the one-token decode step and a prefill of any prompt length), loaded back with `coopt.load` and
measured like any model (`metrics.Candidate`):
- logits: the built prefill over each window at positions 0..T-1; its attention reads the cache
  it has just written, so in an fp8 build every key and value went through fp8;
- greedy tokens: `coopt.generate`, the built prefill and then the built decode step.

    setting = BuildSetting(batch=8, max_seq=128, device="cuda")
    calibration = calibration_inputs(corpus.train, setting)
    candidate = build_candidate(model, "runs/fp8-head", fp8_kv_pipeline("per-head"), setting, calibration)
    report = metrics.compare(metrics.model_logits_fn(model), candidate, corpus.heldout)
    candidate.details["kv_bytes_per_token"]
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# coopt.api first: it decides Triton's interpreter (no GPU) before anything imports triton.language
from coopt.api import Pipeline
from coopt.accuracy.metrics import Candidate, heldout_windows
from coopt.emit.state_file import WEIGHTS_FILE, stored_state
from coopt.passes.registry import DEFAULT_PIPELINE

# No kernel regions: the program is the ATen ops (with the fp8 pass's quantize and dequantize),
# the arithmetic every kernel is verified against. Builds in seconds on a CPU, where the
# interpreter makes verifying kernels slow; for tests and quick runs, not for the reported numbers.
REFERENCE_PIPELINE = "inplace-state-writes,raise-patterns"
PREFILL_EXAMPLE = 16  # tokens of the prefill entry's example call (its length is dynamic)
CACHE_SUFFIXES = ("k_cache", "v_cache", "k_cache.scale", "v_cache.scale")  # the model file's state names


def fp8_kv_pipeline(granularity: str, base: str = DEFAULT_PIPELINE, headroom: float | None = None,
                    smooth_k: bool = False, smooth_v: bool = False, values_only: bool = False,
                    exact_recent: int = 0) -> str:
    """`base` with fp8-kv-cache{granularity=...} right after raise-patterns, where `--kv-cache
    fp8` puts it; per-token scales are computed at each write (scale-source=dynamic). `headroom`
    (the pass's knob, default its own 1.0): scale = absmax x headroom / 448. `smooth_k`: keys
    stored less their calibrated channel means (the pass's smooth-k); `smooth_v` the same for the
    values, their means added back to the attention's output (smooth-v). `values_only`: the
    value caches in fp8, the keys kept in bf16 (the pass's values-only). `exact_recent`: each
    query reads its newest that many keys unrounded (the pass's exact-recent)."""
    knobs = f"granularity={granularity}" + (",scale-source=dynamic" if granularity == "per-token" else "")
    knobs += f",headroom={float(headroom)!r}" if headroom is not None else ""  # a float literal: the knob is a float
    knobs += ",smooth-k=true" if smooth_k else ""
    knobs += ",smooth-v=true" if smooth_v else ""
    knobs += ",values-only=true" if values_only else ""
    knobs += f",exact-recent={exact_recent}" if exact_recent else ""
    text, found = re.subn(r"(^|,)raise-patterns(\{[^}]*\})?", lambda m: f"{m.group(0)},fp8-kv-cache{{{knobs}}}", base, count=1)
    if not found:
        raise ValueError(f"pipeline '{base}' has no raise-patterns for fp8-kv-cache to follow")
    return text


@dataclass(frozen=True)
class BuildSetting:
    """How the harness builds: every call of the built model has `batch` rows (shorter calls
    are padded), its cache `max_seq` positions."""
    batch: int = 8
    max_seq: int = 128
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    top_k: int = 1  # candidates per region: this measures accuracy, not which kernel is fastest
    calibration_calls: int = 4


def calibration_inputs(train_text: torch.Tensor, setting: BuildSetting) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`calibration_calls` prompts (tokens [batch, max_seq], positions 0..max_seq-1) of evenly
    spaced training-split text: fp8 scales are calibrated on real text, never the held-out split."""
    windows = heldout_windows(train_text, setting.max_seq - 1, setting.calibration_calls * setting.batch)
    return [(chunk, torch.arange(setting.max_seq)) for chunk in windows.split(setting.batch) if len(chunk) == setting.batch]


@torch.no_grad()
def decoder_copy(model: torch.nn.Module, setting: BuildSetting, history: torch.Tensor) -> torch.nn.Module:
    """A copy of `model` in `setting.dtype` on its device, caches [batch, Hkv, max_seq, D] whose
    first `history.shape[1]` positions hold the keys and values of `history` [batch, P] (real
    text, so the build's own end-to-end checks decode over a realistic cache)."""
    decoder = copy.deepcopy(model).to(device=setting.device, dtype=setting.dtype).eval()
    decoder.setup_caches(max_batch_size=setting.batch, max_seq_length=setting.max_seq)
    decoder(history.to(setting.device), torch.arange(history.shape[1], device=setting.device))
    return decoder


def build_decoder(model: torch.nn.Module, out_dir: str | Path, pipeline: str, setting: BuildSetting,
                  calibration: list[tuple[torch.Tensor, torch.Tensor]], progress=None):
    """Build `model` (fp32, trained) into `out_dir`: the decode step (tokens [batch, 1] at
    max_seq // 2, after a history from the first calibration prompt) and the prefill entry point
    (tokens [batch, T], T in 2..max_seq), fp8 scales calibrated on `calibration`."""
    text = calibration[0][0]
    position = setting.max_seq // 2
    decoder = decoder_copy(model, setting, text[:, :position])
    device = setting.device
    # contiguous copies: torch.export ties a dynamic length to a sliced input's row stride (max_seq)
    decode = (text[:, position:position + 1].contiguous().to(device), torch.tensor([position], device=device))
    prompt = (text[:, :PREFILL_EXAMPLE].contiguous().to(device), torch.arange(PREFILL_EXAMPLE, device=device))
    length = torch.export.Dim("prompt_length", min=2, max=setting.max_seq)
    return Pipeline(pipeline, top_k=setting.top_k).build(
        decoder, decode, out_dir, force=True, progress=progress, calibration_inputs=calibration,
        entry_points={"prefill": (prompt, ({1: length}, {0: length}))},
    )


def load_candidate(out_dir: str | Path, setting: BuildSetting) -> Candidate:
    """The build in `out_dir` as a Candidate: logits from its prefill entry, greedy tokens from
    coopt.generate, details from its build records."""
    import coopt

    built = coopt.load(out_dir, device=setting.device)
    prefill = built.entry_points["prefill"]
    device, rows = setting.device, setting.batch

    def padded(chunk: torch.Tensor) -> torch.Tensor:  # the build's batch is static
        return torch.cat([chunk, chunk.new_zeros(rows - len(chunk), chunk.shape[1])]).to(device)

    @torch.no_grad()
    def logits(tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=device)
        return torch.cat([prefill(padded(chunk), positions)[:len(chunk)].float().cpu() for chunk in tokens.split(rows)])

    @torch.no_grad()
    def generate(prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        return torch.cat([coopt.generate(built, chunk.to(device), new_tokens)[:, chunk.shape[1]:].cpu()
                          for chunk in prompts.split(rows)])

    return Candidate(logits, generate, build_details(Path(out_dir), setting), model=built)


def build_candidate(model, out_dir, pipeline: str, setting: BuildSetting, calibration, progress=None) -> Candidate:
    """build_decoder, then load_candidate. Example in the module docstring."""
    build_decoder(model, out_dir, pipeline, setting, calibration, progress)
    return load_candidate(out_dir, setting)


def build_details(out_dir: Path, setting: BuildSetting) -> dict:
    """What the harness reports of a build beside its metrics: pipeline, build seconds, the
    build's own accuracy record (lossy builds), KV bytes per cached token, kernels selected."""
    record = json.loads((out_dir / "build.json").read_text())
    return {
        "build_dir": str(out_dir),
        "pipeline": record["pipeline"],
        "build_seconds": record["seconds"] + sum(e.get("seconds", 0.0) for e in entry_records(out_dir).values()),
        "build_accuracy": record.get("accuracy"),
        "kv_bytes_per_token": kv_bytes_per_token(out_dir, setting),
        "kernels": {name: kernel_counts(directory) for name, directory in [("decode", out_dir), *entry_dirs(out_dir)]},
    }


def entry_dirs(out_dir: Path) -> list[tuple[str, Path]]:
    return [(d.name, d) for d in sorted((out_dir / "entries").glob("*")) if (d / "build.json").is_file()]


def entry_records(out_dir: Path) -> dict[str, dict]:
    return {name: json.loads((d / "build.json").read_text()) for name, d in entry_dirs(out_dir)}


def kv_bytes_per_token(out_dir: Path, setting: BuildSetting) -> float:
    """Bytes of every layer's K and V (scales included) per cached token of one sequence: the
    build's own count (build.json accuracy.kv_cache_bytes) when it made one, else the cache
    tensors it stores (weights.pt and zeros.json)."""
    slots = setting.batch * setting.max_seq
    accuracy = json.loads((out_dir / "build.json").read_text()).get("accuracy") or {}
    if "kv_cache_bytes" in accuracy:
        return accuracy["kv_cache_bytes"]["after"] / slots
    weights = stored_state(out_dir / WEIGHTS_FILE)
    return sum(t.numel() * t.element_size() for name, t in weights.items() if name.endswith(CACHE_SUFFIXES)) / slots


def kernel_counts(out_dir: Path) -> dict:
    """{family: [regions, of which a generated kernel was selected]}: whether a build's numbers
    come from its kernels or from reference fallbacks."""
    counts: dict[str, list[int]] = {}
    for region in json.loads((out_dir / "selection.json").read_text())["regions"].values():
        tally = counts.setdefault(region["family"], [0, 0])
        tally[0] += 1
        tally[1] += region["selected"] != "reference"
    return counts
