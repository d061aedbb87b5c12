"""Do a layer's chained GEMVs run faster as one persistent launch than as one launch each?
(issue 3: each b1 GEMV pays ~3 µs over its bytes, its ramp and tail.)

    python bench/gemv_chain_probe.py --json gemv_chain.json

At batch 1 the MLP half of a layer is three dependent GEMVs: o (4096 x 4096), gate|up (28672 x
4096) and down (4096 x 14336, reading silu(gate) * up). Each streams its weights at ~4.2 TB/s
once running, but every launch pays a ramp (the kernel boundary, the first DRAM round trips) and
a tail (the last programs running alone): the output head, 1 GB in one launch, streams at 4.45
TB/s, gate|up (235 MB) at 4.21, o (34 MB) at 3.0.

The probe kernel (an experiment; it lives here) runs the chain in one launch of G resident
programs (G = SMs x programs an SM): each program takes tiles t = pid, pid + G, ... of a phase
(BLOCK_N weight rows over the whole K, multiply-and-sum), stores its outputs, counts itself in
on the phase's counter and waits for all G before the next phase reads them (a grid-wide
barrier: every program is resident, G is at most what fits). With PREFETCH a program, before it
waits, pulls the first 4 slabs of its next tile's weights into L2 (prefetch.global.L2): no kernel
writes them, so they can stream while the slowest program finishes.

Timed, each graph-replayed over weight copies past the L2 (gemm.graph_ms):
- `template`: the GEMV template at the heuristic's first points for the three layer GEMVs as a
  build makes them (o + residual, gate|up + RMSNorm + SwiGLU, down + residual), one after another;
- `launches`: the probe's phases as three launches of one tile a program (the classic grid),
  the baseline for what merging the launches saves;
- `persistent`: one launch, over G, BLOCK_N, BLOCK_K, stages and PREFETCH.
Each probe point's outputs are checked against torch's, a stage at a time (relative 2e-2),
before and after it is timed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import triton
import triton.language as tl
from bandwidth import reference_bandwidth

HIDDEN, FFN = 4096, 14336
SHARED_PER_SM = 228 * 1024  # sm_90: an SM's shared memory (1 KiB of it reserved per resident block)


@triton.jit
def _prefetch_l2(ptrs):
    # one L2 prefetch per pointer (sm_90 PTX); its dummy result keeps the asm in the program
    return tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _phase(x_ptr, w_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, pid, G,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, GLU_IN: tl.constexpr):
    """y[rows] = W[rows, :] @ x for this program's tiles (x = silu(x[:K]) * x[K:] with GLU_IN)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(pid, N // BLOCK_N, G):
        rows = tile * BLOCK_N + offs_n
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for kk in tl.range(0, K // BLOCK_K, num_stages=STAGES):
            w = tl.load(w_ptrs + kk * BLOCK_K)
            # .cg: x may be this launch's output of the phase before, at L2 (never a stale L1 line)
            if GLU_IN:
                gate = tl.load(x_ptr + kk * BLOCK_K + offs_k, cache_modifier=".cg").to(tl.float32)
                up = tl.load(x_ptr + K + kk * BLOCK_K + offs_k, cache_modifier=".cg").to(tl.float32)
                x = (gate * tl.sigmoid(gate)).to(tl.bfloat16).to(tl.float32) * up
            else:
                x = tl.load(x_ptr + kk * BLOCK_K + offs_k, cache_modifier=".cg").to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(y_ptr + rows, acc.to(tl.bfloat16))


@triton.jit
def _meet(counter_ptr, G, w_next_ptr, N_NEXT: tl.constexpr, K_NEXT: tl.constexpr, pid,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr):
    """Count in on the phase's counter, prefetch the next phase's first slabs, wait for all G."""
    tl.debug_barrier()
    seen = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") + 1
    if PREFETCH:
        if pid < N_NEXT // BLOCK_N:
            rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            cols = tl.arange(0, 4 * BLOCK_K // 64) * 64  # its first 4 slabs, one prefetch per 128-byte line
            _prefetch_l2(w_next_ptr + rows.to(tl.int64)[:, None] * K_NEXT + cols[None, :])
    while seen < G:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _chain_kernel(x_ptr, w1_ptr, w2_ptr, w3_ptr, y1_ptr, y2_ptr, y3_ptr, counters_ptr, G,
                  N1: tl.constexpr, K1: tl.constexpr, N2: tl.constexpr, N3: tl.constexpr, K3: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                  FIRST: tl.constexpr, LAST: tl.constexpr, PREFETCH: tl.constexpr):
    """Phases FIRST..LAST of y1 = W1 x, y2 = W2 y1, y3 = W3 (silu(y2[:N3']) * y2[N3':]); a
    grid-wide meeting between two phases of one launch."""
    pid = tl.program_id(0)
    if FIRST <= 1:
        _phase(x_ptr, w1_ptr, y1_ptr, N1, K1, pid, G, BLOCK_N, BLOCK_K, STAGES, False)
        if LAST >= 2:
            _meet(counters_ptr, G, w2_ptr, N2, N1, pid, BLOCK_N, BLOCK_K, STAGES, PREFETCH)
    if FIRST <= 2 and LAST >= 2:
        _phase(y1_ptr, w2_ptr, y2_ptr, N2, N1, pid, G, BLOCK_N, BLOCK_K, STAGES, False)
        if LAST >= 3:
            _meet(counters_ptr + 1, G, w3_ptr, N3, K3, pid, BLOCK_N, BLOCK_K, STAGES, PREFETCH)
    if LAST >= 3:
        _phase(y2_ptr, w3_ptr, y3_ptr, N3, K3, pid, G, BLOCK_N, BLOCK_K, STAGES, True)
    if FIRST < LAST:
        # the last program out zeroes the counters for the next launch (all have passed them)
        tl.debug_barrier()
        if tl.atomic_add(counters_ptr + 2, 1, sem="acq_rel", scope="gpu") == G - 1:
            tl.store(counters_ptr, 0)
            tl.store(counters_ptr + 1, 0)
            tl.store(counters_ptr + 2, 0)


class Chain:
    """The probe at one point: one persistent launch (programs > 0) or one launch a phase."""

    def __init__(self, programs: int, block_n: int, block_k: int, stages: int, prefetch: bool, device,
                 hidden: int = HIDDEN, ffn: int = FFN):
        import torch

        self.programs, self.block_n, self.block_k, self.stages, self.prefetch = programs, block_n, block_k, stages, prefetch
        self.hidden, self.ffn = hidden, ffn
        self.y1 = torch.empty(hidden, device=device, dtype=torch.bfloat16)
        self.y2 = torch.empty(2 * ffn, device=device, dtype=torch.bfloat16)
        self.y3 = torch.empty(hidden, device=device, dtype=torch.bfloat16)
        self.counters = torch.zeros(3, device=device, dtype=torch.int32)

    def label(self) -> str:
        grid = f"persistent {self.programs}" if self.programs else "launches"
        return f"{grid} BN{self.block_n} BK{self.block_k} s{self.stages}" + (" prefetch" if self.prefetch else "")

    def _args(self, grid, first, last, x, w1, w2, w3):
        return ((x, w1, w2, w3, self.y1, self.y2, self.y3, self.counters, grid),
                dict(N1=self.hidden, K1=self.hidden, N2=2 * self.ffn, N3=self.hidden, K3=self.ffn,
                     BLOCK_N=self.block_n, BLOCK_K=self.block_k,
                     STAGES=self.stages, FIRST=first, LAST=last, PREFETCH=self.prefetch, num_warps=4))

    def _launch(self, grid, first, last, x, w1, w2, w3):
        args, kwargs = self._args(grid, first, last, x, w1, w2, w3)
        _chain_kernel[(grid,)](*args, **kwargs)

    def resident(self, per_sm: int, x, w1, w2, w3) -> bool:
        """Whether per_sm programs of the persistent launch fit one SM by shared memory (4 warps
        of at most 255 registers: two always fit by registers). A grid-wide meeting of programs
        that are not all resident never ends: such points are not run."""
        args, kwargs = self._args(self.programs, 1, 3, x, w1, w2, w3)
        compiled = _chain_kernel.warmup(*args, grid=(self.programs,), **kwargs)
        return per_sm <= 2 and per_sm * (compiled.metadata.shared + 1024) <= SHARED_PER_SM

    def __call__(self, x, w1, w2, w3):
        if self.programs:
            self._launch(self.programs, 1, 3, x, w1, w2, w3)
        else:
            for phase, rows in ((1, self.hidden), (2, 2 * self.ffn), (3, self.hidden)):
                self._launch(rows // self.block_n, phase, phase, x, w1, w2, w3)
        return self.y3


def stage_error(chain, x, w1, w2, w3) -> float:
    """The largest relative error of the chain's three outputs, each against torch's from the
    chain's own input to it (bf16 roundings apart propagate through a chain: checked a stage at a time)."""
    import torch.nn.functional as F

    glu = F.silu(chain.y2[:chain.ffn].float()).to(x.dtype).float() * chain.y2[chain.ffn:].float()
    errors = []
    for got, expected in ((chain.y1, w1.float() @ x.float()), (chain.y2, w2.float() @ chain.y1.float()),
                          (chain.y3, w3.float() @ glu)):
        errors.append(((got.float() - expected).abs().max() / expected.abs().max()).item())
    return max(errors)


B1_MLP_HALF = ((1, HIDDEN, HIDDEN, "residual"), (1, FFN, HIDDEN, "norm_swiglu"), (1, HIDDEN, FFN, "residual"))


def timed_template_chain(work: Path, rotations: int, shapes=B1_MLP_HALF, points: int = 3):
    """Template GEMVs (gemm.make_region shapes; default the b1 MLP half: o + residual, gate|up +
    RMSNorm + SwiGLU, down + residual), each at the best of the heuristic's first `points` timed
    alone over its own input copies: (chain(*flat) running them in a row, `rotations` flat input
    sets for it, the alone times in µs, the chosen runs)."""
    from gemm import advised_points, graph_ms, input_copies, make_inputs, make_region

    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

    best_runs, alone_us = [], []
    for shape in shapes:
        region = make_region(*shape)
        copies = input_copies(make_inputs(region))
        runs = []
        for i, params in enumerate(advised_points(region, points)):
            path = work / f"{region.name}_{i}.py"
            path.write_text(MatmulEpilogueFamily().render(region, params))
            runs.append(load_module_from_file(path).run)
        times = [graph_ms(run, copies) * 1e3 for run in runs]
        best = min(range(len(runs)), key=times.__getitem__)
        best_runs.append((runs[best], copies))
        alone_us.append(times[best])
        print(f"  template {region.name}: {', '.join(f'{t:.2f}' for t in times)} us (first points)", flush=True)
    rotation = [list(itertools.chain.from_iterable(c[i % len(c)] for _, c in best_runs)) for i in range(rotations)]
    sizes = [len(c[0]) for _, c in best_runs]

    def chain(*flat):
        at = 0
        for (run, _), size in zip(best_runs, sizes):
            run(*flat[at:at + size])
            at += size

    return chain, rotation, alone_us, [run for run, _ in best_runs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs-per-sm", default="1,2")
    parser.add_argument("--block-n", default="16,32")
    parser.add_argument("--block-k", default="256,512")
    parser.add_argument("--stages", default="3,4")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import torch
    from gemm import announce_gpu, graph_ms, input_copies

    if not announce_gpu("bench/gemv_chain_probe.py"):
        return 1
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    work = Path("/tmp/gemv-chain-probe")
    work.mkdir(exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    w1, w2, w3 = ((torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
                  for n, k in ((HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN)))
    weight_bytes = sum(w.numel() * 2 for w in (w1, w2, w3))
    sets = input_copies([x, w1, w2, w3], weight_bytes)
    floor_us = weight_bytes / reference_bandwidth() * 1e6
    print(f"o + gate|up + down at b1: {weight_bytes / 1e6:.1f} MB of weights, floor {floor_us:.2f} us; "
          f"{sms} SMs; {len(sets)} input copies", flush=True)
    rows = []

    # the template's three GEMVs, each alone (best of its 3 first points) and the best three in a row
    triple, rotation, alone_us, _ = timed_template_chain(work, len(sets))
    template_us = graph_ms(triple, rotation) * 1e3
    rows.append({"kind": "template", "us": template_us, "alone_us": alone_us})
    print(f"  template three in a row {template_us:.2f} us ({weight_bytes / template_us / 1e6:.2f} TB/s; "
          f"alone {sum(alone_us):.2f})", flush=True)

    best = {"template": template_us}
    points = itertools.product(map(int, args.block_n.split(",")), map(int, args.block_k.split(",")),
                               map(int, args.stages.split(",")))
    for block_n, block_k, stages in points:
        variants = [(0, Chain(0, block_n, block_k, stages, False, "cuda"))]
        variants += [(per_sm, Chain(sms * per_sm, block_n, block_k, stages, prefetch, "cuda"))
                     for per_sm in map(int, args.programs_per_sm.split(",")) for prefetch in (False, True)]
        for per_sm, chain in variants:
            name = chain.label()
            try:
                if per_sm and not chain.resident(per_sm, *sets[0]):
                    print(f"  {name:44s} skipped: {per_sm} programs do not fit an SM", flush=True)
                    continue
                chain(*sets[0])
                err = stage_error(chain, *sets[0])
                us = graph_ms(chain, sets) * 1e3
                chain(*sets[0])  # thousands of launches later (the counters): still right
                err = max(err, stage_error(chain, *sets[0]))
            except Exception as error:  # e.g. out of shared memory at this point
                print(f"  {name:44s} FAILED: {type(error).__name__}: {str(error)[:160]}", flush=True)
                continue
            wrong = not err < 2e-2
            kind = "launches" if not chain.programs else ("persistent+prefetch" if chain.prefetch else "persistent")
            rows.append({"kind": kind, "point": name, "us": us, "tb_per_s": weight_bytes / us / 1e6, "err": err,
                         "wrong": wrong})
            print(f"  {name:44s} {us:7.2f} us {weight_bytes / us / 1e6:5.2f} TB/s  err {err:.1e}"
                  + ("  WRONG" if wrong else ""), flush=True)
            if not wrong:
                best[kind] = min(best.get(kind, us), us)
    print(f"\nbest of each kind, µs (floor {floor_us:.2f}: {weight_bytes / 1e6:.1f} MB at {reference_bandwidth() / 1e12:.2f} TB/s)")
    for kind, us in best.items():
        print(f"  {kind:22s} {us:7.2f}  {weight_bytes / us / 1e6:5.2f} TB/s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
