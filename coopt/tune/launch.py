"""How a graph-replayed step launches its kernels: with programmatic dependent launch (PDL) for
some kinds of kernel, or without, whichever the GPU measured faster for the whole step.

PDL lets a kernel's programs be scheduled while the previous kernel drains (each waits for its
predecessor's writes before touching memory). Whether that pays is a property of the whole
step, not of one kernel: a pair of small kernels gains (bench/pdl_probe.py), a whole b1 decode
step with every kind at once lost 15 % (bench/RESULTS.md, session 5), and the GEMVs alone at
b32 were a lead (session 12: 1775.6 against 1789 µs, not in one process). So the build times
the replayed step under each option in `PDL_OPTIONS`, in alternating rounds, and keeps an
option only where it beats launching without PDL by more than `MIN_GAIN` (run-to-run spread of
one process is ~0.2 %). The choice goes into selection.json ("pdl": the kinds), which the
built program.py applies when it loads its kernels.

A kind is still coarse: in a b32 / 2048 step on an H100 (session 52, bench/pdl_boundaries.py)
PDL gained 2-3 µs a layer at q|k|v and gate|up and lost 0.8 at o, all three GEMVs of one kind. So
the chosen option is then refined module by module (`refine_modules`): each generated module of a
kind some option names (one per distinct kernel; a layer's twins share theirs) is timed switched
the other way, and the switches that win are kept (selection.json "pdl_regions": {region: on}
for their regions, which program.py applies over the kinds).

    >>> choose_pdl(built, inputs)  # doctest: +SKIP
    {'pdl': ['gemv'], 'step_ms': {'none': 1.7802, 'gemv': 1.7655}, 'timing': '...'}
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch

# Kernel kinds (the PDL_KIND of a generated module: templates/triton/_pdl.j2) launched with PDL,
# each option tried against launching none with it where the step has every kind it names. The
# GEMVs alone were the b32 lead (session 12); with the decode attentions too a b1 step measured
# slower (session 12: +9 µs), so that option must win on its own step to be kept. The CUDA
# GEMVs (templates/gemv_cuda.py: one wave, weight slabs issued before the wait) are built for PDL
# (session 30: a layer's three MLP GEMVs 2-3 µs faster with it), alone or with the Triton GEMVs;
# only at one block an SM with an 8-warp gate|up, though (session 31: 15-50 µs slower otherwise),
# so each such option is timed again with the GEMVs switched to their PDL-ready kernels (tune/pdl_ready.py).
PDL_OPTIONS: tuple[tuple[str, ...], ...] = (("gemv",), ("gemv", "decode_attention"), ("gemv_cuda",),
                                            ("gemv_cuda", "gemv"))
MIN_GAIN = 0.005
# A module's switch against its kind's choice must win by this much: the spread of one process's
# alternating rounds (~0.2 %), not MIN_GAIN's margin for launching with PDL at all; a module's
# share of a step is small (o's 0.8 µs a layer is 0.3 % of an 8-layer b32 step).
REFINE_GAIN = 0.002


def pdl_capable() -> bool:
    """PDL needs sm_90 or newer (Hopper); never in Triton's interpreter (the generated modules'
    `_pdl_capable` is the same test: they must load without coopt)."""
    return (torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability()[0] >= 9)


def kernel_modules(built) -> list[dict]:
    """The namespaces of the generated kernel modules a built program runs (those with use_pdl:
    every template's; references have none)."""
    spaces = {id(run.__globals__): run.__globals__ for run in built._kernels.values()
              if "use_pdl" in getattr(run, "__globals__", {})}
    return list(spaces.values())


def set_pdl(built, kinds: Iterable[str], switched: Iterable[int] = ()) -> int:
    """Launch the built program's kernels of `kinds` with PDL and the others without, except the
    modules whose id(namespace) is in `switched`, launched the other way (from their next launch:
    capture a new graph after this); how many modules now launch with it."""
    kinds, switched = set(kinds), set(switched)
    return sum(bool(space["use_pdl"]((space["PDL_KIND"] in kinds) != (id(space) in switched)))
               for space in kernel_modules(built))


def module_regions(built, space: dict) -> list[str]:
    """The regions that run a kernel module (a layer's twins share one)."""
    return [region for region, run in built._kernels.items() if getattr(run, "__globals__", None) is space]


def switch_set(label: str) -> str:
    """The switch set a label was timed with ("+ready", "+allready": tune/pdl_ready.py), "" for none."""
    _, plus, suffix = label.partition("+")
    return plus + suffix


def choose_pdl(built, example_inputs, *, options=PDL_OPTIONS, timer: Callable | None = None,
               graph: Callable | None = None,
               switches: dict[str, dict[str, tuple[str, Callable]]] | None = None, refine: bool = True) -> dict | None:
    """Time `built`'s step replayed as a CUDA graph launched without PDL and under each option,
    leave `built` launching the fastest (an option must win by MIN_GAIN), and return
    {"pdl": kinds, "label": the winner's, "step_ms": {label: ms}, "timing": how, "reselected":
    {region: label}}; None (launched without PDL, nothing timed) where the step has no kernel of
    every kind of any option. `switches` ({suffix: {region: (label, run)}}, tune/pdl_ready.py)
    are sets of kernels ready for PDL: each option that launches all of a set's kinds with PDL is
    timed again with the set switched in (its label + the suffix), and a switched selection must
    beat the best without switches by MIN_GAIN too. With `refine`, the chosen option is then refined
    module by module (refine_modules; "pdl_regions" and "refined" in the result). `timer` (coopt.tune.interleaved's
    time_interleaved by default) takes {label: fn}; `graph` (GraphedStep by default) captures the
    step: both are parameters so that tests can stand in for the GPU."""
    from coopt.runtime.cuda_graph import GraphedStep
    from coopt.tune.interleaved import time_interleaved

    timer = timer or time_interleaved
    graph = graph or (lambda: GraphedStep(built, example_inputs, check=False))

    def applicable() -> list[tuple[str, ...]]:  # an option the step lacks a kind of is another's
        present = {space["PDL_KIND"] for space in kernel_modules(built)}
        return [o for o in options if set(o) <= present]

    if not applicable():  # a prefill (GEMMs, no GEMV): nothing to choose, nothing timed
        set_pdl(built, ())
        return None
    selected = dict(built._kernels)
    runs = {suffix: {region: run for region, (_, run) in chosen.items()} for suffix, chosen in (switches or {}).items()}
    steps, kinds_of = {}, {"none": ()}
    try:
        for suffix, kernels in (("", {}), *runs.items()):
            built._kernels.update(selected)
            built._kernels.update(kernels)
            kernel_kinds = {run.__globals__.get("PDL_KIND") for run in kernels.values()}
            for kinds in ((), *applicable()):
                if suffix and not (kernels and kernel_kinds <= set(kinds)):
                    continue  # no switches, or an option that does not launch them with PDL
                label = (",".join(kinds) or "none") + suffix
                if not set_pdl(built, kinds) and kinds:
                    continue  # no PDL on this GPU: nothing to time
                step = graph()  # captured with this option's kernels and launch attributes
                steps[label], kinds_of[label] = (lambda s=step: s(*example_inputs)), kinds
        ms = timer(steps)
    except BaseException:
        built._kernels.update(selected)  # the selection alone, launched without PDL: always correct
        set_pdl(built, ())
        raise
    best = min(ms, key=ms.get)
    plain = {label: t for label, t in ms.items() if not switch_set(label)}
    if switch_set(best) and ms[best] > min(plain.values()) * (1 - MIN_GAIN):
        best = min(plain, key=plain.get)
    if best != "none" and ms[best] > ms["none"] * (1 - MIN_GAIN):
        best = "none"
    chosen = switch_set(best)
    built._kernels.update(selected)
    built._kernels.update(runs.get(chosen, {}))
    set_pdl(built, kinds_of[best])
    considered = {kind for option in applicable() for kind in option}
    steps.clear()  # (the options' graphs: their memory back before the refinement captures its own)
    try:
        refined = refine_modules(built, example_inputs, kinds_of[best], considered if refine else (),
                                 timer=timer, graph=graph)
    except BaseException:
        set_pdl(built, kinds_of[best])  # the option as chosen: measured, always correct
        raise
    return {"pdl": list(kinds_of[best]), "label": best, "step_ms": dict(ms),
            "reselected": {region: label for region, (label, _) in (switches or {}).get(chosen, {}).items()},
            "pdl_regions": refined.pop("regions"), "refined": refined,
            "timing": "the step replayed as a CUDA graph per option, in alternating rounds (median)"}


def refine_modules(built, example_inputs, kinds: Iterable[str], considered: Iterable[str], *, timer: Callable,
                   graph: Callable) -> dict:
    """From `kinds` launched with PDL, time the step with each module of a `considered` kind switched
    the other way (its label: "+" or "-" and the module's first region), all in one timer call;
    keep every switch that beats the unswitched step by REFINE_GAIN, and where several do, time
    them together against the best one alone and keep the faster. Leaves `built` launching the
    result; returns {"regions": {region: launched with PDL} for every region of a switched module,
    "step_ms": {label: ms} ("base": unswitched; "together" and "best alone" where timed), "chosen":
    the label of what it keeps ("base", a module's, or "together")}."""
    kinds, considered = tuple(kinds), set(considered)
    spaces = [space for space in kernel_modules(built) if space["PDL_KIND"] in considered and module_regions(built, space)]
    if not spaces or not set_pdl(built, considered):  # nothing to switch, or no PDL on this GPU
        set_pdl(built, kinds)
        return {"regions": {}, "step_ms": {}, "chosen": "base"}

    def label(space) -> str:
        return ("-" if space["PDL_KIND"] in kinds else "+") + module_regions(built, space)[0]

    def captured(switched: set[int]) -> Callable:
        set_pdl(built, kinds, switched)
        step = graph()  # captured with these launch attributes
        return lambda: step(*example_inputs)

    ms = dict(timer({"base": captured(set()), **{label(space): captured({id(space)}) for space in spaces}}))
    winners = [space for space in spaces if ms[label(space)] < ms["base"] * (1 - REFINE_GAIN)]
    keep = winners[:1]
    if len(winners) > 1:
        best = min(winners, key=lambda space: ms[label(space)])
        ms.update(timer({"together": captured({id(space) for space in winners}), "best alone": captured({id(best)})}))
        keep = winners if ms["together"] < ms["best alone"] else [best]
    set_pdl(built, kinds, {id(space) for space in keep})
    regions = {region: space["PDL_KIND"] not in kinds for space in keep for region in module_regions(built, space)}
    chosen = "together" if len(keep) > 1 else label(keep[0]) if keep else "base"
    return {"regions": regions, "step_ms": ms, "chosen": chosen}
