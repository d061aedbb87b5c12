"""Where an M = 32 GEMV's fixed cost goes: each program's start, loop end and end, stamped with
the GPU's global timer, over a CUDA graph of consecutive launches (issue 4's b32 / 2048 fp8 row).

Sessions 39-46 measured every b32 GEMM kind (the template, TMA loads, cuBLAS, a persistent chain,
a dataflow merge) 4-7 µs over its bytes, and session 46's profile of the replayed step found no
gap between kernels to take (bench/NOTES-decode.md). This probe looks inside the launches: the
template's GEMV (matmul_epilogue, the points the b32 build selects, in the build's fused forms or
plain) is rendered, then patched so that every program stores %globaltimer after the PDL wait (start), after its K
loop (loop end: the stamp takes a value of the accumulator, so it cannot move above the loop) and
after its last store (end), with the SM it ran on. From LAUNCHES launches in a row (each on its own
copy of the weight; 6 x 34-235 MB, past the L2), replayed in one graph:

    ramp      the spread of the programs' starts (the block scheduler filling the SMs)
    loop      each program's start to loop end: the stream (min / median / max)
    tail      the latest loop end less the median one (programs that stream longer)
    epilogue  the latest end less the latest loop end (split-K meeting, epilogue, stores)
    gap       a launch's first start less the previous launch's last end

    python bench/gemv_timeline_probe.py                    # the b32 layer's four GEMV regions as built
    python bench/gemv_timeline_probe.py --shapes o,o+ --json timeline.json   # plain and as built

Each shape runs three times stamped: as above, the same launched with PDL (as the b32 build
launches its GEMVs: a launch starts while the one before drains, its start stamped after the
wait), and with `first_slab` (one extra load of the first weight slab before the loop, stamped
when it lands: the first byte's latency under the launch).

The stamped kernels' graph time is printed beside the plain ones' (the stamps' own cost).
Session 47 (H200) also timed the o+ and down+ forms with their epilogue's residual and g loaded
before the K loop against the kernel as then rendered (o+ 12.22 against 12.36 µs, down+ 32.83
against 33.42); the template has loaded them so since.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# the b32 / 2048 fp8 build's selected points (session 46, bench/RESULTS.md) for its four GEMV
# regions: name -> (region, params). "+" forms are the build's (the norm from the producer's
# statistics before q|k|v and gate|up, SwiGLU after gate|up, the residual add and the next norm's
# statistics after o and down); the others plain (y = x W^T), the same points.
_POINT = {"BLOCK_M": 32, "EPILOGUE_SUBTILE": 1, "GEMV": True, "GROUP_M": 1, "PERSISTENT": False, "STREAM_K": 0,
          "SWAP_AB": True, "USE_TMA": False, "num_warps": 4}
POINTS = {
    "qkv": {**_POINT, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "num_stages": 5},
    "o": {**_POINT, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "num_stages": 4},
    "gate_up": {**_POINT, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1, "num_stages": 3},
    "down": {**_POINT, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 2, "num_stages": 3},
}
ROWS, CHUNK = 32, 64  # the batch; the statistics' chunk of columns (fuse-norm-statistics)

# `--alternatives`: other points of the same regions, timed against the build's (session 47's
# stamps: q|k|v's 96 programs stream at 3.6 TB/s, ~38 GB/s an SM; o's and down's split-K meeting
# costs 2.1-2.3 µs after their loops). More programs for q|k|v; o and down without a meeting
# (32-column tiles, activation rows on the tensor cores' 64-row side: SWAP_AB needs 64 columns;
# their statistics in 32-column chunks), or with more splits; first, the build's split point with
# the flag meeting (session 53: one round trip to L2 after the loop instead of three). Values
# override the build's point.
_UNSWAPPED_32 = {"BLOCK_N": 32, "SWAP_AB": False, "SPLIT_K": 1, "CHUNK": 32}  # (CHUNK: producers' only)
ALTERNATIVES = {
    "qkv+": [{**_UNSWAPPED_32, "BLOCK_K": 128, "num_stages": 5}, {"BLOCK_K": 256, "num_stages": 3},
             {"SPLIT_K": 2, "num_stages": 4}, {"num_stages": 7}],
    "o+": [{"MEET": "flag"}, {**_UNSWAPPED_32, "BLOCK_K": 128, "num_stages": 4}, {**_UNSWAPPED_32, "BLOCK_K": 256, "num_stages": 3},
           {**_UNSWAPPED_32, "BLOCK_K": 128, "num_stages": 7}, {"SPLIT_K": 1, "num_stages": 5}],
    "down+": [{"MEET": "flag"}, {**_UNSWAPPED_32, "BLOCK_K": 256, "num_stages": 3},
              {**_UNSWAPPED_32, "BLOCK_K": 128, "num_stages": 6}, {"SPLIT_K": 4}, {"SPLIT_K": 1, "num_stages": 4}],
    "gate_up+": [{"BLOCK_N": 64, "num_stages": 4}, {"BLOCK_K": 64, "num_stages": 5}],
}


def alternatives(name: str) -> list[tuple]:
    """(region, point) pairs `--alternatives` times for `name`: the build's point with each
    override ("CHUNK": the region's statistics in chunks of that many columns)."""
    build_region, build = shapes()[name]
    pairs = []
    for override in ALTERNATIVES.get(name, []):
        params = {**build, **override}
        chunk = params.pop("CHUNK", CHUNK)
        region = build_region
        if chunk != CHUNK and "row_squares" in build_region.attrs:  # a producer of statistics: its chunk changes
            n, k = build_region.inputs[1].shape
            region = residual_region(name, n, k, chunk=chunk)
        pairs.append((region, params))
    return pairs


def point_label(params: dict) -> str:
    return (f"BN {params['BLOCK_N']} BK {params['BLOCK_K']} split {params['SPLIT_K']} {params['num_stages']} stages"
            + ("" if params["SWAP_AB"] else " unswapped") + (" flag meeting" if params.get("MEET") == "flag" else ""))


def _spec(shape, dtype="bfloat16"):
    from coopt.ir.region import TensorSpec

    return TensorSpec(tuple(shape), dtype)


def plain_region(name: str, n: int, k: int):
    from coopt.ir.region import RegionSummary

    return RegionSummary(name, "matmul_epilogue", inputs=(_spec((ROWS, k)), _spec((n, k))), outputs=(_spec((ROWS, n)),),
                         attrs={"b_layout": "nk", "has_bias": False, "epilogue": [], "outputs": ["acc"]})


def statistics_region(name: str, n: int, k: int, glu: bool = False):
    """The norm from the producer's chunk sums of squares [K / CHUNK, M] (fp32), as q|k|v and
    gate|up run in a b32 build; with `glu` the weight holds [gate; up] and SwiGLU combines them."""
    from coopt.ir.region import RegionSummary

    attrs = {"b_layout": "nk", "has_bias": False, "epilogue": [], "outputs": ["acc"],
             "prologue": {"eps": 1e-5, "kind": "rms_norm_stats", "squares_input": 2}}
    if glu:
        attrs.update(glu=True, epilogue=[["t0", "silu", ["acc"]], ["t1", "mul", ["t0", "acc_hi"]]], outputs=["t1"])
    return RegionSummary(name, "matmul_epilogue", outputs=(_spec((ROWS, 1, n)),), attrs=attrs,
                         inputs=(_spec((ROWS, 1, k)), _spec((2 * n if glu else n, k)), _spec((k // CHUNK, ROWS), "float32")))


def residual_region(name: str, n: int, k: int, rows: int = ROWS, chunk: int = CHUNK):
    """h = residual + x W^T, with h * g and the chunk sums of h^2 for the next norm, as o and down
    run in a b32 build (`chunk`: the statistics' columns a sum; 32 with fuse-norm-statistics{chunk=32})."""
    from coopt.ir.region import RegionSummary

    return RegionSummary(name, "matmul_epilogue",
                         inputs=(_spec((rows, 1, k)), _spec((n, k)), _spec((rows, 1, n)), _spec((n,))),
                         outputs=(_spec((rows, 1, n)), _spec((rows, 1, n)), _spec((n // chunk, rows), "float32")),
                         attrs={"b_layout": "nk", "has_bias": False, "epilogue": [["t0", "add", ["in0", "acc"]]],
                                "outputs": ["t0"], "row_squares": {"chunk": chunk, "output": 0, "weight_input": 3}})


def shapes() -> dict:
    """name -> (region, params)."""
    return {
        "qkv": (plain_region("qkv", 6144, 4096), POINTS["qkv"]),
        "o": (plain_region("o", 4096, 4096), POINTS["o"]),
        "gate_up": (plain_region("gate_up", 28672, 4096), POINTS["gate_up"]),
        "down": (plain_region("down", 4096, 14336), POINTS["down"]),
        "qkv+": (statistics_region("qkv+", 6144, 4096), POINTS["qkv"]),
        "o+": (residual_region("o+", 4096, 4096), POINTS["o"]),
        "gate_up+": (statistics_region("gate_up+", 14336, 4096, glu=True), POINTS["gate_up"]),
        "down+": (residual_region("down+", 4096, 14336), POINTS["down"]),
    }


FIELDS = 5  # start, loop end, end (ns, global timer), SM, first slab landed (ns; --first-slab only, else 0)

def _replace_once(text: str, old: str, new: str) -> str:
    """text with its one `old` replaced: a template that no longer has it exactly once is refused,
    not half patched."""
    assert text.count(old) == 1, f"the template changed: {old!r} found {text.count(old)} times"
    return text.replace(old, new)


STAMP_HELPER = f'''

@triton.jit
def _stamp(stamps_ptr, pid, field: tl.constexpr, after):
    """Program pid's global timer (ns) into stamps[pid, field]; `after` is a value the stamp waits
    for (an operand of the asm: the timer is read once it exists). Field 0 also stores the SM."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [after], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(stamps_ptr + pid * {FIELDS} + field, t)
    if field == 0:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [after], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(stamps_ptr + pid * {FIELDS} + 3, sm.to(tl.int64))


@triton.jit
def _gemv_kernel('''


def instrument(source: str, first_slab: bool = False) -> str:
    """The rendered GEMV module with the stamps: a stamps_ptr argument (the module's global
    _STAMPS, int64 [programs, FIELDS], passed at each launch), `_stamp` after the PDL wait, after
    the K loop and at the kernel's end. `first_slab`: also one load of the program's first weight
    slab before its loop, stamped when it lands (the first byte's latency; the load is an extra
    round trip before the loop's own, so that variant's other times are not the kernel's)."""
    source = _replace_once(source, "\n\n@triton.jit\ndef _gemv_kernel(", STAMP_HELPER)
    source = _replace_once(source, " partial_ptr, arrivals_ptr,\n", " partial_ptr, arrivals_ptr, stamps_ptr,\n")
    source = _replace_once(source, "        tl.extra.cuda.gdc_wait()\n\n",
                  "        tl.extra.cuda.gdc_wait()\n    _stamp(stamps_ptr, pid, 0, pid)\n\n")
    source = _replace_once(source, "    acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]",
                  "    _stamp(stamps_ptr, pid, 1, tl.sum(tl.sum(acc, axis=1), axis=0).to(tl.int32, bitcast=True))\n"
                  "    acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]")
    if first_slab:
        source = _replace_once(source, "    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)\n",
                      "    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)\n"
                      "    _stamp(stamps_ptr, pid, 4, tl.sum(tl.sum(tl.load(b_ptrs).to(tl.float32), axis=1), axis=0)"
                      ".to(tl.int32, bitcast=True))\n")
    kernel_end = source.index("\n\n\n", source.index("def _gemv_kernel("))
    source = (source[:kernel_end] + "\n    tl.debug_barrier()  # every thread's stores issued\n"
              "    _stamp(stamps_ptr, pid, 2, pid)" + source[kernel_end:])
    source = _replace_once(source, " partial, arrivals,\n", " partial, arrivals, _STAMPS,\n")
    return source + "\n\n_STAMPS = None  # set before each launch: int64 [programs, FIELDS]\n"


def programs(region, params: dict) -> int:
    n = region.outputs[0].shape[-1]
    return -(-ROWS // params["BLOCK_M"]) * -(-n // params["BLOCK_N"]) * params["SPLIT_K"]


def summarize(stamps: list[list[list[int]]], weight_bytes: int, bandwidth: float) -> dict:
    """stamps[launch][program] = [start, loop end, end, sm, first slab or 0] (ns) -> µs per launch
    and the gaps; "first_slab_*_us" (median, max of the programs' first slab less their start) where
    the stamps have them."""
    launches = []
    for i, rows in enumerate(stamps):
        starts, loops, ends = ([r[f] for r in rows] for f in range(3))
        first, last = min(starts), max(ends)
        streams = sorted(b - a for a, b in zip(starts, loops))
        per_sm = {}
        for r in rows:
            per_sm[r[3]] = per_sm.get(r[3], 0) + 1
        launch = {
            "span_us": (last - first) / 1e3,
            "bytes_us": weight_bytes / bandwidth * 1e6,
            "ramp_us": (max(starts) - first) / 1e3,
            "loop_min_us": streams[0] / 1e3, "loop_median_us": statistics.median(streams) / 1e3,
            "loop_max_us": streams[-1] / 1e3,
            "tail_us": (max(loops) - statistics.median(loops)) / 1e3,
            "epilogue_us": (last - max(loops)) / 1e3,
            "sms": len(per_sm), "most_programs_an_sm": max(per_sm.values()),
        }
        if all(len(r) > 4 and r[4] for r in rows):
            waits = sorted(r[4] - r[0] for r in rows)
            launch["first_slab_median_us"], launch["first_slab_max_us"] = statistics.median(waits) / 1e3, waits[-1] / 1e3
        if i:
            launch["gap_us"] = (first - max(r[2] for r in stamps[i - 1])) / 1e3
        launches.append(launch)
    return {"launches": launches}


def example_inputs(region, launches: int, seed: int = 0):
    """The region's inputs on the GPU (activations and vectors ~N(0, 1), chunk sums of squares the
    size of CHUNK such values) and `launches` copies of its weight (input 1, scaled by 1/sqrt(K))."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    inputs = []
    for i, spec in enumerate(region.inputs):
        dtype = getattr(torch, spec.dtype)
        if dtype == torch.float32:  # chunk sums of squares
            inputs.append(torch.full(spec.shape, float(CHUNK), device="cuda"))
        else:
            inputs.append(torch.randn(spec.shape, generator=gen, device="cuda").to(dtype))
    k = region.inputs[1].shape[1]
    weights = [torch.randn(region.inputs[1].shape, generator=gen, device="cuda").to(torch.bfloat16) / k ** 0.5
               for _ in range(launches)]
    return inputs, weights


def time_alternatives(name, build, sequence, inputs, weights, want, work, launches) -> list[dict]:
    """Each alternative point against the build's, alternated three times (best of each): their
    outputs agree with the build's within bf16 (another K order rounds differently)."""
    import torch
    from gemm import graph_ms

    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.targets import H200
    from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

    family, rows = MatmulEpilogueFamily(), []
    print(f"  {'point':44s} {'programs':>8s} {'µs':>7s} {'build µs':>9s}")
    for i, (region, params) in enumerate(alternatives(name)):
        problem = family.check(region, params, H200)
        if problem is not None:
            print(f"  {point_label(params):44s} not legal: {problem}")
            rows.append({"params": params, "illegal": problem})
            continue
        path = work / f"{name}_alternative{i}.py"
        path.write_text(family.render(region, params))
        module = load_module_from_file(path)
        got = module.run(inputs[0], weights[0], *inputs[2:])
        for g, w in ((g, w) for g, w in zip(got, want) if g.shape == w.shape):  # (other chunks: other statistics)
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * float(w.float().abs().max()))
        timed = [graph_ms(lambda m=m: sequence(m), [[]]) / launches * 1e3 for m in (module, build) * 3]
        row = {"params": params, "programs": programs(region, params), "us": min(timed[0::2]), "build_us": min(timed[1::2])}
        rows.append(row)
        print(f"  {point_label(params):44s} {row['programs']:8d} {row['us']:7.2f} {row['build_us']:9.2f}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qkv+,o+,gate_up+,down+",
                        help="of qkv, o, gate_up, down, qkv+, o+, gate_up+, down+: the build's forms (+), or plain")
    parser.add_argument("--launches", type=int, default=6, help="launches in a row in the graph")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--alternatives", action="store_true",
                        help="instead of the stamps: the build's point against ALTERNATIVES, alternated in one process")
    args = parser.parse_args()

    import torch
    from gemm import announce_gpu, graph_ms, reference_bandwidth

    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.targets import H200
    from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

    if not announce_gpu("bench/gemv_timeline_probe.py"):
        return 1
    bandwidth = reference_bandwidth()
    family, work, results = MatmulEpilogueFamily(), Path("/tmp/gemv-timeline"), {}
    work.mkdir(exist_ok=True)
    every = shapes()
    for name in args.shapes.split(","):
        region, params = every[name]
        problem = family.check(region, params, H200)
        assert problem is None, problem
        plain_path = work / f"{name}_plain.py"
        plain_source = family.render(region, params)
        plain_path.write_text(plain_source)
        plain = load_module_from_file(plain_path)
        inputs, weights = example_inputs(region, args.launches)
        count = programs(region, params)
        buffers = [torch.zeros(count, FIELDS, dtype=torch.int64, device="cuda") for _ in weights]

        def sequence(module, stamp=False, inputs=inputs, weights=weights, buffers=buffers):
            for w, buf in zip(weights, buffers):
                if stamp:
                    module._STAMPS = buf
                module.run(inputs[0], w, *inputs[2:])

        weight = region.inputs[1]
        weight_bytes = weight.shape[0] * weight.shape[1] * 2
        shape = f"{ROWS}x{weight.shape[0]}x{weight.shape[1]}"
        want = plain.run(inputs[0], weights[0], *inputs[2:])
        plain_us = graph_ms(lambda m=plain: sequence(m), [[]]) / args.launches * 1e3
        results[name] = {"shape": shape, "params": params, "programs": count, "plain_graph_us": plain_us}
        print(f"\n{name} {shape}: {count} programs; a plain launch in a graph of {args.launches} {plain_us:.2f} µs; "
              f"its weight {weight_bytes / bandwidth * 1e6:.2f} µs at {bandwidth / 1e12:.2f} TB/s", flush=True)
        if args.alternatives:
            results[name]["alternatives"] = time_alternatives(name, plain, sequence, inputs, weights, want, work, args.launches)
            continue
        for variant, first_slab, pdl in (("stamped", False, False), ("stamped, PDL", False, True),
                                         ("first-slab", True, False)):
            path = work / f"{name}_{variant.replace(', ', '_')}.py"
            path.write_text(instrument(family.render(region, params), first_slab=first_slab))
            stamped = load_module_from_file(path)
            # PDL as the b32 build launches its GEMVs: each launch may start while the one before
            # drains, its start stamp after the wait (gaps then go negative); off: launched as usual
            stamped.use_pdl(pdl)
            stamped._STAMPS = buffers[0]
            got = stamped.run(inputs[0], weights[0], *inputs[2:])
            # the stamps only add stores of their own: every output as the plain kernel's, bit for bit
            assert all(torch.equal(g, w) for g, w in zip(got, want)), f"{name} {variant}: outputs differ from the plain kernel's"
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                sequence(stamped, stamp=True)  # compiled and warm before the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                sequence(stamped, stamp=True)
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
            summary = summarize([b.tolist() for b in buffers], weight_bytes, bandwidth)
            summary["graph_us"] = graph_ms(lambda m=stamped: sequence(m, stamp=True), [[]]) / args.launches * 1e3
            results[name][variant] = summary
            print(f"  {variant}: {summary['graph_us']:.2f} µs a launch in the graph", flush=True)
            print("  launch  span   ramp  loop min/median/max     tail  epilogue  gap    SMs (most programs an SM)"
                  + ("  first slab median/max" if first_slab else ""))
            for i, launch in enumerate(summary["launches"]):
                print(f"  {i:5d} {launch['span_us']:6.2f} {launch['ramp_us']:6.2f} {launch['loop_min_us']:6.2f} / "
                      f"{launch['loop_median_us']:6.2f} / {launch['loop_max_us']:6.2f} {launch['tail_us']:6.2f} "
                      f"{launch['epilogue_us']:8.2f} {launch.get('gap_us', float('nan')):6.2f}  {launch['sms']} "
                      f"({launch['most_programs_an_sm']})"
                      + (f"  {launch['first_slab_median_us']:6.2f} / {launch['first_slab_max_us']:6.2f}"
                         if first_slab else ""), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
