"""The public API: `coopt.Pipeline`, `coopt.build`, `coopt.load`. The CLI is a thin layer over it.

Example:

    import coopt
    pipe = coopt.Pipeline("raise-patterns,fuse-elementwise{max-ops=8}", target="h100")
    result = pipe.build(model, (x,), "out/mlp")
    fast = coopt.load("out/mlp")
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from coopt.runtime.kernel_loader import use_interpreter_without_gpu

# Before anything imports triton.language: its own jit helpers (tl.cdiv, ...) are decorated
# at import, and the interpreter cannot call non-interpreted ones (measured: RuntimeError
# "Cannot call @triton.jit'd outside of the scope of a kernel" after torch.export had
# imported triton).
use_interpreter_without_gpu()

from coopt.compile import BuildConfig, BuildResult, compile_model  # noqa: E402
from coopt.emit.outdir import ensure_free_space, staged_out_dir  # noqa: E402
from coopt.emit.report import record_entry_points  # noqa: E402
from coopt.emit.state_file import stored_bytes  # noqa: E402
from coopt.passes.registry import DEFAULT_PIPELINE, parse_pipeline_text  # noqa: E402
from coopt.targets import Target, get_target  # noqa: E402


class Pipeline:
    """A configured compiler: passes (a pipeline string or pass objects), a target, an advisor.

    `advisor` is a name ("heuristic", "openai", "replay", or a plugin's) or an Advisor object.
    `kv_cache="fp8"` stores KV caches in float8_e4m3fn (adds the lossy fp8-kv-cache pass after
    raise-patterns; the build then reports its measured accuracy cost), like `--kv-cache fp8`:

        coopt.Pipeline(kv_cache="fp8").build_file("examples/llama/model.py", "out/llama-fp8")

    `paged_kv=P` stores each KV cache as a pool of pages of P positions read and written through a
    `page_table` input (adds paged-kv{page-size=P} after raise-patterns / fp8-kv-cache), like
    `--paged-kv P`; the built model is driven by `coopt.runtime.serve.PagedDecoder`.

    `prefill_chunk=N` bounds the prompt length of each entry point exported with a dynamic one
    (a decoder's prefill) by N tokens (adds chunked-prefill{chunk=N} to that entry's pipeline;
    the T = 1 decode step is left alone): `generate()` then prefills a long prompt N tokens per
    call, like `--prefill-chunk N`.
    """

    def __init__(
        self,
        passes: str | list = DEFAULT_PIPELINE,
        target: str | Target = "h100",
        advisor="heuristic",
        *,
        advisor_url: str | None = None,
        advisor_model: str | None = None,
        advice_file: str | Path | None = None,
        strict_advice: bool = False,
        top_k: int = 3,
        verify_profile: str = "ci",
        seed: int = 0,
        candidate_timeout_s: float = 300.0,
        cuda_graphs: bool | None = None,
        kv_cache: str = "none",
        prefill_chunk: int | None = None,
        paged_kv: int | None = None,
    ):
        from coopt.compile import with_kv_cache, with_paged_kv
        from coopt.llm_advisor import make_advisor

        self.pipeline_text = passes if isinstance(passes, str) else ",".join(p.name for p in passes)
        self.passes = parse_pipeline_text(passes) if isinstance(passes, str) else list(passes)
        self.passes, self.pipeline_text = with_kv_cache(self.passes, self.pipeline_text, kv_cache)
        self.passes, self.pipeline_text = with_paged_kv(self.passes, self.pipeline_text, paged_kv)
        self.kv_cache = kv_cache
        self.paged_kv = paged_kv
        self.target = target if isinstance(target, Target) else get_target(target)
        if advice_file is not None and advisor == "heuristic":
            advisor = "replay"
        if isinstance(advisor, str):
            self.advisor_name = advisor
            self.advisor = make_advisor(
                advisor, base_url=advisor_url, model=advisor_model, advice_file=advice_file, strict=strict_advice
            )
        else:
            self.advisor_name = getattr(advisor, "name", type(advisor).__name__)
            self.advisor = advisor
        self.top_k = top_k
        self.verify_profile = verify_profile
        self.seed = seed
        self.candidate_timeout_s = candidate_timeout_s
        self.cuda_graphs = cuda_graphs
        self.prefill_chunk = prefill_chunk
        if prefill_chunk is not None:  # a bad chunk fails now, not after capture
            from coopt.passes.chunked_prefill import ChunkedPrefill

            ChunkedPrefill(prefill_chunk)

    def config(self) -> BuildConfig:
        return BuildConfig(
            target=self.target,
            passes=self.passes,
            pipeline_text=self.pipeline_text,
            advisor=self.advisor,
            advisor_name=self.advisor_name,
            top_k=self.top_k,
            verify_profile=self.verify_profile,
            seed=self.seed,
            candidate_timeout_s=self.candidate_timeout_s,
            cuda_graphs=self.cuda_graphs,
            kv_cache=self.kv_cache,
            prefill_chunk=self.prefill_chunk,
            paged_kv=self.paged_kv,
        )

    def build(self, model, example_inputs, out_dir, *, dynamic_shapes=None, force=False, progress=None, model_path=None,
              entry_points: dict | None = None, calibration_inputs=None) -> BuildResult:
        """Compile `model` on `example_inputs` into `out_dir` (written atomically).

        `entry_points` ({name: (example inputs, dynamic_shapes or None)}) are more ways to call
        the same model (a decoder's prefill next to its decode step): each is built into
        `out_dir/entries/<name>/`, sharing the main entry's weights and state, and the loaded
        model carries them as `model.entry_points[name]`. `calibration_inputs` ([input tuple,
        ...] of forward; default the example inputs) calibrate an fp8 KV cache's scales, once,
        for the main entry: the entries share its caches and so its scales.
        """
        kwargs = {"progress": progress} if progress else {}
        if self.prefill_chunk is not None and dynamic_shapes is None and not any(d for _, d in (entry_points or {}).values()):
            raise _no_prompt_to_chunk()
        with staged_out_dir(Path(out_dir), force) as staging, _device_memory_as_error("the build"):
            # the weights are written last, after the tuning: refuse now where they cannot fit
            ensure_free_space(staging, stored_bytes(list(model.parameters())), "the model's weights")
            result = compile_model(
                model, tuple(example_inputs), staging, self.config(), dynamic_shapes=dynamic_shapes, model_path=model_path,
                calibration_inputs=calibration_inputs, **kwargs
            )
            for name, (inputs, dynamic) in (entry_points or {}).items():
                entry_progress = {"progress": lambda step, detail="", n=name: progress(step, f"[{n}] {detail}")} if progress else {}
                entry = compile_model(
                    model, tuple(inputs), staging / "entries" / name, self.config(), dynamic_shapes=dynamic,
                    model_path=model_path, shared_weights=staging / "weights.pt", kv_calibration=result.kv_calibration,
                    **entry_progress,
                )
                result.entries[name] = entry
                result.seconds += entry.seconds
            if self.prefill_chunk is not None and not any(r.prefill_chunk for r in (result, *result.entries.values())):
                raise _no_prompt_to_chunk()
            if result.entries:
                record_entry_points(staging, result)
        result.out_dir = Path(out_dir).resolve()
        return result

    def build_file(self, model_file, out_dir, *, force=False, progress=None) -> BuildResult:
        """Compile a KernelBench-style model file (Model, get_inputs, get_init_inputs)."""
        from coopt.emit.outdir import check_out_dir
        from coopt.frontend.model_file import load_model_file

        check_out_dir(Path(out_dir).resolve(), force)  # refuse before spending time on the model
        loaded = load_model_file(model_file, seed=self.seed)
        return self.build(
            loaded.model, loaded.example_inputs, out_dir,
            dynamic_shapes=loaded.dynamic_shapes, force=force, progress=progress, model_path=loaded.path,
            entry_points=loaded.entry_points, calibration_inputs=loaded.calibration_inputs,
        )


@contextlib.contextmanager
def _device_memory_as_error(during: str, advice: str = "the model, its build and the end-to-end check's copies must "
                            "fit together; use a GPU with more memory or build for fewer rows or a shorter cache"):
    """torch's out-of-memory error as a DeviceMemoryError (exit 11) with the first sentences of its
    message (what was asked, what was free), not an internal error with a page of advice."""
    import torch

    from coopt.errors import DeviceMemoryError

    try:
        yield
    except torch.OutOfMemoryError as error:
        said = str(error).split(" Including non-PyTorch memory")[0].strip()
        raise DeviceMemoryError(f"the GPU ran out of memory during {during} ({said}): {advice}") from error


def _no_prompt_to_chunk():
    from coopt.errors import ConfigError

    return ConfigError("--prefill-chunk: no entry point of the model has a dynamic prompt length to chunk (a decoder step "
                       "forward(tokens [B, T], positions [T]) exported with T dynamic, e.g. a prefill entry point)")


def build(model_file, out_dir, *, target: str = "h100", pipeline: str = DEFAULT_PIPELINE, force: bool = False, progress=None, **options) -> BuildResult:
    """`coopt build` as a function: `coopt.build("examples/mlp.py", "out/mlp")`."""
    return Pipeline(pipeline, target, **options).build_file(model_file, out_dir, force=force, progress=progress)


def tune(out_dir, *, timeout_s: float = 60.0) -> dict:
    """`coopt tune` as a function: measure a build's verified candidates on this GPU, reselect,
    and render out/report.md again; entry points too. Returns {region: {"old_selected", "selected",
    "reason"}}, an entry point's regions as "<entry>/<region>"."""
    from coopt.emit.report import write_report
    from coopt.tune.retune import tune_build_dir

    with _device_memory_as_error("coopt tune", "it measures the candidates on the build as loaded: use a GPU with "
                                 "the memory of the one it was built on"):
        summary = tune_build_dir(Path(out_dir), timeout_s=timeout_s)
        write_report(Path(out_dir))
        # the artifact's other entry points (out/entries/<name>) are measured the same way
        for entry in sorted(Path(out_dir).glob("entries/*/selection.json")):
            entry_summary = tune_build_dir(entry.parent, timeout_s=timeout_s)
            write_report(entry.parent)
            summary.update({f"{entry.parent.name}/{region}": result for region, result in entry_summary.items()})
    return summary
