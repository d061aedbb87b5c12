"""decode_attention: flash-decoding of one new token per sequence over a static KV cache.

Region schema (coopt.ir.region): q [B, H, 1, D] (any strides), k_cache / v_cache
[B, Hkv, S_max, D] (any strides), lengths [B] int32 with 1 <= lengths[b] <= S_max; output
[B, H, 1, D] in q's dtype. attrs {"scale", "num_heads", "num_kv_heads", "lengths_input": 3,
"lengths_bound": [1, 2]}, optionally "example_length" (the valid length the advisor plans
for; default S_max). The query of sequence b attends to cache positions 0 .. lengths[b] - 1
(causal for a decode step at position lengths[b] - 1); query head h reads kv head
h // (H // Hkv). A length outside [0, S_max] is clamped into it (never a read outside the cache)
and a length of 0 gives zeros.

Kernel (two stages, as flash-decoding):
    split    grid (B * Hkv, SPLIT_KV): one program per (sequence, kv head, split). Its rows are
             the H // Hkv query heads sharing that kv head (GQA packing: each K/V block is read
             once for the whole group). It takes an equal BLOCK_N-aligned share of the
             sequence's valid keys 0 .. lengths[b] - 1 and runs an online softmax over it in
             fp32; positions past lengths[b] are never loaded, and a split whose share is empty
             does nothing. With SPLIT_KV = 1 it normalises and writes the output itself.
    reduce   grid (B * H,), only when SPLIT_KV > 1: merges the fp32 partials (acc, max, sum)
             of the splits that saw keys.

Bandwidth model: per cached position and kv head the kernel reads 2 * D * element-size bytes
(K and V rows) and does 4 * D * (H // Hkv) flops: 2 * group / element-size flops per byte (4 for
Llama-3-8B in bf16), far below the ~190 (790 TFLOP/s over 4.2 TB/s) at which Hopper becomes
compute bound. So the time is bytes / bandwidth, and the bytes that must move are the valid K
and V rows, sum over b of lengths[b] * Hkv * D * 2 * element size (`kv_bytes_read`); q, the
output and the partials (B * H * SPLIT_KV * (D + 2) * 4 bytes written and read once) are small
beside them. On the H200 (4.2 TB/s measured copy bandwidth) one Llama-3-8B layer (Hkv 8, D 128,
bf16) at length 32768 reads 134 MB: 32 us is the floor the kernel must approach; at length
2048 it reads 8.4 MB (2 us), where the launch latency of two kernels matters as much. A
static-cache baseline reading all S_max positions pays for S_max instead of the length. To
stream at full bandwidth every SM needs a program: B * Hkv * SPLIT_KV should cover the 132 SMs
(the advisor picks SPLIT_KV from the length and the SM count, llm_advisor/heuristic_rules.py).

Knobs (explicit lists, pruned by `check`):
    BLOCK_N      cache positions per step (K and V tiles of BLOCK_N x D)
    SPLIT_KV     programs per (sequence, kv head); 1 = no reduce stage
    USE_DOT      scores and P @ V by tl.dot (group padded to 16 rows: tensor cores) or by
                 multiply and sum on CUDA cores (no padding: best for small groups and fp32)
    num_warps, num_stages  launch options (stages pipeline the K/V loads)

Example (one decode step of a 32-head model with 8 kv heads, cache of 4096 positions):
    >>> from coopt.ir.region import RegionSummary, TensorSpec
    >>> from coopt.targets import H200
    >>> kv = TensorSpec((1, 8, 4096, 128), "bfloat16")
    >>> q = TensorSpec((1, 32, 1, 128), "bfloat16")
    >>> region = RegionSummary(
    ...     "layer0_attn", "decode_attention", inputs=(q, kv, kv, TensorSpec((1,), "int32")),
    ...     outputs=(q,), attrs={"scale": 128 ** -0.5, "num_heads": 32, "num_kv_heads": 8,
    ...                          "lengths_input": 3, "lengths_bound": [1, 2]})
    >>> family = DecodeAttentionFamily()
    >>> params = {"BLOCK_N": 64, "SPLIT_KV": 16, "USE_DOT": True, "num_warps": 4, "num_stages": 3}
    >>> family.check(region, params, H200) is None
    True
    >>> family.check(region, {**params, "SPLIT_KV": 128}, H200)
    'SPLIT_KV=128 is not in the space'
    >>> "_decode_reduce_kernel[" in family.render(region, params)
    True
    >>> kv_bytes_read(region, [2048])  # K and V rows of 2048 positions, 8 kv heads, bf16
    8388608
"""

