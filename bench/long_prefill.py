"""Long prompt (issue 4): chunked prefill of a 131072-token prompt at batch 1, peak GPU memory and
time, against unchunked, eager and coopt, in one run on one GPU.

    python bench/long_prefill.py --out long.json          # 8 Llama-3-8B layers, 131072 tokens, chunk 4096
    python bench/long_prefill.py --quick                  # 16384 tokens
    python bench/long_prefill.py --chunk 2048,8192        # one coopt build per chunk
    python bench/long_prefill.py --preset tiny --prompt 64 --chunk 16 --reference-program   # CPU smoke

The model is examples/llama/model.py (a preset's dimensions, random weights, `--dtype`), its KV
cache sized for the prompt (batch 1, `--cache`, default the prompt), the prompt written at
positions 0 .. T-1. Variants (`--variants`):

- `eager`: the model file's prefill on the whole prompt in one call (if it fits: an OOM is a result);
- `eager-chunked`: the same model called chunk by chunk, each chunk attending to the cache the
  chunks before it wrote (the memory bound chunking buys, without coopt);
- `coopt`: a build of the prefill entry, prompt length dynamic up to the cache, called once;
- `coopt-chunked`: a build with `Pipeline(prefill_chunk=C)` (`--prefill-chunk C`), called per chunk
  as `coopt.generate` prefills (a 1-token tail, which the entry refuses, borrows a token).

Per variant: one untimed call (kernels compile; its last-position logits are compared with eager),
then `--repeat` timed calls: seconds (CUDA events around the whole call or chunk loop, after a
synchronize), tokens/s, and the peak of torch.cuda.max_memory_allocated over the memory allocated
before the timed calls (weights, cache, the loaded build: the baseline). The full-prompt logits
[1, T, vocab] are part of what a call allocates (the model file returns every position's), so the
table also prints the logits bytes of one call. Agreement: max abs error of the last position's
logits against eager unchunked (else the smallest-chunk eager run, else an untimed eager prefill in
chunks of 512), and whether their argmax agrees.

Builds are the minimum: one without a chunk, one per chunk. Each build checks its program against
a float64 copy of the model on its example prompt (`--example` tokens; default bounded so the
float64 attention scores [heads, example, cache] stay under 8 GiB), and selects kernels measured
at that length; one selection serves every length of the dynamic prompt.
Without CUDA (Triton's interpreter) times are reported and memory is n/a.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("eager", "eager-chunked", "coopt", "coopt-chunked")
FLOAT64_SCORES_BUDGET = 8 << 30  # bytes of the build check's float64 attention scores (see --example)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3-8b", help="examples/llama/model.py preset")
    parser.add_argument("--layers", type=int, default=None, help="default 8 for llama-3-8b, else the preset's")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--prompt", type=int, default=131072, help="prompt tokens (batch 1)")
    parser.add_argument("--quick", action="store_true", help="a 16384-token prompt (overrides --prompt)")
    parser.add_argument("--cache", type=int, default=None, help="KV cache positions (default: the prompt)")
    parser.add_argument("--chunk", default="4096", help="prefill chunk(s), comma-separated: one coopt build each")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    parser.add_argument("--example", type=int, default=None,
                        help="prompt tokens of the builds' example call (default: min(chunk, 1024), bounded by "
                             "the float64 check's memory)")
    parser.add_argument("--repeat", type=int, default=2, help="timed calls per variant (after one untimed)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--pipeline", default=None, help="pass pipeline of the builds (default: coopt's)")
    parser.add_argument("--reference-program", action="store_true",
                        help="build without kernel regions (the ATen program the kernels are verified against): "
                             "seconds on a CPU; for smoke tests, not for reported numbers")
    parser.add_argument("--seed", type=int, default=0, help="the prompt's token ids")
    parser.add_argument("--build-dir", type=Path, default=None, help="keep the builds in DIR/<name> (default: a temp dir)")
    parser.add_argument("--keep-weights", action="store_true",
                        help="keep each build's weights.pt (weights and the cache: ~10 GB at the defaults)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results, rewritten after every variant")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt = 16384
    args.cache = args.cache or args.prompt
    args.chunks = sorted({int(c) for c in args.chunk.split(",") if c})
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choices: {', '.join(VARIANTS)}")
    if args.layers is None:
        args.layers = 8 if args.preset == "llama-3-8b" else None
    if args.prompt < 2 or args.cache < args.prompt:
        parser.error(f"--prompt {args.prompt} must be >= 2 and fit the cache ({args.cache})")
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ── the prompt in chunks ──────────────────────────────────────────────────────────────────────────


def chunk_plan(length: int, chunk: int | None, shortest: int = 2) -> list[tuple[int, int]]:
    """[(start, end)] covering 0 .. length in calls of at most `chunk` tokens (one call without a
    chunk). A prefill entry takes at least `shortest` tokens per call: a shorter tail borrows the
    tokens it lacks from the call before it, so there are still ceil(length / chunk) calls.

    >>> chunk_plan(40, 16)
    [(0, 16), (16, 32), (32, 40)]
    >>> chunk_plan(33, 16)
    [(0, 16), (16, 31), (31, 33)]
    """
    if chunk is None or chunk >= length:
        return [(0, length)]
    if chunk < 2 * shortest - 1:  # the call before a short tail must keep `shortest` after lending
        raise ValueError(f"chunk {chunk} is too short for calls of at least {shortest} tokens")
    bounds = list(range(0, length, chunk)) + [length]
    if length - bounds[-2] < shortest:
        bounds[-2] = length - shortest
    return list(zip(bounds[:-1], bounds[1:]))


def default_example(args, heads: int) -> int:
    """Prompt tokens of the builds' example call: min(smallest chunk, 1024), at most what keeps
    the float64 end-to-end check's attention scores (8 bytes x heads x example x cache) under
    FLOAT64_SCORES_BUDGET, a power of two, at least 16 (and at most the prompt)."""
    if args.example is not None:
        return args.example
    bound = FLOAT64_SCORES_BUDGET // (8 * heads * args.cache)
    example = min(args.chunks[0], 1024, 1 << max(4, bound.bit_length() - 1))
    return max(2, min(example, args.prompt))


# ── the model and its builds ──────────────────────────────────────────────────────────────────────


def load_model(args, example: int, device):
    """examples/llama/model.py at batch 1 with a cache of `args.cache` positions, and its prefill
    entry point's (example inputs, dynamic shapes) with an `example`-token prompt."""
    env = {"COOPT_LLAMA_PRESET": args.preset, "COOPT_LLAMA_BATCH": "1", "COOPT_LLAMA_POS": "0",
           "COOPT_LLAMA_MAX_SEQ": str(args.cache), "COOPT_EXAMPLE_DTYPE": args.dtype,
           "COOPT_LLAMA_PREFILL": str(example), "COOPT_LLAMA_RAGGED": "0"}
    if args.layers is not None:
        env["COOPT_LLAMA_LAYERS"] = str(args.layers)
    os.environ.update(env)
    from coopt.frontend.model_file import load_model_file

    loaded = load_model_file(ROOT / "examples" / "llama" / "model.py")
    inputs, dynamic = loaded.entry_points["prefill"]
    return loaded.model.to(device).eval(), tuple(x.to(device) for x in inputs), dynamic


