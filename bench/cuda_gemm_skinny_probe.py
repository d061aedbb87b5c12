"""Can a CUDA kernel stream a batch-32 decode GEMM's weights as the batch-1 CUDA GEMV does? (issue
3 and 4's b32 rows: their GEMVs, Triton at M = 32, stream at ~3.7 TB/s against gemv_cuda's ~4.5 at
batch 1; at 4.3 TB/s they would take ~70 µs off an 8-layer b32 / 2048 step, what b32 / 2048 fp8
and its values-only row miss their targets by: bench/NOTES-decode.md, session 34.)

    python bench/cuda_gemm_skinny_probe.py --json gemm_skinny.json
    python bench/cuda_gemm_skinny_probe.py --shapes o,down --points 8:8:4:64,4:4:4:64

y = x W^T, x [M, K] bf16 (M = 16, 32 or 64 rows of a batch), W [N, K] bf16, y [M, N] bf16. At M
= 32, x is 256 KB at K = 4096 and 917 KB at 14336: no SM's shared memory holds it, and re-reading
it from L2 for every weight row costs as many bytes as the weights. So K is split: a thread-block
cluster of C blocks shares row groups, each block holding its K / C slice of x in shared memory
(staged once) and streaming that slice of its row groups' weights:

- a warp's unit is a row group of 32 weight rows (two m16 tiles); each warp streams its groups'
  slabs (32 rows x KW columns) through its own STAGES-slab cp.async ring, 16-byte pieces
  XOR-swizzled by row so that ldmatrix meets no bank twice; the slabs of its next group follow
  its last without a gap (the ring runs across groups);
- per 16 columns: W's rows by ldmatrix.x4 (A), x's rows by ldmatrix.x4 from the staged slice
  (rows padded 16 bytes: B), mma.sync m16n8k16 bf16 with fp32 accumulators, 2 x M / 8 tiles; x's
  fragments serve 32 weight rows, so shared reads are ~2x the weight bytes;
- a cluster owns a contiguous share of the row groups, W of them a round (one a warp). After a
  round each warp stores its partial sums [M x 32] (fp32) in its block's shared memory, the
  cluster meets (split barrier: arrive after storing, wait only after the next round's loop),
  and each block sums 1/C of the round's outputs over the C blocks' partials through distributed
  shared memory (mapa + ld.shared::cluster, rank order: deterministic) and stores them in bf16;
  with two partials buffers (PARTS 2) a round's meeting waits only after the next round's loop,
  with one (less shared memory: K = 14336's x slice is 115 KB at C = 8) its reduction comes first;
- the grid is one wave of clusters (the driver's count of co-resident clusters); the ring's first
  slabs go out before griddepcontrol.wait when launched with PDL (`pdl`).

Each point is checked against torch's fp32 product (relative 2e-2, before and after timing), then
timed graph-replayed over weight copies past the L2 (bench/gemm.graph_ms) beside cuBLAS
(torch.matmul) and the GEMM template (templates/matmul_epilogue.py) at the heuristic advisor's
first points on the same plain region, in the same process. A point is C:WARPS:STAGES:KW[:PARTS].
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

GROUP_ROWS = 32  # weight rows a warp's group: two m16 tiles
# Llama-3-8B's decode GEMMs (N, K): a layer's four (gate|up is its [gate; up] weight, plain here)
# and the output head
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}
DEFAULT_POINTS = "8:8:3:64,8:8:4:64:1,8:4:4:64,4:4:6:64,16:4:4:64,16:8:3:64,16:8:4:64:1,8:6:4:64,8:12:2:64:1"

SOURCE = r"""
#define M {{ m }}                // activation rows (the batch)
#define K {{ k }}
#define C {{ cluster }}          // blocks of a cluster: K split C ways
#define WARPS {{ warps }}
#define STAGES {{ stages }}      // slabs in a warp's ring
#define KW {{ kw }}              // columns of a slab (KW * 2 bytes of each of its rows)
#define PDL {{ 1 if pdl else 0 }}  // the ring's first slabs before griddepcontrol.wait
#define PARTS {{ parts }}        // partials buffers: 2 lets a round's meeting wait until after the next round's loop
#define RG 32                    // weight rows a group (a warp's unit of work): two m16 tiles
#define TM (RG / 16)
#define NT (M / 8)               // n8 tiles of the batch
#define KS (K / C)               // a block's share of K
#define SLABS (KS / KW)          // slabs of a group's rows in that share
#define CHUNKS (KW / 8)          // 16-byte pieces of a slab's row
#define XROW (KS + 8)            // bf16 elements of a staged x row: +16 bytes, so ldmatrix's 8 rows meet no bank twice
#define R (WARPS * RG)           // weight rows of a round (a group a warp)
#define RP (R + 4)               // floats of a partials row (one batch row): +4, so fragment stores meet no bank twice
#define TPM (WARPS * 32 / M)     // threads that reduce one batch row
#define V (R / C / TPM)          // consecutive outputs a thread reduces and stores
#define RING_BYTES (RG * KW * 2)