from __future__ import annotations

import math

from coopt.ir.region import DTYPE_BYTES, RegionSummary
from coopt.targets import Target
from coopt.templates.attention import _TL_DTYPE, _TORCH_DTYPE
from coopt.templates.base import TemplateFamily, dim_range, next_pow2, render_template

_MAX_HEAD_DIM = 256
# Register budgets per thread, from ptxas -v for sm_90 (triton 3.9) over BLOCK_N x D x group x
# warps: multiply-and-sum materialises the [group, BLOCK_N, D] products in fp32, and up to 32 per
# thread stay under ~200 registers without spilling (64 reach 255 and spill); tl.dot keeps
# the K/V tile, the scores and the accumulator per thread: 16-bit operands feed the tensor cores
# from shared memory and fit at (tile + group x (BLOCK_N + D)) <= 160 per thread, fp32 (FMA dot
# on CUDA cores, operands in registers) at <= 64.
_MAX_PRODUCTS_PER_THREAD = 32
_MAX_DOT_VALUES_PER_THREAD = {"bf16/fp16": 160, "fp32": 64}
# Every thread should load at least one 16-byte vector of each K tile; fewer leaves warps idle.
_MIN_TILE_BYTES_PER_THREAD = 16


def kv_bytes_read(region: RegionSummary, lengths) -> int:
    """Bytes the kernel must read from the caches for these valid lengths (K and V rows)."""
    _, kv_heads, _, head_dim = region.inputs[1].shape
    return sum(int(n) for n in lengths) * kv_heads * head_dim * 2 * DTYPE_BYTES[region.inputs[1].dtype]


