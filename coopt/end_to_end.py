"""Step 8 of a build: the whole built model against the original.

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

A build with a lossy pass (fp8-kv-cache) cannot match the original at the normal tolerance:
`measure_lossy_end_to_end` holds its kernels to the build's own reference program (the same
transform on ATen ops, at the build's dtype) as above, both judged against the unquantized
model in float64 (the kernels may be as much less accurate than the reference program as any
kernel than eager), then measures the transform's cost against the original.
"""

from __future__ import annotations

import copy

import torch

from coopt.candidates import REFERENCE
from coopt.errors import DeviceMemoryError, EndToEndMismatch

# Built slower than eager by more than this (interleaved medians, whose spread is ~0.5 %) makes
# the build time its reference program too.
SLOWER_MARGIN = 0.02


def ensure_room_for_the_check(model) -> None:
    """Refuse at the start, not after the tuning, a build whose check cannot fit: it loads the
    build beside the model on the GPU, and the build's weights take at least the model's
    parameters' bytes (fusions copy weights, no pass shrinks them). A model on the CPU is not
    checked here."""
    from coopt.verify.end_to_end import device_free_bytes

    parameters = list(model.parameters())
    if not parameters or parameters[0].device.type != "cuda":
        return
    needed = sum(p.numel() * p.element_size() for p in parameters)
    free = device_free_bytes(parameters[0].device)
    if needed > free:
        raise DeviceMemoryError(f"the GPU cannot hold the build's end-to-end check: it loads the build ({needed / 2**30:.1f} "
                                f"GiB of weights) beside the model, and {free / 2**30:.1f} GiB are free with the model on "
                                f"it; use a GPU with more memory")


def check_end_to_end(model, example_inputs, regions, out, *, trials: int, seed: int, measured: bool,
                     stateful: bool, cuda_graphs: bool, warnings: list[str], write_selection, adapt=None,
                     lossy_original=None) -> dict:
    """The build.json "end_to_end" record: the verdict, and on a GPU the interleaved timing.
    `write_selection()` rewrites selection.json after a fallback changed `regions`. `adapt`
    wraps each loaded build into something called like `model` (a paged-kv program takes a page
    table the original does not: compile.paged_as_static). `lossy_original`: `model` is a lossy
    build's reference program and this the unquantized model; both programs are judged against
    its high-precision copy and the errors reported from `model` (verify/end_to_end.py). A
    `stateful` model's buffers are run and put back as they were."""
    from coopt.runtime.loader import load as load_build
    from coopt.verify import verify_end_to_end
    from coopt.verify.bisect import copy_buffers, snapshot_buffers
    from coopt.verify.end_to_end import native_bytes, reference_copy

    def load(out, device):
        built = load_build(out, device=device)
        return adapt(built) if adapt is not None else built

    # One high-precision reference serves every check (a float64 copy; where none fits in the
    # device's memory, as for a decode step built for many rows with large caches, the model
    # itself run with each submodule cast as it runs).
    source = lossy_original if lossy_original is not None else model
    high, precision = reference_copy(source)
    if high is None:
        warnings.append(f"end-to-end check: no high-precision reference ({precision}); judged by the floor around eager")
    elif precision != "float64":
        warnings.append(f"end-to-end check: the high-precision reference is {precision} (no float64 copy of the "
                        f"whole model fits in the device's free memory)")
    errors_from = "original" if lossy_original is not None and high is not None else "high"
    # Each full check runs a freshly loaded build, whose state is what weights.pt holds: the model
    # (and the high-precision reference) start from the same state, not from what the trials of an
    # earlier check wrote (a prompt reads cache rows it does not write: trials at other positions
    # would make even the reference program disagree with itself). The check runs the caller's
    # model and puts its buffers back at the end (one snapshot of its buffers, not a deep copy of
    # the whole model beside it); the copy's buffers are set from its source's, never snapshotted.
    # (the build is loaded after it: its bytes, about the model's, are not the snapshot's to take)
    restore_model = snapshot_buffers(model, reserve=native_bytes(model)) if stateful else (lambda: None)

    def initial_state():
        restore_model()
        if stateful and isinstance(high, torch.nn.Module):  # a StreamedCopy holds no state of its own
            copy_buffers(source, high)

    device = device_of(example_inputs)

    def reload():
        return load(out, device=device)

    def full_check(built):
        initial_state()
        return verify_end_to_end(model, built, example_inputs, trials=trials, seed=seed, high_reference=False,
                                 high_model=high, errors_from=errors_from)

    try:
        record, built = _checked(model, example_inputs, regions, out, seed, high, initial_state, full_check, reload,
                                 warnings, write_selection)
        record["reference_precision"] = precision
        if measured:
            record.update(_timing(model, built, example_inputs, regions, out, cuda_graphs, warnings, write_selection))
    finally:
        restore_model()
    return record


