"""bench/gpu_session.sh, the steps device calls run: the script parses, and every step its header
offers is one the script has (a step renamed or dropped must leave the header too: a device call
spent on "usage: ..." is ten minutes of a session's thirty)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_session.sh"


def steps() -> set[str]:
    """The case labels of the script's step dispatch (`name)` or `a|b)` at four spaces)."""
    labels = re.findall(r"^    ([a-z0-9][a-z0-9|-]*)\)", SCRIPT.read_text(), re.MULTILINE)
    return {name for label in labels for name in label.split("|")}


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
def test_the_script_parses():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_every_step_the_header_offers_exists():
    header = [line for line in SCRIPT.read_text().splitlines() if line.startswith("#")]
    offered = {name for line in header
               for match in re.finditer(r"gpu_session\.sh ([a-z0-9][a-z0-9-]*(?: / [a-z0-9-]+)*)", line)
               for name in match.group(1).split(" / ")}
    assert {"gemv-timeline", "window-warps", "fp8-recent-b32"} <= offered  # (the pattern still reads the header)
    assert offered <= steps(), sorted(offered - steps())
    # (sabotage: a header line naming a step that does not exist is caught)
    assert "no-such-step" not in steps()
