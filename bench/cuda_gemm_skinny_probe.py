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
  slabs go out before griddepcontrol.wait, which matters when launched with PDL (`--pdl`).

The kernel is the template family gemm_skinny_cuda's (templates/cuda/gemm_skinny.cu.j2) in its
plain form; the family adds the epilogues a b32 build's regions carry (residual, the norm
statistics in and out, GLU) and is kept out of builds (COOPT_GEMM_SKINNY_CUDA) until this probe
and its GPU tests have run.

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

from bandwidth import reference_bandwidth  # noqa: E402

# Llama-3-8B's decode GEMMs (N, K): a layer's four (gate|up is its [gate; up] weight, plain here)
# and the output head
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}
# session 36 (H100): clusters of 4-16 leave SMs idle (15 x 8 = 120 blocks of 132), so the three
# points slowest there gave way to clusters of 2 (x's half slice staged: K 4096 only)
DEFAULT_POINTS = "8:8:3:64,8:4:4:64,4:4:6:64,16:4:4:64,16:8:3:64,8:6:4:64,2:4:4:64,2:6:3:64:1,2:8:2:64:1"

PARAM_KNOBS = ("CLUSTER", "num_warps", "num_stages", "KW", "PARTS")


def params_of(cluster: int, warps: int, stages: int, kw: int = 64, parts: int = 2) -> dict:
    return dict(zip(PARAM_KNOBS, (cluster, warps, stages, kw, parts)))


def render(m: int, n: int, k: int, cluster: int, warps: int, stages: int, kw: int = 64, parts: int = 2) -> str:
    """The family's kernel (templates/cuda/gemm_skinny.cu.j2) in its plain form: y = x W^T."""
    from coopt.templates.base import render_template
    from coopt.templates.gemm_skinny_cuda import layout

    params = params_of(cluster, warps, stages, kw, parts)
    return render_template("cuda/gemm_skinny.cu.j2", p=params, L=layout(m, k, n, False, 0, params), glu=False,
                           stats=None, bias=False, extras=[], program=[], out_name="v_acc", produce=None)


def shared_bytes(m: int, n: int, k: int, cluster: int, warps: int, stages: int, kw: int = 64, parts: int = 2) -> int:
    """x's slice (rows padded 16 bytes), every warp's ring, `parts` rounds of partials."""
    from coopt.templates.gemm_skinny_cuda import layout

    return layout(m, k, n, False, 0, params_of(cluster, warps, stages, kw, parts)).shared


def point_problem(m: int, n: int, k: int, cluster: int, warps: int, stages: int, kw: int = 64, parts: int = 2,
                  shared_limit: int = 227 * 1024) -> str | None:
    """Why the kernel cannot run this point (None: it can): the family's layout checks, then the
    block's shared memory."""
    from coopt.templates.gemm_skinny_cuda import layout

    try:
        shared = layout(m, k, n, False, 0, params_of(cluster, warps, stages, kw, parts)).shared
    except ValueError as error:
        return str(error)
    return f"{shared} B of shared memory a block" if shared > shared_limit else None


class SkinnyGemm:
    """y = x W^T at one point (x [m, k], W [n, k], y [m, n]; bf16): one wave of clusters."""

    def __init__(self, m: int, n: int, k: int, cluster: int, warps: int, stages: int, kw: int = 64, parts: int = 2,
                 pdl: bool = False):
        from coopt.runtime.cuda_kernels import DriverKernel

        from coopt.templates.gemm_skinny_cuda import GROUP_ROWS

        problem = point_problem(m, n, k, cluster, warps, stages, kw, parts)
        if problem:
            raise ValueError(problem)
        self.shared = shared_bytes(m, n, k, cluster, warps, stages, kw, parts)
        self.kernel = DriverKernel(render(m, n, k, cluster, warps, stages, kw, parts), "coopt_gemm_skinny", self.shared,
                                   cluster=cluster)
        self.m, self.n, self.k, self.cluster, self.warps, self.pdl = m, n, k, cluster, warps, pdl
        resident = self.kernel.max_active_clusters(warps * 32, cluster)
        if resident < 1:
            raise RuntimeError(f"no cluster of {cluster} blocks ({warps} warps, {self.shared} B each) fits the GPU")
        self.clusters = min(resident, n // GROUP_ROWS)  # one wave, none without a row group

    def __call__(self, x, w, y=None):
        import torch

        from coopt.runtime.cuda_kernels import pointers

        assert x.shape == (self.m, self.k) and w.shape == (self.n, self.k) and x.is_contiguous() and w.is_contiguous()
        if y is None:
            y = torch.empty((self.m, self.n), device=x.device, dtype=torch.bfloat16)
        self.kernel.launch((self.clusters * self.cluster, 1, 1), (self.warps * 32, 1, 1), pointers(w, x, y),
                           pdl=self.pdl)
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
    parser.add_argument("--points", default=DEFAULT_POINTS, help="C:WARPS:STAGES:KW[:PARTS], comma-separated")
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

        print(f"\n{name}: {args.m} x {n} x {k}, {traffic / 1e6:.1f} MB, floor {traffic / reference_bandwidth() * 1e6:.2f} us at {reference_bandwidth() / 1e12:.2f} TB/s; "
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
