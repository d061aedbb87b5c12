"""Time candidate modules in this process: `python -m coopt.tune.worker < request.json`.

Run by `coopt.tune.measure` in a subprocess, so a kernel that crashes the process, hangs, or
corrupts the CUDA context costs one error entry and never the caller.

Batch request (JSON on stdin), one region:
    {"candidates": {label: path, ...}, "region": RegionSummary.to_json(), "dims": {name: int},
     "warmup_ms": 25, "rep_ms": 100, "seed": 0, "allow_cpu": false, "inductor_labels": [label]}
or several regions (what `measure.measure_jobs` sends), each candidate with its own fields:
    {"candidates": {label: {"module": path, "region": ..., "dims": ..., "inductor": bool}, ...},
     "warmup_ms": 25, "rep_ms": 100, "seed": 0, "allow_cpu": false}
Result stream (stdout), one JSON line each, flushed as soon as it is known:
    {"ready": true}                      start-up (torch import, CUDA init) is done
    {"startup_error": "one line"}        start-up failed; nothing was timed (the worker exits)
    {"label": l, "median_ms": f, "p20_ms": f, "p80_ms": f, "device": name, "method": m}
        (method: "events" = do_bench with L2 flushes, "cuda-graph" = replayed graph, GPU time
        only, asked for with "cuda_graph": true; "cpu-wall" = the test-only CPU path)
    {"label": l, "error": "one line"}    the worker exits right after this line
The candidates are timed one after another in the order given. After any candidate error the
worker exits: a failed launch can leave the CUDA context unusable for everything after it, so
the parent starts a fresh worker for the rest. A line that never comes means the candidate in
progress hung or killed the process.

Single request (the original protocol, still accepted): {"module": path, ...the rest as above}
gives exactly one line, {"median_ms": ..., "device": ...} or {"error": "one line"}.

Everything the candidate (or Triton, or C code) prints goes to stderr: file descriptor 1 is
pointed at stderr before any candidate is imported, and results go to a saved copy of it.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import traceback

from coopt.ir.region import RegionSummary
from coopt.tune.inputs import make_input_sets, rotation_count


def main() -> int:
    request = json.loads(sys.stdin.read())
    sys.stdout.flush()
    result_stream = os.fdopen(os.dup(1), "w")  # os.dup: not inherited by the candidate's children
    os.dup2(2, 1)  # stray prints from the candidate must not corrupt the JSON results
    if "candidates" in request:
        return time_batch(request, result_stream)
    _emit(result_stream, _time_guarded(request))
    return 0


def time_batch(request: dict, result_stream) -> int:
    """Time request["candidates"] in order, one result line each; exit after the first error."""
    problem = start_up(request)
    if problem is not None:
        _emit(result_stream, {"startup_error": problem})
        return 0
    _emit(result_stream, {"ready": True})
    for label, spec in request["candidates"].items():
        if isinstance(spec, dict):  # per-candidate fields: a batch spanning several regions
            job = {**request, **spec}
        else:
            job = {**request, "module": spec, "inductor": label in request.get("inductor_labels", ())}
        result = _time_guarded(job)
        _emit(result_stream, {"label": label, **result})
        if "error" in result:
            # The CUDA context may be poisoned (an illegal address is sticky), so nothing more is
            # timed here. os._exit: interpreter teardown could hang on a broken context.
            sys.stderr.flush()
            os._exit(0)
    return 0


def start_up(request: dict) -> str | None:
    """Import torch, initialise CUDA, import Triton's timer: the per-process cost paid once.

    Returns None, or a one-line reason that applies to every candidate of the batch.
    """
    try:
        import torch

        from coopt.runtime.kernel_loader import use_interpreter_without_gpu

        on_gpu = torch.cuda.is_available()
        if not on_gpu and not request.get("allow_cpu", False):
            return "no CUDA device in the timing worker"
        use_interpreter_without_gpu()  # before Triton sees any kernel
        if on_gpu:
            torch.cuda.init()
            torch.cuda.get_device_name()
            import triton.testing  # noqa: F401  (do_bench; importing Triton is seconds)
    except Exception as exc:
        traceback.print_exc()
        return f"worker start-up failed: {_one_line(exc)}"
    return None


def _time_guarded(request: dict) -> dict:
    try:
        return time_candidate(request)
    except Exception as exc:  # anything not already classified: report it, don't crash
        traceback.print_exc()
        return {"error": f"worker failed: {_one_line(exc)}"}


def _emit(result_stream, result: dict) -> None:
    result_stream.write(json.dumps(result) + "\n")
    result_stream.flush()


def time_candidate(request: dict) -> dict:
    """Load the module, make inputs, warm up (first call compiles), then time; see module doc."""
    import torch

    from coopt.runtime.kernel_loader import load_module_from_file

    region = RegionSummary.from_json(request["region"])
    dims = request["dims"]
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not request.get("allow_cpu", False):
        return {"error": "no CUDA device in the timing worker"}
    device = "cuda" if on_gpu else "cpu"

    try:
        module = load_module_from_file(request["module"])
        run = module.run
        if request.get("inductor"):
            # the comparison point: the same ops compiled by torch.compile (inductor)
            run = torch.compile(run, dynamic=False)
    except Exception as exc:
        traceback.print_exc()
        return {"error": f"import failed: {_one_line(exc)}"}

    n_sets = rotation_count(region, dims)
    input_sets = make_input_sets(region, dims, n_sets, device=device, seed=request.get("seed", 0))
    rotation = itertools.cycle(input_sets)

    def call_next_set():
        return run(*next(rotation))

    warmup_ms, rep_ms = request.get("warmup_ms", 25), request.get("rep_ms", 100)
    with torch.inference_mode():
        try:
            for inputs in input_sets:  # first call per set compiles / autotunes; keep it untimed
                run(*inputs)
            if on_gpu:
                torch.cuda.synchronize()  # surfaces asynchronous launch errors here, not in timing
        except Exception as exc:
            traceback.print_exc()
            return {"error": f"run() raised {_one_line(exc)}"}
        method = "events"
        if on_gpu and request.get("cuda_graph"):
            timed = bench_in_cuda_graph(call_next_set, rep_ms)
            if timed is not None:
                (median, p20, p80), method = timed, "cuda-graph"
        if on_gpu and method == "events":
            median, p20, p80 = bench_on_gpu(call_next_set, warmup_ms, rep_ms)
        elif not on_gpu:
            median, p20, p80 = bench_on_cpu_for_tests(call_next_set, warmup_ms, rep_ms)
            method = "cpu-wall"
        name = torch.cuda.get_device_name() if on_gpu else "cpu"
    return {"median_ms": median, "p20_ms": p20, "p80_ms": p80, "device": name, "method": method}


def bench_on_gpu(fn, warmup_ms: float, rep_ms: float) -> tuple[float, float, float]:
    """(median, p20, p80) in ms via triton.testing.do_bench: CUDA events, L2 flushed per run.

    `quantiles=` is used rather than `return_mode="median"` because it yields all three numbers
    from one run; both exist with the same meaning in Triton 3.6 and 3.9.
    """
    from triton.testing import do_bench

    median, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return float(median), float(p20), float(p80)


def bench_in_cuda_graph(fn, rep_ms: float) -> tuple[float, float, float] | None:
    """(median, p20, p80) in ms of GPU time per call, replayed as a CUDA graph; None when `fn`
    cannot be captured (a host sync, a CPU-side op), so the caller falls back to events.

    For builds whose step is replayed as a graph (decoders with a KV cache): there the CPU
    launch cost of a call is not on the GPU timeline, and a plain event timing of a 5 µs kernel
    behind 20 µs of Python launch would measure Python. The rotation of input sets is captured
    into the graph as it is called, so consecutive calls still read different buffers.
    """
    import torch
    from triton.testing import do_bench_cudagraph

    try:
        times = do_bench_cudagraph(fn, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    except Exception:  # capture refused (sync, allocation on the host): time without a graph
        traceback.print_exc()
        torch.cuda.synchronize()
        return None
    median, p20, p80 = (float(t) for t in times)
    return median, p20, p80


def bench_on_cpu_for_tests(fn, warmup_ms: float, rep_ms: float) -> tuple[float, float, float]:
    """(median, p20, p80) in ms of host wall time per call: NOT a GPU measurement.

    Only for tests and CPU smoke runs (`allow_cpu=True`), so the subprocess protocol can be
    exercised without a GPU. Mirrors do_bench's shape: estimate, warm up for warmup_ms, then
    time individual calls for about rep_ms.
    """
    start = time.perf_counter()
    for _ in range(3):
        fn()
    estimate_ms = max((time.perf_counter() - start) * 1e3 / 3, 1e-6)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    times_ms = []
    for _ in range(max(5, min(10_000, int(rep_ms / estimate_ms)))):
        t0 = time.perf_counter()
        fn()
        times_ms.append((time.perf_counter() - t0) * 1e3)
    times_ms.sort()
    return _quantile(times_ms, 0.5), _quantile(times_ms, 0.2), _quantile(times_ms, 0.8)


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile, as torch.quantile computes it."""
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


if __name__ == "__main__":
    sys.exit(main())
