"""Benchmark coopt against eager PyTorch and torch.compile, in one run on one GPU.

    python bench/run.py                                  # all examples, bench sizes, bf16
    python bench/run.py --examples mlp --size small --dtype float32 --out results.json

For each example: build with coopt (verified, measured selection), then time eager,
torch.compile (default), torch.compile (max-autotune) and the coopt build, and print one table.
Every variant is checked against eager first. Timing happens after all are built, in alternating
rounds (coopt.tune.interleaved: triton.testing.do_bench medians, L2 flushed between reps), so
the GPU's clock drift falls on every variant alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from progress import build_progress

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="mlp,minigpt_block,llama_layer")
    parser.add_argument("--size", default="bench", choices=["bench", "small"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--modes", default="eager,compile,max-autotune,reduce-overhead,coopt,coopt-graph",
                        help="reduce-overhead / coopt-graph: each replayed as a CUDA graph (no host cost a call)")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7,
                        help="timing rounds; each times every variant once, in turn (clock drift hits all alike)")
    parser.add_argument("--out", type=Path, default=None, help="write full results as JSON here")
    parser.add_argument("--build-dir", type=Path, default=None,
                        help="keep each coopt build (report.md, selection.json) in DIR/<example>")
    return parser.parse_args()


def environment() -> dict:
    import torch
    import triton

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
    }


def load_example(name: str, size: str, dtype: str):
    os.environ["COOPT_EXAMPLE_SIZE"] = size
    os.environ["COOPT_EXAMPLE_DTYPE"] = dtype
    from coopt.frontend.model_file import load_model_file

    loaded = load_model_file(EXAMPLES / f"{name}.py")
    model = loaded.model.cuda()
    inputs = tuple(x.cuda() for x in loaded.example_inputs)
    return model, inputs


def max_rel_err(actual, expected) -> float:
    import torch

    a, e = actual.float(), expected.float()
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-12))


def bench_example(name: str, args) -> dict:
    import torch

    import coopt
    from coopt.tune.interleaved import time_interleaved

    model, inputs = load_example(name, args.size, args.dtype)
    modes = args.modes.split(",")
    with torch.no_grad():
        expected = model(*inputs)
    row: dict = {"example": name, "dtype": args.dtype, "size": args.size, "ms": {}, "err": {}, "setup_s": {}}
    variants = {}

    def prepare(mode: str, fn, setup_s: float):
        """Check `fn` against eager now; time it later, interleaved with the other variants."""
        with torch.no_grad():
            row["err"][mode] = max_rel_err(fn(), expected)
        row["setup_s"][mode] = setup_s
        variants[mode] = fn
        print(f"  {name:14s} {mode:13s} rel err {row['err'][mode]:.2e}  setup {setup_s:6.1f}s", flush=True)

    if "eager" in modes:
        prepare("eager", lambda: model(*inputs), 0.0)
    for mode, options in (("compile", {}), ("max-autotune", {"mode": "max-autotune"}),
                          ("reduce-overhead", {"mode": "reduce-overhead"})):
        if mode in modes:
            torch._dynamo.reset()
            compiled = torch.compile(model, **options)
            start = time.monotonic()
            with torch.no_grad():
                compiled(*inputs)
            prepare(mode, lambda compiled=compiled: compiled(*inputs), time.monotonic() - start)
    if "coopt" in modes:
        parent = args.build_dir or Path(tempfile.mkdtemp(prefix="coopt-bench-"))
        out = parent / name
        start = time.monotonic()
        result = coopt.Pipeline(top_k=args.top_k).build(model, inputs, out, force=True, progress=build_progress())
        built = coopt.load(out)
        prepare("coopt", lambda: built(*inputs), time.monotonic() - start)
        if "coopt-graph" in modes:  # the same build replayed as one CUDA graph (inputs copied in)
            from coopt.runtime.cuda_graph import GraphedStep

            graphed = GraphedStep(built, inputs, check=False)
            prepare("coopt-graph", lambda: graphed(*inputs), 0.0)
        row["coopt_regions"] = {r.summary.name: {"selected": r.selected, "reason": r.reason,
                                                   "latency": {c.label: c.latency_ms for c in r.candidates}}
                                for r in result.regions}
        row["coopt_out"] = str(out)
    with torch.no_grad():
        row["ms"] = time_interleaved(variants, rounds=args.rounds)
        row["host_ms"] = {mode: host_ms(fn) for mode, fn in variants.items()}
    for mode, ms in row["ms"].items():
        print(f"  {name:14s} {mode:13s} {ms:9.4f} ms (median of {args.rounds} interleaved rounds), "
              f"host {row['host_ms'][mode]:.4f} ms a call", flush=True)
    return row


def host_ms(fn, calls: int = 50) -> float:
    """CPU milliseconds per call to enqueue `fn`'s work (the GPU idle beforehand, no sync between
    calls): where it exceeds the GPU time, the variant is bound by its Python and launch cost."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / calls * 1000


def table(rows: list[dict]) -> str:
    """Plain calls (coopt against eager, compile, max-autotune) and, where run, graph replays
    (coopt-graph against reduce-overhead)."""
    modes = ["eager", "compile", "max-autotune", "coopt", "reduce-overhead", "coopt-graph"]
    head = ("| example | " + " | ".join(f"{m} ms" for m in modes)
            + " | coopt vs eager | vs compile | vs max-autotune | coopt-graph vs reduce-overhead | coopt build s |")
    lines = [head, "|" + " --- |" * (len(modes) + 6)]
    for row in rows:
        ms = row["ms"]
        cells = [f"{ms[m]:.4f}" if m in ms else "—" for m in modes]

        def ratio(base, ours="coopt"):
            return f"{ms[base] / ms[ours]:.2f}x" if base in ms and ours in ms else "—"

        build = f"{row['setup_s'].get('coopt', 0):.0f}"
        lines.append(f"| {row['example']} | " + " | ".join(cells) + f" | {ratio('eager')} | {ratio('compile')} | "
                     f"{ratio('max-autotune')} | {ratio('reduce-overhead', 'coopt-graph')} | {build} |")
    return "\n".join(lines)


def main():
    args = parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/run.py needs a CUDA GPU")
    env = environment()
    print(json.dumps(env), flush=True)
    rows = []
    for name in args.examples.split(","):
        rows.append(bench_example(name, args))
        if args.out:  # after every example: a run cut short still leaves its finished rows
            args.out.write_text(json.dumps({"environment": env, "args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2, default=str))
    print("\n" + table(rows))


if __name__ == "__main__":
    main()