class DecodeAttentionFamily(TemplateFamily):
    name = "decode_attention"

    # -- shape facts -------------------------------------------------------------------
    @staticmethod
    def _group(region: RegionSummary) -> int:
        return region.attrs["num_heads"] // region.attrs["num_kv_heads"]

    @staticmethod
    def _block_d(region: RegionSummary) -> int:
        return max(16, next_pow2(region.inputs[0].shape[3]))

    def block_h(self, region: RegionSummary, use_dot: bool) -> int:
        """Rows of a program: the head group, padded to a power of two (16 for tl.dot)."""
        rows = next_pow2(self._group(region))
        return max(16, rows) if use_dot else rows

    def matches(self, region: RegionSummary) -> bool:
        if region.family != self.name or len(region.inputs) != 4 or len(region.outputs) != 1:
            return False
        q, k, v, lengths = region.inputs
        if any(len(s.shape) != 4 for s in (q, k, v, region.outputs[0])) or len(lengths.shape) != 1:
            return False
        head_dim = q.shape[3]
        heads, kv_heads = region.attrs.get("num_heads"), region.attrs.get("num_kv_heads")
        return (
            isinstance(head_dim, int)
            and 1 <= head_dim <= _MAX_HEAD_DIM
            and q.shape[2] == 1
            and k.shape[3] == v.shape[3] == head_dim
            and isinstance(heads, int) and isinstance(kv_heads, int)
            and kv_heads >= 1 and heads % kv_heads == 0
            and q.dtype == k.dtype == v.dtype
            and all(s.dtype in _TL_DTYPE for s in (q, region.outputs[0]))
            and q.shape[1] == heads and k.shape[1] == kv_heads
            and lengths.dtype in ("int32", "int64")
            # verification draws valid lengths only when the region names them (verify/strategies.py)
            and region.attrs.get("lengths_input") == 3
            and list(region.attrs.get("lengths_bound") or ()) == [1, 2]
        )

    # -- the space -----------------------------------------------------------------------
    def param_space(self, region: RegionSummary, target: Target) -> dict[str, list]:
        return {
            "BLOCK_N": [16, 32, 64, 128],
            "SPLIT_KV": [1, 2, 4, 8, 16, 32, 64],
            "USE_DOT": [False, True],
            "num_warps": [2, 4, 8],
            "num_stages": [1, 2, 3, 4],
        }

    def check(self, region: RegionSummary, params: dict, target: Target) -> str | None:
        space = self.param_space(region, target)
        for knob, values in space.items():
            if params.get(knob) not in values:
                return f"{knob}={params.get(knob)} is not in the space"
        bn, split_kv, use_dot = params["BLOCK_N"], params["SPLIT_KV"], params["USE_DOT"]
        warps, stages = params["num_warps"], params["num_stages"]
        block_d, block_h = self._block_d(region), self.block_h(region, use_dot)
        elem = DTYPE_BYTES[region.inputs[1].dtype]
        threads = 32 * warps
        # A K tile may cover the largest cache, never more; each split at least one K tile.
        _, max_length = dim_range(region, [region.inputs[1].shape[2]])
        if max_length is not None and bn > max(16, next_pow2(max_length)):
            return f"BLOCK_N={bn} exceeds the cache (S_max <= {max_length})"
        if max_length is not None and split_kv > 1 and split_kv * bn > max_length:
            return f"SPLIT_KV={split_kv} splits of BLOCK_N={bn} exceed the cache (S_max <= {max_length})"
        smem = (block_h * block_d + 2 * bn * block_d * stages) * elem
        if smem > target.smem_per_block_bytes:
            return f"{stages} K/V stages need {smem} B of shared memory > {target.smem_per_block_bytes} B"
        if warps > min(space["num_warps"]) and bn * block_d * elem < _MIN_TILE_BYTES_PER_THREAD * threads:
            return f"a {bn}x{block_d} K tile leaves some of {warps} warps without a 16-byte load"
        if use_dot:
            kind = "fp32" if elem == 4 else "bf16/fp16"
            values = (bn * block_d + block_h * (bn + block_d)) // threads
            if values > _MAX_DOT_VALUES_PER_THREAD[kind]:
                return f"tl.dot on {bn}x{block_d} {kind} K/V tiles over {warps} warps spills registers"
        elif block_h * bn * block_d // threads > _MAX_PRODUCTS_PER_THREAD:
            return f"{block_h}x{bn}x{block_d} products over {warps} warps spill registers"
        return None

    # -- rendering -------------------------------------------------------------------------
    def render(self, region: RegionSummary, params: dict) -> str:
        head_dim = region.inputs[0].shape[3]
        scale = region.attrs.get("scale")
        block_d = self._block_d(region)
        return render_template(
            "triton/decode_attention.py.j2",
            region_name=region.name,
            params=params,
            scale=repr(float(scale if scale is not None else 1.0 / math.sqrt(head_dim))),
            num_heads=region.attrs["num_heads"],
            num_kv_heads=region.attrs["num_kv_heads"],
            head_dim=head_dim,
            block_d=block_d,
            block_h=self.block_h(region, params["USE_DOT"]),
            reduce_warps=4 if params["SPLIT_KV"] * block_d >= 2048 else 1,
            ieee_dot=region.inputs[0].dtype == "float32",
            out_tl_dtype=_TL_DTYPE[region.outputs[0].dtype],
            out_torch_dtype=_TORCH_DTYPE[region.outputs[0].dtype],
        )
