"""Replay the repro scripts a build wrote (out/verify/repro/*.py) with variants of the failing
candidate's source: which change makes it pass, and how its output is off. For failures that
only a GPU shows, where each device call is precious: one call replays every repro under every
variant and prints a line each.

Session 18 found the decode attention's lane bug this way (bench/RESULTS.md): candidate /
reference along the worst output row showed columns 8-15 off by one factor and columns 0-7
exact, and of the variants only `--knob NUM_WARPS=1` passed, which pointed at values shared
across warps and then at the PTX.

    python bench/repro_variants.py out/verify/repro/*.py --knob NUM_WARPS=1,4 --knob NUM_STAGES=1 \\
        --replace 'is_pure=True=>is_pure=False' [--device cuda]

A knob is a module-level constant of the candidate (`NAME = value`, as the templates render
them); a replacement is any text of its source. Each variant is written beside the candidate as
variant_<n>.py, replayed by the build's own rule (coopt.verify.repro.replay), then removed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def knob_variants(source: str, knob: str) -> list[tuple[str, str | None]]:
    """`NAME=v1,v2`: (label, source with `NAME = v`) for each value; the source None where the
    candidate has no module-level NAME."""
    name, _, values = knob.partition("=")
    line = re.compile(rf"^{re.escape(name)} = .*$", re.MULTILINE)
    found = line.search(source) is not None
    return [(f"{name}={value}", line.sub(f"{name} = {value}", source, count=1) if found else None)
            for value in values.split(",")]


def replacement_variant(source: str, replacement: str) -> tuple[str, str | None]:
    """`OLD=>NEW`: (label, source with every OLD made NEW); None where OLD is not in it."""
    old, _, new = replacement.partition("=>")
    return f"{old!r} -> {new!r}", source.replace(old, new) if old in source else None


def worst_row_ratios(region_json: dict, reference_path: Path, candidate_path: Path, example_json: dict,
                     device: str) -> tuple[int, list[float]]:
    """The output the candidate is furthest off in, and candidate / reference along its worst
    row (its last dimension), on the example's inputs."""
    import torch

    from coopt.ir.region import RegionSummary
    from coopt.verify.check import _as_outputs, _clones, _fp8_written, example_inputs, load_module, run_upcast
    from coopt.verify.strategies import Example

    region, example = RegionSummary.from_json(region_json), Example.from_json(example_json)
    inputs = example_inputs(region, example, device)
    with torch.inference_mode():
        expected = run_upcast(load_module(reference_path), inputs, keep=_fp8_written(region))
        got = _as_outputs(load_module(candidate_path).run(*_clones(inputs)))
    errors = [(out.double() - ref.double()).abs().reshape(-1, ref.shape[-1] if ref.dim() else 1)
              for out, ref in zip(got, expected)]
    worst = max(range(len(errors)), key=lambda i: float(errors[i].max()) if errors[i].numel() else 0.0)
    row = int(errors[worst].amax(dim=1).argmax())
    out = got[worst].double().reshape(errors[worst].shape)[row]
    ref = expected[worst].double().reshape(errors[worst].shape)[row]
    return worst, [round(float(r), 4) for r in out / ref]


def replay_variants(script, variants: list[tuple[str, str | None]], device: str) -> list[tuple[str, str | None]]:
    """(label, None where the variant passes, else its failure line) for each variant of the
    repro `script`'s candidate."""
    from coopt.verify.repro import replay

    candidate = Path(script.CANDIDATE)
    source = candidate.read_text()
    results = []
    for n, (label, text) in enumerate([("as built", source), *variants]):
        if text is None:
            results.append((label, "not applicable: the candidate has no such text"))
            continue
        path = candidate.with_name(f"variant_{n}.py")
        path.write_text(text)
        try:
            results.append((label, replay(script.REGION, script.REFERENCE, path, script.EXAMPLE, device=device)))
        finally:
            path.unlink()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repros", nargs="+", type=Path, help="repro scripts a build wrote (out/verify/repro/*.py)")
    parser.add_argument("--knob", action="append", default=[], help="NAME=v1,v2: the candidate's constant NAME set to each")
    parser.add_argument("--replace", action="append", default=[], help="OLD=>NEW: every OLD of the candidate's source made NEW")
    parser.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    args = parser.parse_args()
    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.verify.runner import default_device

    device = args.device or default_device()
    for path in args.repros:
        script = load_module_from_file(path)  # its constants; main() is not run
        source = Path(script.CANDIDATE).read_text()
        variants = [v for knob in args.knob for v in knob_variants(source, knob)]
        variants += [replacement_variant(source, r) for r in args.replace]
        output, ratios = worst_row_ratios(script.REGION, Path(script.REFERENCE), Path(script.CANDIDATE),
                                          script.EXAMPLE, device)
        print(f"== {path}: output {output}, candidate / reference along its worst row: {ratios}", flush=True)
        for label, failure in replay_variants(script, variants, device):
            print(f"   {label}: {'passes' if failure is None else failure}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
