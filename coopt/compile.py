"""The whole build, top to bottom. Read this first: every step says why it is there.

`compile_model` writes into a staging directory (coopt.emit.outdir) that becomes `out/` only
when every step succeeded, so a failed build leaves nothing half-written.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.printer import Printer

from coopt.candidates import REFERENCE, RegionBuild, make_candidates, region_signature
from coopt.codegen.input_bounds import state_moved_writes
from coopt.codegen.program import program_source
from coopt.emit.state_file import save_state, stored_state
from coopt.end_to_end import (
    check_end_to_end,
    device_of,
    ensure_room_for_the_check,
    measure_lossy_end_to_end,
)
from coopt.fp8_cache import calibrate_kv_absmax, needs_calibration, set_calibration
from coopt.frontend.capture import capture
from coopt.frontend.importer import import_program
from coopt.ir.summary import kernels, name_regions, summarize, symbol_table
from coopt.ir.unfused import unfused_ops
from coopt.passes.chunked_prefill import fit_example_inputs, prefill_chunk
from coopt.passes.paged_kv import PAGE_TABLE, RING_SLOTS, paged_record
from coopt.passes.stats import collect_counters
from coopt.targets import Target
from coopt.tune.launch import choose_pdl, pdl_capable
from coopt.verify.check import one_line


@dataclass
class BuildConfig:
    target: Target
    passes: list  # pass objects, in order
    pipeline_text: str
    advisor: object
    advisor_name: str = "heuristic"
    top_k: int = 3
    verify_profile: str = "ci"
    seed: int = 0
    candidate_timeout_s: float = 300.0
    e2e_trials: int = 3
    # time candidates replayed in a CUDA graph (GPU time only); None = decide from the model:
    # yes for a stateful step (a decoder writing its KV cache), which the runtime replays as a graph
    cuda_graphs: bool | None = None
    # KV-cache storage: "fp8" adds fp8-kv-cache (defaults) after raise-patterns unless the
    # pipeline has it already; "bf16" / "none" leave the pipeline as it is (the model's dtype)
    kv_cache: str = "none"
    # tokens per prefill call: entries with a dynamic prompt length get chunked-prefill{chunk=N}
    # appended (decided per entry after import, `with_prefill_chunk`); None: as exported
    prefill_chunk: int | None = None
    # positions per page: paged-kv{page-size=N} after raise-patterns / fp8-kv-cache (KV caches as
    # page pools read through a page table input); None: caches as the model has them
    paged_kv: int | None = None

    def __post_init__(self):
        self.passes, self.pipeline_text = with_kv_cache(self.passes, self.pipeline_text, self.kv_cache)
        self.passes, self.pipeline_text = with_paged_kv(self.passes, self.pipeline_text, self.paged_kv)
        if self.prefill_chunk is not None:
            from coopt.passes.chunked_prefill import ChunkedPrefill

            ChunkedPrefill(self.prefill_chunk)  # a bad chunk fails here, before any build step

    @property
    def lossy_passes(self) -> list:
        return [p for p in self.passes if getattr(p, "lossy", False)]


KV_CACHE_CHOICES = ("none", "bf16", "fp8", "fp8-recent", "fp8-values")


# --kv-cache fp8's pass: centred keys measured better at no cost (session 9, accuracy harness on
# the H200: top-1 98.93 % against 98.51 % plain per-head, KL 1.04e-3 against 1.90e-3; the
# centring runs inside the kv_write kernel)
KV_FP8_PASS = "fp8-kv-cache{smooth-k=true}"
# --kv-cache fp8-values's: only the values in fp8, the keys kept (the one rounding measured over
# 99 % top-1 on the harness model: session 11's probe)
KV_FP8_VALUES_PASS = "fp8-kv-cache{values-only=true}"
# --kv-cache fp8-recent's: fp8's, each query's newest 4 keys read unrounded (a bf16 / fp32 ring of
# each sequence's last 4 rows beside each cache; bench/fp8_kv_probe.py, sessions 42-43: top-1
# 99.19-99.26 % against 98.29-98.33 % without, eager on the harness model)
KV_FP8_RECENT_PASS = "fp8-kv-cache{smooth-k=true,exact-recent=4}"
KV_CACHE_PASSES = {"fp8": KV_FP8_PASS, "fp8-recent": KV_FP8_RECENT_PASS, "fp8-values": KV_FP8_VALUES_PASS}


def with_kv_cache(passes: list, pipeline_text: str, kv_cache: str) -> tuple[list, str]:
    """(passes, pipeline text) for the --kv-cache choice: "fp8" puts fp8-kv-cache{smooth-k=true}
    (per-head calibrated scales, keys centred: KV_FP8_PASS), "fp8-recent" the same with the newest
    4 keys of each query unrounded (KV_FP8_RECENT_PASS), "fp8-values"
    fp8-kv-cache{values-only=true} (only the values in fp8), right after raise-patterns (it
    rewrites the raised attentions, before fusion outlines them); a pipeline that already has the
    pass keeps it and its knobs."""
    from coopt.errors import ConfigError

    if kv_cache not in KV_CACHE_CHOICES:
        raise ConfigError(f"unknown --kv-cache '{kv_cache}'; choices: {', '.join(KV_CACHE_CHOICES)}")
    names = [p.name for p in passes]
    if kv_cache not in KV_CACHE_PASSES or "fp8-kv-cache" in names:
        return list(passes), pipeline_text
    if "raise-patterns" not in names:
        raise ConfigError(f"--kv-cache {kv_cache} needs raise-patterns in the pipeline "
                          "(fp8-kv-cache rewrites the raised cache attentions)")
    from coopt.passes.registry import parse_pipeline_text

    at = names.index("raise-patterns") + 1
    passes = [*passes[:at], *parse_pipeline_text(KV_CACHE_PASSES[kv_cache]), *passes[at:]]
    return passes, _insert_after_raise(pipeline_text, KV_CACHE_PASSES[kv_cache])


def with_paged_kv(passes: list, pipeline_text: str, page_size: int | None) -> tuple[list, str]:
    """(passes, pipeline text) for --paged-kv P: paged-kv{page-size=P} right after fp8-kv-cache
    when the pipeline has it (pages hold what the fp8 pass stores), else after raise-patterns
    (it rewrites the raised cache attentions and writes, before fusion outlines them). A
    pipeline that already has paged-kv keeps it and its knobs."""
    import re

    from coopt.errors import ConfigError
    from coopt.passes.paged_kv import PagedKv

    if page_size is None:
        return list(passes), pipeline_text
    paged = PagedKv(page_size=page_size)  # a bad page size fails here, with the knob's message
    names = [p.name for p in passes]
    if "paged-kv" in names:
        return list(passes), pipeline_text
    after = "fp8-kv-cache" if "fp8-kv-cache" in names else "raise-patterns"
    if after not in names:
        raise ConfigError("--paged-kv needs raise-patterns in the pipeline (paged-kv rewrites the raised cache attentions)")
    at = names.index(after) + 1
    pattern = "(^|,)" + re.escape(after) + r"(\{[^}]*\})?"
    text = re.sub(pattern, lambda m: m.group(0) + f",paged-kv{{page-size={page_size}}}", pipeline_text, count=1)
    return [*passes[:at], paged, *passes[at:]], text


def _insert_after_raise(text: str, kv_pass: str) -> str:
    """Pipeline text with --kv-cache's pass after raise-patterns (other passes' knobs kept)."""
    import re

    return re.sub(r"(^|,)raise-patterns(\{[^}]*\})?", lambda m: m.group(0) + "," + kv_pass, text, count=1)


def with_prefill_chunk(config: BuildConfig, module: ModuleOp) -> BuildConfig:
    """The config of one entry point: --prefill-chunk appends chunked-prefill{chunk=N} when the
    entry's prompt length is dynamic (a prefill); the decode step (T = 1) keeps its pipeline."""
    import dataclasses

    from coopt.passes.chunked_prefill import ChunkedPrefill, prompt_length_symbol

    chunk = config.prefill_chunk
    if chunk is None or "chunked-prefill" in (p.name for p in config.passes) or prompt_length_symbol(module) is None:
        return config
    text = f"{config.pipeline_text},chunked-prefill{{chunk={chunk}}}"
    return dataclasses.replace(config, passes=[*config.passes, ChunkedPrefill(chunk)], pipeline_text=text)


