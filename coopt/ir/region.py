"""Region summaries: the plain-data contract between the IR and everything after fusion.

A fused kernel region (`coopt.kernel` in the IR) is summarised as a `RegionSummary`. Templates,
the advisor, the verifier and the tuner read only this, never the IR, so they stay testable
without xDSL. Everything here is JSON-ready (see `to_json` / `from_json`).

Family attributes (`RegionSummary.attrs`), one schema per template family:

elementwise
    inputs: tensors broadcastable to the output shape (numpy rules).
    attrs = {"program": [[name, fn, [arg, ...]], ...], "outputs": [name, ...]}
    `arg` is an input name "in0", "in1", ..., an earlier result name, or a float literal.
    fn is one of ELEMENTWISE_FNS. Arithmetic is done in fp32; outputs are cast to their dtype.

row_reduction (reduction over the last dim, one row per program)
    attrs = {"kind": "softmax" | "log_softmax" | "layer_norm" | "rms_norm", "eps": float,
             "has_weight": bool, "has_bias": bool, "residual": bool}
    inputs, in order: x, [residual if residual], [weight if has_weight], [bias if has_bias]
    outputs: y = norm(x + residual) (or norm(x)), and when residual also h = x + residual.

matmul_epilogue (C = A @ B' (+ bias) then an elementwise epilogue)
    attrs = {"b_layout": "nk" | "kn", "has_bias": bool, "epilogue": program, "outputs": [...]}
    inputs, in order: a [..., K], b ([N, K] for "nk" i.e. nn.Linear weight, [K, N] for "kn"),
    [bias [N] if has_bias], extra epilogue tensors (broadcastable to [..., N]).
    The epilogue program (same form as elementwise) names the matmul(+bias) result "acc" and
    the extra epilogue tensors "in0", "in1", ...; an empty program with outputs ["acc"] is a
    plain (biased) matmul.
    Optional, decode-sized regions only (fuse-decode-gemv; the GEMV kernel implements them):
    "prologue": {"kind": "rms_norm", "eps": float, "has_weight": bool} normalizes a's rows
    first, a * rsqrt(mean(a^2, -1) + eps) [* g], with g [K] the input right after [bias];
    "glu": true means b holds two halves (2N rows for "nk", 2N columns for "kn") and the
    program reads "acc" = a @ first half and "acc_hi" = a @ second half (SwiGLU:
    silu(acc) * acc_hi); no bias then. Output [..., N].
    Norm statistics (fuse-norm-statistics, GEMV only): "prologue": {"kind": "rms_norm_stats",
    "eps": float, "squares_input": j} means a is h * g already and input j (where g was) is
    sq [K / C, M] fp32, chunk sums of h^2: the product is scaled per row by
    rsqrt(sum(sq, 0) / K + eps). "row_squares": {"chunk": C, "weight_input": i, "output": o}
    means the region also takes g [N] as its last input (i) and returns two more outputs
    after its own: hg = h * g (h = output o, in its dtype) and sq [N / C, M] fp32, the sums
    of h^2 (h rounded to its dtype) over each C columns of each row.

attention (softmax(q k^T * scale [+ causal mask]) v)
    attrs = {"causal": bool, "scale": float, "num_heads": int, "num_kv_heads": int,
             ["lengths_input": 3, "lengths_bound": [1, 2]]}
    With lengths (a prompt over a KV cache; causal is then False): a fourth input lengths [Sq]
    int32, query i attending to keys 0 .. lengths[i] - 1 (1 <= lengths[i] <= Sk).
    inputs: q [B, H, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, D]; output [B, H, Sq, D].
    H is a multiple of Hkv (GQA: query head h reads kv head h // (H // Hkv)). With causal and
    Sq != Sk the mask is aligned to the bottom right, as in SDPA with a KV cache.

decode_attention (one new token per sequence over a static KV cache, valid prefix only)
    attrs = {"scale": float, "num_heads": H, "num_kv_heads": Hkv,
             "lengths_input": 3, "lengths_bound": [1, 2], ["example_length": int],
             ["lengths_offset": int]}
    inputs: q [B, H, 1, D], k_cache [B, Hkv, S_max, D], v_cache [B, Hkv, S_max, D],
    lengths [B] int32 or int64 with 1 <= lengths[b] <= S_max; output [B, H, 1, D] in q's dtype.
    Sequence b attends to cache positions 0 .. lengths[b] - 1 (causal for a decode step at
    position lengths[b] - 1); GQA as in attention. "lengths_input" / "lengths_bound" name the
    lengths input and the dim bounding it (input 1, dim 2: S_max), so that verification draws
    valid lengths; "example_length" is the length the advisor plans for (default S_max).
    With "lengths_offset": c (fuse-attention's `lengths_add`: a decode step's positions) input 3
    holds lengths - c and the kernel adds c; the bounds above and example_length are the
    lengths'. That saves the step the ATen launch of `positions + 1`.

    fp8 cache (fp8-kv-cache pass, docs/kv-cache.md): k_cache / v_cache float8_e4m3fn and two
    more inputs k_scale, v_scale (fp32: [1] per-tensor, [Hkv] per-head, [B, Hkv, S_max]
    per-token), attrs "kv_scale": that granularity; the cache is read as k * k_scale. With
    per-tensor / per-head scales k_cache may stay in q's dtype beside an fp8 v_cache
    (fp8-kv-cache's values-only; its k_scale ones). The same holds for attention with lengths
    (a prompt over an fp8 cache).

    Paged KV (coopt/runtime/paged.py): attrs add "page_size": P (a power of two, 16..256);
    inputs q [B, H, 1, D], k_pages / v_pages [N_pages, Hkv, P, D], lengths [B] int32 or int64,
    page_table [B, max_pages] int32 (then k_scale, v_scale as above when "kv_scale"; per-token:
    scale pools [N_pages, Hkv, P] paged alike). Position p of sequence b is
    k_pages[page_table[b, p // P], :, p % P] (per token, its scale the same index of k_scale);
    slots of page_table past cdiv(lengths[b], P) are never read. paged-kv's regions also carry
    "page_table_input": 4 and "pool_input": 1 (verification draws valid page ids and lengths
    up to max_pages * P). attention with lengths (a prompt over the cache) takes the same paged
    form: q [B, H, T, D], pools, lengths [T], page_table, [k_scale, v_scale].

    The step's cache write folded in (fuse-kv-write-attention; unpaged, not fp8): attrs add
    "kv_write": {"positions_input": i, "rope": bool[, "rope_tables_input": j]} and "inplace":
    [1, 2]; inputs i, i + 1, i + 2 are positions [1], k_new, v_new [B, Hkv, 1, D] (K's cos, sin
    at j: i + 3, or 4 where the query's serve); outputs k_cache and v_cache after
    cache[:, :, positions] = rope(k_new) / v_new, then the attention over them. With
    "gathered_tables": true in "kv_write", every rotary table (the query's and K's) is a whole
    table [S, D] (S >= S_max) whose row positions[0] the region uses. Over fp8 caches whose
    newest rows the queries read unrounded (attrs "exact_rows": "folded", "recent" N, and for
    N > 1 "rings_input" r): the own rows are the write's rows before rounding, and the rings
    [B_max, Hkv, N, D] (inputs r, r + 1, last) are written in place at slot positions[0] % N
    ("inplace" [1, 2, r, r + 1], outputs the caches, the rings, the attention's output).

kv_write (a step's KV-cache write; optional rotary embedding of K and fp8 quantization)
    attrs = {"rope": bool, "quant": "none" | "per-tensor" | "per-head" | "per-token",
             "inplace": [input indices written in place]}
    inputs: k_cache, v_cache [B_max, Hkv, S_max, D], positions [T] int, k, v [B, Hkv, T, D],
    [cos, sin when rope], [k_scale, v_scale when quantized: per-token scale buffers
    [B_max, Hkv, S_max] (paged: [N, Hkv, P]) written in place too, attrs "headroom"], [k_offset
    [1, Hkv, 1, D] fp32 when attrs "k_offset": fp8-kv-cache's smooth-k, per-tensor/per-head]; outputs:
    the inplace inputs after cache[:B, :, positions] = quant(rope(k) - k_offset) (and quant(v)). Per row (attrs
    "positions": "per-row", "index_input": 2, "index_bound": [0, 2]; a ragged decode step): positions [B], k, v
    [B, Hkv, 1, D], cache[b, :, positions[b]] = quant(rope(k[b, :, 0])). Paged (attrs
    "page_size": P, "page_table_input": last, "pool_input": 0): k_cache / v_cache are pools
    [N, Hkv, P, D] and a last input page_table [B, max_pages] int32 says where position p of
    sequence b goes (row p % P of page page_table[b, p // P]). Values only (attrs "values_only":
    true, fp8-kv-cache's values-only, quant per-tensor / per-head): k_cache in k's dtype, written
    unquantized, and V's scale the one scale input. Exact rows (attrs "exact_outputs": ["k"] / ["v"]
    / ["k", "v"], fp8-kv-cache's exact-recent): after the written buffers, the rows as they are before
    rounding, [B, Hkv, T, D] (fp32 with an offset, else k's dtype). docs/kv-cache.md has the whole contract.

rope (rotary embedding, rotate-half form)
    attrs = {}
    inputs: x [..., D] (D even, rank <= 4), cos and sin broadcastable to x; output in x's dtype:
    x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin.

embedding_rows (the embedding before the first norm GEMV, fuse-norm-statistics)
    attrs = {"row_squares": {"chunk": C, "weight_input": 2, "output": 0}, "index_input": 1,
             "index_bound": [0, 0]}
    inputs: table [V, K], ids [...] int64 or int32 in [0, V), g [K]; outputs h = table[ids] [..., K],
    hg = h * g in h's dtype, sq [K / C, M] fp32 (sums of h^2 over C-column chunks of each row),
    the outputs a GEMV producer of statistics adds (matmul_epilogue "row_squares").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

ELEMENTWISE_FNS = {
    # fn name -> arity
    "add": 2, "sub": 2, "mul": 2, "div": 2, "maximum": 2, "minimum": 2, "pow": 2,
    "neg": 1, "relu": 1, "silu": 1, "sigmoid": 1, "gelu": 1, "gelu_tanh": 1, "tanh": 1,
    "exp": 1, "log": 1, "sqrt": 1, "rsqrt": 1, "abs": 1, "square": 1, "reciprocal": 1,
    "sin": 1, "cos": 1, "erf": 1, "hardsigmoid": 1, "hardswish": 1,
    "where": 3,  # (condition, if true, if false); the condition a bool input, read as 0 / 1
    # float casts (x.to(dtype), x.float()): in the fp32 program a cast to a 16-bit type rounds the
    # value to it (the program goes on in fp32); a 16-bit value widened to fp32 is rounded to its
    # own dtype first (inside the program it may not have been yet), fp32 to fp32 is the identity
    "to_f32": 1, "to_bf16": 1, "to_f16": 1, "bf16_to_f32": 1, "f16_to_f32": 1,
}

FAMILIES = ("elementwise", "row_reduction", "matmul_epilogue", "attention", "decode_attention", "rope", "kv_write",
            "embedding_rows")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int64": 8, "int32": 4, "bool": 1}

Dim = int | str  # a str is a symbolic dim ("s0") or an expression of them ("4*s0")


def eval_dim(dim: Dim, dims: dict[str, int]) -> int:
    """Value of a dim given values of the symbols; expressions are sympy's printing (+ - * //)."""
    if isinstance(dim, int):
        return dim
    if dim in dims:
        return dims[dim]
    if not all(c.isalnum() or c in "_+-*/() " for c in dim):
        raise ValueError(f"unsupported dim expression {dim!r}")
    return int(eval(dim, {"__builtins__": {}}, dict(dims)))  # noqa: S307 - checked charset above


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[Dim, ...]
    dtype: str

    def concrete(self, dims: dict[str, int]) -> tuple[int, ...]:
        return tuple(eval_dim(d, dims) for d in self.shape)


