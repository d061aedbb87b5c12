"""Where a built decode step's time goes on the GPU: each kernel's time inside the replayed CUDA
graph (the real step, not a region timed alone) and the time between kernels.

    python bench/profile_step.py BUILD_DIR [--layers 8 --batch 1 --pos 2048 --cache 4096] [--regions]
    COOPT_PDL=1 python bench/profile_step.py BUILD_DIR ...   # the same with programmatic dependent launch

BUILD_DIR is a coopt build of examples/llama/model.py (bench/decode.py --build-dir keeps one per
case). The step is replayed as bench/decode.py times it (GraphedStep), under torch.profiler;
kernel times come from CUPTI. With PDL a kernel may start before the previous one ends and waits
inside (gdc_wait), so its duration then includes that wait: compare the step's span with
COOPT_PDL=1 (off by default since this measurement: bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def launch_table(kernels, steps: int) -> list[dict]:
    """Each launch of the step in order: its name, mean duration and mean gap after the launch
    before it (the first's gap is after the previous step's last kernel, 0 for the first step),
    in µs. `kernels`: the profiled CUDA events of `steps` replays sorted by start (time_range in
    µs). A kernel's own duration tells which GEMV of a layer is off its bandwidth (33 launches
    share one name), and the gaps where the launch latency goes (session 19: 15 µs a step)."""
    per_step = len(kernels) // steps
    table = [{"name": kernels[i].name, "us": 0.0, "gap_us": 0.0} for i in range(per_step)]
    for n, event in enumerate(kernels[:per_step * steps]):
        entry = table[n % per_step]
        entry["us"] += (event.time_range.end - event.time_range.start) / steps
        if n:
            entry["gap_us"] += (event.time_range.start - kernels[n - 1].time_range.end) / steps
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build_dir", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--pos", type=int, default=2048)
    parser.add_argument("--cache", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--regions", action="store_true",
                        help="also time each region of the step (called without the graph, under the profiler) "
                             "and its achieved bandwidth")
    parser.add_argument("--launches", action="store_true",
                        help="also print every launch of the step in order, with the gap before it (always in --out)")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile
    from triton.testing import do_bench

    import coopt
    from coopt.runtime.cuda_graph import GraphedStep
    from decode import load_case

    _, inputs = load_case(args.layers, args.batch, args.pos, args.cache)
    built = coopt.load(args.build_dir, device="cuda")
    step = GraphedStep(built, inputs, check=False)
    ms = do_bench(lambda: step.graph.replay(), warmup=25, rep=200, return_mode="median")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step.graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    per_step = len(kernels) // args.steps
    by_name = defaultdict(lambda: [0, 0.0])
    busy = span = 0.0
    for i in range(args.steps):
        chunk = kernels[i * per_step:(i + 1) * per_step]
        span += (chunk[-1].time_range.end - chunk[0].time_range.start) / args.steps
        for e in chunk:
            by_name[e.name][0] += 1
            by_name[e.name][1] += (e.time_range.end - e.time_range.start) / args.steps
            busy += (e.time_range.end - e.time_range.start) / args.steps
    # COOPT_PDL when set ("1" every kernel, or the kinds launched with PDL), else the build's own
    # measured choice (selection.json "pdl", applied by program.py)
    pdl = os.environ.get("COOPT_PDL") or ",".join(
        json.loads((args.build_dir / "selection.json").read_text()).get("pdl", ())) or "0"
    print(f"replay median {ms * 1000:.1f} us (do_bench); profiled: {per_step} kernels a step, span {span:.1f} us, "
          f"sum of kernel durations {busy:.1f} us (PDL: {pdl})")
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    for name, (count, us) in rows:
        print(f"  {us:9.1f} us  x{count // args.steps:<3d} {name[:90]}")
    result = {"pdl": pdl, "replay_us": ms * 1000, "span_us": span, "busy_us": busy,
              "kernels": {n: {"per_step": c // args.steps, "us": us} for n, (c, us) in rows}}
    result["launches"] = launch_table(kernels, args.steps)
    if args.launches:
        print("\nlaunches in step order (mean over the steps; gap = start - the previous kernel's end):")
        for i, launch in enumerate(result["launches"]):
            print(f"  {i:3d} {launch['us']:8.2f} us  gap {launch['gap_us']:6.2f}  {launch['name'][:60]}")
    if args.regions:
        from region_times import region_bytes, region_table, time_regions

        times = time_regions(built, inputs, steps=args.steps)
        table = region_table(times, region_bytes(args.build_dir / "report.md"), valid_share=(args.pos + 1) / args.cache)
        print("\nregions (called one by one without the graph, CUDA time under the profiler):")
        for row in table:
            bandwidth = f"{row['tb_per_s']:.2f} TB/s" if row["tb_per_s"] is not None else "—"
            print(f"  {row['region']:28s} {row['us']:8.1f} us  {row['mb']:9.2f} MB  {bandwidth}")
        result["regions"] = table
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
