"""Can a GEMV start streaming its weights before the GEMV it depends on has finished? (issue 3:
every b1 GEMV pays ~3.9 µs over its bytes, the same whether the kernels are separate launches or
one persistent launch with grid-wide meetings: bench/gemv_chain_probe.py, RESULTS session 24.)

    python bench/cuda_gemv_pdl_probe.py --json cuda_gemv_pdl.json

A decode layer's GEMVs form a chain (o -> gate|up -> down at batch 1), and each waits for the
whole output of the one before: its first weight bytes leave DRAM only after the previous
kernel's last program has finished, the launch has gone through and a DRAM round trip has passed.
But a weight is no kernel's output. With programmatic dependent launch (PDL) a kernel's blocks
may start while the previous kernel still runs, as SMs free up, and everything before their
`griddepcontrol.wait` overlaps it. Session 3's Triton try (bench/pdl_probe.py) loaded a first
weight tile into registers before the wait and broke the loop's software pipeline (12.12 µs a
4096 x 4096 layer against 11.27 with the wait first); Triton lets no cp.async ring be filled
before a wait and consumed after it. This probe is written in CUDA C++ so it can:

- a persistent grid (every block resident, so no block of the kernel's own waits for an SM a
  dependent took), each warp streaming ROWS weight rows at a time, 512 bytes a row a slab,
  through its own STAGES-slab cp.async ring, the slabs of consecutive row groups back to back;
- x staged in shared memory once a block, after the wait; the gate|up GEMV streams gate row g
  and up row g in one warp and stores silu(gate) * up (the build's SwiGLU epilogue);
- MODE 0: plain launches; MODE 1: PDL with the wait first (the launch and block scheduling
  overlap the previous kernel's tail); MODE 2: PDL with the ring's first STAGES - 1 slabs issued
  before the wait (the weight stream overlaps the previous kernel's tail as well).
  Every PDL block lets dependents in right after its wait (the grid has no later blocks they
  could crowd out), so at most two kernels of the chain are in flight.

The product form of this kernel is the template family gemv_cuda (templates/gemv_cuda.py: MODE 2
always, launched with PDL where the build measures it faster, with the norm prologue and the
epilogue programs a build's regions carry); this probe keeps the modes and the counter-drawn
form that session 30 compared.

Timed graph-replayed over weight copies past the L2 (gemm.graph_ms), one o -> gate|up -> down
triple a call, against the GEMV template's three kernels at the heuristic's first points, without
and with the template's own PDL form (the control: whole steps measured it slower) (with
their residual and norm epilogues, which this probe's kernels do not have: bias in the CUDA
kernels' favour of a few tenths of a µs). Each point's outputs are checked against torch's,
a stage at a time (relative 2e-2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from coopt.templates.base import render_string  # noqa: E402

HIDDEN, FFN = 4096, 14336
SLAB = 256  # bf16 elements a row a slab: 16 bytes a lane
MODES = {0: "launches", 1: "pdl, wait first", 2: "pdl, ring before wait"}
GEMVS = ("o", "gate|up", "down")

SOURCE = r"""
#define WARPS {{ warps }}
#define ROWS {{ rows }}        // weight rows a warp streams together (a row group)
#define STAGES {{ stages }}    // slabs in a warp's ring
#define K {{ k }}
#define SLABS (K / 256)        // 512-byte pieces of a row
#define GLU {{ 1 if glu else 0 }}  // rows g and g + groups a group, y[g] = silu(gate) * up (ROWS 2)
#define MODE {{ mode }}        // 0 plain, 1 PDL wait first, 2 PDL ring issued before the wait
#define DYNAMIC {{ 1 if dynamic else 0 }}  // row groups past a warp's first taken from a counter

{% include "cuda/_prelude.cuh.j2" %}

