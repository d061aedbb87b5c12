"""Pass registry ({name: "module:Class"}, imported lazily) and pipeline-string parsing."""

from __future__ import annotations

import importlib
import re

from xdsl.passes import get_pass_option_infos
from xdsl.utils.arg_spec import parse_pipeline
from xdsl.utils.exceptions import ArgSpecParseError

from coopt.errors import ConfigError

_BUILTIN = {
    "inplace-state-writes": "coopt.passes.inplace_state_writes:InplaceStateWrites",
    "cse-aten": "coopt.passes.cse_aten:CseAten",
    "simplify-aten": "coopt.passes.simplify_aten:SimplifyAten",
    "fold-constants": "coopt.passes.fold_constants:FoldConstants",
    "raise-patterns": "coopt.passes.raise_patterns:RaisePatterns",
    "fp8-kv-cache": "coopt.passes.fp8_kv_cache:Fp8KvCache",
    "fuse-parallel-linears": "coopt.passes.fuse_parallel_linears:FuseParallelLinears",
    "fuse-decode-gemv": "coopt.passes.fuse_decode_gemv:FuseDecodeGemv",
    "fuse-norm-residual": "coopt.passes.fuse_norm_residual:FuseNormResidual",
    "fuse-attention": "coopt.passes.fuse_attention:FuseAttention",
    "fuse-kv-write": "coopt.passes.fuse_kv_write:FuseKvWrite",
    "fuse-kv-write-attention": "coopt.passes.fuse_kv_write_attention:FuseKvWriteAttention",
    "fuse-rope": "coopt.passes.fuse_rope:FuseRope",
    "fuse-linear-epilogue": "coopt.passes.fuse_linear_epilogue:FuseLinearEpilogue",
    "fuse-norm-statistics": "coopt.passes.fuse_norm_statistics:FuseNormStatistics",
    "fuse-elementwise": "coopt.passes.fuse_elementwise:FuseElementwise",
    "chunked-prefill": "coopt.passes.chunked_prefill:ChunkedPrefill",
    "paged-kv": "coopt.passes.paged_kv:PagedKv",
}

# Phase order matters: state writes become in-place first (they change what later ops read),
# then the same small computations repeated per layer are merged (one value for every layer's
# positions: the raising below then sees one), then exact ATen rewrites to fewer kernels (a K = 1
# matmul as a product, views and repeats moved onto inputs) leave expressions of weights alone,
# which are computed once at build time, then raise (fusion matches raised ops), then merge
# linears that share an input (before any of them is outlined with an epilogue), then the decode GEMVs take the RMSNorm before them and
# the SwiGLU after the merged gate|up (before fuse-norm-residual would give that norm a kernel of
# its own; the residual add it leaves becomes the previous GEMV's epilogue), then the big regions
# (norms, attention, GEMM epilogues) before plain elementwise chains take what is left. The
# KV-cache writes take K's rope into their region before fuse-rope gives every remaining rope a
# region of its own. A batched step's norm GEMVs take their rows' statistics from the o / down
# projection + residual before them once fuse-linear-epilogue has made those regions.
DEFAULT_PIPELINE = "inplace-state-writes,cse-aten,simplify-aten,fold-constants,raise-patterns,fuse-parallel-linears,fuse-decode-gemv,fuse-norm-residual,fuse-attention,fuse-kv-write,fuse-kv-write-attention,fuse-rope,fuse-linear-epilogue,fuse-norm-statistics,fuse-elementwise"
# The default without fuse-norm-statistics: a batched step's norms each a row kernel of their own
# (or in their GEMV's loop), as before session 15; what the statistics are measured against
# (bench/decode.py mode coopt-rownorms; bench/RESULTS.md session 15: b32 / 2048 replayed in 1765.9
# us with them against 1780.2 without, 44 kernels a step against 60).
ROW_NORMS_PIPELINE = DEFAULT_PIPELINE.replace("fuse-norm-statistics,", "")
# The default without fuse-kv-write-attention (a step's kv_write a kernel of its own, as before
# session 13): what the fold is measured against (bench/decode.py mode coopt-unfolded;
# bench/RESULTS.md session 13: the fold 0.2-0.6 % faster at b1 and b32)
UNFOLDED_KV_WRITE_PIPELINE = DEFAULT_PIPELINE.replace("fuse-kv-write-attention,", "")


def _load(ref: str):
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


def available_passes() -> dict[str, type]:
    """Every pass by name: built-in and from plugins (a plugin may not reuse a built-in name)."""
    from coopt.plugins import check_builtin_clash, plugin_passes

    check_builtin_clash("passes", _BUILTIN)
    passes = {name: _load(ref) for name, ref in _BUILTIN.items()}
    passes.update(plugin_passes())
    return passes


def pass_knobs(cls) -> list[tuple[str, str, object]]:
    """(kebab-case knob, type, default) for `coopt passes`."""
    return [(info.name.replace("_", "-"), info.expected_type.strip("'"), info.default_value) for info in get_pass_option_infos(cls)]


def _knob_separators(text: str) -> str:
    """Knobs inside braces may be separated by commas as well as spaces
    ('fp8-kv-cache{granularity=per-token,scale-source=dynamic}'): a comma that starts another
    `knob=` becomes the space xDSL's parser wants; list values ('a=1,2') stay as they are."""
    out, depth = [], 0
    for i, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth > 0 and re.match(r"\s*[A-Za-z][\w-]*\s*=", text[i + 1:]):
            char = " "
        out.append(char)
    return "".join(out)


def parse_pipeline_text(text: str) -> list:
    """'raise-patterns,fuse-elementwise{max-ops=8}' → pass objects; errors name the culprit."""
    passes = available_passes()
    try:
        specs = list(parse_pipeline(_knob_separators(text)))
    except ArgSpecParseError as exc:
        detail = str(exc).strip().splitlines()[-1].strip()
        raise ConfigError(f"malformed pipeline string '{text}': {detail}") from None
    result = []
    for spec in specs:
        if spec.name not in passes:
            raise ConfigError(f"unknown pass '{spec.name}' in pipeline; known passes: {', '.join(sorted(passes))}")
        cls = passes[spec.name]
        knobs = {info.name.replace("_", "-") for info in get_pass_option_infos(cls)}
        for key in spec.parameters:
            if key.replace("_", "-") not in knobs:
                known = ", ".join(sorted(knobs)) or "none"
                raise ConfigError(f"unknown knob '{key}' for pass '{spec.name}'; its knobs: {known}")
        try:
            result.append(cls.from_spec(spec))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"bad knob value for pass '{spec.name}': {exc}") from None
    return result
