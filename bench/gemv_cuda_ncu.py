"""Launch chosen gemv_cuda points once each, for Nsight Compute to read their counters (issue 3).

Session 31's sweep (`bash bench/gpu_session.sh gemv-sweep`) found the CUDA GEMV with an RMSNorm
prologue streaming gate|up ~15 µs slower than the same kernel without it at 16 warps, at every
ring depth, and 1-4 µs slower at 8 warps; the prologue's own work is a read of 8 KB and two
barriers. Timing differences could not say where the time goes; ncu's counters can (DRAM bytes
and throughput, warp stall reasons, occupancy):

    ncu --clock-control none -k regex:coopt_gemv --section SpeedOfLight ... \\
        python bench/gemv_cuda_ncu.py --cases 14336:norm_swiglu:16:2:6:1:0,14336:swiglu:16:2:6:1:0

A case is N:EPILOGUE:WARPS:ROWS:STAGES:BLOCKS:STAGGER on bench/gemm.py's regions (one row, K
4096: EPILOGUE norm, plain, norm_swiglu, swiglu, residual). The cases launch in the order given,
each once, after its output is checked against the eager region (so ncu's N-th kernel is the
N-th case); `gpu_session.sh gemv-ncu` runs it under ncu.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gemm import cuda_point  # noqa: E402

DEFAULT_CASES = ("14336:norm_swiglu:16:2:6:1:0,14336:swiglu:16:2:6:1:0,"
                 "14336:norm_swiglu:8:2:6:1:0,14336:swiglu:8:2:6:1:0,"
                 "128256:norm:16:1:6:1:0,128256:norm:8:2:6:1:1")


def parse_case(text: str) -> tuple[tuple, dict]:
    """'N:EPILOGUE:WARPS:ROWS:STAGES:BLOCKS:STAGGER' -> (gemm.py's shape, the gemv_cuda point)."""
    fields = text.split(":")
    if len(fields) != 7:
        raise ValueError(f"a case is N:EPILOGUE:WARPS:ROWS:STAGES:BLOCKS:STAGGER, got {text!r}")
    n, epilogue, *knobs = fields
    k = 14336 if epilogue == "residual" else 4096
    return (1, int(n), k, epilogue), cuda_point(knobs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT_CASES, help="comma list of N:EPILOGUE:WARPS:ROWS:STAGES:BLOCKS:STAGGER")
    args = parser.parse_args()
    try:
        cases = [parse_case(text) for text in args.cases.split(",")]
    except ValueError as error:
        print(f"bench/gemv_cuda_ncu.py: {error}", file=sys.stderr)
        return 2

    from gemm import announce_gpu, eager, make_inputs, make_region, relative_error

    if not announce_gpu("bench/gemv_cuda_ncu.py"):
        return 2
    import torch

    from coopt.runtime.kernel_loader import load_module_from_source
    from coopt.targets import H200
    from coopt.templates.gemv_cuda import GemvCudaFamily

    family = GemvCudaFamily()
    for i, (shape, point) in enumerate(cases):
        region = make_region(*shape)
        problem = family.check(region, point, H200)
        if problem:
            print(f"case {i} {shape} {point}: {problem}", file=sys.stderr)
            return 2
        module = load_module_from_source(family.render(region, point), Path(f"/tmp/gemv_ncu_{i}"), "gemv")
        inputs = make_inputs(region)
        expected = eager(region, inputs).float()
        with torch.no_grad():
            err = relative_error(module.run(*inputs)[0], expected)  # the one launch ncu profiles
        torch.cuda.synchronize()
        print(f"case {i}: {shape} {point} err {err:.1e}" + ("" if err < 2e-2 else "  WRONG"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
