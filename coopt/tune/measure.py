"""Time verified candidates of one region, one subprocess per candidate, one at a time.

One at a time because they share one GPU: two candidates timed together would each measure the
other's load. A subprocess each because a bad kernel may segfault, hang, or leave the CUDA context
unusable; the caller only ever sees an error entry.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import coopt
from coopt.ir.region import RegionSummary
from coopt.tune.db import TuningDB, TuningKey
from coopt.tune.inputs import resolve_dims
from coopt.tune.measurement import Measurement

__all__ = ["Measurement", "gpu_available", "measure_candidates", "run_worker"]

# Last lines of a dead worker's stderr worth quoting in its error (the Python traceback's last line
# or the fatal signal message).
_STDERR_TAIL_CHARS = 300


def gpu_available() -> bool:
    """Whether this process sees a CUDA GPU (without one, callers report "unmeasured")."""
    import torch

    return torch.cuda.is_available()


def measure_candidates(
    region: RegionSummary,
    module_paths: dict[str, Path],
    dims: dict[str, int] | None = None,
    *,
    timeout_s: float = 60,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    allow_cpu: bool = False,
    db: TuningDB | None = None,
) -> dict[str, Measurement]:
    """Time each candidate module (label -> path) at `dims` (default: the region's example dims).

    Returns {label: Measurement}; a candidate that crashes, hangs past `timeout_s` or raises gets
    a Measurement with `error` set. Without CUDA returns {} (the caller marks "unmeasured"),
    unless `allow_cpu`, a test-only path that times host wall clock instead of GPU events.
    With `db`, cached measurements are reused and new successful ones stored.

    >>> measure_candidates(region, {"c0": Path("out/kernels/r0__c0.py")})    # doctest: +SKIP
    {'c0': Measurement(median_ms=0.041, p20_ms=0.040, p80_ms=0.043, error=None, ...)}
    """
    on_gpu = gpu_available()
    if not on_gpu and not allow_cpu:
        return {}
    dims = resolve_dims(region, dims)
    floors = {"bytes_moved": region.bytes_moved(dims), "flops": region.flops(dims)}
    device = _device_name(on_gpu) if db is not None else ""
    results: dict[str, Measurement] = {}
    for label, path in module_paths.items():
        key = TuningKey.for_candidate(path, region, dims, device) if db is not None else None
        cached = db.get(key) if key is not None else None
        if cached is not None:
            results[label] = cached
            continue
        request = {
            "module": str(Path(path).resolve()),
            "region": region.to_json(),
            "dims": dims,
            "warmup_ms": warmup_ms,
            "rep_ms": rep_ms,
            "seed": 0,
            "allow_cpu": allow_cpu,
        }
        outcome = run_worker(request, timeout_s)
        if "error" in outcome:
            measurement = Measurement.failed(outcome["error"], **floors)
        else:
            measurement = Measurement(
                median_ms=outcome["median_ms"], p20_ms=outcome["p20_ms"], p80_ms=outcome["p80_ms"],
                device=outcome.get("device", ""), **floors,
            )
        if key is not None:
            db.put(key, measurement)
        results[label] = measurement
    return results


def run_worker(request: dict, timeout_s: float) -> dict:
    """Run `python -m coopt.tune.worker` on `request`; its result dict, or {"error": one line}."""
    env = dict(os.environ)
    # The interpreter would time Python, not the GPU; the worker re-enables it itself when there
    # is no GPU (kernel_loader), so drop any inherited setting.
    env.pop("TRITON_INTERPRET", None)
    # The worker must import this very coopt, installed or not.
    package_root = str(Path(coopt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "coopt.tune.worker"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env, text=True,
        start_new_session=True,  # own process group, so a timeout also ends its children
    )
    try:
        stdout, stderr = proc.communicate(json.dumps(request), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        return {"error": f"timed out after {timeout_s:g} s"}
    if proc.returncode != 0:
        return {"error": _describe_death(proc.returncode, stderr)}
    lines = stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": "worker returned no result" + _tail(stderr)}
    if not isinstance(result, dict) or ("error" not in result and "median_ms" not in result):
        return {"error": f"worker returned a malformed result: {lines[-1][:200]}"}
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group we created for this worker only
    except ProcessLookupError:
        pass


def _describe_death(returncode: int, stderr: str) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"worker crashed ({name})" + _tail(stderr)
    return f"worker exited with code {returncode}" + _tail(stderr)


def _tail(stderr: str) -> str:
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    return f": {lines[-1][:_STDERR_TAIL_CHARS]}" if lines else ""


def _device_name(on_gpu: bool) -> str:
    """Name for cache keys; initialises CUDA in this process, so only called when a db is used."""
    if not on_gpu:
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0)
