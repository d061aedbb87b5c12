"""What the OpenAI-compatible advisor says to the model: messages and the reply's JSON schema.

The prompt states facts the compiler already knows (shapes, dtypes, bytes, flops, target) and
the bounded space; the strict schema limits each knob to its allowed values, so a well-behaved
server cannot even express an out-of-space point. Legality across knobs (e.g. shared-memory
limits) is not expressible per knob, so the legal points are listed when there are few, and
anything else is screened out afterwards. Bump PROMPT_VERSION whenever the text changes: it
is part of the cache identity, so old answers to a different prompt are not reused.
"""

from __future__ import annotations

import json

from coopt.llm_advisor.protocol import AdviceRequest

PROMPT_VERSION = "prompt-v1"

# Listing more legal points than this costs tokens without helping the model much.
MAX_LISTED_POINTS = 256

SYSTEM = (
    "You tune GPU kernels (Triton) for NVIDIA GPUs. The compiler gives you one fused kernel "
    "region and a bounded space of parameter choices it has already proven legal. Rank the "
    "choices you expect to run fastest on the target, best first. Use only knob values from "
    "the space and only the listed legal points. Answer with JSON only, matching the schema: "
    '{"ranked": [{"params": {knob: value, ...}}, ...], "rationale": "one or two sentences"}.'
)


def _safe(call):
    """A summary figure, or None when the summary lacks the dims to compute it."""
    try:
        return call()
    except Exception:  # a figure for the prompt must never stop the build
        return None


def region_facts(request: AdviceRequest) -> dict:
    """Everything the model may use about the region and the target (plain JSON)."""
    region = request.region
    bytes_moved = _safe(region.bytes_moved)
    flops = _safe(region.flops)
    return {
        "region": region.name,
        "family": request.family,
        "attrs": region.attrs,
        "inputs": [{"shape": list(s.shape), "dtype": s.dtype} for s in region.inputs],
        "outputs": [{"shape": list(s.shape), "dtype": s.dtype} for s in region.outputs],
        "input_names": list(region.input_names),
        "symbolic_dims": {k: list(v) for k, v in region.dims.items()},
        "example_dims": region.example_dims,
        "bytes_moved": bytes_moved,
        "flops": flops,
        "flops_per_byte": round(flops / bytes_moved, 3) if flops and bytes_moved else None,
        "target": request.target,
    }


def messages(request: AdviceRequest) -> list[dict]:
    """Chat messages for `chat.completions.create`."""
    legal = list(request.legal)
    ask = {
        "task": f"Rank up to {request.top_k} parameter points, best first.",
        "kernel": region_facts(request),
        "space": request.space,
        "legal_point_count": len(legal),
    }
    if len(legal) <= MAX_LISTED_POINTS:
        ask["legal_points"] = legal
    else:
        ask["note"] = "Not every combination of the space is legal; illegal picks are discarded."
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": json.dumps(ask, sort_keys=True, default=str)},
    ]


def _json_type(values: list) -> str | list[str]:
    """JSON-schema type(s) of a knob's values; strict servers want a type beside the enum."""
    def one(value) -> str:
        if isinstance(value, bool):
            return "boolean"
        if isinstance(value, int):
            return "integer"
        if isinstance(value, float):
            return "number"
        return "string" if isinstance(value, str) else "null" if value is None else "array"

    types = sorted({one(v) for v in values})
    return types[0] if len(types) == 1 else types


def response_format(request: AdviceRequest) -> dict:
    """`response_format` with a strict JSON schema: each knob is an enum of its allowed values."""
    knobs = sorted(request.space)
    params = {
        "type": "object",
        "properties": {k: {"type": _json_type(list(v)), "enum": list(v)} for k, v in sorted(request.space.items())},
        "required": knobs,
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {
            "ranked": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"params": params},
                    "required": ["params"],
                    "additionalProperties": False,
                },
            },
            "rationale": {"type": "string"},
        },
        "required": ["ranked", "rationale"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "kernel_ranking", "strict": True, "schema": schema}}
