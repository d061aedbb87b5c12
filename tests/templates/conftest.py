"""Shared fixtures for template tests.

- `load_candidate(source, stem)`: import a rendered candidate (Triton's interpreter without a GPU).
- `assert_close(actual, expected)`: compare at the tolerance of `actual`'s dtype. Under the
  interpreter fp32 -> bf16 truncates (docs: /work/shared/TRITON-INTERPRETER.md), so bf16 is
  compared at one bf16 ulp, never bit-exact.
- `compile_for_sm90(jobs)`: compile the kernel each candidate's `run(*inputs)` would launch for
  sm_90 (Hopper) without a GPU, through template_helpers.compile_for_hopper (a fresh process):
  catches what only the real compiler rejects (loop-carried type changes, bad constexpr use) and
  the interpreter happily runs.
- `golden(name, text)`: compare `text` with tests/templates/golden/<name>; COOPT_UPDATE_GOLDEN=1
  rewrites the file instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from template_helpers import compile_for_hopper

from coopt.runtime.kernel_loader import load_module_from_source

GOLDEN_DIR = Path(__file__).parent / "golden"

# dtype -> (rtol, atol)
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}

@pytest.fixture
def load_candidate(tmp_path):
    def load(source: str, stem: str = "candidate"):
        return load_module_from_source(source, tmp_path, stem)

    return load


@pytest.fixture
def assert_close():
    def check(actual: torch.Tensor, expected: torch.Tensor):
        rtol, atol = TOLERANCE[actual.dtype]
        assert actual.shape == expected.shape
        torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), rtol=rtol, atol=atol)

    return check


@pytest.fixture
def compile_for_sm90(tmp_path):
    """compile_for_sm90([(label, source, inputs, kernel_name), ...]) compiles all in one process.

    The work is template_helpers.compile_for_hopper's (a fresh process: see there); each job's
    run(*inputs) must launch kernel_name once, and nothing else.
    """
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the kernels are compiled for real when they run")
    pytest.importorskip("triton.backends.compiler")

    def compile_all(jobs) -> None:
        compiled = compile_for_hopper([(label, source, inputs) for label, source, inputs, _ in jobs], tmp_path)
        for label, _, _, kernel_name in jobs:
            assert {name: facts["launches"] for name, facts in compiled[label].items()} == {kernel_name: 1}, label
            # every template launches with programmatic dependent launch on sm_90 (triton/_pdl.j2)
            assert all(facts["pdl"] for facts in compiled[label].values()), f"{label}: launched without PDL"

    return compile_all


@pytest.fixture
def golden():
    def check(name: str, text: str):
        path = GOLDEN_DIR / name
        if os.environ.get("COOPT_UPDATE_GOLDEN") == "1":
            path.write_text(text)
            return
        assert path.exists(), f"{path} is missing: run with COOPT_UPDATE_GOLDEN=1 to write it"
        assert text == path.read_text(), (
            f"rendering differs from {path}; if the change is intended, rerun with COOPT_UPDATE_GOLDEN=1"
        )

    return check
