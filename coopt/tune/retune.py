"""`coopt tune out/`: measure a build's verified candidates on this GPU and re-select.

A build made without a GPU records "unmeasured" selections (advisor rank); this finishes the
selection on the target. It rewrites only out/selection.json, atomically, so an interrupted tune
leaves the previous selection intact. program.py reads selection.json at load time.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from coopt.errors import ConfigError, InputFileError
from coopt.ir.region import RegionSummary
from coopt.tune import measure
from coopt.tune.db import TuningDB
from coopt.tune.select import REFERENCE_FAMILY, select_candidate

SELECTION_FILE = "selection.json"


def tune_build_dir(
    out_dir: Path,
    *,
    timeout_s: float = 60,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    allow_cpu: bool = False,
    db: TuningDB | None = None,
) -> dict:
    """Measure every verified candidate (and the reference) of every region, re-select, rewrite.

    Each timed candidate entry gets `latency_ms` (median, or null when timing failed) and
    `timing` (quantiles, achieved GB/s and TFLOP/s, error); each region gets `selected` and
    `reason`; the file gets `"measured": true`. `allow_cpu` is for tests only.

    Returns {region: {"old_selected", "selected", "reason"}}.
    Raises InputFileError when `out_dir` is not a build directory, ConfigError without a GPU.

    >>> tune_build_dir(Path("out"))                                   # doctest: +SKIP
    {'r0': {'old_selected': 'r0.c1', 'selected': 'r0.c0', 'reason': 'fastest of 3 verified: ...'}}
    """
    out_dir = Path(out_dir)
    selection = read_selection(out_dir)  # validate first: a wrong directory is the likelier mistake
    if not allow_cpu and not measure.gpu_available():
        raise ConfigError("coopt tune needs a CUDA GPU; none found")

    cuda_graph = _built_for_cuda_graphs(out_dir)
    regions = selection["regions"]
    # identical regions (same_as) share their leader's files: time the leaders only, all of
    # them in one worker (one CUDA start for the whole build)
    leaders = [name for name, entry in regions.items() if regions.get(entry.get("same_as") or "") is None]
    jobs = [
        measure.TimingJob(
            RegionSummary.from_json(regions[name]["summary"]),
            {c["label"]: out_dir / c["module"] for c in regions[name]["candidates"] if _worth_timing(c)},
        )
        for name in leaders
    ]
    timings = measure.measure_jobs(
        jobs, timeout_s=timeout_s, warmup_ms=warmup_ms, rep_ms=rep_ms, allow_cpu=allow_cpu, db=db, cuda_graph=cuda_graph,
    )
    summary = {}
    for name, measurements in zip(leaders, timings):
        region_entry = regions[name]
        candidates = region_entry["candidates"]
        for candidate in candidates:
            timing = measurements.get(candidate["label"])
            # A latency from another GPU (or none) must not survive next to this GPU's numbers.
            candidate["latency_ms"] = timing.median_ms if timing is not None and timing.ok else None
            if timing is not None:
                candidate["timing"] = timing.to_json()
            else:
                candidate.pop("timing", None)
        selected, reason = select_candidate(candidates, measurements)
        summary[name] = {"old_selected": region_entry.get("selected"), "selected": selected, "reason": reason}
        region_entry["selected"] = selected
        region_entry["reason"] = reason  # the key the build writes (coopt/candidates.py)
    for name, region_entry in regions.items():
        leader = regions.get(region_entry.get("same_as") or "")
        if leader is not None:  # an identical region: same files, same answer
            summary[name] = {**summary[region_entry["same_as"]], "old_selected": region_entry.get("selected")}
            region_entry.update(candidates=leader["candidates"], selected=leader["selected"], reason=leader["reason"])

    selection["measured"] = True
    _drop_stale_launch(selection, summary)
    write_json_atomic(out_dir / SELECTION_FILE, selection)
    return summary


def _drop_stale_launch(selection: dict, summary: dict) -> None:
    """A build's launch choice (selection.json "pdl", tune/launch.py) was measured on its own
    selection, some regions perhaps switched to PDL-ready kernels for it (tune/pdl_ready.py); a
    re-selection by each region's own time undoes those, and PDL over kernels not made for it
    cost a b1 step 280 µs (session 31). So where a selection changed, the step launches without
    PDL (always correct) and says why ("launch_note", shown by report.md) until a rebuild
    measures it again."""
    changed = sorted(name for name, info in summary.items() if info["old_selected"] != info["selected"])
    switched_on = sum(selection.get("pdl_regions", {}).values())  # regions launched with PDL outside the kinds
    launched = ", ".join(selection.get("pdl", ())) or (f"{switched_on} regions" if switched_on else "")
    if not launched or not changed:
        return
    selection["launch_note"] = (f"launched without PDL: the build measured PDL for {launched} "
                                f"with its own selection, and `coopt tune` changed {len(changed)} regions' "
                                f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}); rebuild to measure it again")
    selection["pdl"], selection["pdl_regions"] = [], {}


def _built_for_cuda_graphs(out_dir: Path) -> bool:
    """Whether the build timed its candidates in CUDA graphs (build.json), so a re-tune does too."""
    try:
        return bool(json.loads((Path(out_dir) / "build.json").read_text()).get("cuda_graphs", False))
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def read_selection(out_dir: Path) -> dict:
    """Load and check out/selection.json (docs/contracts.md); InputFileError if it is not one."""
    path = Path(out_dir) / SELECTION_FILE
    not_build_dir = f"{out_dir} is not a coopt build directory"
    if not path.is_file():
        raise InputFileError(f"{not_build_dir}: no {SELECTION_FILE}")
    try:
        selection = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputFileError(f"{not_build_dir}: {SELECTION_FILE} is not valid JSON ({exc})") from None
    regions = selection.get("regions") if isinstance(selection, dict) else None
    if not isinstance(regions, dict):
        raise InputFileError(f"{not_build_dir}: {SELECTION_FILE} has no 'regions' object")
    for name, entry in regions.items():
        problem = _region_problem(Path(out_dir), entry)
        if problem:
            raise InputFileError(f"{not_build_dir}: region {name}: {problem}")
    return selection


def _region_problem(out_dir: Path, entry) -> str | None:
    """One line saying what is wrong with a region entry, or None."""
    if not isinstance(entry, dict) or not isinstance(entry.get("summary"), dict):
        return "no 'summary'"
    candidates = entry.get("candidates")
    if not isinstance(candidates, list) or not all(isinstance(c, dict) and "label" in c for c in candidates):
        return "'candidates' is not a list of labelled entries"
    if not any(c.get("family") == REFERENCE_FAMILY for c in candidates):
        return "no reference candidate"
    try:
        RegionSummary.from_json(entry["summary"])
    except (KeyError, TypeError, ValueError) as exc:
        return f"malformed summary ({exc!r})"
    for candidate in candidates:
        if _worth_timing(candidate):
            module = candidate.get("module")
            if not isinstance(module, str) or not (out_dir / module).is_file():
                return f"candidate {candidate['label']}: module file {module!r} missing"
    return None


def _worth_timing(candidate: dict) -> bool:
    # Unverified candidates can never be selected, so timing them only costs GPU time.
    return candidate.get("family") == REFERENCE_FAMILY or bool(candidate.get("verified"))


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to a temp file beside `path`, then rename over it: readers never see half a file."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp makes the file private (0600); keep the permissions the old file had.
        os.chmod(tmp_name, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
