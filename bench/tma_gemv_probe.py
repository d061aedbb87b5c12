"""Does a batch-32 GEMV stream its weight faster through tensor descriptors (TMA) than through
pointer loads? One question, before any template grows a TMA form (needs a GPU).

    python bench/tma_gemv_probe.py                       # the b32 layer's four GEMM shapes
    python bench/tma_gemv_probe.py --shapes o --json out.json

Why: a b32 / 2048 decode layer spends ~22 µs above its bytes, and the four M = 32 GEMMs hold
most of it (bench/NOTES-decode.md, session 38: o streams at 2.07 TB/s of the H100's 3.0 copied,
q|k|v 2.47, down 2.60, gate|up 2.80). The matmul_epilogue template's GEMV points load the weight
with pointer loads (cp.async on sm_90), and its TMA points exist only on the tile kernel, whose
64-row tiles at M = 32 leave SMs idle. This probe's kernel is the GEMV's shape in both forms, the
same code but for how a weight slab arrives: SWAP_AB (the [BLOCK_N, BLOCK_K] weight slab is the
dot's left operand, the 32 activation rows its right one), split-K over a grid of N blocks x
SPLIT_K, the splits meeting in the same launch (each stores its fp32 partial tile; the last to
arrive, told by an arrival counter, sums them and writes the bf16 output). Beside it, each shape's
cuBLAS (torch.matmul) and the template's first advised points, all replayed in CUDA graphs
rotating through weight copies past the L2, as bench/gemm.py times decode shapes.

The answer decides the next step: if the TMA form beats the template's best by more than the
~1 µs a GEMM it would need to matter, the GEMV kernel grows a USE_TMA knob; if not, the weight's
arrival is not what the M = 32 GEMMs lose to.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))

# name -> (M, N, K): a Llama-3-8B layer's GEMMs at batch 32 (q|k|v 6144 wide, gate|up merged)
SHAPES = {"qkv": (32, 6144, 4096), "o": (32, 4096, 4096), "gate_up": (32, 28672, 4096), "down": (32, 4096, 14336)}


@triton.jit
def _split_gemv_kernel(w_desc, x_desc, w_ptr, x_ptr, out_ptr, partial_ptr, arrivals_ptr, M, N, K,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr,
                       UPCAST: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, steps)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in tl.range(first, last, num_stages=NUM_STAGES):
        if USE_TMA:  # the copy engine brings both tiles (out-of-range rows read as zero)
            w = w_desc.load([pid_n * BLOCK_N, step * BLOCK_K])
            x = x_desc.load([0, step * BLOCK_K])
        else:
            cols = step * BLOCK_K + offs_k
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + cols[None, :],
                        mask=(offs_n < N)[:, None] & (cols < K)[None, :], other=0.0)
            x = tl.load(x_ptr + offs_m[:, None] * K + cols[None, :],
                        mask=(offs_m < M)[:, None] & (cols < K)[None, :], other=0.0)
        if UPCAST:  # Triton's interpreter gets bf16 dots wrong (../shared/TRITON-INTERPRETER.md)
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc)
    # the meeting: every split stores its [BLOCK_N, BLOCK_M] partial; the last to arrive sums them
    tile = offs_n[:, None] * BLOCK_M + offs_m[None, :]
    tile_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    if SPLIT_K == 1:
        total = acc
    else:
        tl.store(partial_ptr + pid_k * N * BLOCK_M + tile, acc, mask=tile_mask)
        tl.debug_barrier()  # every thread's partial stored before the one atomic releases them
        arrived = tl.atomic_add(arrivals_ptr + pid_n, 1, sem="acq_rel")  # releases the partial, acquires the rest
        if arrived != SPLIT_K - 1:
            return
        total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):
            total += tl.load(partial_ptr + split * N * BLOCK_M + tile, mask=tile_mask, other=0.0)
        tl.atomic_xchg(arrivals_ptr + pid_n, 0)  # ready for the next call
    tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], total.to(tl.bfloat16), mask=tile_mask)


class SplitGemv:
    """out = x @ w.T for x [M, K] and w [N, K] (bf16) at one point; workspaces made once."""

    def __init__(self, m: int, n: int, k: int, block_n: int, block_k: int, split_k: int, stages: int,
                 warps: int, use_tma: bool, device: str):
        self.m, self.n, self.k = m, n, k
        self.block_n, self.block_k, self.block_m = block_n, block_k, max(16, triton.next_power_of_2(m))
        self.split_k, self.stages, self.warps, self.use_tma = split_k, stages, warps, use_tma
        self.partial = torch.empty(split_k, n, self.block_m, dtype=torch.float32, device=device)
        self.arrivals = torch.zeros(triton.cdiv(n, block_n), dtype=torch.int32, device=device)

    def label(self) -> str:
        return (f"{'tma' if self.use_tma else 'ptr'} n{self.block_n} k{self.block_k} split{self.split_k} "
                f"s{self.stages} w{self.warps}")

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.m, self.n, dtype=torch.bfloat16, device=x.device)
        if self.use_tma:
            w_desc = TensorDescriptor.from_tensor(w, [self.block_n, self.block_k])
            x_desc = TensorDescriptor.from_tensor(x, [self.block_m, self.block_k])
        else:
            w_desc = x_desc = None
        grid = (triton.cdiv(self.n, self.block_n), self.split_k)
        _split_gemv_kernel[grid](w_desc, x_desc, w, x, out, self.partial, self.arrivals, self.m, self.n, self.k,
                                 BLOCK_N=self.block_n, BLOCK_K=self.block_k, BLOCK_M=self.block_m,
                                 SPLIT_K=self.split_k, NUM_STAGES=self.stages, USE_TMA=self.use_tma,
                                 UPCAST=os.environ.get("TRITON_INTERPRET") == "1", num_warps=self.warps)
        return out


def points(m: int, n: int, k: int, sms: int) -> list[dict]:
    """Each form at a few tiles, SPLIT_K chosen so the grid is about one or two waves of SMs."""
    chosen = []
    for block_n, block_k, stages in ((128, 128, 4), (64, 128, 6), (128, 64, 6), (64, 256, 4)):
        blocks = triton.cdiv(n, block_n)
        for waves in (1, 2):
            split = max(1, min(k // block_k, round(waves * sms / blocks)))
            for use_tma in (True, False):
                point = {"block_n": block_n, "block_k": block_k, "split_k": split, "stages": stages, "warps": 4,
                         "use_tma": use_tma}
                if point not in chosen:
                    chosen.append(point)
    return chosen


def template_runs(m: int, n: int, k: int, count: int, work_dir: Path) -> list[tuple[str, object]]:
    """The matmul_epilogue template's first `count` advised points for the plain region."""
    from gemm import advised_points, label, make_region

    from coopt.runtime.kernel_loader import load_module_from_source
    from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

    region, family = make_region(m, n, k, "plain"), MatmulEpilogueFamily()
    runs = []
    for i, params in enumerate(advised_points(region, count)):
        run = load_module_from_source(family.render(region, params), work_dir, f"template_{n}x{k}_{i}").run
        runs.append((f"template {label(params)}", lambda x, w, run=run: run(x, w)[0]))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma list of: " + ",".join(SHAPES))
    parser.add_argument("--advised", type=int, default=2, help="the template's first N advised points a shape")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from gemm import announce_gpu, graph_ms, input_copies

    if not announce_gpu("bench/tma_gemv_probe.py"):
        return 2
    import tempfile

    from bandwidth import reference_bandwidth

    floor = reference_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # TMA descriptors are host objects made each call; graphs capture them by value, so each
    # captured call binds its own input set's descriptors, as a build's runtime would make once
    work_dir, rows, table = Path(tempfile.mkdtemp(prefix="tma_gemv_")), [], []
    for name in args.shapes.split(","):
        m, n, k = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(torch.bfloat16)
        expected = (x.float() @ w.float().T)
        sets = input_copies([x, w])
        weight_bytes = n * k * 2
        print(f"\n{name}: {m}x{n}x{k}, {weight_bytes / 1e6:.1f} MB of weight, {len(sets)} copies rotated", flush=True)
        runs = [("cublas", lambda x, w: torch.matmul(x, w.T))]
        runs += template_runs(m, n, k, args.advised, work_dir)
        runs += [(g.label(), g) for g in (SplitGemv(m, n, k, device="cuda", **p) for p in points(m, n, k, sms))]
        results = []
        for label, call in runs:
            try:
                err = ((call(x, w).float() - expected).abs().max() / expected.abs().max()).item()
                us = graph_ms(call, sets) * 1e3
                err = max(err, ((call(x, w).float() - expected).abs().max() / expected.abs().max()).item())
            except Exception as error:  # noqa: BLE001 - a point that does not compile or launch is a row too
                print(f"  {label:44s} FAILED {type(error).__name__}: {str(error)[:160]}", flush=True)
                continue
            tb_s = weight_bytes / (us * 1e-6) / 1e12
            ok = err < 2e-2
            results.append((us, label, tb_s, err, ok))
            rows.append({"shape": name, "m": m, "n": n, "k": k, "kernel": label, "us": us, "tb_s": tb_s,
                         "of_floor": tb_s * 1e12 / floor, "max_rel_err": err, "ok": ok})
        for us, label, tb_s, err, ok in sorted(results):
            print(f"  {label:44s} {us:8.2f} us  {tb_s:5.2f} TB/s ({tb_s * 1e12 / floor:5.1%})  err {err:.1e}"
                  + ("" if ok else "  WRONG"), flush=True)
        best = {kind: min((r for r in results if r[1].startswith(kind) and r[4]), default=None)
                for kind in KINDS}
        table.append((name, best))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    print("\nbest of each kind (µs, TB/s):")
    print(f"  {'shape':8s} " + " ".join(f"{kind:>16s}" for kind in KINDS))
    for name, best in table:
        cells = [f"{b[0]:7.2f} {b[2]:4.2f}TB/s" if b else f"{'-':>16s}" for b in best.values()]
        print(f"  {name:8s} " + " ".join(f"{c:>16s}" for c in cells))
    # a line us = a + bytes / bw through each kind's best per shape: a is what a GEMM costs
    # beyond streaming its weight (launch, ramp, tail, the splits' meeting), bw its streaming rate
    for kind, fit in fixed_costs(table).items():
        print(f"  {kind:8s} fit over the shapes: {fit[0]:.2f} us a GEMM + weight bytes at {fit[1]:.2f} TB/s")
    return 0


KINDS = ("cublas", "template", "tma", "ptr")


def fixed_costs(table: list[tuple[str, dict]]) -> dict[str, tuple[float, float]]:
    """kind -> (intercept us, TB/s) of the least-squares line through its best (weight bytes, us)
    per shape; kinds measured on fewer than two shapes are left out."""
    from attention_sweep import fit_latency

    fits = {}
    for kind in KINDS:
        points = [(SHAPES[name][1] * SHAPES[name][2] * 2, best[kind][0]) for name, best in table if best[kind]]
        if len({x for x, _ in points}) >= 2:
            fits[kind] = fit_latency(points)
    return fits


if __name__ == "__main__":
    sys.exit(main())
