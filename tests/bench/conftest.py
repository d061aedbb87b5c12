"""The benchmark scripts (bench/*.py) as modules, and a clean environment: they configure the
Llama model file through COOPT_LLAMA_* variables, which must not leak into other tests."""

from __future__ import annotations

import os
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
