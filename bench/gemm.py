"""Time matmul_epilogue points against cuBLAS on the MLP and decode GEMM shapes (needs a GPU).

    python bench/gemm.py --quick                  # ~24 curated points, < 3 min with compilation
    python bench/gemm.py                          # every legal point (hours: narrow it down)
    python bench/gemm.py --shapes up,down --variants tma --limit 40 --json gemm.json

Shapes (bf16): `up` 4096x4096 @ [16384, 4096]^T + bias, gelu (the MLP up-projection); `down`
4096x16384 @ [4096, 16384]^T + bias + residual; `decode` M = 1, 8, 32 with N = 4096 / 14336,
K = 4096 (a plain linear). Each point is rendered by the family, checked against eager PyTorch,
then timed with triton.testing.do_bench (median, L2 flushed). References: `cublas` is the bare
matmul (torch.matmul), `eager` the whole region (F.linear plus the epilogue) as the model runs it.

Compilation dominates a cold run: points are first compiled in parallel worker processes (one
launch each on the GPU, filling Triton's cache), then checked and timed one by one here.
`--list` prints the points without a GPU. Full mode covers ~1450 points per large shape: at a few
seconds of compilation each, narrow it with --variants / --limit on a time-limited machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# -- shapes -----------------------------------------------------------------------------------
# name -> (M, N, K, epilogue): "gelu" = +bias, gelu; "residual" = +bias, + x; "plain" = no bias.
SHAPES = {
    "up": [(4096, 16384, 4096, "gelu")],
    "down": [(4096, 4096, 16384, "residual")],
    "decode": [(m, n, 4096, "plain") for m in (1, 8, 32) for n in (4096, 14336)],
}

# -- the curated quick subset -------------------------------------------------------------------
_PLAIN = {"GROUP_M": 8, "SPLIT_K": 1, "PERSISTENT": False, "USE_TMA": False, "EPILOGUE_SUBTILE": 1}


def _point(bm, bn, bk, warps, stages, **variant):
    return {**_PLAIN, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, **variant}


_TMA_PERSISTENT = {"PERSISTENT": True, "USE_TMA": True}
QUICK_LARGE = [
    # the plain kernel: 128x256 is the point measured at 0.952 ms on `up` (2026-11-30)
    _point(128, 256, 64, 8, 3),
    _point(128, 128, 64, 8, 4),
    # persistent grid, pointer loads (cp.async)
    _point(128, 256, 64, 8, 3, PERSISTENT=True, EPILOGUE_SUBTILE=2),
    _point(128, 128, 64, 8, 4, PERSISTENT=True),
    # one program per tile, tensor copies (TMA) in and out
    _point(128, 256, 64, 8, 3, USE_TMA=True),
    _point(128, 256, 64, 8, 4, USE_TMA=True, EPILOGUE_SUBTILE=2),
    _point(128, 128, 64, 8, 5, USE_TMA=True),
    # persistent + TMA: the heuristic's first picks (`up`: s4 halves; `down`: s3 halves)
    _point(128, 256, 64, 8, 4, **_TMA_PERSISTENT, EPILOGUE_SUBTILE=2),
    _point(128, 256, 64, 8, 3, **_TMA_PERSISTENT, EPILOGUE_SUBTILE=2),
    _point(128, 256, 64, 8, 3, **_TMA_PERSISTENT),
    _point(128, 128, 64, 8, 4, **_TMA_PERSISTENT),
    _point(128, 128, 64, 8, 5, **_TMA_PERSISTENT),
    _point(128, 128, 64, 4, 4, **_TMA_PERSISTENT),
    _point(128, 128, 128, 8, 3, **_TMA_PERSISTENT, EPILOGUE_SUBTILE=2),
    _point(128, 256, 128, 8, 2, **_TMA_PERSISTENT, EPILOGUE_SUBTILE=2),
    _point(64, 256, 64, 8, 4, **_TMA_PERSISTENT, EPILOGUE_SUBTILE=2),
]
QUICK_DECODE = [
    _point(16, 32, 128, 4, 4),
    _point(16, 64, 128, 4, 4),
    _point(16, 32, 256, 4, 4),
    _point(16, 64, 64, 4, 5),
    _point(16, 32, 128, 4, 4, SPLIT_K=2),
    _point(16, 64, 128, 4, 5, SPLIT_K=4),
    _point(32, 64, 128, 4, 4),  # legal for M = 32 only
    _point(16, 128, 128, 4, 4),
]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the curated subset (~24 points)")
    parser.add_argument("--shapes", default="up,down,decode", help="comma list of: " + ",".join(SHAPES))
    parser.add_argument("--variants", default="all", choices=["all", "plain", "persistent", "tma"],
                        help="full mode: keep only points of this kernel variant")
    parser.add_argument("--limit", type=int, default=None, help="full mode: at most this many points per shape")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="parallel compile processes")
    parser.add_argument("--json", type=Path, default=None, help="write every measurement here")
    parser.add_argument("--list", action="store_true", help="print the points per shape and exit (no GPU needed)")
    return parser.parse_args()


# -- regions, inputs, references ----------------------------------------------------------------
def make_region(m: int, n: int, k: int, epilogue: str):
    from coopt.ir.region import RegionSummary, TensorSpec

    inputs = [TensorSpec((m, k), "bfloat16"), TensorSpec((n, k), "bfloat16")]
    program, has_bias = [], epilogue != "plain"
    if has_bias:
        inputs.append(TensorSpec((n,), "bfloat16"))
    if epilogue == "gelu":
        program = [["y", "gelu", ["acc"]]]
    elif epilogue == "residual":
        inputs.append(TensorSpec((m, n), "bfloat16"))
        program = [["y", "add", ["acc", "in0"]]]
    outputs = ["y"] if program else ["acc"]
    return RegionSummary(
        name=f"gemm_{m}x{n}x{k}_{epilogue}", family="matmul_epilogue", inputs=tuple(inputs),
        outputs=(TensorSpec((m, n), "bfloat16"),),
        attrs={"b_layout": "nk", "has_bias": has_bias, "epilogue": program, "outputs": outputs},
    )


def make_inputs(region, seed: int = 0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = region.inputs[0].shape[-1]
    tensors = []
    for i, spec in enumerate(region.inputs):
        x = torch.randn(spec.shape, generator=gen, device="cuda", dtype=torch.float32)
        if i == 1:
            x = x / math.sqrt(k)  # keep the product O(1), as a trained weight would
        tensors.append(x.to(torch.bfloat16))
    return tensors


def eager(region, inputs):
    """The region as the model runs it: F.linear (cuBLAS) then the epilogue."""
    import torch.nn.functional as F

    program = region.attrs["epilogue"]
    bias = inputs[2] if region.attrs["has_bias"] else None
    y = F.linear(inputs[0], inputs[1], bias)
    if program and program[0][1] == "gelu":
        y = F.gelu(y)
    elif program and program[0][1] == "add":
        y = y + inputs[3]
    return y


def traffic_bytes(region) -> int:
    """Bytes every input and output must cross DRAM at least once (the GB/s denominator)."""
    from coopt.ir.region import DTYPE_BYTES

    specs = (*region.inputs, *region.outputs)
    return sum(math.prod(s.shape) * DTYPE_BYTES[s.dtype] for s in specs)


# -- points ------------------------------------------------------------------------------------------
def select_points(region, args) -> list[dict]:
    from coopt.targets import H200
    from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

    family = MatmulEpilogueFamily()
    m = region.inputs[0].shape[0]
    if args.quick:
        curated = QUICK_DECODE if m <= 32 else QUICK_LARGE
        return [p for p in curated if family.check(region, p, H200) is None]
    points = family.legal_points(region, H200)
    keep = {
        "all": lambda p: True,
        "plain": lambda p: not (p["PERSISTENT"] or p["USE_TMA"]),
        "persistent": lambda p: p["PERSISTENT"] and not p["USE_TMA"],
        "tma": lambda p: p["USE_TMA"],
    }[args.variants]
    points = [p for p in points if keep(p)]
    return points[: args.limit] if args.limit else points


def label(params: dict) -> str:
    text = f"{params['BLOCK_M']}x{params['BLOCK_N']}x{params['BLOCK_K']} w{params['num_warps']} s{params['num_stages']}"
    text += f" g{params['GROUP_M']}" + (f" splitk{params['SPLIT_K']}" if params["SPLIT_K"] > 1 else "")
    flags = [name for name, on in (("persistent", params.get("PERSISTENT")), ("tma", params.get("USE_TMA"))) if on]
    if params.get("EPILOGUE_SUBTILE", 1) > 1:
        flags.append(f"subtile{params['EPILOGUE_SUBTILE']}")
    return text + (" " + "+".join(flags) if flags else "")


def _warm(job) -> str | None:
    """Worker process: compile one point by running it once on the GPU (fills the shared cache)."""
    path, shape = job
    try:
        from coopt.runtime.kernel_loader import load_module_from_file

        region = make_region(*shape)
        load_module_from_file(path).run(*make_inputs(region))
        import torch

        torch.cuda.synchronize()
        return None
    except Exception as error:  # reported by the timing pass as well
        return f"{type(error).__name__}: {str(error)[:200]}"


# -- the run -----------------------------------------------------------------------------------------
def main() -> int:
    args = parse_args()
    shapes = [shape for name in args.shapes.split(",") for shape in SHAPES[name]]
    if args.list:
        for shape in shapes:
            points = select_points(make_region(*shape), args)
            print(f"{shape}: {len(points)} points")
            for params in points:
                print("   ", label(params))
        return 0
    import torch
    import triton
    from triton.testing import do_bench

    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

    if not torch.cuda.is_available():
        print("bench/gemm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                      "mode": "quick" if args.quick else "full"}), flush=True)
    family = MatmulEpilogueFamily()
    work_dir = Path(tempfile.mkdtemp(prefix="coopt_gemm_"))

    # 1. render every (shape, point) and compile them in parallel
    plan = []
    for shape in shapes:
        region = make_region(*shape)
        for i, params in enumerate(select_points(region, args)):
            path = work_dir / f"{region.name}__{i}.py"
            path.write_text(family.render(region, params))
            plan.append((shape, params, str(path)))
    started = time.time()
    print(f"compiling {len(plan)} kernels in {args.jobs} processes ...", flush=True)
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        warm_errors = list(pool.map(_warm, [(path, shape) for shape, _, path in plan]))
    print(f"compiled in {time.time() - started:.0f} s", flush=True)

    # 2. per shape: references, then every point (checked, then timed)
    rows = []
    for shape in shapes:
        region = make_region(*shape)
        m, n, k, epilogue = shape
        inputs = make_inputs(region)
        flop, traffic = 2 * m * n * k, traffic_bytes(region)
        with torch.no_grad():
            expected = eager(region, inputs).float()
        scale = expected.abs().max().item()

        def report(name, ms, err=None, extra=""):
            tflops, gbs = flop / ms / 1e9, traffic / ms / 1e6
            rows.append({"shape": shape, "point": name, "ms": ms, "tflops": tflops, "gbs": gbs, "err": err})
            err_text = "" if err is None else f"  err {err:.1e}"
            print(f"  {name:58s} {ms:8.4f} ms {tflops:7.1f} TFLOP/s {gbs:7.0f} GB/s{err_text}{extra}", flush=True)

        print(f"\n{m}x{n}x{k} {epilogue} (bf16): {flop / 1e12:.3f} TFLOP, {traffic / 1e6:.1f} MB", flush=True)
        cublas_ms = do_bench(lambda: torch.matmul(inputs[0], inputs[1].T), return_mode="median")
        eager_ms = do_bench(lambda: eager(region, inputs), return_mode="median")
        report("cublas (torch.matmul, no epilogue)", cublas_ms)
        report("eager (F.linear + epilogue)", eager_ms)
        results = []
        for (s, params, path), warm_error in zip(plan, warm_errors):
            if s != shape:
                continue
            name = label(params)
            try:
                run = load_module_from_file(path).run
                (out,) = run(*inputs)
                err = (out.float() - expected).abs().max().item() / scale
                if not err < 2e-2:
                    print(f"  {name:58s} WRONG: max rel err {err:.2e}", flush=True)
                    continue
                ms = do_bench(lambda: run(*inputs), return_mode="median")
            except Exception as error:
                print(f"  {name:58s} FAILED: {warm_error or f'{type(error).__name__}: {str(error)[:200]}'}", flush=True)
                continue
            results.append((ms, name, err))
        for ms, name, err in sorted(results):
            report(name, ms, err, f"  {cublas_ms / ms:5.2f}x cublas {eager_ms / ms:5.2f}x eager")
    print(f"\ntotal {time.time() - started:.0f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
