"""Does a GEMV that has finished streaming its own weight gain by pulling the next GEMV's weight
into L2? (issue 4's b32 / 2048 fp8 row, bench/NOTES-decode.md session 49)

Every b32 GEMV of the step is 4-7 µs over its bytes (session 46's profile), spent where HBM is
not busy: the programs that finish early wait for the last ones (tail, ~1.8 µs), o's and down's
split-K meeting (~2.2 µs) and the next launch's ramp. The weights are no kernel's output, so
during that time a kernel could already fetch the first bytes its successor will read: each
program, once its K loop is done, issues bulk L2 prefetches (`cp.async.bulk.prefetch.L2`, one
instruction a contiguous run) of its share of the next weight's first K steps, in every split
the next kernel runs; the next kernel then finds them in L2.

The probe renders the b32 build's four GEMV regions (bench/gemv_timeline_probe.py's points:
q|k|v and gate|up with the norm from statistics, o and down with the residual and statistics),
patches each kernel with the prefetch (rows of the next weight, runs per row at its splits' first
K steps, bytes a run: launch arguments, so one compiled kernel serves every budget; none for a
budget of 0), and replays LAYERS layers of q|k|v -> o -> gate|up -> down (distinct weights, the
attention left out) in a CUDA graph with PDL as the build launches them, for each budget of
prefetched bytes a launch, alternated over rounds. The outputs must be the same bit for bit
whatever the budget (a prefetch moves no data the kernels see).

    python bench/tail_prefetch_probe.py                       # budgets 0, 4, 8, 16, 32 MB
    python bench/tail_prefetch_probe.py --evict-last --evict-first   # and the two L2 policies
    python bench/tail_prefetch_probe.py --budgets 0,8 --layers 4 --json probe.json
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

from gemv_timeline_probe import POINTS, ROWS, _replace_once, shapes  # noqa: E402

ORDER = ("qkv+", "o+", "gate_up+", "down+")  # a layer's GEMVs in launch order (the attention left out)
ARGS = "pf_ptr, pf_rows, pf_row_stride, pf_runs, pf_run_stride, pf_run_bytes, "

PREFETCH_HELPER = '''

@triton.jit
def _bulk_prefetch_l2(ptrs, valid, size, EVICT_LAST: tl.constexpr):
    # one bulk L2 prefetch of `size` bytes from each pointer whose `valid` is not 0 (sm_90 PTX)
    if EVICT_LAST:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.ne.s32 p, $2, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $3, pol; mov.u32 $0, 0; }",
            "=r,l,r,r", [ptrs, valid, size], dtype=tl.int32, is_pure=False, pack=1)
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptrs, valid, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _tail_prefetch(ptr, rows, row_stride, runs, run_stride, run_bytes, EVICT_LAST: tl.constexpr):
    # this program's share of the rows: [pid * rows / programs, (pid + 1) * rows / programs)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    first = (pid * rows) // programs
    last = ((pid + 1) * rows) // programs
    for r0 in range(first, last, 128):
        r = r0 + tl.arange(0, 128)
        valid = (r < last).to(tl.int32)
        r = tl.minimum(r, last - 1)
        size = tl.full([128], 0, tl.int32) + run_bytes
        for j in range(runs):
            _bulk_prefetch_l2(ptr + r.to(tl.int64) * row_stride + j * run_stride, valid, size, EVICT_LAST)


@triton.jit
def _gemv_kernel('''

RELEASE = """        tl.extra.cuda.gdc_launch_dependents()
"""


def patch(source: str) -> str:
    """The rendered GEMV module with the tail prefetch: `run(..., pf=(next weight, rows, row
    stride, runs, run stride, bytes a run), evict_last=False)`."""
    source = _replace_once(source, "\n\n@triton.jit\ndef _gemv_kernel(", PREFETCH_HELPER)
    source = _replace_once(source, "    a_ptr, b_ptr, ", "    a_ptr, b_ptr, " + ARGS)
    source = _replace_once(source, "UPCAST_DOT: tl.constexpr, PDL: tl.constexpr,",
                           "UPCAST_DOT: tl.constexpr, PDL: tl.constexpr, EVICT_LAST: tl.constexpr,")
    # after the K loop's release, before the split meeting and the epilogue
    source = _replace_once(source, RELEASE, RELEASE + "    _tail_prefetch(pf_ptr, pf_rows, pf_row_stride, pf_runs, "
                                                      "pf_run_stride, pf_run_bytes, EVICT_LAST)\n")
    head, _, rest = source.partition("\ndef run(")
    signature, _, body = rest.partition("):\n")
    source = f"{head}\ndef run({signature}, pf=None, evict_last=False):\n{body}"
    source = _replace_once(source, "            a2, b, ", "            a2, b, *pf, ")
    return _replace_once(source, "PDL=PDL, **PDL_LAUNCH,", "PDL=PDL, EVICT_LAST=evict_last, **PDL_LAUNCH,")


def evict_first(source: str) -> str:
    """The patched module with the K loop's weight loads marked evict_first: the streamed slabs,
    read once, go first when the L2 needs room, before the next weight's prefetched lines."""
    for slab in ("b_ptrs", "b_hi_ptrs"):
        source = source.replace(f"tl.load({slab})", f'tl.load({slab}, eviction_policy="evict_first")')
        source = source.replace(f"tl.load({slab}, mask", f'tl.load({slab}, eviction_policy="evict_first", mask')
    assert source.count('eviction_policy="evict_first"') >= 2, "the template's weight loads changed"
    return source