static_assert(K % (C * KW) == 0 && KW % 16 == 0 && CHUNKS >= 8, "a block's share of K is whole slabs of 128 bytes or more");
static_assert(M % 16 == 0 && WARPS * 32 % M == 0, "M is whole n16 pairs, a whole number of threads a batch row");
static_assert(V >= 2 && RG % V == 0, "a thread reduces 2 or more outputs, inside one group");

{% include "cuda/_prelude.cuh.j2" %}
{% include "cuda/_mma_f16.cuh.j2" %}

__device__ __forceinline__ void copy16_to(unsigned int dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned int* r, unsigned int address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address) : "memory");
}

__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

__device__ __forceinline__ unsigned int cluster_rank() {
  unsigned int r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// `n` floats (2 or 4) at shared address `p` of block `rank` of the cluster
template <int N> __device__ __forceinline__ void cluster_load_floats(float* v, unsigned int p, unsigned int rank) {
  unsigned int remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(p), "r"(rank));
  if (N == 4)
    asm volatile("ld.shared::cluster.v4.f32 { %0, %1, %2, %3 }, [%4];"
                 : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3]) : "r"(remote) : "memory");
  else
    asm volatile("ld.shared::cluster.v2.f32 { %0, %1 }, [%2];" : "=f"(v[0]), "=f"(v[1]) : "r"(remote) : "memory");
}

extern "C" __global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(WARPS * 32, 1)
coopt_gemm_skinny(const bf16_t* __restrict__ w, const bf16_t* __restrict__ x, bf16_t* __restrict__ y, int groups) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned int rank = cluster_rank();
  const int cluster = blockIdx.x / C, clusters = gridDim.x / C;
  // the cluster's row groups: a contiguous share, the same in each of its blocks
  const int first = (int)((long long)groups * cluster / clusters);
  const int end = (int)((long long)groups * (cluster + 1) / clusters);
  const int rounds = (end - first + WARPS - 1) / WARPS;
  const int mine = max(0, (end - first - warp + WARPS - 1) / WARPS);  // groups first + r * WARPS + warp < end
  if (rounds == 0) return;  // the whole cluster alike: no barrier is left waiting

  const unsigned int xs = shared_address(smem);                                       // M x XROW bf16
  const unsigned int ring = xs + M * XROW * 2 + warp * STAGES * RING_BYTES;           // this warp's slabs
  float* part = reinterpret_cast<float*>(smem + M * XROW * 2 + WARPS * STAGES * RING_BYTES);  // PARTS x M x RP

  // Slab i of this warp: group first + (i / SLABS) * WARPS + warp, columns rank * KS + (i % SLABS) * KW.
  // Lane l copies piece l % CHUNKS of rows l / CHUNKS + 32 / CHUNKS * j, at piece ^ (row & 7).
  const bf16_t* w_share = w + (size_t)rank * KS + (lane % CHUNKS) * 8;
  auto issue = [&](int i) {
    if (i < mine * SLABS) {
      const int group = first + (i / SLABS) * WARPS + warp;
      const bf16_t* src = w_share + (size_t)group * RG * K + (i % SLABS) * KW;
      const unsigned int slot = ring + (i % STAGES) * RING_BYTES;
#pragma unroll
      for (int j = 0; j < RG * CHUNKS / 32; ++j) {
        const int row = lane / CHUNKS + 32 / CHUNKS * j;
        copy16_to(slot + row * KW * 2 + (((lane % CHUNKS) ^ (row & 7)) << 4), src + (size_t)row * K);
      }
    }
    commit();  // an empty group past the end keeps wait_groups' count uniform
  };

  for (int i = 0; i < STAGES - 1; ++i) issue(i);  // weights: no kernel writes them
