"""Whether a graph-replayed step's GEMVs pull the next GEMV's weight into L2 once their own is
streamed (prefetch-next-weight's regions, templates/matmul_epilogue's tail prefetch), and how
many bytes a launch.

What the prefetch gains is a property of the whole step (the bytes must move in time HBM would
otherwise idle, and still be in L2 when the next kernel reads them), not of one kernel timed
alone: so, as for PDL (tune/launch.py), the build times the replayed step without the prefetch
and with each budget in `BUDGETS`, in alternating rounds, and keeps a budget only where it beats
none by more than `MIN_GAIN`. Each prefetching region aims at its next GEMV's selected point: the
plan puts a run at every split's first K step (SPLIT_K and BLOCK_K of that region's selection).
The choice goes into selection.json ("prefetch"), which the built program.py applies when it loads
its kernels.

    >>> choose_prefetch(built, inputs, prefetch_plans(regions))  # doctest: +SKIP
    {'bytes': 16777216, 'label': '16 MB', 'step_ms': {'none': 1.53, '8 MB': 1.52, '16 MB': 1.51}, ...}
"""

from __future__ import annotations

from collections.abc import Callable

from coopt.candidates import RegionBuild
from coopt.tune.launch import MIN_GAIN

# Bytes a launch tried (each region's share of its next weight's first bytes): ~2-4 µs of HBM
# time at 4.2 TB/s, the order of a b32 GEMV's tail and meeting (bench/NOTES-decode.md session 47),
# and well inside the 50 MB L2.
BUDGETS = (8 << 20, 16 << 20)
# The plan for a next region that runs no template GEMV (the reference, another family).
DEFAULT_PLAN = {"split_k": 1, "block_k": 128}


def prefetch_plans(regions: list[RegionBuild]) -> dict[str, dict]:
    """{region: {"split_k", "block_k"}} for each region whose selected kernel can prefetch (a
    template GEMV of a region with a tail prefetch): the selected point of the region whose weight
    it prefetches (found by the weight's name), DEFAULT_PLAN where that one runs no template GEMV."""
    by_weight = {r.summary.input_names[1]: r for r in regions
                 if r.summary.family == "matmul_epilogue" and len(r.summary.input_names) > 1 and r.summary.input_names[1]}
    plans = {}
    for region in regions:
        prefetch, chosen = region.summary.attrs.get("tail_prefetch"), region.selected_entry()
        if not prefetch or chosen is None or chosen.family != "matmul_epilogue" or not chosen.params.get("GEMV"):
            continue
        names = region.summary.input_names
        consumer = by_weight.get(names[prefetch["input"]] if prefetch["input"] < len(names) else "")
        following = consumer.selected_entry() if consumer is not None else None
        if following is not None and following.family == "matmul_epilogue" and following.params.get("GEMV"):
            plans[region.summary.name] = {"split_k": int(following.params.get("SPLIT_K", 1)),
                                          "block_k": int(following.params["BLOCK_K"])}
        else:
            plans[region.summary.name] = dict(DEFAULT_PLAN)
    return plans


def set_prefetch(built, plans: dict[str, dict], budget: int) -> int:
    """Prefetch `budget` bytes a launch in each planned region's kernel (0: none), from their
    next launch on (capture a new graph after this); how many now prefetch."""
    on = 0
    for region, plan in plans.items():
        space = getattr(built._kernels.get(region), "__globals__", {})
        if "use_tail_prefetch" in space:
            on += bool(space["use_tail_prefetch"](budget, **plan))
    return on


def choose_prefetch(built, example_inputs, plans: dict[str, dict], *, budgets=BUDGETS,
                    timer: Callable | None = None, graph: Callable | None = None) -> dict | None:
    """Time `built`'s replayed step without the prefetch and with each budget, leave `built`
    prefetching the fastest (a budget must win by MIN_GAIN) and return {"bytes", "label",
    "step_ms", "timing", "plans"}; None (no prefetch, nothing timed) where no region can
    prefetch on this GPU. `timer` and `graph` as in choose_pdl: parameters so that tests can stand
    in for the GPU."""
    from coopt.runtime.cuda_graph import GraphedStep
    from coopt.tune.interleaved import time_interleaved

    timer = timer or time_interleaved
    graph = graph or (lambda: GraphedStep(built, example_inputs, check=False))
    steps, bytes_of = {}, {"none": 0}
    try:
        for budget in budgets:
            if not set_prefetch(built, plans, budget):
                continue  # no region prefetches (no Hopper GPU, no plan): nothing to time
            label = f"{budget / 2**20:g} MB"
            step = graph()  # captured with this budget's launch arguments
            steps[label], bytes_of[label] = (lambda s=step: s(*example_inputs)), budget
        if not steps:
            set_prefetch(built, plans, 0)
            return None
        set_prefetch(built, plans, 0)
        step = graph()
        steps["none"] = lambda s=step: s(*example_inputs)
        ms = timer(steps)
    except BaseException:
        set_prefetch(built, plans, 0)  # no prefetch: always correct, the build as timed alone
        raise
    best = min(ms, key=ms.get)
    if best != "none" and ms[best] > ms["none"] * (1 - MIN_GAIN):
        best = "none"
    set_prefetch(built, plans, bytes_of[best])
    return {"bytes": bytes_of[best], "label": best, "step_ms": dict(ms), "plans": plans,
            "timing": "the step replayed as a CUDA graph per budget, in alternating rounds (median)"}