@dataclass(frozen=True)
class RegionSummary:
    name: str
    family: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    attrs: dict = field(default_factory=dict)
    # symbolic dim -> (min, max) inclusive, and the value seen in the example inputs
    dims: dict[str, tuple[int, int]] = field(default_factory=dict)
    example_dims: dict[str, int] = field(default_factory=dict)
    input_names: tuple[str, ...] = ()  # weight names ("fc1.weight") or "" for activations

    def bytes_moved(self, dims: dict[str, int] | None = None) -> int:
        """Fewest bytes a kernel must move: every input read once, every output written once."""
        dims = dims or self.example_dims
        total = 0
        for spec in (*self.inputs, *self.outputs):
            n = 1
            for d in spec.concrete(dims):
                n *= d
            total += n * DTYPE_BYTES.get(spec.dtype, 4)
        return total

    def flops(self, dims: dict[str, int] | None = None) -> int:
        dims = dims or self.example_dims
        if self.family == "matmul_epilogue":
            a = self.inputs[0].concrete(dims)
            b = self.inputs[1].concrete(dims)
            m = 1
            for d in a[:-1]:
                m *= d
            n = b[0] if self.attrs.get("b_layout") == "nk" else b[1]
            return 2 * m * n * a[-1]
        if self.family == "decode_attention":  # one query token against the whole cache (upper bound)
            b, h, _, d = self.inputs[0].concrete(dims)
            return 4 * b * h * self.inputs[1].concrete(dims)[2] * d
        if self.family == "attention":
            bq, h, sq, d = self.inputs[0].concrete(dims)
            sk = self.inputs[1].concrete(dims)[2]
            return 4 * bq * h * sq * sk * d
        out = self.outputs[0].concrete(dims)
        n = 1
        for d in out:
            n *= d
        return n * max(1, len(self.attrs.get("program", [])) or 5)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> "RegionSummary":
        return RegionSummary(
            name=data["name"],
            family=data["family"],
            inputs=tuple(TensorSpec(tuple(s["shape"]), s["dtype"]) for s in data["inputs"]),
            outputs=tuple(TensorSpec(tuple(s["shape"]), s["dtype"]) for s in data["outputs"]),
            attrs=data.get("attrs", {}),
            dims={k: tuple(v) for k, v in data.get("dims", {}).items()},
            example_dims=dict(data.get("example_dims", {})),
            input_names=tuple(data.get("input_names", ())),
        )

    def key(self) -> str:
        """Stable text key (for caches): the summary as canonical JSON."""
        return json.dumps(self.to_json(), sort_keys=True)