#if PDL
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  // the block's slice of x, once (after the wait: it is the kernel before's output)
  for (int j = threadIdx.x; j < M * (KS / 8); j += WARPS * 32) {
    const int row = j / (KS / 8), piece = j % (KS / 8);
    copy16_to(xs + (row * XROW + piece * 8) * 2, x + (size_t)row * K + rank * KS + piece * 8);
  }
  commit();
  wait_groups<0>();
  __syncthreads();

  // ldmatrix.x4 addresses: A (a tile's 16 rows x 16 columns: rows 0-7 / 8-15, columns 0-7 / 8-15
  // in a0..a3's order) and B (x rows 0-7 columns 0-7, 0-7 / 8-15, 8-15 / 0-7, 8-15 / 8-15: b0 b1
  // of the n8 tile 2p, then of 2p + 1)
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_half = lane >> 4;
  const unsigned int b_lane = xs + (((lane & 7) + (lane >> 4) * 8) * XROW + ((lane >> 3) & 1) * 8) * 2;

  // a round's partials, then the sum of this block's 1/C of them over the cluster: thread t sums
  // V outputs of batch row t / TPM (rows rank * R / C + (t % TPM) * V of the round's R)
  const int red_m = threadIdx.x / TPM, red_row = rank * (R / C) + (threadIdx.x % TPM) * V;
  auto reduce = [&](int r) {
    const int base = first + r * WARPS;                   // the round's first group
    if (red_row >= min(WARPS, end - base) * RG) return;   // past the last group of a short round
    constexpr int VEC = V >= 4 ? 4 : 2;
    const unsigned int at = shared_address(part + (r % PARTS) * M * RP + red_m * RP + red_row);
    float sum[V];
#pragma unroll
    for (int v = 0; v < V; ++v) sum[v] = 0.0f;
#pragma unroll
    for (int q = 0; q < C; ++q) {
#pragma unroll
      for (int v = 0; v < V; v += VEC) {
        float got[VEC];
        cluster_load_floats<VEC>(got, at + v * 4, q);
#pragma unroll
        for (int e = 0; e < VEC; ++e) sum[v + e] += got[e];
      }
    }
    unsigned int* out = reinterpret_cast<unsigned int*>(y + (size_t)red_m * groups * RG + base * RG + red_row);
#pragma unroll
    for (int v = 0; v < V; v += 2) out[v / 2] = pack_bf16(sum[v], sum[v + 1]);
  };

  int i = 0;  // this warp's slab count
  for (int r = 0; r < rounds; ++r) {
    float acc[TM][NT][4];
#pragma unroll
    for (int t = 0; t < TM; ++t)
#pragma unroll
      for (int j = 0; j < NT; ++j) acc[t][j][0] = acc[t][j][1] = acc[t][j][2] = acc[t][j][3] = 0.0f;
    if (r < mine) {
      for (int s = 0; s < SLABS; ++s, ++i) {
        __syncwarp();  // every lane has read the slot the next copy refills
        issue(i + STAGES - 1);
        wait_groups<STAGES - 1>();
        __syncwarp();  // every lane's copies of slab i have landed
        const unsigned int slot = ring + (i % STAGES) * RING_BYTES;
        const unsigned int b_at = b_lane + s * KW * 2;
#pragma unroll
        for (int kk = 0; kk < KW / 16; ++kk) {
          unsigned int a[TM][4], b[NT / 2][4];
#pragma unroll
          for (int t = 0; t < TM; ++t) {
            const int row = t * 16 + a_row, piece = 2 * kk + a_half;
            ldmatrix_x4(a[t], slot + row * KW * 2 + ((piece ^ (row & 7)) << 4));
          }
#pragma unroll
          for (int p = 0; p < NT / 2; ++p) ldmatrix_x4(b[p], b_at + (p * 16 * XROW + kk * 16) * 2);
#pragma unroll
          for (int t = 0; t < TM; ++t)
#pragma unroll
            for (int j = 0; j < NT; ++j)
              mma_bf16(acc[t][j], a[t][0], a[t][1], a[t][2], a[t][3], b[j / 2][2 * (j & 1)], b[j / 2][2 * (j & 1) + 1]);
        }
      }
    }
#if PARTS == 2
    if (r > 0) {
      __syncwarp();    // the barriers are .aligned: every lane of the warp at the same one
      cluster_wait();  // every block's partials of round r - 1
      reduce(r - 1);
    }
#else
    if (r > 0) {
      __syncwarp();
      cluster_wait();  // every block has read round r - 1's partials: the buffer is free
    }
#endif
    if (r < mine) {
      // c0 c1: weight row g, batch rows 2c, 2c + 1; c2 c3: weight row g + 8
      float* buf = part + (r % PARTS) * M * RP + warp * RG + (lane >> 2);
      const int col = 2 * (lane & 3);
#pragma unroll
      for (int t = 0; t < TM; ++t)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          float* at = buf + (j * 8 + col) * RP + t * 16;
          at[0] = acc[t][j][0];
          at[RP] = acc[t][j][1];
          at[8] = acc[t][j][2];
          at[RP + 8] = acc[t][j][3];
        }
    }
    __syncwarp();
    cluster_arrive();