def build(model, inputs, dynamic, args, chunk: int | None, build_root: Path):
    """One coopt build of the prefill (chunked when `chunk`), loaded; and its build seconds."""
    import coopt
    from coopt.accuracy.builds import REFERENCE_PIPELINE
    from coopt.passes.registry import DEFAULT_PIPELINE

    passes = args.pipeline or (REFERENCE_PIPELINE if args.reference_program else DEFAULT_PIPELINE)
    out = build_root / (f"prefill-chunk{chunk}" if chunk else "prefill")
    start = time.monotonic()

    def progress(step, detail=""):
        log(f"    {time.monotonic() - start:7.1f}s [{step}] {detail}")

    coopt.Pipeline(passes, top_k=args.top_k, prefill_chunk=chunk).build(
        model, inputs, out, dynamic_shapes=dynamic, force=True, progress=progress)
    built = coopt.load(out)
    if not args.keep_weights:  # loaded: the disk copy of the weights and the cache is not needed
        (out / "weights.pt").unlink(missing_ok=True)
    return built, time.monotonic() - start, out


# ── one variant ───────────────────────────────────────────────────────────────────────────────────


def prefill_runner(step, tokens, plan):
    """A function prefilling `tokens` [1, T] through `step` call by call; returns the last
    position's logits [vocab] (each call's full logits are dropped before the next call)."""
    import torch

    def run():
        with torch.no_grad():
            for start, end in plan:
                logits = step(tokens[:, start:end], torch.arange(start, end, device=tokens.device))
                last = logits[0, -1].clone()
                del logits
        return last

    return run