def kv_write_inputs(region: RegionSummary) -> int | None:
    """Index of the positions of the cache write a decode_attention region has folded in
    (attrs "kv_write", from fuse-kv-write-attention; k_new, v_new and K's cos, sin follow), else None."""
    folded = region.attrs.get("kv_write") if region.family == "decode_attention" else None
    return folded["positions_input"] if isinstance(folded, dict) else None


def gemv_prologue(region: RegionSummary, kind: str) -> dict | None:
    """A matmul_epilogue region's attrs["prologue"] when it is of `kind` ("rms_norm": the
    GEMV normalizes a's rows itself; "rms_norm_stats": a is h * g and the rows' sums of
    squares are an input), else None."""
    prologue = region.attrs.get("prologue") if region.family == "matmul_epilogue" else None
    return prologue if isinstance(prologue, dict) and prologue.get("kind") == kind else None


def squares_input(region: RegionSummary) -> int | None:
    """Index of the sums of squares a "rms_norm_stats" prologue reads, else None.

        >>> squares_input(RegionSummary("r", "matmul_epilogue", (), (), {"prologue": {"kind": "rms_norm_stats", "squares_input": 2}}))
        2
        >>> squares_input(RegionSummary("r", "matmul_epilogue", (), (), {"prologue": {"kind": "rms_norm"}})) is None
        True
    """
    return (gemv_prologue(region, "rms_norm_stats") or {}).get("squares_input")