#if PARTS == 1
    cluster_wait();  // every block's partials of round r
    reduce(r);
    __syncwarp();
    cluster_arrive();  // done reading them (waited for before the next round's stores)
#endif
  }
#if PARTS == 2
  cluster_wait();
  reduce(rounds - 1);
  __syncwarp();
  cluster_arrive();  // no block leaves while another still reads its shared memory
#endif
  cluster_wait();
}
"""


def render(m: int, k: int, cluster: int, warps: int, stages: int, kw: int = 64, parts: int = 2, pdl: bool = False) -> str:
    return render_string(SOURCE, m=m, k=k, cluster=cluster, warps=warps, stages=stages, kw=kw, parts=parts, pdl=pdl)


def shared_bytes(m: int, k: int, cluster: int, warps: int, stages: int, kw: int = 64, parts: int = 2) -> int:
    """x's slice (rows padded 16 bytes), every warp's ring, `parts` rounds of partials (fp32, rows
    padded 16 bytes)."""
    rows = warps * GROUP_ROWS
    return m * (k // cluster + 8) * 2 + warps * stages * GROUP_ROWS * kw * 2 + parts * m * (rows + 4) * 4


def point_problem(m: int, n: int, k: int, cluster: int, warps: int, stages: int, kw: int, parts: int = 2,
                  shared_limit: int = 227 * 1024) -> str | None:
    """Why the kernel cannot run this point (None: it can); the source's static_asserts and more."""
    per_thread = warps * GROUP_ROWS // cluster // (warps * 32 // m) if warps * 32 % m == 0 else 0
    problems = [
        (n % GROUP_ROWS, f"N={n} is not whole groups of {GROUP_ROWS} rows"),
        (k % (cluster * kw) or kw % 64, f"K={k} is not whole slabs of {kw} columns in {cluster} shares (KW a multiple of 64)"),
        (m % 16 or warps * 32 % m, f"M={m}: needs a multiple of 16 dividing the block's {warps * 32} threads"),
        (per_thread < 2 or GROUP_ROWS % per_thread, f"{per_thread} outputs a thread in the reduction (needs 2-32)"),
        (cluster not in (1, 2, 4, 8, 16) or stages < 2 or parts not in (1, 2), "1-16 blocks a cluster (a power of 2), 2 or more slabs a ring, 1-2 partials"),
        (shared_bytes(m, k, cluster, warps, stages, kw, parts) > shared_limit,
         f"{shared_bytes(m, k, cluster, warps, stages, kw, parts)} B of shared memory a block"),
    ]
    return next((why for bad, why in problems if bad), None)


class SkinnyGemm:
    """y = x W^T at one point (x [m, k], W [n, k], y [m, n]; bf16): one wave of clusters."""

    def __init__(self, m: int, n: int, k: int, cluster: int, warps: int, stages: int, kw: int = 64, parts: int = 2,
                 pdl: bool = False):
        import torch

        from coopt.runtime.cuda_kernels import DriverKernel

        problem = point_problem(m, n, k, cluster, warps, stages, kw, parts)
        if problem:
            raise ValueError(problem)
        self.shared = shared_bytes(m, k, cluster, warps, stages, kw, parts)
        self.kernel = DriverKernel(render(m, k, cluster, warps, stages, kw, parts, pdl), "coopt_gemm_skinny", self.shared,
                                   cluster=cluster)
        self.m, self.n, self.k, self.cluster, self.warps, self.pdl = m, n, k, cluster, warps, pdl
        self.groups = n // GROUP_ROWS
        resident = self.kernel.max_active_clusters(warps * 32, cluster)
        if resident < 1:
            raise RuntimeError(f"no cluster of {cluster} blocks ({warps} warps, {self.shared} B each) fits the GPU")
        self.clusters = min(resident, self.groups)
        self.device = torch.cuda.current_device()

    def __call__(self, x, w, y=None):
        import ctypes

        import torch

        from coopt.runtime.cuda_kernels import pointers

        assert x.shape == (self.m, self.k) and w.shape == (self.n, self.k) and x.is_contiguous() and w.is_contiguous()
        if y is None:
            y = torch.empty((self.m, self.n), device=x.device, dtype=torch.bfloat16)
        self.kernel.launch((self.clusters * self.cluster, 1, 1), (self.warps * 32, 1, 1),
                           [*pointers(w, x, y), ctypes.c_int(self.groups)], pdl=self.pdl)
        return y


