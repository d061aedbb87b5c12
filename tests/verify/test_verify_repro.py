"""Repro scripts run on their own, after the output directory has been renamed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from verify_helpers import MUL_ADD_REFERENCE, vector_region, write_module, ODD_TAIL_BUG

import coopt
from coopt.verify.runner import verify_candidate



def _run_script(script: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    root = str(Path(coopt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # From an unrelated working directory: the script must find its modules by itself.
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, cwd=script.anchor, timeout=120)


def test_repro_script_reproduces_after_the_out_dir_is_renamed(tmp_path):
    staging = tmp_path / "out.tmp"
    reference = write_module(staging / "kernels", "ew0__reference", MUL_ADD_REFERENCE)
    candidate = write_module(staging / "kernels", "ew0__c3", ODD_TAIL_BUG)
    result = verify_candidate(vector_region(lo=2), reference, candidate,
                              repro_dir=staging / "verify" / "repro", label="c3")
    assert not result.ok
    assert Path(result.repro) == staging / "verify" / "repro" / "ew0__c3.py"

    final = tmp_path / "out"
    staging.rename(final)  # what the build does once out/ is complete
    script = final / "verify" / "repro" / "ew0__c3.py"
    assert str(staging) not in script.read_text()

    failing = _run_script(script)
    assert failing.returncode == 1, failing.stderr
    assert failing.stdout.strip() == result.failure

    write_module(final / "kernels", "ew0__c3", MUL_ADD_REFERENCE)  # the fix
    fixed = _run_script(script)
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.startswith("passes now: dims n=3, seed 0, magnitude 1")
