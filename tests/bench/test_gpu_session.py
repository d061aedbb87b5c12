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


def missing_steps(script: str) -> tuple[set[str], set[str]]:
    """(steps the header's `gpu_session.sh NAME` lines offer, those of them the script's step
    dispatch has no case label for: `name)` or `a|b)` at four spaces)."""
    labels = re.findall(r"^    ([a-z0-9][a-z0-9|-]*)\)", script, re.MULTILINE)
    steps = {name for label in labels for name in label.split("|")}
    header = [line for line in script.splitlines() if line.startswith("#")]
    offered = {name for line in header
               for match in re.finditer(r"gpu_session\.sh ([a-z0-9][a-z0-9-]*(?: / [a-z0-9-]+)*)", line)
               for name in match.group(1).split(" / ")}
    return offered, offered - steps


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
def test_the_script_parses():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_every_step_the_header_offers_exists():
    offered, missing = missing_steps(SCRIPT.read_text())
    assert {"gemv-timeline", "window-warps", "fold-b32", "fp8-recent-b32"} <= offered
    assert not missing, sorted(missing)


def test_a_header_line_naming_no_step_is_found():
    script = SCRIPT.read_text().replace("#!/usr/bin/env bash\n", "#!/usr/bin/env bash\n#   bash bench/gpu_session.sh no-such-step\n")
    assert missing_steps(script)[1] == {"no-such-step"}