def measure(run, repeat: int, device) -> dict:
    """One untimed call (its logits), then `repeat` timed calls: seconds each, and on CUDA the
    peak allocated over the memory allocated before them."""
    import torch

    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    last = run()
    record = {"seconds": [], "baseline_bytes": None, "peak_bytes": None}
    if cuda:
        torch.cuda.synchronize()
        record["baseline_bytes"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeat):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record()
            run()
            end.record()
            torch.cuda.synchronize()
            record["seconds"].append(begin.elapsed_time(end) / 1e3)
        else:
            begin_s = time.perf_counter()
            run()
            record["seconds"].append(time.perf_counter() - begin_s)
    if cuda:
        record["peak_bytes"] = torch.cuda.max_memory_allocated() - record["baseline_bytes"]
    return record, last


def run_variant(name: str, chunk: int | None, step, tokens, args, device, vocab: int, element_bytes: int) -> tuple[dict, object]:
    """The row of one variant (status "ok", "OOM" or "error") and its last logits (None unless ok)."""
    import torch

    plan = chunk_plan(tokens.shape[1], chunk)
    row = {"variant": name, "chunk": chunk, "calls": len(plan), "status": "ok",
           "logits_bytes_per_call": max(e - s for s, e in plan) * vocab * element_bytes}
    log(f"  {name}: {len(plan)} call(s) of up to {max(e - s for s, e in plan)} tokens")
    try:
        record, last = measure(prefill_runner(step, tokens, plan), args.repeat, device)
    except torch.cuda.OutOfMemoryError as error:
        row.update(status="OOM", error=str(error).splitlines()[0])
        log(f"  {name}: out of memory ({row['error'][:160]})")
        return row, None
    except Exception as error:  # noqa: BLE001 - a failing variant is a result; the others still run
        row.update(status="error", error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        log(f"  {name}: {row['error'][:300]}")
        return row, None
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    seconds = statistics.median(record["seconds"]) if record["seconds"] else float("nan")
    row.update(record, median_s=seconds, tokens_per_s=tokens.shape[1] / seconds if record["seconds"] else None)
    peak = f"{row['peak_bytes'] / 2**30:.2f} GiB over baseline" if row["peak_bytes"] is not None else "memory n/a"
    log(f"  {name}: {seconds:.3f} s, {row['tokens_per_s'] or 0:,.0f} tokens/s, {peak}")
    return row, last.float().cpu()


def compare(row: dict, last, reference: str, expected) -> None:
    """A row's max abs error and argmax agreement of its last logits against the reference's."""
    row["reference"] = reference
    row["max_abs_err"] = float((last - expected).abs().max())
    row["top1_agrees"] = bool(last.argmax() == expected.argmax())


def pick_reference(rows: list[dict], logits: dict) -> str | None:
    """Eager unchunked if it ran, else the eager chunked run of the smallest chunk."""
    eager = [r for r in rows if r["variant"].startswith("eager") and r["variant"] in logits]
    eager.sort(key=lambda r: (r["chunk"] is not None, r["chunk"] or 0))
    return eager[0]["variant"] if eager else None


def coopt_variant(chunk: int | None, model, inputs, dynamic, tokens, args, device, vocab, element_bytes, build_root):
    """Build, load and measure one coopt variant: (row, last logits or None)."""
    name = f"coopt chunk {chunk}" if chunk else "coopt"
    log(f"  building {name}")
    try:
        built, seconds, out = build(model, inputs, dynamic, args, chunk, build_root)
    except Exception as error:  # noqa: BLE001 - a failed build is a result; the other variants still run
        row = {"variant": name, "chunk": chunk, "calls": len(chunk_plan(args.prompt, chunk)), "status": "build failed",
               "error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
        log(f"  {name}: build failed: {row['error'][:300]}")
        return row, None
    row, last = run_variant(name, chunk, built, tokens, args, device, vocab, element_bytes)
    # the build's own contract (DECODER): the longest call it takes, its prefill chunk
    row.update(build_s=seconds, build_dir=str(out) if args.build_dir else None, build_length=built.decoder["length"],
               build_prefill_chunk=built.decoder.get("prefill_chunk"))
    return row, last


# ── the run ───────────────────────────────────────────────────────────────────────────────────────


def environment(device) -> dict:
    import torch
    import triton

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10, cwd=ROOT).stdout.strip()
        except OSError:
            return ""

    commit = git("rev-parse", "HEAD")  # a copied tree without .git (the GPU machine): COOPT_COMMIT, if set
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "none (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
        "host": platform.node(),
        "commit": commit or os.environ.get("COOPT_COMMIT", "unknown"),
        "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None,
        "command": " ".join(sys.argv),
    }