def _checked(model, example_inputs, regions, out, seed, high, initial_state, full_check, reload, warnings,
             write_selection) -> tuple[dict, object]:
    """check_end_to_end's verdict and the build it judged last: the full check, then bisection
    and fallbacks while it fails. Each check and the bisection load the build afresh: it starts
    from the state weights.pt holds, as the model starts from its initial state."""
    built = reload()
    verdict = full_check(built)
    if not verdict.ok:
        built = None  # one loaded build at a time (a paged build's pool is large)
        built = reload()
        at_fault = _bisect(model, built, example_inputs, regions, out, seed, high, initial_state)
        _fall_back(regions, at_fault, "end-to-end mismatch: this region's kernel breaks the whole model's "
                   "agreement with the original (found by bisection); fell back to the reference")
        warnings.append(f"end-to-end check failed with kernels ({verdict.failure}); bisection blamed "
                        f"{', '.join(at_fault) or 'no single region'}: fell back to the reference there")
        write_selection()
        built = None
        built = reload()
        verdict = full_check(built)
    if not verdict.ok:
        kernel_regions = [r.summary.name for r in regions if r.selected != REFERENCE]
        if not kernel_regions:
            raise EndToEndMismatch(f"the built model does not match the original: {verdict.failure}")
        _fall_back(regions, kernel_regions, "end-to-end mismatch with kernels: fell back to the reference")
        warnings.append(f"end-to-end check still failed ({verdict.failure}); every region fell back to its reference")
        write_selection()
        built = None
        built = reload()
        verdict = full_check(built)
        if not verdict.ok:
            raise EndToEndMismatch(f"the built model does not match the original: {verdict.failure}")
    return verdict.to_json(), built


def measure_lossy_end_to_end(model, example_inputs, regions, out, *, lossy_passes, trials: int, seed: int,
                             cuda_graphs: bool, warnings: list[str], write_selection, module, program,
                             adapt=None) -> tuple[dict, dict]:
    """(end_to_end, accuracy) records of a build with lossy passes: its kernels are checked
    against the build's own reference program (bisected and fallen back as `check_end_to_end`
    does); the transform's cost is then measured against the original model (outputs on fresh
    inputs; for a decoder also teacher-forced decode steps: top-1 agreement, mean KL; the KV
    bytes saved). Non-finite outputs fail the build, after a retry on the references if kernels
    were selected."""
    from coopt.fp8_cache import fp8_record, kv_cache_bytes
    from coopt.runtime.loader import load
    from coopt.verify.end_to_end import measure_end_to_end

    device = device_of(example_inputs)
    adapt = adapt or (lambda built: built)
    kernels_check = None
    if any(r.selected != REFERENCE for r in regions):
        kernels_check = check_end_to_end(adapt(reference_program(out, regions, device)), example_inputs, regions, out,
                                         trials=trials, seed=seed, measured=False, stateful=True,
                                         cuda_graphs=cuda_graphs, warnings=warnings, write_selection=write_selection,
                                         adapt=adapt, lossy_original=model)

    def measure() -> dict:
        return measure_end_to_end(copy.deepcopy(model), adapt(load(out, device=device)), example_inputs, trials=trials, seed=seed)

    outputs = measure()
    kernel_regions = [r.summary.name for r in regions if r.selected != REFERENCE]
    if not outputs["finite"] and kernel_regions:
        warnings.append("the lossy build's outputs were not finite with kernels; every region fell back to its reference")
        _fall_back(regions, kernel_regions, "non-finite end-to-end outputs with kernels: fell back to the reference")
        write_selection()
        outputs = measure()
    if not outputs["finite"]:
        raise EndToEndMismatch(f"the built model's outputs are not finite (lossy pipeline: "
                               f"{', '.join(p.name for p in lossy_passes)}); "
                               f"try fp8-kv-cache{{headroom=...}} above 1 or per-token scales")
    accuracy = {
        "passes": [{"pass": p.name, "knobs": _knob_values(p)} for p in lossy_passes],
        "reference": "the original model, unquantized (eager)",
        **{k: outputs[k] for k in ("trials", "max_abs_err", "max_rel_err")},
        **_decode_accuracy(model, out, example_inputs, device),
    }
    record = fp8_record(module)
    if record is not None:
        accuracy["kv_cache_bytes"] = kv_cache_bytes(record, {**program.state_dict, **program.constants})
    e2e = {"ok": True, "lossy": True, "trials": outputs["trials"], "max_abs_err": outputs["max_abs_err"],
           "max_rel_err": outputs["max_rel_err"], "kernels_vs_reference_program": kernels_check}
    return e2e, accuracy


