"""Differential verification of candidate kernels against their region's reference.

Every candidate module (`run(*inputs) -> tuple`, see docs/contracts.md) is fuzzed with
Hypothesis-generated shapes and values and compared with the region's reference module (eager
PyTorch) at a per-dtype tolerance (`tolerances.py` states the exact rule). Failures are shrunk
and written as runnable repro scripts (`repro.py`). Candidates that may crash or hang are
checked in a worker subprocess (`isolated.py`).

    from coopt.verify import verify_candidate, verify_candidates_isolated
    result = verify_candidate(region, "kernels/r0__reference.py", "kernels/r0__c0.py")
    result.ok, result.failure

Nothing here times anything: latency is coopt/tune's job.

Files, one job each:
    result.py      VerifyResult (JSON-ready)
    tolerances.py  per-dtype tolerances and `compare`
    profiles.py    the "ci" and "thorough" profiles (example counts, dim caps)
    strategies.py  Hypothesis strategies for dims + deterministic input tensors
    check.py       one example: reference (fp64 + native) vs candidate
    runner.py      `verify_candidate`: the Hypothesis search, shrinking, repro
    end_to_end.py  `verify_end_to_end`: the whole built model vs the original
    repro.py       repro scripts for failing candidates
    isolated.py    `verify_candidates_isolated`: a restartable worker subprocess
    worker.py      the worker's side of that protocol
"""

from __future__ import annotations

# Lazy exports: `import coopt.verify.result` (the parent side of the worker protocol) should not
# pay for importing Hypothesis and torch.
_EXPORTS = {
    "VerifyResult": "coopt.verify.result",
    "verify_candidate": "coopt.verify.runner",
    "verify_end_to_end": "coopt.verify.end_to_end",
    "verify_candidates_isolated": "coopt.verify.isolated",
    "VerifyWorker": "coopt.verify.isolated",
    "compare": "coopt.verify.tolerances",
    "Comparison": "coopt.verify.tolerances",
    "TOLERANCES": "coopt.verify.tolerances",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'coopt.verify' has no attribute {name!r}")