def plan(weight, split_k: int, block_k: int, budget: int) -> tuple:
    """The prefetch of `budget` bytes of an "nk" weight [R, K] read by SPLIT_K splits of BLOCK_K
    steps: (weight, rows, row stride, runs, run stride, bytes a run), each row's run at every
    split's first K step, as long as the budget allows (a multiple of 16 bytes); no rows for 0."""
    rows, k = weight.shape
    k_steps = -(-(-(-k // block_k)) // split_k)
    run_stride = k_steps * block_k
    run_bytes = min(run_stride * weight.element_size(), budget // max(rows * split_k, 1)) // 16 * 16
    if budget <= 0 or run_bytes < 16:
        return (weight, 0, weight.stride(0), 1, run_stride, 16)
    return (weight, rows, weight.stride(0), split_k, run_stride, run_bytes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="0,4,8,16,32", help="MB prefetched a launch, comma-separated")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--evict-last", action="store_true", help="also each budget with an evict_last L2 policy")
    parser.add_argument("--evict-first", action="store_true",
                        help="also each budget with the weight loads marked evict_first")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import torch
    from gemm import announce_gpu, graph_ms, reference_bandwidth

    from coopt.runtime.kernel_loader import load_module_from_file
    from coopt.targets import H200
    from coopt.templates.matmul_epilogue import MatmulEpilogueFamily

    if not announce_gpu("bench/tail_prefetch_probe.py"):
        return 1
    bandwidth = reference_bandwidth()
    family, work = MatmulEpilogueFamily(), Path("/tmp/tail-prefetch")
    work.mkdir(exist_ok=True)
    every, modules = shapes(), {False: {}, True: {}}  # evict_first -> name -> module
    for name in ORDER:
        region, params = every[name]
        assert family.check(region, params, H200) is None
        for first in (False, True) if args.evict_first else (False,):
            path = work / f"{name.rstrip('+')}{'_evict_first' if first else ''}.py"
            source = patch(family.render(region, params))
            path.write_text(evict_first(source) if first else source)
            modules[first][name] = load_module_from_file(path)
            modules[first][name].use_pdl(True)  # as the b32 build launches its GEMVs

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    layers = []
    for _ in range(args.layers):
        layers.append({name: randn(*every[name][0].inputs[1].shape, scale=every[name][0].inputs[1].shape[1] ** -0.5)
                       for name in ORDER})
    norm_g = randn(4096)
    attention_out = randn(ROWS, 1, 4096)  # stands in for the attention's output
    x0, sq0 = randn(ROWS, 1, 4096), torch.full((64, ROWS), 64.0, device="cuda")
    weight_bytes = sum(w.numel() * 2 for layer in layers for w in layer.values())

    def step(budget: int, evict_last: bool = False, first: bool = False):
        """LAYERS layers; each GEMV prefetches `budget` bytes of the next one's weight."""
        h, hg, sq = x0, x0, sq0
        chain = [(i, name) for i in range(args.layers) for name in ORDER]
        for position, (i, name) in enumerate(chain):
            nxt = chain[(position + 1) % len(chain)]
            following = POINTS[nxt[1].rstrip("+")]
            pf = plan(layers[nxt[0]][nxt[1]], following["SPLIT_K"], following["BLOCK_K"], budget)
            w, module = layers[i][name], modules[first][name]
            if name == "qkv+":
                module.run(hg, w, sq, pf=pf, evict_last=evict_last)
            elif name == "o+":
                h, hg, sq = module.run(attention_out, w, h, norm_g, pf=pf, evict_last=evict_last)
            elif name == "gate_up+":
                act = module.run(hg, w, sq, pf=pf, evict_last=evict_last)[0]
            else:
                h, hg, sq = module.run(act, w, h, norm_g, pf=pf, evict_last=evict_last)
        return h, hg, sq

    budgets = [int(float(mb) * 2**20) for mb in args.budgets.split(",")]
    variants = [(b, False, False) for b in budgets]
    if args.evict_last:
        variants += [(b, True, False) for b in budgets if b > 0]
    if args.evict_first:
        variants += [(b, False, True) for b in budgets]
    want = step(0)
    for variant in variants:  # compiled, and the same outputs bit for bit
        got = step(*variant)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"{variant}: outputs differ"
    times = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            times[v].append(graph_ms(lambda v=v: step(*v), [[]]) * 1e3)
    floor = weight_bytes / bandwidth * 1e6
    print(f"\n{args.layers} layers of q|k|v -> o -> gate|up -> down at {ROWS} rows, PDL; weights "
          f"{weight_bytes / 1e9:.2f} GB = {floor:.1f} µs at {bandwidth / 1e12:.2f} TB/s")
    print(f"{'prefetch a launch':>20s} {'µs (best)':>10s} {'median':>8s} {'µs a layer over bytes':>22s} {'TB/s':>6s}")
    rows = []
    for (budget, evict_last, first), ts in times.items():
        best = min(ts)
        row = {"budget_mb": budget / 2**20, "evict_last": evict_last, "evict_first": first, "us": ts, "best_us": best,
               "over_floor_us_a_layer": (best - floor) / args.layers, "tb_s": weight_bytes / best / 1e6}
        rows.append(row)
        label = f"{budget / 2**20:g} MB" + (" evict_last" if evict_last else "") + (" evict_first" if first else "")
        print(f"{label:>20s} {best:10.1f} {statistics.median(ts):8.1f} {row['over_floor_us_a_layer']:22.2f} "
              f"{row['tb_s']:6.2f}")
    if args.json:
        args.json.write_text(json.dumps({"floor_us": floor, "layers": args.layers, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
