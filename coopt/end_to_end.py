"""Step 8 of a build (lossless pipelines): the whole built model against the original.

Every region's kernel was verified on its own; the whole model can still disagree with the
original (a kernel fed a view it was never fuzzed with, a write outside its output) or run
slower than eager (kernels that win alone but lose under sustained load). Both are checked on
the built program as it will run, and both fall back region by region where they can:

- correctness: on a mismatch, `verify.bisect` finds the regions whose kernels cause it; those
  fall back to their references, the others are kept, and the whole model is checked again
  (if it still disagrees, every region falls back; if even that disagrees, the build fails);
- speed (GPU, builds timed without CUDA graphs): eager and built are timed in alternating
  rounds (`tune.interleaved`); if the built model is slower than eager by more than
  SLOWER_MARGIN, the reference program (every region on its reference) is timed in the same
  rounds and, when faster, replaces the kernels, so a build is not slower end to end than the
  program its regions fell back from.
"""

from __future__ import annotations

import copy

import torch

from coopt.candidates import REFERENCE
from coopt.errors import EndToEndMismatch

# Built slower than eager by more than this (interleaved medians, whose spread is ~0.5 %) makes
# the build time its reference program too.
SLOWER_MARGIN = 0.02


def check_end_to_end(model, example_inputs, regions, out, *, trials: int, seed: int, measured: bool,
                     stateful: bool, cuda_graphs: bool, warnings: list[str], write_selection) -> dict:
    """The build.json "end_to_end" record: the verdict, and on a GPU the interleaved timing.
    `write_selection()` rewrites selection.json after a fallback changed `regions`."""
    from coopt.runtime.loader import load
    from coopt.verify import verify_end_to_end

    if stateful:
        model = copy.deepcopy(model)  # the check runs the model: never mutate the caller's buffers
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    built = load(out, device=device)

    def full_check(built):
        return verify_end_to_end(model, built, example_inputs, trials=trials, seed=seed)

    verdict = full_check(built)
    if not verdict.ok:
        at_fault = _bisect(model, built, example_inputs, regions, out, seed)
        _fall_back(regions, at_fault, "end-to-end mismatch: this region's kernel breaks the whole model's "
                   "agreement with the original (found by bisection); fell back to the reference")
        warnings.append(f"end-to-end check failed with kernels ({verdict.failure}); bisection blamed "
                        f"{', '.join(at_fault) or 'no single region'}: fell back to the reference there")
        write_selection()
        built = load(out, device=device)
        verdict = full_check(built)
    if not verdict.ok:
        kernel_regions = [r.summary.name for r in regions if r.selected != REFERENCE]
        if not kernel_regions:
            raise EndToEndMismatch(f"the built model does not match the original: {verdict.failure}")
        _fall_back(regions, kernel_regions, "end-to-end mismatch with kernels: fell back to the reference")
        warnings.append(f"end-to-end check still failed ({verdict.failure}); every region fell back to its reference")
        write_selection()
        built = load(out, device=device)
        verdict = full_check(built)
        if not verdict.ok:
            raise EndToEndMismatch(f"the built model does not match the original: {verdict.failure}")
    record = verdict.to_json()
    if measured:
        record.update(_timing(model, built, example_inputs, regions, out, cuda_graphs, warnings, write_selection))
    return record


def reference_program(out, regions, device):
    """The build in `out` loaded with every region on its reference: the program its kernels
    replace (for a lossy build, the lossy transform on ATen ops)."""
    from coopt.runtime.loader import load
    from coopt.verify.bisect import reference_runs

    program = load(out, device=device)
    program._kernels.update(reference_runs(regions, out))
    return program


def _bisect(model, built, example_inputs, regions, out, seed: int) -> list[str]:
    """Regions whose kernels break the agreement; each probe is one trial of the end-to-end
    check, from the same model state."""
    from coopt.verify import verify_end_to_end
    from coopt.verify.bisect import ReferencesDisagree, regions_at_fault, snapshot_buffers
    from coopt.verify.end_to_end import float64_copy

    # Probes are judged like the full check (the float64 reference sets the tolerance: the bf16
    # floor alone rejects even the reference program of a deep model), on one float64 copy.
    high = float64_copy(model)
    restore = snapshot_buffers(*(m for m in (model, built, high) if m is not None))

    def agrees() -> bool:
        restore()
        return verify_end_to_end(model, built, example_inputs, trials=1, seed=seed,
                                 float64_reference=high is not None, float64_model=high).ok

    try:
        at_fault = regions_at_fault(built, regions, out, agrees)
    except ReferencesDisagree:
        at_fault = []
    restore()
    return at_fault


def _fall_back(regions, names, reason: str) -> None:
    names = set(names)
    for region in regions:
        if region.summary.name in names and region.selected != REFERENCE:
            region.selected, region.reason = REFERENCE, reason


def _timing(model, built, example_inputs, regions, out, cuda_graphs: bool, warnings, write_selection) -> dict:
    from coopt.tune.interleaved import time_interleaved
    from coopt.verify.bisect import reference_runs

    run_eager, run_built = (lambda: model(*example_inputs)), (lambda: built(*example_inputs))
    with torch.no_grad():
        ms = time_interleaved({"eager": run_eager, "built": run_built})
    record = {"eager_ms": ms["eager"], "built_ms": ms["built"], "speedup": ms["eager"] / ms["built"],
              "timing": "CUDA events, eager and built in alternating rounds (median)"}
    kernels = {r.summary.name for r in regions if r.selected != REFERENCE}
    # A graph-replayed build (a decode step) runs without the launch cost timed here: its kernels
    # were selected replayed in graphs, and events would charge them Python overhead they never pay.
    if cuda_graphs or not kernels or ms["built"] <= ms["eager"] * (1 + SLOWER_MARGIN):
        return record
    chosen, references = dict(built._kernels), reference_runs(regions, out)
    with torch.no_grad():
        built._kernels.update(references)
        with_references = lambda: built(*example_inputs)  # noqa: E731 - timed in place of run_built
        ms = time_interleaved({"eager": run_eager, "kernels": lambda: _with(built, chosen, run_built),
                               "references": lambda: _with(built, references, with_references)})
        built._kernels.update(chosen)
    record["reference_program_ms"] = ms["references"]
    if ms["references"] < ms["kernels"]:
        _fall_back(regions, kernels, f"end to end the kernels lost to the references ({ms['kernels']:.4g} vs "
                   f"{ms['references']:.4g} ms, eager {ms['eager']:.4g} ms, timed in alternating rounds): "
                   "kept the reference")
        warnings.append(f"the built model was slower than eager end to end ({ms['kernels']:.4g} vs {ms['eager']:.4g} ms) "
                        f"and its reference program faster ({ms['references']:.4g} ms): every region kept its reference")
        write_selection()
        record.update(eager_ms=ms["eager"], built_ms=ms["references"], speedup=ms["eager"] / ms["references"])
    return record


def _with(built, kernels: dict, run):
    built._kernels.update(kernels)
    return run()
