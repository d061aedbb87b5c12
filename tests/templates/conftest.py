"""Shared fixtures for template tests.

- `load_candidate(source, stem)`: import a rendered candidate (Triton's interpreter without a GPU).
- `assert_close(actual, expected)`: compare at the tolerance of `actual`'s dtype. Under the
  interpreter fp32 -> bf16 truncates (docs: /work/shared/TRITON-INTERPRETER.md), so bf16 is
  compared at one bf16 ulp, never bit-exact.
- `compile_for_sm90(jobs)`: compile the kernel each candidate's `run(*inputs)` would launch for
  sm_90 (Hopper) without a GPU, in a fresh process (this file is also that process's script):
  catches what only the real compiler rejects (loop-carried type changes, bad constexpr use) and
  the interpreter happily runs.
- `golden(name, text)`: compare `text` with tests/templates/golden/<name>; COOPT_UPDATE_GOLDEN=1
  rewrites the file instead.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coopt.runtime.kernel_loader import load_module_from_source

GOLDEN_DIR = Path(__file__).parent / "golden"

# dtype -> (rtol, atol)
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}

_TRITON_TYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.bool: "i1",
                torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}


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
        torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)

    return check


class _LaunchRecorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records instead of launching."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _signature(kernel, args, kwargs):
    bound = dict(zip(kernel.arg_names, args)) | kwargs
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TRITON_TYPE[value.dtype]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
    return signature, constexprs


def _compile_one(path: str, inputs, kernel_name: str) -> None:
    """Import the candidate, record the launch `run(*inputs)` makes, compile that for sm_90."""
    import triton.compiler
    from triton.backends.compiler import GPUTarget

    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    kernel, recorder = getattr(module, kernel_name), _LaunchRecorder()
    setattr(module, kernel_name, recorder)
    module.run(*inputs)
    ((args, kwargs),) = recorder.launches
    num_warps = kwargs.pop("num_warps")
    signature, constexprs = _signature(kernel, args, kwargs)
    compiled = triton.compiler.compile(
        triton.compiler.ASTSource(kernel, signature, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps},
    )
    assert compiled.asm.get("cubin"), "ptxas produced no cubin"


def _compile_worker(jobs_file: str) -> int:
    """`python conftest.py JOBS`: compile every job, print one line per failure."""
    failures = 0
    for path, inputs, kernel_name in torch.load(jobs_file):
        try:
            _compile_one(path, inputs, kernel_name)
        except Exception as error:  # report every kernel, not just the first
            failures += 1
            print(f"{Path(path).name}: {type(error).__name__}: {error}")
    return 1 if failures else 0


@pytest.fixture
def compile_for_sm90(tmp_path):
    """compile_for_sm90([(label, source, inputs, kernel_name), ...]) compiles all in one process.

    Fresh process because triton.language's own @jit helpers (tl.max, tl.sum, ...) are built for
    either the interpreter or the compiler when triton is imported: once the interpreter has run
    here, the real front end fails on them.
    """
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the kernels are compiled for real when they run")
    pytest.importorskip("triton.backends.compiler")

    def compile_all(jobs) -> None:
        records = []
        for label, source, inputs, kernel_name in jobs:
            path = tmp_path / f"{label}.py"
            path.write_text(source)
            records.append((str(path), list(inputs), kernel_name))
        torch.save(records, tmp_path / "jobs.pt")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")  # a cache hit would skip the front end
        result = subprocess.run([sys.executable, __file__, str(tmp_path / "jobs.pt")], env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"sm_90 compilation failed:\n{result.stdout}\n{result.stderr[-3000:]}"

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


if __name__ == "__main__":
    sys.exit(_compile_worker(sys.argv[1]))
