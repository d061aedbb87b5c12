"""Crashing and hanging candidates fail alone; the rest of the batch is still verified."""

from __future__ import annotations

from verify_helpers import MUL_ADD_REFERENCE, vector_region, write_module, ODD_TAIL_BUG

from coopt.verify.isolated import VerifyWorker, verify_candidates_isolated

SEGFAULT = """
    import ctypes

    def run(x, y):
        return (ctypes.string_at(0),)
"""

EXITS = """
    import os

    def run(x, y):
        os._exit(3)
"""

HANGS = """
    import time

    def run(x, y):
        print("this must not corrupt the worker protocol")
        while True:
            time.sleep(0.1)
"""

RAISES = """
    def run(x, y):
        raise RuntimeError("illegal launch")
"""



def test_batch_survives_crashes_and_hangs(tmp_path, mul_add_reference):
    kernels = tmp_path / "kernels"
    sources = {"c0": MUL_ADD_REFERENCE, "c1": SEGFAULT, "c2": ODD_TAIL_BUG, "c3": EXITS,
               "c4": HANGS, "c5": RAISES, "c6": MUL_ADD_REFERENCE}
    paths = {label: write_module(kernels, f"ew0__{label}", src) for label, src in sources.items()}
    results = verify_candidates_isolated(vector_region(lo=2), mul_add_reference, paths,
                                         timeout_s=4, repro_dir=tmp_path / "repro")

    assert list(results) == list(sources)
    assert results["c0"].ok and results["c6"].ok
    assert results["c1"].failure.startswith("crashed: worker died with signal SIGSEGV")
    assert "Fatal Python error: Segmentation fault" in results["c1"].failure
    assert "[dims n=3, seed 0, magnitude 1]" in results["c2"].failure
    assert (tmp_path / "repro" / "ew0__c2.py").exists()
    assert results["c3"].failure == "crashed: worker died with exit code 3"
    assert results["c4"].failure == "timed out after 4 s"
    assert results["c5"].failure.startswith("candidate raised RuntimeError: illegal launch")


def test_one_worker_serves_many_candidates_and_regions(tmp_path, mul_add_reference):
    good = write_module(tmp_path / "kernels", "good", MUL_ADD_REFERENCE)
    with VerifyWorker() as worker:
        for region in (vector_region(), vector_region("bfloat16"), vector_region(lo=2)):
            result = worker.verify(region, mul_add_reference, good, label="c0", timeout_s=60)
            assert result.ok, result.failure
        assert worker.starts == 1
