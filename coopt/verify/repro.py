"""Repro scripts for failing candidates: `repro_dir/<region>__<label>.py`.

The script holds the region summary and the failing example (dims, seed, magnitude) as data
and finds the reference and candidate module files by paths relative to its own location: out/
is written in a temporary directory and renamed, so absolute paths would break. It rebuilds the
exact inputs and applies the same rule as the build (`replay` below), prints the error and
exits 1 while the candidate still fails, 0 once it passes. It needs coopt importable.

    $ python out/verify/repro/r0__c1.py        # optional argument: device ("cpu", "cuda")
    output 0: max abs err 1.2 ... [dims n=3, seed 0, magnitude 1]
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from coopt.ir.region import RegionSummary
from coopt.verify.strategies import Example

_SCRIPT = '''\
"""Repro: candidate {label} of region {region_name} fails verification.

At build time: {failure}

Run `python {script_name} [device]`: prints the error and exits 1 while the candidate still
fails, exits 0 once it passes. Needs coopt importable (it rebuilds the inputs and applies the
build's tolerance rule). Module paths are relative to this file.
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REFERENCE = HERE / {reference!r}
CANDIDATE = HERE / {candidate!r}
REGION = json.loads({region_json!r})
EXAMPLE = json.loads({example_json!r})


def main() -> int:
    from coopt.verify.repro import replay

    device = sys.argv[1] if len(sys.argv) > 1 else None
    failure = replay(REGION, REFERENCE, CANDIDATE, EXAMPLE, device=device)
    if failure is None:
        print("passes now: " + {example_text!r})
        return 0
    print(failure)
    return 1


if __name__ == "__main__":
    sys.exit(main())
'''


def repro_path(repro_dir: str | Path, region_name: str, label: str) -> Path:
    """`repro_dir/<region>__<label>.py` with characters unsafe in file names replaced."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{region_name}__{label}")
    return Path(repro_dir) / f"{safe}.py"


def write_repro(
    region: RegionSummary,
    reference_path: str | Path,
    candidate_path: str | Path,
    example: Example,
    *,
    repro_dir: str | Path,
    label: str,
    failure: str,
) -> Path:
    """Write the repro script for `example` and return its path."""
    path = repro_path(repro_dir, region.name, label)
    path.parent.mkdir(parents=True, exist_ok=True)
    source = _SCRIPT.format(
        label=label,
        region_name=region.name,
        failure=failure.replace('"""', "'''").replace("\\", "/"),
        script_name=path.name,
        reference=_relative(reference_path, path.parent),
        candidate=_relative(candidate_path, path.parent),
        region_json=json.dumps(region.to_json(), sort_keys=True),
        example_json=json.dumps(example.to_json(), sort_keys=True),
        example_text=example.describe(),
    )
    path.write_text(source)
    return path


def replay(region_json: dict, reference_path, candidate_path, example_json: dict,
           *, device: str | None = None) -> str | None:
    """Re-run one example: the failure line (as the build printed it), or None if it passes."""
    from coopt.verify.check import check_example, load_module
    from coopt.verify.runner import default_device

    region = RegionSummary.from_json(region_json)
    example = Example.from_json(example_json)
    reference = load_module(reference_path)
    if isinstance(reference, str):
        return f"reference {reference}"
    candidate = load_module(candidate_path)
    if isinstance(candidate, str):
        return f"candidate {candidate}"
    outcome = check_example(region, reference, candidate, example, device or default_device())
    return None if outcome.ok else f"{outcome.failure} [{example.describe()}]"


def _relative(target: str | Path, start: Path) -> str:
    # Resolve both first so symlinked temp dirs (macOS /var -> /private/var) agree.
    relative = os.path.relpath(Path(target).resolve(), start.resolve())
    return Path(relative).as_posix()
