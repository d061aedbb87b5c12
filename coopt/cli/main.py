"""`coopt` command line: parses arguments, shows progress, prints results. The work is in coopt.api.

Exit codes: see coopt/errors.py (also `coopt --help`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from coopt.errors import CooptError

EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 2 usage; 3 model file; 4 torch.export failed; 5 bad configuration "
    "(target, pass, knob, --kv-cache fp8 without a KV cache); 6 output dir not empty or not writable (disk space); 7 advisor failed (strict); 8 end-to-end "
    "mismatch; 9 bad input file; 10 plugin error; 11 GPU out of memory; 70 internal error."
)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="coopt: compile PyTorch models into fast Triton kernels. " + EXIT_CODES_HELP)


def _fail(exc: CooptError, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"ok": False, "error": exc.message, "exit_code": exc.exit_code}))
    typer.echo(f"coopt: error: {exc.message}", err=True)
    raise typer.Exit(exc.exit_code)


def _run(fn, as_json: bool):
    """Run `fn`, turning coopt errors into one line + exit code and anything else into exit 70."""
    try:
        return fn()
    except CooptError as exc:
        _fail(exc, as_json)
    except KeyboardInterrupt:
        typer.echo("coopt: interrupted", err=True)
        raise typer.Exit(130)
    except Exception as exc:  # a bug: still one line, and the traceback only on request
        import os
        import traceback

        if os.environ.get("COOPT_TRACEBACK"):
            traceback.print_exc()
        _fail(CooptError(f"internal error: {type(exc).__name__}: {exc} (set COOPT_TRACEBACK=1 for details)"), as_json)


class _Progress:
    """One status line on stderr (rich), silent when stderr is not a terminal or with --quiet."""

    def __init__(self, quiet: bool):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.quiet = quiet
        self.status = None
        self.start = time.monotonic()

    def __enter__(self):
        if not self.quiet and self.console.is_terminal:
            self.status = self.console.status("starting")
            self.status.__enter__()
        return self

    def __call__(self, step: str, detail: str = "") -> None:
        if self.status is not None:
            self.status.update(f"[bold]{step}[/bold] {detail}")
        elif not self.quiet:
            # logs (CI, the GPU machine) get the elapsed time: it shows where a slow build waits
            self.console.print(f"{time.monotonic() - self.start:7.1f}s [{step}] {detail}", highlight=False, markup=False)

    def __exit__(self, *exc):
        if self.status is not None:
            self.status.__exit__(*exc)


@app.command()
def build(
    model_file: Path = typer.Argument(..., help="KernelBench-style model file (Model, get_inputs, get_init_inputs)"),
    out: Path = typer.Option(..., "-o", "--out", help="output directory (written atomically)"),
    target: str = typer.Option("h100", "--target", help="target GPU (h100, h200, or a plugin's)"),
    pipeline: Optional[str] = typer.Option(None, "-p", "--pipeline", help="pass pipeline, e.g. 'raise-patterns,fuse-elementwise{max-ops=8}'"),
    advisor: str = typer.Option("heuristic", "--advisor", help="heuristic | openai | replay | a plugin advisor"),
    advisor_url: Optional[str] = typer.Option(None, "--advisor-url", help="OpenAI-compatible base URL (key from $OPENAI_API_KEY)"),
    advisor_model: Optional[str] = typer.Option(None, "--advisor-model", help="model name for --advisor openai"),
    advice: Optional[Path] = typer.Option(None, "--advice", help="replay a recorded out/advice.json (no LLM)"),
    no_advisor_fallback: bool = typer.Option(False, "--no-advisor-fallback", help="fail (exit 7) instead of falling back to the heuristic"),
    top_k: int = typer.Option(3, "--top-k", help="template candidates per family and region"),
    profile: str = typer.Option("ci", "--verify-profile", help="fuzzing profile: ci (fast) or thorough"),
    seed: int = typer.Option(0, "--seed", help="seed for the model file's hooks (random weights, example inputs), fuzzing and end-to-end inputs"),
    cuda_graphs: Optional[bool] = typer.Option(
        None, "--cuda-graphs/--no-cuda-graphs",
        help="time candidates replayed in CUDA graphs (default: yes for models that write a KV cache)"),
    kv_cache: str = typer.Option(
        "none", "--kv-cache",
        help="KV-cache storage: none/bf16 (default: as the model), fp8 (lossy: adds fp8-kv-cache after raise-patterns, "
             "per-head calibrated scales, keys centred (smooth-k); the report measures the accuracy cost; exit 5 for a model "
             "without a KV cache), fp8-recent (fp8, each query's newest 4 keys read unrounded from a ring beside the cache: "
             "fp8-kv-cache{exact-recent=4}; with --paged-kv a ring slot a live sequence, knob max-sequences) or fp8-values (lossy: only the values in fp8, the keys kept: "
             "fp8-kv-cache{values-only})"),
    prefill_chunk: Optional[int] = typer.Option(
        None, "--prefill-chunk",
        help="tokens per prefill call (a power of two >= 16): adds chunked-prefill{chunk=N} to entry points with a "
             "dynamic prompt length, so a long prompt is prefilled chunk by chunk (exit 5 when there is none)"),
    paged_kv: Optional[int] = typer.Option(
        None, "--paged-kv",
        help="page size (16, 32, 64, 128 or 256): KV caches become page pools read and written through a page_table "
             "input (adds paged-kv{page-size=N} after raise-patterns / fp8-kv-cache; knobs num-pages and, with "
             "--kv-cache fp8-recent, max-sequences in the pipeline string; exit 5 for a model without a KV cache)"),
    force: bool = typer.Option(False, "--force", help="replace a non-empty output directory"),
    as_json: bool = typer.Option(False, "--json", help="print a machine-readable result on stdout"),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="no progress display"),
):
    """Compile MODEL_FILE into a loadable, verified build directory."""
    from coopt.api import Pipeline
    from coopt.passes.registry import DEFAULT_PIPELINE

    def work():
        pipe = Pipeline(
            pipeline or DEFAULT_PIPELINE, target, advisor,
            advisor_url=advisor_url, advisor_model=advisor_model, advice_file=advice,
            strict_advice=no_advisor_fallback, top_k=top_k, verify_profile=profile, seed=seed,
            cuda_graphs=cuda_graphs, kv_cache=kv_cache, prefill_chunk=prefill_chunk, paged_kv=paged_kv,
        )
        with _Progress(quiet or as_json) as progress:
            return pipe.build_file(model_file, out, force=force, progress=progress)

    result = _run(work, as_json)
    if as_json:
        print(json.dumps({"ok": True, **result.to_json()}, indent=2))
        return
    for line in result.warnings:
        typer.echo(f"coopt: warning: {line}", err=True)
    kernels = sum(r.selected != "reference" for r in result.regions)
    typer.echo(
        f"built {out} in {result.seconds:.1f}s: {len(result.regions)} regions, {kernels} on generated kernels, "
        f"{len(result.regions) - kernels} on the reference{_left_to_pytorch(result)}; "
        f"latency {'measured' if result.measured else 'unmeasured (run coopt tune on the GPU)'}; "
        f"report: {out / 'report.md'}"
    )


def _left_to_pytorch(result) -> str:
    """", N ops left to PyTorch" when known ops outside every region launch their own kernels
    (the report lists them), else nothing."""
    left = sum(result.unfused_ops.values())
    return f", {left} op{'s' if left != 1 else ''} left to PyTorch" if left else ""


@app.command()
def tune(
    out: Path = typer.Argument(..., help="a build directory"),
    timeout: float = typer.Option(60.0, "--timeout", help="seconds per candidate"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Re-measure the verified candidates of a build on this GPU and rewrite its selection."""
    from coopt.api import tune as tune_build

    summary = _run(lambda: tune_build(out, timeout_s=timeout), as_json)
    if as_json:
        print(json.dumps({"ok": True, "regions": summary}, indent=2, default=str))
    else:
        for region, info in summary.items():
            typer.echo(f"{region}: {info}")