// y[n] = sum_k W[n, k] x[k], W [groups * ROWS, K] bf16 row-major; a persistent grid. With GLU the
// weight is [gate; up] and a group's two rows are gate row g and up row g: y[g] = silu(gate) * up
//
// DYNAMIC: a warp's first row group is its own (warp index), each later one the next of a counter
// (+ the warps' count), so blocks that share an SM (a PDL kernel's blocks land wherever an SM has
// room, several on one) take less of the work instead of holding the kernel up. The counter's
// increments a launch come to exactly `groups` (every warp with a first group takes until it
// draws one past the end), so the thread that draws the last resets it for the next launch.
extern "C" __global__ void __launch_bounds__(WARPS * 32) gemv(const u32x4* __restrict__ w, const u32x4* x,
                                                              bf16_t* y, int groups, int* counter) {
  extern __shared__ u32x4 smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u32x4* xs = smem;                                            // x, K / 8 pieces
  u32x4* ring = smem + K / 8 + warp * STAGES * ROWS * 32;      // this warp's slabs
  const int first = blockIdx.x * WARPS + warp, stride = gridDim.x * WARPS;
#if DYNAMIC
  static_assert(SLABS >= STAGES, "a ring spans at most two row groups");
  int items = first < groups ? 0x7fffffff : 0;  // known once a draw comes back past the end
  int taken_even = first, taken_odd = first;    // the row groups of items i / SLABS even and odd (registers)
  auto group_of = [&](int i) { return ((i / SLABS) & 1) ? taken_odd : taken_even; };
#else
  const int mine = first < groups ? (groups - 1 - first) / stride + 1 : 0;
  const int items = mine * SLABS;  // (row group, slab) pairs this warp streams, in order
  auto group_of = [&](int i) { return first + (i / SLABS) * stride; };
#endif

  // each lane copies and later reads only its own 16 bytes of a slab: no warp barrier needed
  auto issue = [&](int i) {
#if DYNAMIC
    if (i < items && i % SLABS == 0 && i > 0) {  // a new row group: draw it (after the wait)
      int drawn = 0;
      if (lane == 0) {
        drawn = atomicAdd(counter, 1);
        if (drawn == groups - 1) atomicExch(counter, 0);  // the launch's last draw
      }
      drawn = __shfl_sync(FULL, drawn, 0) + stride;
      if (drawn >= groups) items = i;
      else if ((i / SLABS) & 1) taken_odd = drawn;
      else taken_even = drawn;
    }
#endif
    if (i < items) {
      const int group = group_of(i), slab = i % SLABS;
      u32x4* slot = ring + (i % STAGES) * ROWS * 32;
#if GLU
      const u32x4* src = w + ((size_t)group * K + slab * 256) / 8 + lane;
      const size_t row_step = (size_t)groups * K / 8;  // gate row g, then up row g
#else
      const u32x4* src = w + ((size_t)group * ROWS * K + slab * 256) / 8 + lane;
      const size_t row_step = K / 8;
#endif
#pragma unroll
      for (int r = 0; r < ROWS; ++r) copy16(slot + r * 32 + lane, src + r * row_step);
    }
    commit();  // an empty group past the end keeps wait_groups' count uniform
  };

#if MODE == 2
  for (int i = 0; i < STAGES - 1; ++i) issue(i);  // weights: no kernel writes them (first group only)
#endif
#if MODE >= 1
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#if MODE < 2
  for (int i = 0; i < STAGES - 1; ++i) issue(i);
#endif
  for (int j = threadIdx.x; j < K / 8; j += WARPS * 32) xs[j] = x[j];
  __syncthreads();

  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
  for (int i = 0; i < items; ++i) {
    issue(i + STAGES - 1);  // into the slot read at i - 1
    wait_groups<STAGES - 1>();
    const u32x4* slot = ring + (i % STAGES) * ROWS * 32;
    const int slab = i % SLABS;
    const u32x4 xv = xs[slab * 32 + lane];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] += dot8(slot[r * 32 + lane], xv);
    if (slab == SLABS - 1) {
      const int group = group_of(i);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(FULL, acc[r], o);
      }
#if GLU
      // the template's SwiGLU epilogue: silu(gate) * up in fp32, one bf16 rounding
      if (lane == 0) y[group] = to_bf16(acc[0] / (1.0f + __expf(-acc[0])) * acc[1]);
#else
#pragma unroll
      for (int r = 0; r < ROWS; ++r) if (lane == r) y[group * ROWS + r] = to_bf16(acc[r]);
#endif
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
    }
  }
}
"""


def render(k: int, glu: bool, mode: int, warps: int = 8, rows: int = 2, stages: int = 8, dynamic: bool = False) -> str:
    return render_string(SOURCE, k=k, glu=glu, mode=mode, warps=warps, rows=rows, stages=stages, dynamic=dynamic)


def shared_bytes(k: int, warps: int = 8, rows: int = 2, stages: int = 8) -> int:
    """x staged (bf16, K elements), then every warp's ring of STAGES slabs of ROWS x 512 bytes."""
    return 2 * k + warps * stages * rows * 512


