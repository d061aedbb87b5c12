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
q|k|v and gate|up with the norm from statistics, o and down with the residual and statistics) as
prefetch-next-weight leaves them (o, gate|up and down take the next GEMV's weight; q|k|v, which
the attention follows in a build, does not), with the template's own tail prefetch, and replays
LAYERS layers of q|k|v -> o -> gate|up -> down (distinct weights, the attention left out) in a
CUDA graph with PDL as the build launches them, for each budget of prefetched bytes a launch
(`use_tail_prefetch`, planned for the next GEMV's point), alternated over rounds. The outputs must
be the same bit for bit whatever the budget (a prefetch moves no data the kernels see).

    python bench/tail_prefetch_probe.py                       # budgets 0, 4, 8, 16, 32 MB
    python bench/tail_prefetch_probe.py --evict-first         # and each with the stream marked evict_first
    python bench/tail_prefetch_probe.py --budgets 0,8 --layers 4 --json probe.json
    python bench/tail_prefetch_probe.py --pdl both            # and each launched without PDL
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

from gemv_timeline_probe import POINTS, ROWS, shapes  # noqa: E402

ORDER = ("qkv+", "o+", "gate_up+", "down+")  # a layer's GEMVs in launch order (the attention left out)
PREFETCHING = ("o+", "gate_up+", "down+")  # those a GEMV follows directly in a build


def with_prefetch(region, next_name: str):
    """`region` as prefetch-next-weight leaves it: the next GEMV's weight as its last input."""
    import dataclasses

    following = shapes()[next_name][0].inputs[1]
    return dataclasses.replace(region, inputs=(*region.inputs, following),
                               attrs={**region.attrs, "tail_prefetch": {"input": len(region.inputs), "layout": "nk"}})


def evict_first(source: str) -> str:
    """A rendered GEMV module with the K loop's weight loads marked evict_first: the streamed
    slabs, read once, go first when the L2 needs room, before the next weight's prefetched lines."""
    for slab in ("b_ptrs", "b_hi_ptrs"):
        source = source.replace(f"tl.load({slab})", f'tl.load({slab}, eviction_policy="evict_first")')
        source = source.replace(f"tl.load({slab}, mask", f'tl.load({slab}, eviction_policy="evict_first", mask')
    assert source.count('eviction_policy="evict_first"') >= 2, "the template's weight loads changed"
    return source


def variants_of(budgets: list[int], evict_first: bool, pdl: str) -> list[tuple[int, bool, bool]]:
    """(budget, evict_first, PDL) for each timed variant: every budget, plain and (asked for) with
    the evict_first loads, launched with PDL, without it or both ("on", "off", "both")."""
    pdls = {"on": (True,), "off": (False,), "both": (True, False)}[pdl]
    return [(b, first, on) for on in pdls for first in (False, True)[:1 + evict_first] for b in budgets]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="0,4,8,16,32", help="MB prefetched a launch, comma-separated")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--evict-first", action="store_true",
                        help="also each budget with the weight loads marked evict_first")
    parser.add_argument("--pdl", choices=("on", "off", "both"), default="on",
                        help="launch the GEMVs with PDL (as the b32 build did on the H100), without it (as on "
                             "the H200 in session 40, where the gaps it leaves are time the prefetch can fill), or both")
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
    for position, name in enumerate(ORDER):
        region, params = every[name]
        if name in PREFETCHING:
            region = with_prefetch(region, ORDER[(position + 1) % len(ORDER)])
        assert family.check(region, params, H200) is None
        for first in (False, True) if args.evict_first else (False,):
            path = work / f"{name.rstrip('+')}{'_evict_first' if first else ''}.py"
            source = family.render(region, params)  # the template's tail prefetch, as a build renders it
            path.write_text(evict_first(source) if first else source)
            modules[first][name] = load_module_from_file(path)

    def use_budget(budget: int) -> None:
        """Each module prefetches `budget` bytes a launch, planned for the GEMV after it."""
        for position, name in enumerate(ORDER):
            following = POINTS[ORDER[(position + 1) % len(ORDER)].rstrip("+")]
            for group in modules.values() if name in PREFETCHING else ():
                if name in group:
                    group[name].use_tail_prefetch(budget, following["SPLIT_K"], following["BLOCK_K"])

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

    def step(budget: int, first: bool = False, pdl: bool = True):
        """LAYERS layers; o, gate|up and down prefetch `budget` bytes of the next GEMV's weight
        (q|k|v, followed by the attention in a build, does not); launched with PDL or not."""
        use_budget(budget)
        for module in modules[first].values():
            module.use_pdl(pdl)
        h, hg, sq = x0, x0, sq0
        for i, layer in enumerate(layers):
            following = layers[(i + 1) % len(layers)]["qkv+"]
            group = modules[first]
            group["qkv+"].run(hg, layer["qkv+"], sq)
            h, hg, sq = group["o+"].run(attention_out, layer["o+"], h, norm_g, layer["gate_up+"])
            act = group["gate_up+"].run(hg, layer["gate_up+"], sq, layer["down+"])[0]
            h, hg, sq = group["down+"].run(act, layer["down+"], h, norm_g, following)
        return h, hg, sq

    budgets = [int(float(mb) * 2**20) for mb in args.budgets.split(",")]
    variants = variants_of(budgets, args.evict_first, args.pdl)
    want = step(0)
    for variant in variants:  # compiled, and the same outputs bit for bit
        got = step(*variant)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"{variant}: outputs differ"
    times = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            times[v].append(graph_ms(lambda v=v: step(*v), [[]]) * 1e3)
    floor = weight_bytes / bandwidth * 1e6
    print(f"\n{args.layers} layers of q|k|v -> o -> gate|up -> down at {ROWS} rows; weights "
          f"{weight_bytes / 1e9:.2f} GB = {floor:.1f} µs at {bandwidth / 1e12:.2f} TB/s")
    print(f"{'prefetch a launch':>20s} {'µs (best)':>10s} {'median':>8s} {'µs a layer over bytes':>22s} {'TB/s':>6s}")
    rows = []
    for (budget, first, pdl), ts in times.items():
        best = min(ts)
        row = {"budget_mb": budget / 2**20, "evict_first": first, "pdl": pdl, "us": ts, "best_us": best,
               "over_floor_us_a_layer": (best - floor) / args.layers, "tb_s": weight_bytes / best / 1e6}
        rows.append(row)
        label = f"{budget / 2**20:g} MB" + (" evict_first" if first else "") + ("" if pdl else " no PDL")
        print(f"{label:>20s} {best:10.1f} {statistics.median(ts):8.1f} {row['over_floor_us_a_layer']:22.2f} "
              f"{row['tb_s']:6.2f}")
    if args.json:
        args.json.write_text(json.dumps({"floor_us": floor, "layers": args.layers, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