def parse_point(text: str) -> tuple[int, int, int, int, int]:
    """C:WARPS:STAGES:KW[:PARTS] (PARTS 2 unless given)."""
    fields = [int(f) for f in text.split(":")]
    return tuple(fields + [2] * (5 - len(fields)))


def triton_points(m: int, n: int, k: int, count: int) -> list:
    """(label, run) of the GEMM template's `count` first advised points on the plain region."""
    import tempfile

    from gemm import _PLAIN, advised_points, label, make_region

    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

    region = make_region(m, n, k, "plain")
    work = Path(tempfile.mkdtemp(prefix="coopt_skinny_"))
    runs = []
    for i, params in enumerate(advised_points(region, count)):
        path = work / f"point{i}.py"
        path.write_text(MatmulEpilogueFamily().render(region, {**_PLAIN, **params}))
        runs.append((f"template {label({**_PLAIN, **params})}", load_module_from_file(path).run))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, default=32)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--points", default=DEFAULT_POINTS, help="C:WARPS:STAGES:KW, comma-separated")
    parser.add_argument("--pdl", action="store_true", help="also time each point launched with PDL")
    parser.add_argument("--advised", type=int, default=2, help="the GEMM template's first advised points")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import torch
    from gemm import PointTimes, announce_gpu, input_copies

    if not announce_gpu("bench/cuda_gemm_skinny_probe.py", m=args.m):
        return 1
    times = PointTimes(width=44)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(args.m, k, generator=gen, device="cuda").to(torch.bfloat16)
        w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
        traffic = (w.numel() + x.numel() + args.m * n) * 2
        sets = input_copies([x, w])
        expected = x.float() @ w.float().T

        def error(call):  # call(x, w) -> y
            return ((call(x, w).float() - expected).abs().max() / expected.abs().max()).item()

        print(f"\n{name}: {args.m} x {n} x {k}, {traffic / 1e6:.1f} MB, floor {traffic / 4.2e6:.2f} us at 4.2 TB/s; "
              f"{len(sets)} input copies", flush=True)
        times.record(name, "cublas", "cublas (torch.matmul)", lambda a, b: torch.matmul(a, b.T), sets, traffic,
                     error=lambda: error(lambda a, b: torch.matmul(a, b.T)))
        try:
            template_runs = triton_points(args.m, n, k, args.advised)
        except Exception as failure:  # no advisor (pydantic) or a render error: the CUDA points still run
            print(f"  template points: {type(failure).__name__}: {str(failure)[:200]}", flush=True)
            template_runs = []
        for label_text, run in template_runs:
            first_output = (lambda a, b, run=run: run(a, b)[0])
            times.record(name, "template", label_text, first_output, sets, traffic, error=lambda f=first_output: error(f))
        for text in args.points.split(","):
            cluster, warps, stages, kw, parts = parse_point(text)
            for pdl in (False, True) if args.pdl else (False,):
                point = f"cuda c{cluster} w{warps} s{stages} kw{kw} p{parts}" + (" pdl" if pdl else "")
                problem = point_problem(args.m, n, k, cluster, warps, stages, kw, parts)
                if problem:
                    print(f"  {point:44s} skipped: {problem}", flush=True)
                    continue
                try:
                    gemm = SkinnyGemm(args.m, n, k, cluster, warps, stages, kw, parts, pdl)
                except Exception as failure:
                    print(f"  {point:44s} FAILED: {type(failure).__name__}: {str(failure)[:200]}", flush=True)
                    continue
                times.record(name, "cuda", f"{point} ({gemm.clusters} clusters)", gemm, sets, traffic,
                             error=lambda g=gemm: error(g))
        if args.json:  # after every shape: a run cut short keeps what it measured
            args.json.write_text(json.dumps(times.rows, indent=1))
    times.print_best()
    return 0


if __name__ == "__main__":
    sys.exit(main())
