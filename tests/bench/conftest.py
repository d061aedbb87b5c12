"""The benchmark scripts (bench/*.py) as modules, and a clean environment: they configure the
Llama model file through COOPT_LLAMA_* variables, which must not leak into other tests."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """COOPT_LLAMA_* / COOPT_EXAMPLE_DTYPE unset before a test and restored after it (the
    benchmarks set them with os.environ.update)."""
    names = [n for n in os.environ if n.startswith("COOPT_LLAMA_") or n == "COOPT_EXAMPLE_DTYPE"]
    for name in {*names, "COOPT_LLAMA_PRESET", "COOPT_LLAMA_LAYERS", "COOPT_LLAMA_BATCH", "COOPT_LLAMA_POS",
                 "COOPT_LLAMA_MAX_SEQ", "COOPT_LLAMA_PREFILL", "COOPT_LLAMA_RAGGED", "COOPT_EXAMPLE_DTYPE"}:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def hopper_registers(tmp_path):
    """compile(source) -> registers a thread: the CUDA source compiled for sm_90a by the toolkit's
    nvcc (the probes compile with NVRTC on the GPU machine; this machine may have nvcc instead),
    asserted to compile and not to spill. Skips where no nvcc is installed."""
    if shutil.which("nvcc") is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")

    def compile_source(source: str) -> int:
        path = tmp_path / "kernel.cu"
        path.write_text(source)
        result = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-std=c++17", "-Xptxas", "-v", "-o",
                                 str(tmp_path / "kernel.cubin"), str(path)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr[-2000:]
        assert re.search(r"0 bytes spill stores, 0 bytes spill loads", result.stderr), result.stderr[-2000:]
        return int(re.search(r"Used (\d+) registers", result.stderr).group(1))

    return compile_source