class CudaGemv:
    """One GEMV y = W x at one point, a persistent grid of `per_sm` blocks an SM (at most what
    fits); with `glu`, W = [gate; up] (n rows) and y = silu(gate x) * (up x) (n / 2 outputs, a
    warp's two rows gate row g and up row g)."""

    def __init__(self, n: int, k: int, glu: bool, mode: int, warps: int, rows: int, stages: int, per_sm: int,
                 dynamic: bool = False):
        import torch

        from coopt.runtime.cuda_kernels import DriverKernel

        assert k % 256 == 0 and n % rows == 0 and (rows == 2 or not glu) and (not dynamic or k // 256 >= stages)
        self.kernel = DriverKernel(render(k, glu, mode, warps, rows, stages, dynamic), "gemv",
                                   shared_bytes(k, warps, rows, stages))
        self.counter = torch.zeros(1, device="cuda", dtype=torch.int32)  # DYNAMIC's draws (zero between launches)
        fits = self.kernel.blocks_per_sm(warps * 32)
        if fits < 1:
            raise RuntimeError(f"no block of {warps} warps and {shared_bytes(k, warps, rows, stages)} B fits an SM")
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.groups, self.warps, self.mode = n // rows, warps, mode
        self.grid = min(sms * min(per_sm, fits), -(-self.groups // warps))

    def __call__(self, w, x, y) -> None:
        import ctypes

        from coopt.runtime.cuda_kernels import pointers

        self.kernel.launch((self.grid, 1, 1), (self.warps * 32, 1, 1),
                           [*pointers(w, x, y), ctypes.c_int(self.groups), *pointers(self.counter)], pdl=self.mode > 0)


class Triple:
    """o (HIDDEN x HIDDEN) -> gate|up (2 FFN x HIDDEN, silu(gate) * up out) -> down (HIDDEN x FFN),
    as a build fuses them (the gate|up GEMV's SwiGLU epilogue); gate|up streams its two rows a
    warp through a ring of the same bytes as the others'."""

    def __init__(self, mode: int, warps: int, rows: int, stages: int, per_sm: int, hidden: int = HIDDEN,
                 ffn: int = FFN, dynamic: bool = False):
        import torch

        self.point = dict(mode=mode, warps=warps, rows=rows, stages=stages, per_sm=per_sm, dynamic=dynamic)
        self.stages = [CudaGemv(hidden, hidden, False, mode, warps, rows, stages, per_sm, dynamic),
                       CudaGemv(2 * ffn, hidden, True, mode, warps, 2, max(2, stages * rows // 2), per_sm, dynamic),
                       CudaGemv(hidden, ffn, False, mode, warps, rows, stages, per_sm, dynamic)]
        self.y1, self.y3 = (torch.empty(hidden, device="cuda", dtype=torch.bfloat16) for _ in "13")
        self.y2 = torch.empty(ffn, device="cuda", dtype=torch.bfloat16)
        self.ffn = ffn

    def label(self) -> str:
        p = self.point
        return (f"{MODES[p['mode']]:21s} {p['warps']}w {p['rows']}r {p['stages']}s {p['per_sm']}/SM"
                + (" drawn" if p["dynamic"] else ""))

    def operands(self, x, w1, w2, w3) -> list:
        """(weight, input, output) of each GEMV."""
        return [(w1, x, self.y1), (w2, self.y1, self.y2), (w3, self.y2, self.y3)]

    def __call__(self, x, w1, w2, w3):
        for gemv, (w, a, out) in zip(self.stages, self.operands(x, w1, w2, w3)):
            gemv(w, a, out)
        return self.y3


def stage_error(triple: Triple, x, w1, w2, w3) -> float:
    """The largest relative error of the triple's three outputs, each against torch's in fp32 from
    the triple's own input to it (bf16 roundings apart propagate through a chain)."""
    import torch.nn.functional as F

    gate_up = w2.float() @ triple.y1.float()
    errors = []
    for got, expected in ((triple.y1, w1.float() @ x.float()),
                          (triple.y2, F.silu(gate_up[:triple.ffn]) * gate_up[triple.ffn:]),
                          (triple.y3, w3.float() @ triple.y2.float())):
        errors.append(((got.float() - expected).abs().max() / expected.abs().max()).item())
    return max(errors)


def checked(triple: Triple, inputs) -> float:
    """The triple's stage-by-stage error on `inputs`, run on them first (the timing's last call
    ran on another input set, and the first check comes before any run)."""
    triple(*inputs)
    return stage_error(triple, *inputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="0,1,2")
    parser.add_argument("--points", default="16:1:8:1,16:1:8:1:d,16:1:6:1:d,16:1:4:1:d,16:2:4:1:d,8:1:8:2:d",
                        help="warps:rows:stages:blocks an SM[:d (row groups drawn from a counter)], each "
                             "timed in every mode")
    parser.add_argument("--alone-modes", default="0,2", help="modes whose GEMVs are also timed alone")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    alone_modes = {int(m) for m in args.alone_modes.split(",") if m}
    import torch
    from bandwidth import reference_bandwidth
    from gemm import PointTimes, announce_gpu, graph_ms, input_copies
    from gemv_chain_probe import timed_template_chain

    if not announce_gpu("bench/cuda_gemv_pdl_probe.py"):
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    w1, w2, w3 = ((torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
                  for n, k in ((HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN)))
    weight_bytes = sum(w.numel() * 2 for w in (w1, w2, w3))
    sets = input_copies([x, w1, w2, w3], weight_bytes)
    print(f"o + gate|up + down at b1: {weight_bytes / 1e6:.1f} MB of weights, floor "
          f"{weight_bytes / reference_bandwidth() * 1e6:.2f} us at {reference_bandwidth() / 1e12:.2f} TB/s; {len(sets)} input copies", flush=True)

    # the template's three GEMVs at their best first point each, in a row (gemv_chain_probe's baseline)
    work = Path("/tmp/cuda-gemv-pdl-probe")
    work.mkdir(exist_ok=True)
    template, rotation, alone_us, template_runs = timed_template_chain(work, len(sets))
    alone = dict(zip(GEMVS, alone_us))
    template_us = graph_ms(template, rotation) * 1e3
    rows = [{"kind": "template", "us": template_us, "tb_per_s": weight_bytes / template_us / 1e6, "alone_us": alone}]
    print(f"  {'template (three launches)':44s} {template_us:7.2f} us {weight_bytes / template_us / 1e6:5.2f} TB/s",
          flush=True)
    # the control: the template's own PDL form (templates/triton/_pdl.j2: wait first, released
    # after the main loop), which whole decode steps measured slower (RESULTS sessions 6-29)
    for run in template_runs:
        run.__globals__["use_pdl"](True)
    template_pdl_us = graph_ms(template, rotation) * 1e3
    for run in template_runs:
        run.__globals__["use_pdl"](False)
    again_us = graph_ms(template, rotation) * 1e3  # the plain triple again: the call's drift
    print(f"  {'template (three launches) again':44s} {again_us:7.2f} us", flush=True)
    rows.append({"kind": "template, pdl", "us": template_pdl_us, "tb_per_s": weight_bytes / template_pdl_us / 1e6})
    print(f"  {'template (three launches, PDL)':44s} {template_pdl_us:7.2f} us "
          f"{weight_bytes / template_pdl_us / 1e6:5.2f} TB/s", flush=True)

    times = PointTimes(width=44)
    for point in args.points.split(","):
        fields = point.split(":")
        warps, nrows, stages, per_sm = map(int, fields[:4])
        dynamic = fields[4:] == ["d"]
        for mode in map(int, args.modes.split(",")):
            try:
                triple = Triple(mode, warps, nrows, stages, per_sm, dynamic=dynamic)
            except Exception as error:  # e.g. no block fits
                print(f"  {point} mode {mode}: FAILED: {type(error).__name__}: {str(error)[:160]}", flush=True)
                continue
            times.record("b1 triple", MODES[mode], triple.label(), triple, sets, weight_bytes,
                         error=lambda t=triple: checked(t, sets[0]))
            if mode in alone_modes:  # each GEMV alone, back to back with itself (timing only)
                for name, gemv, (w, a, out) in zip(GEMVS, triple.stages, triple.operands(*sets[0])):
                    weights = input_copies([w], w.numel() * 2)  # past the L2, as the template's alone times
                    times.record(name, MODES[mode], f"  {name} alone", lambda w, g=gemv, a=a, out=out: g(w, a, out),
                                 weights, w.numel() * 2)
    rows += times.rows
    print(f"\nbest of each kind, µs (template: triple {template_us:.2f}, with PDL {template_pdl_us:.2f}, alone "
          + ", ".join(f"{name} {us:.2f}" for name, us in alone.items()) + ")")
    for (case, kind), us in sorted(times.best.items()):
        print(f"  {case:10s} {kind:22s} {us:7.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