def lengths_offset(region: RegionSummary) -> int:
    """What the kernel adds to the lengths input (attrs "lengths_offset", fuse-attention's
    lengths_add: the input then holds a step's positions); 0 when it holds the lengths."""
    return region.attrs.get("lengths_offset", 0)


def rope_at(region: RegionSummary) -> int | None:
    """Index of the query's cos (sin follows) in a decode_attention region that rotates its
    query (attrs "rope"): after the lengths and, paged, the page table; else None."""
    if region.family != "decode_attention" or not region.attrs.get("rope"):
        return None
    return 4 if region.attrs.get("page_size") is None else 5


def kv_write_offsets(region: RegionSummary) -> tuple[int | None, int | None]:
    """Indices of K's and V's offsets [1, Hkv, 1, D] when a decode_attention region's folded
    write stores its fp8 caches centred (smooth-k / smooth-v: attrs kv_write "k_offset_input",
    "v_offset_input", the last inputs), each None where absent."""
    folded = region.attrs.get("kv_write") if region.family == "decode_attention" else None
    if not isinstance(folded, dict):
        return None, None
    return folded.get("k_offset_input"), folded.get("v_offset_input")


def kv_write_rope(region: RegionSummary) -> int | None:
    """Index of K's cos (sin follows) when a decode_attention region's folded write rotates K:
    after v_new, or the query's own tables (4) when they are the same values; else None."""
    folded = region.attrs.get("kv_write") if region.family == "decode_attention" else None
    return folded.get("rope_tables_input") if isinstance(folded, dict) and folded.get("rope") else None
