"""Verify candidates that may crash or hang, without risking the build process.

One worker subprocess (`python -m coopt.verify.worker`, protocol in worker.py) checks the
candidates one after another, so torch is imported once per batch, not once per candidate. If
the worker dies (segfault, os._exit, illegal memory access) the candidate gets
"crashed: ..."; if it exceeds `timeout_s` the worker is killed and the candidate gets
"timed out after N s". Either way a fresh worker is started for the remaining candidates.
`VerifyWorker` can also be kept open across regions.

    >>> results = verify_candidates_isolated(
    ...     region, "kernels/r0__reference.py",
    ...     {"c0": "kernels/r0__c0.py", "c1": "kernels/r0__c1.py"},
    ...     timeout_s=300, repro_dir="out/verify/repro")  # doctest: +SKIP
    >>> {label: r.ok for label, r in results.items()}  # doctest: +SKIP
    {'c0': True, 'c1': False}
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import coopt
from coopt.ir.region import RegionSummary
from coopt.verify.result import VerifyResult

DEFAULT_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 180.0  # importing torch + triton on a cold machine
_STDERR_TAIL_BYTES = 4000


def verify_candidates_isolated(
    region: RegionSummary,
    reference_path: str | Path,
    candidate_paths: dict[str, str | Path],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    profile: str | None = None,
    seed: int = 0,
    device: str | None = None,
    repro_dir: str | Path | None = None,
) -> dict[str, VerifyResult]:
    """Verify every candidate in one (restartable) worker; {label: VerifyResult} in input order.

    `timeout_s` bounds each candidate's whole search (all examples and shrinking), not
    counting the worker's start; the other arguments are those of `verify_candidate`.
    """
    with VerifyWorker() as worker:
        return {
            label: worker.verify(region, reference_path, path, label=label, timeout_s=timeout_s,
                                 profile=profile, seed=seed, device=device, repro_dir=repro_dir)
            for label, path in candidate_paths.items()
        }


class VerifyWorker:
    """A worker subprocess that verifies candidates one at a time, restarted when it dies.

        >>> with VerifyWorker() as worker:  # doctest: +SKIP
        ...     worker.verify(region, ref, cand, label="c0", timeout_s=60).ok
        True
    """

    def __init__(self, *, startup_timeout_s: float = STARTUP_TIMEOUT_S):
        self.startup_timeout_s = startup_timeout_s
        self.starts = 0  # how many worker processes were started (tests read it)
        self._process: subprocess.Popen | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr = None

    def __enter__(self) -> "VerifyWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def verify(self, region: RegionSummary, reference_path, candidate_path, *, label: str,
               timeout_s: float = DEFAULT_TIMEOUT_S, profile=None, seed: int = 0,
               device: str | None = None, repro_dir=None) -> VerifyResult:
        """Verify one candidate in the worker (see `verify_candidate` for the arguments)."""
        problem = self._ensure_started()
        if problem is not None:
            return VerifyResult.failed(problem)
        request = {
            "label": label,
            "region": region.to_json(),
            "reference": str(reference_path),
            "candidate": str(candidate_path),
            "profile": profile.to_json() if hasattr(profile, "to_json") else profile,
            "seed": seed,
            "device": device,
            "repro_dir": None if repro_dir is None else str(repro_dir),
        }
        try:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        except OSError:
            pass  # the worker is already dead: the read below reports how it died
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self._kill()
            return VerifyResult.failed(f"timed out after {timeout_s:g} s")
        if line is None:
            return VerifyResult.failed(f"crashed: {self._death_report()}")
        reply = json.loads(line)
        if reply.get("poisoned"):
            self._stop()  # the device context is unusable: the next candidate gets a new one
        return VerifyResult.from_json(reply["result"])

    def close(self) -> None:
        self._stop()

    # -- process management -------------------------------------------------------------

    def _ensure_started(self) -> str | None:
        """Start a worker unless one is alive; a one-line problem if it cannot start."""
        if self._process is not None and self._process.poll() is None:
            return None
        self._discard()
        self._stderr = tempfile.TemporaryFile()
        self._lines = queue.Queue()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "coopt.verify.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            text=True, env=_worker_env(), cwd=os.getcwd(),
        )
        self.starts += 1
        threading.Thread(target=_pump, args=(self._process.stdout, self._lines),
                         daemon=True).start()
        try:
            line = self._lines.get(timeout=self.startup_timeout_s)
        except queue.Empty:
            self._kill()
            return f"verifier worker did not start within {self.startup_timeout_s:g} s"
        if line is None or not json.loads(line).get("ready"):
            return f"verifier worker failed to start: {self._death_report()}"
        return None

    def _death_report(self) -> str:
        code = self._process.wait()
        self._process = None
        how = f"exit code {code}"
        if code < 0:
            try:
                how = f"signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"signal {-code}"
        hint = _stderr_hint(self._stderr)
        return f"worker died with {how}" + (f" ({hint})" if hint else "")

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def _stop(self) -> None:
        """Ask the worker to exit; kill it if it does not."""
        if self._process is not None and self._process.poll() is None:
            try:
                self._process.stdin.write(json.dumps({"exit": True}) + "\n")
                self._process.stdin.close()
                self._process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._kill()
        self._process = None
        self._discard()

    def _discard(self) -> None:
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


def _pump(stream, lines: queue.Queue) -> None:
    """Forward the worker's protocol lines; None marks end of stream (the worker died)."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # The worker must import this very coopt, installed or not.
    root = str(Path(coopt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _stderr_hint(stderr_file) -> str:
    """The most telling line of the worker's stderr tail (faulthandler's, else the last)."""
    if stderr_file is None:
        return ""
    stderr_file.seek(0, os.SEEK_END)
    size = stderr_file.tell()
    stderr_file.seek(max(0, size - _STDERR_TAIL_BYTES))
    lines = [line.strip() for line in
             stderr_file.read().decode(errors="replace").splitlines() if line.strip()]
    for line in lines:
        if line.startswith("Fatal Python error"):
            return line
    return lines[-1][:300] if lines else ""