@dataclass
class BuildResult:
    out_dir: Path
    regions: list[RegionBuild]
    counters: dict
    fallback_ops: dict
    measured: bool
    e2e: dict
    warnings: list[str] = field(default_factory=list)
    cuda_graphs: bool = False
    entries: dict = field(default_factory=dict)  # entry name -> BuildResult (out/entries/<name>)
    seconds: float = 0.0
    step_seconds: dict = field(default_factory=dict)
    # fp8 KV cache with calibrated scales: {buffer: absmax per kv head}, shared with the entries
    kv_calibration: dict | None = None
    accuracy: dict | None = None  # a lossy build's measured cost against the original (build.json)
    prefill_chunk: int | None = None  # chunked-prefill's chunk, when the entry's pipeline ran it
    # ops outside every region that launch work of their own (PyTorch's kernels between coopt's)
    unfused_ops: dict = field(default_factory=dict)
    # a graph-replayed step's measured launch choice: {"pdl": kinds, "step_ms": {...}} (tune/launch.py)
    launch: dict | None = None

    def to_json(self) -> dict:
        return {
            "out_dir": str(self.out_dir),
            "regions": {r.summary.name: {"family": r.summary.family, "selected": r.selected, "reason": r.reason} for r in self.regions},
            "counters": self.counters,
            "fallback_ops": self.fallback_ops,
            "unfused_ops": self.unfused_ops,
            "measured": self.measured,
            "cuda_graphs": self.cuda_graphs,
            "end_to_end": self.e2e,
            "warnings": self.warnings,
            "seconds": round(self.seconds, 2),
            "step_seconds": self.step_seconds,
            **({"accuracy": self.accuracy} if self.accuracy is not None else {}),
            **({"entries": {name: entry.to_json() for name, entry in self.entries.items()}} if self.entries else {}),
        }


