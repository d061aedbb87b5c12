"""Time verified candidates of one or more regions, one after another, in worker subprocesses.

One at a time because they share one GPU: two candidates timed together would each measure the
other's load. In a subprocess because a bad kernel may segfault, hang, or leave the CUDA context
unusable; the caller only ever sees an error entry.

A worker start costs seconds on a GPU machine (torch import, CUDA init), so one worker times the
whole batch (every region of a build) and reports each as it finishes (protocol: worker.py). When
a candidate hangs past its timeout or kills the worker, that candidate gets the error, the
worker's process group is killed, and a fresh worker takes the candidates not yet reported. The
worker also exits after any candidate error (the CUDA context may be poisoned), so each failure
followed by more candidates costs one restart.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import coopt
from coopt.ir.region import RegionSummary
from coopt.tune.db import TuningDB, TuningKey
from coopt.tune.inputs import resolve_dims
from coopt.tune.measurement import Measurement

__all__ = ["Measurement", "TimingJob", "gpu_available", "measure_candidates", "measure_jobs", "time_in_workers"]

# Last lines of a dead worker's stderr worth quoting in its error (the Python traceback's last line
# or the fatal signal message).
_STDERR_TAIL_CHARS = 300
# Extra time a fresh worker gets to say it is ready (torch import and CUDA init happen then),
# on top of the per-candidate timeout.
STARTUP_ALLOWANCE_S = 30.0
# How long a worker that reported everything may take to exit before its group is killed.
_EXIT_GRACE_S = 5.0


def gpu_available() -> bool:
    """Whether this process sees a CUDA GPU (without one, callers report "unmeasured")."""
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class TimingJob:
    """One region's candidates to time: label -> module path, at `dims` (default: example dims).
    Labels in `inductor_labels` are timed through torch.compile (the comparison point)."""

    region: RegionSummary
    module_paths: dict[str, Path]
    dims: dict[str, int] | None = None
    inductor_labels: frozenset[str] = frozenset()


def measure_candidates(
    region: RegionSummary,
    module_paths: dict[str, Path],
    dims: dict[str, int] | None = None,
    *,
    inductor_labels: frozenset[str] = frozenset(),
    **options,
) -> dict[str, Measurement]:
    """Time each candidate module (label -> path) of one region; see `measure_jobs`.

    >>> measure_candidates(region, {"c0": Path("out/kernels/r0__c0.py")})    # doctest: +SKIP
    {'c0': Measurement(median_ms=0.041, p20_ms=0.040, p80_ms=0.043, error=None, ...)}
    """
    return measure_jobs([TimingJob(region, module_paths, dims, inductor_labels)], **options)[0]


def measure_jobs(
    jobs: list[TimingJob],
    *,
    timeout_s: float = 60,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    allow_cpu: bool = False,
    db: TuningDB | None = None,
    cuda_graph: bool = False,
) -> list[dict[str, Measurement]]:
    """Time the candidates of several regions, all in one worker process while none fails.

    One worker for the whole batch because its start (torch import, CUDA init) costs seconds, a
    build has tens of regions, and most candidates take well under a second to time.
    Returns, per job, {label: Measurement}; a candidate that crashes, hangs past `timeout_s`
    (each candidate's own limit, see `time_in_workers`) or raises gets a Measurement with `error`.
    Without CUDA returns empty dicts (the caller marks "unmeasured"), unless `allow_cpu`, a
    test-only path that times host wall clock instead of GPU events.
    With `db`, cached measurements are reused and new successful ones stored (never for inductor
    labels: same file as the reference, other compiler).
    With `cuda_graph`, candidates are timed replayed in a CUDA graph (GPU time, no launch cost):
    the right measure for a step the runtime replays as a graph.
    """
    on_gpu = gpu_available()
    if not on_gpu and not allow_cpu:
        return [{} for _ in jobs]
    device = _device_name(on_gpu) if db is not None else ""
    results: list[dict[str, Measurement]] = [{} for _ in jobs]
    pending: dict[str, tuple[int, str, TuningKey | None, dict]] = {}  # worker key -> (job, label, db key, floors)
    to_time: dict[str, dict] = {}
    for index, job in enumerate(jobs):
        dims = resolve_dims(job.region, job.dims)
        floors = {"bytes_moved": job.region.bytes_moved(dims), "flops": job.region.flops(dims)}
        region_json = job.region.to_json()
        for label, path in job.module_paths.items():
            inductor = label in job.inductor_labels
            key = TuningKey.for_candidate(path, job.region, dims, device + (":graph" if cuda_graph else "")) \
                if db is not None and not inductor else None
            cached = db.get(key) if key is not None else None
            if cached is not None:
                results[index][label] = cached
                continue
            worker_key = f"{index}:{label}"
            pending[worker_key] = (index, label, key, floors)
            to_time[worker_key] = {"module": str(Path(path).resolve()), "region": region_json, "dims": dims, "inductor": inductor}
    if to_time:
        request = {"warmup_ms": warmup_ms, "rep_ms": rep_ms, "seed": 0, "allow_cpu": allow_cpu, "cuda_graph": cuda_graph}
        outcomes = time_in_workers(request, to_time, timeout_s)
        for worker_key, (index, label, key, floors) in pending.items():
            outcome = outcomes[worker_key]
            if "error" in outcome:
                measurement = Measurement.failed(outcome["error"], **floors)
            else:
                measurement = Measurement(
                    median_ms=outcome["median_ms"], p20_ms=outcome["p20_ms"], p80_ms=outcome["p80_ms"],
                    device=outcome.get("device", ""), method=outcome.get("method", ""), **floors,
                )
            if key is not None:
                db.put(key, measurement)
            results[index][label] = measurement
    return [{label: results[i][label] for label in job.module_paths} for i, job in enumerate(jobs)]


def time_in_workers(request: dict, candidates: dict, timeout_s: float) -> dict[str, dict]:
    """Time `candidates` (label -> module path, or label -> per-candidate request fields, see
    worker.py) in as few worker processes as failures allow.

    `request` is the worker request without "candidates". Returns {label: the worker's result
    dict, or {"error": one line}} for every label. `timeout_s` applies to each candidate, counted
    from the previous result line, or from the worker's "ready" line for the first one; start-up
    itself gets `timeout_s + STARTUP_ALLOWANCE_S`. A worker that fails during start-up (nothing
    candidate-specific ran yet) fails all remaining candidates with that one error.
    """
    outcomes: dict[str, dict] = {}
    while len(outcomes) < len(candidates):
        pending = {label: path for label, path in candidates.items() if label not in outcomes}
        reported = _run_one_worker({**request, "candidates": pending}, timeout_s)
        assert reported and set(reported) <= set(pending), "each worker run must settle a candidate"
        outcomes.update(reported)
    return {label: outcomes[label] for label in candidates}


def _run_one_worker(request: dict, timeout_s: float) -> dict[str, dict]:
    """Start one worker on request["candidates"]; the outcomes it settled (at least one).

    Stops at the first failure: the candidate in progress gets the error (all pending ones when
    the worker never got ready), and the caller starts a fresh worker for what is left.
    """
    labels = list(request["candidates"])
    outcomes: dict[str, dict] = {}
    startup_limit = timeout_s + STARTUP_ALLOWANCE_S
    # The request and stderr go through files, not pipes: neither side can block on a full pipe
    # (a worker stuck before reading its request, a chatty candidate).
    with tempfile.TemporaryFile() as request_file, tempfile.TemporaryFile() as stderr_file:
        request_file.write(json.dumps(request).encode())
        request_file.seek(0)
        proc = _start_worker(request_file, stderr_file)
        ready = False
        reported_all = False  # every candidate reported by the worker itself, none failed

        def fail(error: str) -> None:
            if ready:
                outcomes[labels[len(outcomes)]] = {"error": error}
            else:  # nothing candidate-specific ran yet: a fresh worker would fail the same way
                outcomes.update({label: {"error": error} for label in labels if label not in outcomes})

        try:
            reader = _LineReader(proc.stdout)
            deadline = time.monotonic() + startup_limit
            while len(outcomes) < len(labels):
                timed_out = (f"timed out after {timeout_s:g} s" if ready
                             else f"worker start-up timed out after {startup_limit:g} s")
                try:
                    line = reader.next_line(deadline)
                except TimeoutError:
                    fail(timed_out)
                    break
                if line is None:  # end of stream: the worker is exiting or dead
                    fail(_exit_reason(proc, stderr_file, deadline, timed_out))
                    break
                try:
                    message = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    message = None
                if not isinstance(message, dict):
                    fail(_malformed(line))
                    break
                if message.get("ready") is True and not ready:
                    ready = True
                elif "startup_error" in message and not ready:
                    fail(str(message["startup_error"]))
                    break
                elif message.get("label") == labels[len(outcomes)] and ("error" in message or "median_ms" in message):
                    ready = True
                    result = {k: v for k, v in message.items() if k != "label"}
                    outcomes[message["label"]] = result
                    if "error" in result:
                        break  # the worker exits after an error; a fresh one takes the rest
                else:
                    fail(_malformed(line))
                    break
                deadline = time.monotonic() + timeout_s
            else:
                reported_all = True
        finally:
            _finish(proc, graceful=reported_all)
    return outcomes


def _start_worker(request_file, stderr_file) -> subprocess.Popen:
    """`python -m coopt.tune.worker` in its own process group; its stdout is a pipe to us."""
    env = dict(os.environ)
    # The interpreter would time Python, not the GPU; the worker re-enables it itself when there
    # is no GPU (kernel_loader), so drop any inherited setting.
    env.pop("TRITON_INTERPRET", None)
    # The worker must import this very coopt, installed or not.
    package_root = str(Path(coopt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", "coopt.tune.worker"],
        stdin=request_file, stdout=subprocess.PIPE, stderr=stderr_file,
        env=env,
        start_new_session=True,  # own process group, so a kill also ends its children
    )


class _LineReader:
    """Complete lines from a pipe, each waited for until a deadline (time.monotonic())."""

    def __init__(self, pipe):
        self._fd = pipe.fileno()
        self._buffer = b""
        self._eof = False
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._fd, selectors.EVENT_READ)

    def next_line(self, deadline: float) -> bytes | None:
        """The next line without its newline; None at end of stream (a cut-off last line is
        dropped: the writer died mid-line); raises TimeoutError once `deadline` has passed."""
        while b"\n" not in self._buffer:
            if self._eof:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if self._selector.select(remaining):
                chunk = os.read(self._fd, 1 << 16)
                if chunk:
                    self._buffer += chunk
                else:
                    self._eof = True
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line


def _exit_reason(proc: subprocess.Popen, stderr_file, deadline: float, timed_out: str) -> str:
    """Why a worker closed its result stream before reporting the candidate in progress."""
    try:
        returncode = proc.wait(timeout=max(deadline - time.monotonic(), 0) + _EXIT_GRACE_S)
    except subprocess.TimeoutExpired:
        return timed_out
    stderr = _read_tail(stderr_file)
    if returncode != 0:
        return _describe_death(returncode, stderr)
    return "worker returned no result" + _tail(stderr)


def _finish(proc: subprocess.Popen, graceful: bool) -> None:
    """End the worker: let it exit by itself briefly when it reported everything, else kill it."""
    if graceful and proc.poll() is None:
        try:
            proc.wait(timeout=_EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:  # still ours (not reaped), so its pid names its group only
        _kill_group(proc)
    proc.wait()
    proc.stdout.close()


def _malformed(line: bytes) -> str:
    return f"worker returned a malformed result: {line.decode(errors='replace')[:200]}"


def _read_tail(stderr_file) -> str:
    stderr_file.seek(0, os.SEEK_END)
    size = stderr_file.tell()
    stderr_file.seek(max(0, size - 8192))
    return stderr_file.read().decode(errors="replace")


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