def run(args) -> dict:
    import torch

    from coopt.runtime.kernel_loader import use_interpreter_without_gpu

    use_interpreter_without_gpu()  # before anything imports triton.language (environment() does)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from coopt.frontend.model_file import import_model_file

    llama = import_model_file(ROOT / "examples" / "llama" / "model.py")
    heads = llama.ModelArgs.from_preset(args.preset).n_heads
    example = default_example(args, heads)
    env = environment(device)
    log(json.dumps(env))
    log(f"loading {args.preset} ({args.layers or 'all'} layers, {args.dtype}), cache {args.cache}, "
        f"prompt {args.prompt}, chunks {args.chunks}, build example {example} tokens")
    start = time.monotonic()
    model, inputs, dynamic = load_model(args, example, device)
    vocab, element_bytes = model.args.vocab_size, torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, vocab, (1, args.prompt), generator=generator).to(device)
    result = {"environment": env, "settings": {
        "preset": args.preset, "layers": model.args.n_layers, "dtype": args.dtype, "prompt": args.prompt,
        "cache": args.cache, "chunks": args.chunks, "example": example, "repeat": args.repeat,
        "pipeline": args.pipeline or ("reference program" if args.reference_program else "default"),
        "top_k": args.top_k, "device": str(device), "load_s": time.monotonic() - start}, "rows": []}
    log(f"  loaded in {result['settings']['load_s']:.0f}s")
    rows, logits = result["rows"], {}

    def record(row, last):
        rows.append(row)
        if last is not None:
            logits[row["variant"]] = last
            if result.get("reference"):
                compare(row, last, result["reference"], logits[result["reference"]])
        if args.out:
            args.out.write_text(json.dumps(result, indent=2))

    if "eager" in args.variants:
        record(*run_variant("eager", None, model, tokens, args, device, vocab, element_bytes))
    if "eager-chunked" in args.variants:
        for chunk in args.chunks:
            record(*run_variant(f"eager chunk {chunk}", chunk, model, tokens, args, device, vocab, element_bytes))
    result["reference"] = pick_reference(rows, logits)
    if result["reference"] is None:  # no eager run fitted (or none asked for): an untimed chunked eager prefill
        result["reference"] = "eager chunk 512 (reference)"
        log(f"  reference: {result['reference']}")
        logits[result["reference"]] = prefill_runner(model, tokens, chunk_plan(args.prompt, min(512, args.prompt)))().float().cpu()
    for row in rows:  # the eager runs against the reference, now that it is known
        if row["variant"] in logits:
            compare(row, logits[row["variant"]], result["reference"], logits[result["reference"]])
    build_root = args.build_dir or Path(tempfile.mkdtemp(prefix="coopt-long-prefill-"))
    builds = ([None] if "coopt" in args.variants else []) + (args.chunks if "coopt-chunked" in args.variants else [])
    for chunk in builds:
        record(*coopt_variant(chunk, model, inputs, dynamic, tokens, args, device, vocab, element_bytes, build_root))
        gc.collect()  # the loaded build goes before the next one is built
    if args.build_dir is None:
        shutil.rmtree(build_root, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


def table(result: dict) -> str:
    """The markdown table of a run's rows."""
    settings = result["settings"]
    gib = 2**30
    lines = [f"Prefill of {settings['prompt']} tokens at batch 1, {settings['preset']} ({settings['layers']} layers, "
             f"{settings['dtype']}), cache {settings['cache']}, {result['environment']['gpu']}; "
             f"time: median of {settings['repeat']}; peak: max allocated over the baseline (weights, cache, build)",
             "",
             "| variant | calls | s | tokens/s | peak over baseline GiB | baseline GiB | logits per call GiB | "
             f"max abs err vs {result.get('reference') or 'eager'} | top-1 | build s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        if row["status"] != "ok":
            logits_gib = f"{row['logits_bytes_per_call'] / gib:.3f}" if "logits_bytes_per_call" in row else "—"
            build_s = f"{row['build_s']:.0f}" if "build_s" in row else "—"
            lines.append(f"| {row['variant']} | {row['calls']} | {row['status']} | — | — | — | {logits_gib} | — | — | {build_s} |")
            continue
        peak = f"{row['peak_bytes'] / gib:.2f}" if row["peak_bytes"] is not None else "n/a"
        base = f"{row['baseline_bytes'] / gib:.2f}" if row["baseline_bytes"] is not None else "n/a"
        err = f"{row['max_abs_err']:.3g}" if "max_abs_err" in row else "—"
        top1 = ("yes" if row["top1_agrees"] else "no") if "top1_agrees" in row else "—"
        build_s = f"{row['build_s']:.0f}" if "build_s" in row else "—"
        lines.append(f"| {row['variant']} | {row['calls']} | {row['median_s']:.3f} | {row['tokens_per_s']:,.0f} | {peak} | "
                     f"{base} | {row['logits_bytes_per_call'] / gib:.3f} | {err} | {top1} | {build_s} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