@app.command()
def passes(as_json: bool = typer.Option(False, "--json")):
    """List the available passes with their knobs."""
    from coopt.passes.registry import DEFAULT_PIPELINE, available_passes, pass_knobs

    found = _run(available_passes, as_json)
    rows = {name: {"summary": getattr(cls, "summary", ""), "lossy": getattr(cls, "lossy", False),
                   "knobs": [{"name": n, "type": t, "default": d} for n, t, d in pass_knobs(cls)]}
            for name, cls in sorted(found.items())}
    if as_json:
        print(json.dumps({"default_pipeline": DEFAULT_PIPELINE, "passes": rows}, indent=2))
        return
    for name, row in rows.items():
        knobs = ", ".join(f"{k['name']}: {k['type']} = {k['default']}" for k in row["knobs"]) or "no knobs"
        typer.echo(f"{name}{' (lossy)' if row['lossy'] else ''}: {row['summary']}\n    knobs: {knobs}")
    typer.echo(f"\ndefault pipeline: {DEFAULT_PIPELINE}")


@app.command()
def opt(
    mlir_file: Path = typer.Argument(..., help="IR in the coopt dialect ('-' for stdin)"),
    pipeline: str = typer.Option(..., "-p", "--pipeline", help="passes to run"),
):
    """Run passes over a .mlir file and print the result (for IR tests)."""
    from coopt.ir.textio import parse_module, print_module
    from coopt.passes.registry import parse_pipeline_text

    def work():
        text = sys.stdin.read() if str(mlir_file) == "-" else _read(mlir_file)
        module = parse_module(text, str(mlir_file))
        from xdsl.context import Context

        ctx = Context(allow_unregistered=True)
        for compiler_pass in parse_pipeline_text(pipeline):
            compiler_pass.apply(ctx, module)
        module.verify()
        return print_module(module)

    typer.echo(_run(work, False), nl=False)


def _read(path: Path) -> str:
    from coopt.errors import InputFileError

    try:
        return path.read_text()
    except OSError as exc:
        raise InputFileError(f"cannot read '{path}': {exc.strerror}") from None


def main() -> None:
    import warnings

    # torch's pytree deprecation chatter is noise for a compiler user; real problems are errors
    warnings.filterwarnings("ignore", category=FutureWarning)
    app()


if __name__ == "__main__":
    main()