def _noop(step: str, detail: str = "") -> None:
    pass


class StepClock:
    """Wraps the progress callback and adds up wall time per build step (capture, verify,
    measure, ...), so build.json and the report say where a slow build spent its time."""

    def __init__(self, progress):
        self.progress = progress
        self.seconds: dict[str, float] = {}
        self._step: str | None = None
        self._since = time.monotonic()

    def __call__(self, step: str, detail: str = "") -> None:
        self._close()
        self._step = step
        self.progress(step, detail)

    def _close(self) -> None:
        now = time.monotonic()
        if self._step is not None:
            self.seconds[self._step] = self.seconds.get(self._step, 0.0) + now - self._since
        self._since = now

    def totals(self) -> dict[str, float]:
        self._close()
        self._step = None
        return {step: round(s, 2) for step, s in self.seconds.items()}


def dump_ir(module: ModuleOp, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as stream:
        Printer(stream=stream).print_op(module)
        stream.write("\n")


def compile_model(model, example_inputs, out: Path, config: BuildConfig, *, dynamic_shapes=None, model_path=None, progress=_noop,
                  shared_weights: Path | None = None, calibration_inputs=None, kv_calibration: dict | None = None) -> BuildResult:
    """Build one entry point of `model` into `out`. With `shared_weights` (the weights.pt of the
    artifact's main entry), tensors stored there are not stored again: the entry reads them, and
    writes the same state buffers, through the main entry at load time.

    An fp8 KV cache with calibrated scales is calibrated on `calibration_inputs` (a list of
    input tuples; default: the example inputs) unless `kv_calibration` (the main entry's
    `BuildResult.kv_calibration`) is given: entries sharing a cache share its scales."""
    from coopt.emit.manifest import write_manifest
    from coopt.emit.report import write_build_record, write_report
    from coopt.llm_advisor.replay import AdviceLog

    start = time.monotonic()
    warnings: list[str] = []
    progress = StepClock(progress)

    # 0. device: capture, verify and check where the kernels will run — the GPU when there is one
    model, example_inputs = _on_build_device(model, example_inputs)
    ensure_room_for_the_check(model)  # step 8 loads the build beside the model: refuse now, not after the tuning

    # 1. capture: torch.export gives a functional ATen graph; buffer writes become outputs
    progress("capture", "torch.export")
    program = capture(model, example_inputs, dynamic_shapes, model_path, notes=warnings)

    # 2. import: ATen → coopt dialect; weights by name, unknown ops kept as fallback ops
    progress("import", "ATen graph → coopt IR")
    imported = import_program(program, example_inputs)
    module = imported.module
    dump_ir(module, out / "ir" / "00-import.mlir")

    # 2b. calibrate: an fp8 KV cache with calibrated scales needs the range of what the original
    #     model writes into each cache; the pass reads it from the IR (it touches no data)
    if needs_calibration(config.passes):
        if kv_calibration is None:
            progress("calibrate", "original model on the calibration inputs")
            kv_calibration = calibrate_kv_absmax(model, calibration_inputs or [example_inputs])
        set_calibration(module, kv_calibration)

    # 2c. chunked prefill: --prefill-chunk bounds a dynamic prompt length (a prefill entry) by the
    #     chunk; only the import says whether this entry has one (the decode step has T = 1)
    config = with_prefill_chunk(config, module)

    # 3. passes: raise patterns, then fuse into kernel regions; an IR dump after each pass
    ctx = Context(allow_unregistered=True)
    with collect_counters() as counters:
        for index, compiler_pass in enumerate(config.passes, start=1):
            progress("passes", compiler_pass.name)
            compiler_pass.apply(ctx, module)
            module.verify()
            dump_ir(module, out / "ir" / f"{index:02d}-{compiler_pass.name}.mlir")
    name_regions(module)
    # a chunked prefill program refuses calls longer than the chunk: check it on the first chunk
    example_inputs = fit_example_inputs(module, example_inputs)
    if paged_record(module) is not None:  # before any verification: the end-to-end check needs it
        _check_paged_example(paged_record(module), example_inputs)

    # 4. candidates: the reference (the replaced ATen ops) plus the advisor's top-k legal points,
    #    made once per distinct region (the layers of a model repeat the same regions)
    advice_log = AdviceLog(config.advisor)
    regions, distinct = _candidates(module, config, advice_log, out, progress, example_inputs)
    warnings += _advice_warnings(advice_log)

    # 5. verify: fuzz every template candidate against its region's reference, in a worker
    #    process so a crashing or hanging kernel only fails itself
    _verify(distinct, out, config, progress)

    # 6. select: measured latency on a GPU; without one, the advisor's best verified choice.
    #    A stateful step (decoder + KV cache) is replayed as a CUDA graph, so it is timed as one
    graphs = config.cuda_graphs if config.cuda_graphs is not None else _is_stateful(module)
    measured = _select(distinct, out, progress, cuda_graphs=graphs)
    by_name = {r.summary.name: r for r in distinct}
    for twin in (r for r in regions if r.same_as is not None):
        twin.follow(by_name[twin.same_as])

    # 7. emit: the program, the weights, the selection
    progress("emit", "program.py")
    _emit(module, program, imported, model, example_inputs, regions, out, config, measured, shared_weights)

    # 8. end to end: the built model against the original on fresh inputs; where a mix of verified
    #    kernels still disagrees, or loses to eager, fall back to the references (end_to_end.py)
    progress("end-to-end", "built model vs original")
    accuracy = None
    # paged-kv: the program takes a page table; it is checked as its static-cache original
    adapt = paged_as_static if paged_record(module) is not None else None

    # a model that writes its state where its own state moves (codegen/input_bounds.py) cannot be
    # called hundreds of times on one input: it is checked, not timed, end to end and step by step
    moved = state_moved_writes(module)
    if moved and measured:
        warnings.append(f"not timed end to end: the model writes {', '.join(moved)} at positions its own state "
                        "moves, so a timed loop of one call would write past them; the regions were timed alone")
    timed = measured and not moved

    def end_to_end(warnings: list[str]) -> tuple[dict, dict | None]:
        if config.lossy_passes:
            # a lossy pass changes numerics by design: measure its cost against the original instead
            return measure_lossy_end_to_end(
                model, example_inputs, regions, out, lossy_passes=config.lossy_passes, trials=config.e2e_trials,
                seed=config.seed, cuda_graphs=graphs, warnings=warnings,
                write_selection=lambda: write_selection(out, regions, measured), module=module, program=program,
                adapt=adapt)
        return check_end_to_end(model, example_inputs, regions, out, trials=config.e2e_trials, seed=config.seed,
                                measured=timed, stateful=_is_stateful(module), cuda_graphs=graphs,
                                warnings=warnings, write_selection=lambda: write_selection(out, regions, measured),
                                adapt=adapt), None

    e2e, accuracy = end_to_end(warnings)

    # 8b. launch: a graph-replayed step on sm_90+ is timed with PDL for its GEMVs (and for its GEMVs
    #     and attentions) and without, and the faster kept (selection.json "pdl"): whether PDL pays is the whole step's;
    #     each PDL option also with the GEMVs re-selected among their PDL-ready kernels (tune/pdl_ready.py)
    launch = None
    if graphs and timed and e2e.get("ok") and pdl_capable():
        progress("launch", "the step with and without PDL")
        alone = {r.summary.name: (r.selected, r.reason) for r in regions}
        launch = _choose_launch(out, example_inputs, regions, measured, warnings, adapt)
        if launch is not None and launch["reselected"]:
            # each switched kernel was verified alone; the mix is checked whole, as the first selection was
            progress("end-to-end", "the selection re-selected for PDL")
            e2e, accuracy, launch = _check_reselection(end_to_end, (e2e, accuracy), launch, alone, regions, out,
                                                       measured, warnings)

    # 9. record: report for people, manifest for tools, advice for replay
    result = BuildResult(out, regions, dict(counters), imported.fallback_targets, measured, e2e, warnings, graphs,
                         kv_calibration=kv_calibration, accuracy=accuracy, prefill_chunk=prefill_chunk(module),
                         unfused_ops=unfused_ops(module), launch=launch)
    result.seconds = time.monotonic() - start
    result.step_seconds = progress.totals()
    advice_log.write(out / "advice.json")
    write_manifest(out, config, model_path, result)
    write_build_record(out, config, model_path, result)
    write_report(out)
    return result


def paged_as_static(built):
    """A loaded paged-kv program behind the static-cache signature of the model it was built
    from (identity page table; coopt.runtime.paged.StaticView)."""
    from coopt.runtime.paged_layout import StaticView

    return StaticView(built, built.paged)


def _check_paged_example(record: dict, example_inputs) -> None:
    """The end-to-end check lays the caches out as pages, sequence b in pages b*J .. b*J+J-1
    (J = num_pages // batch, at most max_pages): the example call's positions must fit."""
    from coopt.errors import ConfigError
    from coopt.runtime.paged_layout import identity_pages

    index = record.get("positions_input")
    positions = example_inputs[index] if index is not None and index < len(example_inputs) else None
    per = identity_pages(record["batch"], record["max_pages"], record["num_pages"]) * record["page_size"]
    if isinstance(positions, torch.Tensor) and positions.numel() and int(positions.max()) >= per:
        raise ConfigError(
            f"paged-kv: num-pages={record['num_pages']} is too few to check the build against the original: its example "
            f"call holds {record['batch']} sequences up to position {int(positions.max())}, which needs "
            f"{record['batch']} x {int(positions.max()) // record['page_size'] + 1} pages of {record['page_size']}")


def _on_build_device(model, example_inputs):
    """Model and inputs on the GPU if there is one (a copy: the caller's model is not moved)."""
    if not torch.cuda.is_available() or device_of(example_inputs).type == "cuda":
        return model, example_inputs
    import copy

    moved = [x.cuda() if isinstance(x, torch.Tensor) else x for x in example_inputs]
    return moved_in_place(copy.deepcopy(model), torch.device("cuda")), tuple(moved)


def moved_in_place(model: torch.nn.Module, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> torch.nn.Module:
    """`model` with its parameters and buffers on `device` and its floating ones in `dtype` (as
    `.to(device, dtype)` converts them), each tensor object keeping its identity: its contents
    swapped with its converted copy's (torch.utils.swap_tensors). `.to()` would put new buffer
    objects in the module, and whatever else held the old ones would keep them: transformers'
    StaticCache layers hold their caches on plain objects as well as in the exportable wrapper's
    buffers, and a moved wrapper's forward then wrote CPU caches with GPU rows (every transformers
    build failed on a GPU, session 42). A deep copy keeps those aliases; this keeps them through
    the conversion."""
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        to_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        if (device is None or tensor.device == device) and to_dtype == tensor.dtype:
            continue
        converted = tensor.detach().to(device=device if device is not None else tensor.device, dtype=to_dtype)
        if isinstance(tensor, torch.nn.Parameter):
            converted = torch.nn.Parameter(converted, requires_grad=tensor.requires_grad)
        torch.utils.swap_tensors(tensor, converted)
    return model


def _candidates(module, config: BuildConfig, advice_log, out: Path, progress, example_inputs=()) -> tuple[list[RegionBuild], list[RegionBuild]]:
    """(every region in program order, the distinct ones): a region equal to an earlier one
    becomes its twin and shares its candidate files instead of getting its own."""
    symbols = symbol_table(module)
    regions: list[RegionBuild] = []
    leaders: dict[str, RegionBuild] = {}
    for kernel in kernels(module):
        summary = _with_example_length(summarize(kernel, symbols), kernel, example_inputs)
        signature = region_signature(summary)
        if signature in leaders:
            regions.append(leaders[signature].twin(summary))
            continue
        progress("advise", summary.name)
        leaders[signature] = make_candidates(kernel, summary, config.target, config.advisor, advice_log, out, config.top_k)
        regions.append(leaders[signature])
    return regions, list(leaders.values())


def _with_example_length(summary, kernel, example_inputs):
    """A decode_attention region plans (advisor) and is timed (tune) at the cache length of the
    example call, not the whole cache: its lengths come from a user input (positions + 1), whose
    example value is known here."""
    import dataclasses

    from coopt.ir.region import lengths_offset
    from coopt.passes.raise_decode_attention import lengths_source

    if summary.family != "decode_attention" or "example_length" in summary.attrs:
        return summary
    source = lengths_source(kernel.inputs[summary.attrs.get("lengths_input", 3)])
    if source is None:
        return summary
    argument, offset = source
    example = example_inputs[argument.index] if argument.index < len(example_inputs) else None
    if not isinstance(example, torch.Tensor) or example.dtype.is_floating_point or example.numel() == 0:
        return summary
    offset += lengths_offset(summary)  # the input holds lengths - lengths_offset
    return dataclasses.replace(summary, attrs={**summary.attrs, "example_length": int(example.max()) + offset})


def _advice_warnings(advice_log) -> list[str]:
    """Advisor warnings (fallbacks, rejections), each once, for the report and the CLI."""
    seen: list[str] = []
    for entry in advice_log.entries.values():
        for line in entry.get("warnings", []):
            if line not in seen:
                seen.append(line)
    return seen


def _verify(regions: list[RegionBuild], out: Path, config: BuildConfig, progress) -> None:
    from coopt.verify.isolated import VerifyWorker

    results = {}
    # one worker for the whole build (restarted only when a candidate kills it): a process
    # start costs seconds (torch import, CUDA init), a candidate's check usually less
    with VerifyWorker() as worker:
        for region in regions:
            templates = [c for c in region.candidates if c.family != REFERENCE]
            for index, candidate in enumerate(templates, start=1):
                progress("verify", f"{region.summary.name}: {candidate.label} ({index}/{len(templates)})")
                verdict = worker.verify(
                    region.summary, out / region.candidates[0].module, out / candidate.module,
                    label=candidate.label, timeout_s=config.candidate_timeout_s, profile=config.verify_profile,
                    seed=config.seed, repro_dir=out / "verify" / "repro",
                )
                candidate.verified = verdict.ok
                candidate.verify = _verdict_json(verdict)
            if templates:
                results[region.summary.name] = {c.label: c.verify for c in templates}
    (out / "verify").mkdir(parents=True, exist_ok=True)
    (out / "verify" / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True))


def _verdict_json(verdict) -> dict:
    return verdict.to_json()


def _is_stateful(module: ModuleOp) -> bool:
    from coopt.ir.dialect import StateUpdateOp, StateWriteOp

    return any(isinstance(op, (StateWriteOp, StateUpdateOp)) for op in module.walk())


def _select(regions: list[RegionBuild], out: Path, progress, *, cuda_graphs: bool = False) -> bool:
    from coopt.tune.measure import TimingJob, gpu_available, measure_jobs
    from coopt.tune.select import select_candidate

    measured = gpu_available()
    all_measurements = [{} for _ in regions]
    if measured:
        # every region's verified candidates, plus its reference through torch.compile (the
        # comparison point the report names), timed in one worker: one CUDA start per build
        progress("measure", f"{sum(len(r.candidates) for r in regions) + len(regions)} timings, {len(regions)} regions")
        jobs = [
            TimingJob(
                r.summary,
                {**{c.label: out / c.module for c in r.candidates if c.verified}, INDUCTOR: out / r.candidates[0].module},
                inductor_labels=frozenset({INDUCTOR}),
            )
            for r in regions
        ]
        all_measurements = measure_jobs(jobs, cuda_graph=cuda_graphs)
    for region, measurements in zip(regions, all_measurements):
        if measured:
            inductor = measurements.pop(INDUCTOR)
            region.inductor_ms = inductor.median_ms if inductor.error is None else None
            for c in region.candidates:
                if c.label in measurements and measurements[c.label].error is None:
                    c.latency_ms = measurements[c.label].median_ms
        region.selected, region.reason = select_candidate([c.to_json() for c in region.candidates], measurements)
    return measured


INDUCTOR = "torch.compile"


def _emit(module, program, imported, model, example_inputs, regions, out, config, measured, shared_weights=None) -> None:
    params = _forward_params(model, len(imported.user_input_names))
    paged = paged_record(module)
    if paged is not None:  # paged-kv added the page table (and with exact-recent rings, their slots) last
        params = [*params, PAGE_TABLE, *([RING_SLOTS] if paged.get("ring_slots_input") is not None else [])]
    out_spec = torch.utils._pytree.treespec_dumps(program.call_spec.out_spec)
    source = program_source(
        module,
        model_name=type(model).__name__,
        target=config.target.name,
        params=params,
        out_spec=out_spec,
        regions=[r.summary.name for r in regions],
    )
    (out / "program.py").write_text(source)
    state = {**program.state_dict, **program.constants}
    weights = program_weights(module, state)
    if shared_weights is not None:
        import os

        stored = set(stored_state(shared_weights))
        weights = {name: t for name, t in weights.items() if name not in stored}
        shared = {"weights": os.path.relpath(shared_weights, out), "names": sorted(stored)}
        (out / "shared_weights.json").write_text(json.dumps(shared, indent=1))
    save_state(weights, out)  # weights.pt, and zeros.json for the all-zero state (KV caches)
    write_selection(out, regions, measured)


def program_weights(module: ModuleOp, state: dict) -> dict:
    """The tensors the final program reads or writes, by state name: weights that passes merged
    (fuse-parallel-linears) and expressions of weights (fold-constants) are materialised here, and
    parts no longer read are not stored; fp8 KV caches (fp8-kv-cache) are stored quantized, beside
    their scales (coopt.fp8_cache)."""
    from coopt.fp8_cache import fp8_record, fp8_weights
    from coopt.ir.dialect import StateUpdateOp, StateWriteOp, WeightOp
    from coopt.passes.fold_constants import compute_constant, constants_record
    from coopt.passes.fuse_parallel_linears import concat_parts
    from coopt.runtime.paged_layout import cache_to_pages, rings_to_slots

    record = fp8_record(module)  # fp8-kv-cache: quantized caches and their scales
    fp8 = fp8_weights(record, state) if record is not None else {}
    paged = paged_record(module)  # paged-kv: each cache's contents laid out as pages
    constants = constants_record(module)  # fold-constants: weight-only expressions

    def value(name: str) -> torch.Tensor:
        if name in fp8:
            return fp8[name]
        if name in constants:
            return compute_constant(constants[name], value)
        parts = concat_parts(name)
        return torch.cat([value(p) for p in parts], dim=0) if parts else state[name]

    weights = {}
    for op in module.walk():
        if not isinstance(op, (WeightOp, StateWriteOp, StateUpdateOp)) or op.ref.data in weights:
            continue
        name = op.ref.data
        tensor = value(name)
        if paged is not None and name in paged["pools"]:
            tensor = cache_to_pages(tensor, paged["batch"], paged["num_pages"], paged["page_size"], paged["max_pages"])
        if paged is not None and name in paged.get("rings", {}):  # exact-recent rings: row b's in slot b
            tensor = rings_to_slots(tensor, paged["batch"], paged["ring_slots"])
        weights[name] = tensor.detach().clone()
    return weights


def write_selection(out: Path, regions: list[RegionBuild], measured: bool, pdl: list[str] | None = None,
                    pdl_regions: dict[str, bool] | None = None) -> None:
    """out/selection.json: each region's candidates and the one selected, (`pdl`) the kinds of
    kernel launched with PDL and (`pdl_regions`) the regions launched otherwise than their kind,
    as the build measured them (program.py reads all three)."""
    data = {"measured": measured, "regions": {r.summary.name: r.to_json() for r in regions}, "pdl": list(pdl or ()),
            "pdl_regions": dict(pdl_regions or {})}
    (out / "selection.json").write_text(json.dumps(data, indent=2, sort_keys=True))


def _choose_launch(out: Path, example_inputs, regions: list[RegionBuild], measured: bool, warnings: list[str],
                   adapt=None) -> dict | None:
    """Load the emitted build, time its replayed step with and without PDL (tune/launch.py), also
    with the regions' PDL-ready kernels switched in (tune/pdl_ready.py), and record the fastest in
    selection.json; None (and a warning) where timing it failed. `adapt` (paged-kv:
    paged_as_static) puts the program behind the example call's signature, as for the end-to-end
    check."""
    from coopt.runtime.loader import load
    from coopt.tune.launch import switch_set
    from coopt.tune.pdl_ready import apply_reselection, ready_switches, swap_runs

    try:
        built = load(out)
        switches = ready_switches(regions)
        with torch.no_grad():
            launch = choose_pdl(adapt(built) if adapt is not None else built, example_inputs,
                                switches={suffix: swap_runs(swaps, out) for suffix, swaps in switches.items()})
    except Exception as error:  # noqa: BLE001 - launching without PDL is always correct
        warnings.append(f"the step could not be timed with PDL ({one_line(error)}): launched without it")
        return None
    if launch is None:  # no kernel PDL is tried for: nothing measured, nothing to record
        return None
    # each switched kernel was verified with its region; the caller checks the mix end to end
    apply_reselection(regions, switches.get(switch_set(launch["label"]), {}), launch["step_ms"], launch["label"])
    write_selection(out, regions, measured, pdl=launch["pdl"], pdl_regions=launch.get("pdl_regions"))
    return launch


def _check_reselection(end_to_end, before: tuple, launch: dict, alone: dict, regions: list[RegionBuild], out: Path,
                       measured: bool, warnings: list[str]) -> tuple[dict, dict | None, dict]:
    """The end-to-end check again over the selection the launch step switched for PDL: kept where
    it passes (its record replaces the first), else every region back to its selection alone
    (`alone`: {region: (selected, reason)}), launched without PDL, and a warning. Returns (e2e,
    accuracy, launch)."""
    scratch: list[str] = []
    e2e, accuracy = end_to_end(scratch)
    if e2e.get("ok"):
        warnings.extend(scratch)
        write_selection(out, regions, measured, pdl=launch["pdl"], pdl_regions=launch.get("pdl_regions"))
        return e2e, accuracy, launch
    for region in regions:
        region.selected, region.reason = alone[region.summary.name]
    write_selection(out, regions, measured, pdl=[])
    warnings.append(f"the selection switched to PDL-ready kernels ({launch['label']}) failed the end-to-end check: "
                    "kept each region's own selection, launched without PDL")
    return (*before, {**launch, "pdl": [], "label": "none", "reselected": {}, "pdl_regions": {},
                      "reverted": "the switched selection failed the end-to-end check"})


def _forward_params(model, count: int) -> list[str]:
    import inspect

    names = []
    for p in inspect.signature(model.forward).parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    names = names[:count]
    return names if len(names) == count else [f"input_{i}" for i in range(count)]