DECODE_STEPS = 16  # teacher-forced decode steps a lossy decoder build is measured over


def _decode_accuracy(model, out, example_inputs, device) -> dict:
    """Top-1 agreement and mean KL over teacher-forced decode steps from the example position,
    when the build is a decode step (DECODER contract, one token per call); else {}."""
    from coopt.runtime.loader import load
    from coopt.verify.decode_agreement import decode_agreement

    built = load(out, device=device)
    decoder = getattr(built, "decoder", None)
    if decoder is None or not decoder["length"][0] <= 1 <= decoder["length"][1]:
        return {}
    tokens = example_inputs[decoder["tokens"]][:, :1]
    start = int(example_inputs[decoder["positions"]].min())
    steps = min(DECODE_STEPS, decoder["max_seq"] - start)
    if steps < 1:
        return {}
    agreement = decode_agreement(built, copy.deepcopy(model), tokens, start, steps)
    return {"decode_steps": agreement.steps, "top1_agreement": agreement.top1_agreement, "mean_kl": agreement.mean_kl,
            "decode_max_abs_err": agreement.max_abs_err}


def _knob_values(compiler_pass) -> dict:
    """{kebab-case knob: value} of a pass instance (the knobs `coopt passes` lists)."""
    from coopt.passes.registry import pass_knobs

    return {name: getattr(compiler_pass, name.replace("-", "_")) for name, _, _ in pass_knobs(type(compiler_pass))}


def reference_program(out, regions, device):
    """The build in `out` loaded with every region on its reference: the program its kernels
    replace (for a lossy build, the lossy transform on ATen ops)."""
    from coopt.runtime.loader import load
    from coopt.verify.bisect import reference_runs

    program = load(out, device=device)
    program._kernels.update(reference_runs(regions, out))
    return program


def device_of(example_inputs) -> torch.device:
    """The device of the first tensor input (the model's), else the CPU."""
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))


def _bisect(model, built, example_inputs, regions, out, seed: int, high, initial_state) -> list[str]:
    """Regions whose kernels break the agreement; each probe is one trial of the end-to-end
    check, from the initial state of `model` and its high-precision reference `high` (None:
    judged by the floor around eager), which `initial_state()` restores."""
    from coopt.verify import verify_end_to_end
    from coopt.verify.bisect import ReferencesDisagree, regions_at_fault, snapshot_buffers

    # Probes are judged like the full check (the high-precision reference sets the tolerance: the
    # bf16 floor alone rejects even the reference program of a deep model).
    restore_built = snapshot_buffers(built)

    def agrees() -> bool:
        initial_state()
        restore_built()
        return verify_end_to_end(model, built, example_inputs, trials=1, seed=seed, high_reference=False,
                                 high_model=high).ok

    try:
        at_fault = regions_at_fault(built, regions, out, agrees)
    except ReferencesDisagree:
        at_fault = []
    restore_built()
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

    def running(kernels: dict):
        def run():
            built._kernels.update(kernels)
            return built(*example_inputs)
        return run

    with torch.no_grad():
        ms = time_interleaved({"eager": run_eager, "kernels": running(chosen), "references": running(references)})
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

