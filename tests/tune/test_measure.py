"""The timing worker protocol, on CPU (allow_cpu): success, crash, hang, exception, cache.

Each worker is a fresh Python that imports torch (~2 s here), so the failure modes share one
module-scoped measurement call instead of one call each.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tune_helpers import ADD, add_region, write_module

from coopt.tune import measure
from coopt.tune.db import TuningDB
from coopt.tune.worker import _quantile, bench_on_cpu_for_tests

FAST = dict(warmup_ms=2, rep_ms=5, allow_cpu=True)

FAILING = {
    "exits": """
        import os

        def run(a, b):
            os._exit(3)
    """,
    "segfaults": """
        import ctypes

        def run(a, b):
            ctypes.string_at(0)
    """,
    "raises": """
        def run(a, b):
            raise RuntimeError("boom")
    """,
    "bad_import": """
        import not_a_module_coopt_knows
    """,
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    directory = tmp_path_factory.mktemp("candidates")
    paths = {"ok": write_module(directory, "ok", ADD)}
    paths.update({label: write_module(directory, label, body) for label, body in FAILING.items()})
    return measure.measure_candidates(add_region(), paths, timeout_s=30, **FAST)


def test_success_has_quantiles_and_rates(outcomes):
    timing = outcomes["ok"]
    assert timing.ok and timing.error is None
    assert 0 < timing.p20_ms <= timing.median_ms <= timing.p80_ms
    assert timing.device == "cpu"
    assert timing.bytes_moved == 3 * 4 * 64 * 4  # two inputs and one output of [4, 64] fp32
    assert timing.achieved_gbps == pytest.approx(timing.bytes_moved / timing.median_ms / 1e6)
    assert timing.achieved_tflops is not None


def test_exit_code_is_an_error(outcomes):
    assert outcomes["exits"].error.startswith("worker exited with code 3")
    assert outcomes["exits"].median_ms is None and not outcomes["exits"].ok


def test_segfault_is_an_error(outcomes):
    assert outcomes["segfaults"].error.startswith("worker crashed (SIGSEGV)")


def test_exception_is_an_error(outcomes):
    assert outcomes["raises"].error == "run() raised RuntimeError: boom"


def test_import_failure_is_an_error(outcomes):
    assert outcomes["bad_import"].error.startswith("import failed: ModuleNotFoundError")


def test_errors_keep_the_floors(outcomes):
    assert outcomes["raises"].bytes_moved == outcomes["ok"].bytes_moved


def test_hang_times_out(tmp_path):
    hang = write_module(tmp_path, "hang", """
        import time

        def run(a, b):
            while True:
                time.sleep(1)
    """)
    timing = measure.measure_candidates(add_region(), {"hang": hang}, timeout_s=2, **FAST)["hang"]
    assert timing.error == "timed out after 2 s"


def test_worker_stdout_is_only_the_result(tmp_path):
    # Candidates (and Triton, and C code) may print; the result must still be one JSON line.
    noisy = write_module(tmp_path, "noisy", """
        import os

        def run(a, b):
            print("python noise")
            os.write(1, b"fd noise\\n")
            return (a + b,)
    """)
    request = {"module": str(noisy), "region": add_region().to_json(), "dims": {"B": 4},
               "warmup_ms": 1, "rep_ms": 2, "allow_cpu": True}
    proc = subprocess.run([sys.executable, "-m", "coopt.tune.worker"], input=json.dumps(request),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    assert set(json.loads(lines[0])) == {"median_ms", "p20_ms", "p80_ms", "device"}
    assert "python noise" in proc.stderr and "fd noise" in proc.stderr


def test_no_gpu_returns_empty(tmp_path, monkeypatch):
    monkeypatch.setattr(measure, "gpu_available", lambda: False)
    module = write_module(tmp_path, "ok", ADD)
    assert measure.measure_candidates(add_region(), {"ok": module}) == {}


def test_db_hit_skips_the_worker(tmp_path, monkeypatch):
    module = write_module(tmp_path, "ok", ADD)
    db = TuningDB(tmp_path / "tuning.sqlite")
    first = measure.measure_candidates(add_region(), {"ok": module}, db=db, **FAST)["ok"]
    assert first.ok and len(db) == 1

    def no_worker(request, timeout_s):
        raise AssertionError("a cached measurement was re-timed")

    monkeypatch.setattr(measure, "run_worker", no_worker)
    assert measure.measure_candidates(add_region(), {"ok": module}, db=db, **FAST) == {"ok": first}


def test_cpu_bench_quantiles():
    median, p20, p80 = bench_on_cpu_for_tests(lambda: sum(range(100)), warmup_ms=1, rep_ms=2)
    assert 0 < p20 <= median <= p80
    assert _quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert _quantile([1.0, 2.0, 3.0, 4.0], 0.2) == pytest.approx(1.6)
