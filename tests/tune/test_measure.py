"""The timing worker protocol, on CPU (allow_cpu): success, crash, hang, exception, cache,
and batches: one worker per region, restarted only after a failure.

Each worker is a fresh Python that imports torch (~1-2 s here), so the failure modes share one
module-scoped measurement call instead of one call each.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
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
    assert set(json.loads(lines[0])) == {"median_ms", "p20_ms", "p80_ms", "device", "method"}
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

    def no_worker(request, candidates, timeout_s):
        raise AssertionError("a cached measurement was re-timed")

    monkeypatch.setattr(measure, "time_in_workers", no_worker)
    assert measure.measure_candidates(add_region(), {"ok": module}, db=db, **FAST) == {"ok": first}


def test_cpu_bench_quantiles():
    median, p20, p80 = bench_on_cpu_for_tests(lambda: sum(range(100)), warmup_ms=1, rep_ms=2)
    assert 0 < p20 <= median <= p80
    assert _quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert _quantile([1.0, 2.0, 3.0, 4.0], 0.2) == pytest.approx(1.6)


# Every module of the batch test appends "label pid" to a file when imported, so the test can see
# which candidates shared a worker process.
RECORDS_PID = """
    import os

    with open({pids!r}, "a") as _f:
        _f.write("{label} %d\\n" % os.getpid())
"""

BATCH = {
    "good0": ADD,
    "good1": ADD,
    "hang": """
        import time

        def run(a, b):
            while True:
                time.sleep(1)
    """,
    "good2": ADD,
    "crash": """
        import os

        def run(a, b):
            os._exit(3)
    """,
    "good3": ADD,
    "raises": """
        def run(a, b):
            raise RuntimeError("boom")
    """,
    "good4": ADD,
}


def test_batch_restarts_a_worker_only_after_a_failure(tmp_path, monkeypatch):
    pids_file = tmp_path / "pids"
    paths = {
        label: write_module(tmp_path, label, RECORDS_PID.format(pids=str(pids_file), label=label) + body)
        for label, body in BATCH.items()
    }
    starts = []
    start_worker = measure._start_worker

    def counting_start(*args, **kwargs):
        starts.append(1)
        return start_worker(*args, **kwargs)

    monkeypatch.setattr(measure, "_start_worker", counting_start)
    outcomes = measure.measure_candidates(add_region(), paths, timeout_s=3, **FAST)

    assert list(outcomes) == list(BATCH)
    goods = [label for label in BATCH if label.startswith("good")]
    assert all(outcomes[label].ok for label in goods), {label: outcomes[label].error for label in goods}
    assert outcomes["hang"].error == "timed out after 3 s"
    assert outcomes["crash"].error.startswith("worker exited with code 3")
    assert outcomes["raises"].error == "run() raised RuntimeError: boom"

    failures = sum(not timing.ok for timing in outcomes.values())
    assert failures == 3 and len(starts) == 1 + failures
    pid = dict(line.split() for line in pids_file.read_text().splitlines())
    assert pid["good0"] == pid["good1"] == pid["hang"]  # no failure between them: one process
    assert pid["good2"] == pid["crash"]
    assert pid["good3"] == pid["raises"]
    assert len({pid["good0"], pid["good2"], pid["good3"], pid["good4"]}) == 4


def test_worker_batch_stream_is_one_line_per_candidate(tmp_path):
    noisy = write_module(tmp_path, "noisy", """
        def run(a, b):
            print("python noise")
            return (a + b,)
    """)
    raises = write_module(tmp_path, "raises", FAILING["raises"])
    request = {"candidates": {"a": str(noisy), "b": str(noisy), "c": str(raises), "d": str(noisy)},
               "region": add_region().to_json(), "dims": {"B": 4}, "warmup_ms": 1, "rep_ms": 2,
               "allow_cpu": True}
    proc = subprocess.run([sys.executable, "-m", "coopt.tune.worker"], input=json.dumps(request),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[0] == {"ready": True}
    assert [line["label"] for line in lines[1:]] == ["a", "b", "c"]  # exits after c's error
    assert set(lines[1]) == {"label", "median_ms", "p20_ms", "p80_ms", "device", "method"}
    assert lines[1]["method"] == "cpu-wall"
    assert lines[3] == {"label": "c", "error": "run() raised RuntimeError: boom"}
    assert "python noise" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_startup_failure_fails_the_whole_batch_in_one_worker(tmp_path, monkeypatch):
    module = write_module(tmp_path, "ok", ADD)
    starts = []
    start_worker = measure._start_worker
    monkeypatch.setattr(measure, "_start_worker", lambda *a: starts.append(1) or start_worker(*a))
    request = {"region": add_region().to_json(), "dims": {"B": 4}, "allow_cpu": False}
    outcomes = measure.time_in_workers(request, {"x": str(module), "y": str(module)}, timeout_s=30)
    assert outcomes == {"x": {"error": "no CUDA device in the timing worker"},
                        "y": {"error": "no CUDA device in the timing worker"}}
    assert len(starts) == 1


def test_inductor_label_times_the_same_file_through_torch_compile(tmp_path):
    """The torch.compile comparison point: same module, compiled, and never cached under the
    reference's key."""
    path = write_module(tmp_path, "ref", ADD)
    db = TuningDB(tmp_path / "tuning.sqlite")
    results = measure.measure_candidates(
        add_region(), {"reference": path, "torch.compile": path}, allow_cpu=True, timeout_s=120,
        warmup_ms=1, rep_ms=5, db=db, inductor_labels=frozenset({"torch.compile"}),
    )
    assert results["reference"].ok and results["torch.compile"].ok, results
    assert len(db) == 1  # only the plain reference was stored


def test_jobs_of_several_regions_share_one_worker_and_keep_their_own_dims(tmp_path, monkeypatch):
    """A build times every region in one worker; each candidate still runs at its own region's
    dims (the byte floors differ), and results come back per job under the original labels."""
    path = write_module(tmp_path, "ok", ADD)
    starts = []
    start_worker = measure._start_worker
    monkeypatch.setattr(measure, "_start_worker", lambda *a: starts.append(1) or start_worker(*a))
    jobs = [
        measure.TimingJob(add_region("r0"), {"c0": path}, {"B": 4}),
        measure.TimingJob(add_region("r1"), {"c0": path, "c1": path}, {"B": 16}),
    ]
    results = measure.measure_jobs(jobs, timeout_s=60, **FAST)
    assert [sorted(r) for r in results] == [["c0"], ["c0", "c1"]]
    assert all(m.ok for r in results for m in r.values())
    assert results[0]["c0"].bytes_moved == 3 * 4 * 64 * 4
    assert results[1]["c1"].bytes_moved == 3 * 16 * 64 * 4
    assert len(starts) == 1
