"""Does programmatic dependent launch (PDL) shorten a decode-like chain of small kernels replayed
in a CUDA graph, with this torch/triton? A probe for issue 3, not a benchmark of coopt.

    python bench/pdl_probe.py            # needs an sm_90 GPU; prints one table

The chain mimics a decode step: L layers of [GEMV 4096x4096 bf16 (a distinct 32 MB weight per
layer, so nothing stays in L2), then a tiny elementwise kernel]. Variants, each captured in one
CUDA graph and replayed: plain launches; PDL with `gdc_wait` first (the next kernel's launch and
block scheduling overlap the previous kernel's tail); PDL with the GEMV's first weight tile
loaded before `gdc_wait` (weights never depend on the previous kernel, so the next GEMV starts
streaming while the previous one drains). Reported: µs per layer and the weight stream's TB/s.
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

K = N = 4096
LAYERS = 32
BLOCK_N, BLOCK_K = 32, 256


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PDL: tl.constexpr, PREFETCH: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if PREFETCH:
        w0 = tl.load(w_ptrs)  # a weight: no earlier kernel writes it
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH:
        acc += tl.sum(w0.to(tl.float32) * tl.load(x_ptr + ks).to(tl.float32)[None, :], axis=1)
    for k in tl.range(1 if PREFETCH else 0, K // BLOCK_K, num_stages=4):
        w = tl.load(w_ptrs + k * BLOCK_K)
        x = tl.load(x_ptr + k * BLOCK_K + ks)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty))


@triton.jit
def scale_kernel(y_ptr, x_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.load(y_ptr + offs, mask=offs < n).to(tl.float32)
    tl.store(x_ptr + offs, (y / (1.0 + tl.abs(y))).to(x_ptr.dtype.element_ty), mask=offs < n)


def chain(x0, weights, y, x, pdl: bool, prefetch: bool):
    launch = {"launch_pdl": True} if pdl else {}
    x.copy_(x0)
    for w in weights:
        gemv_kernel[(N // BLOCK_N,)](x, w, y, K=K, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PDL=pdl, PREFETCH=prefetch,
                                     num_warps=4, **launch)
        scale_kernel[(triton.cdiv(N, 1024),)](y, x, N, BLOCK=1024, PDL=pdl, num_warps=4, **launch)
    return x


def main():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("bench/pdl_probe.py needs an sm_90 GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(LAYERS)]
    x0 = torch.randn(K, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.empty(N, device="cuda", dtype=torch.bfloat16)
    x = torch.empty(K, device="cuda", dtype=torch.bfloat16)
    rows, expected = [], None
    for name, pdl, prefetch in (("plain", False, False), ("pdl", True, False), ("pdl+prefetch", True, True),
                                ("prefetch only", False, True)):
        try:
            result = chain(x0, weights, y, x, pdl, prefetch).clone()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench_cudagraph(lambda: chain(x0, weights, y, x, pdl, prefetch), rep=200)
        except Exception as error:  # noqa: BLE001 - a probe reports what failed
            rows.append({"variant": name, "error": f"{type(error).__name__}: {error}"[:300]})
            continue
        expected = result if expected is None else expected
        per_layer_us = ms * 1e3 / LAYERS
        rows.append({"variant": name, "ms": ms, "us_per_layer": per_layer_us,
                     "weight_TBps": N * K * 2 / (per_layer_us * 1e-6) / 1e12,
                     "max_diff_vs_plain": float((result.float() - expected.float()).abs().max())})
    print(json.dumps({"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
                      "rows": rows}, indent=1))
    print("| variant | µs per layer (GEMV 32 MB + tiny kernel) | weight stream TB/s | max diff vs plain |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error'][:80]} | | |")
        else:
            print(f"| {r['variant']} | {r['us_per_layer']:.2f} | {r['weight_TBps']:.2f} | {r['max_diff_vs_plain']:.3g} |")


if __name__ == "__main__":
    main()
