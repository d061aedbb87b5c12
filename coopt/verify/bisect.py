"""Which regions' kernels make a built model disagree with the original.

Every selected kernel passed its own differential check, yet the whole model can still disagree
with the original: a kernel may read a strided view it was never fuzzed with, write outside its
output, or race on a workspace shared with another launch. Dropping every kernel then throws
away all the speed for one culprit; this finds the culprits instead, by switching groups of
regions (a region and its twins, which share one kernel) between their kernel and their
reference and re-running the end-to-end check:

1. each group alone on its kernel, every other region on its reference: a group that disagrees
   alone is a culprit;
2. all the others together: if they agree, done;
3. otherwise (an interaction between groups) they are added one at a time and a group that
   breaks the agreement is a culprit too.

At most 2n + 1 checks for n groups; the caller's check restores any model state between runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class ReferencesDisagree(Exception):
    """Even with every region on its reference the built model disagrees: not a kernel's fault."""


def culprit_groups(groups: Sequence[str], agrees: Callable[[frozenset[str]], bool]) -> list[str]:
    """The groups whose kernels must fall back, in `groups` order.

    `agrees(enabled)` runs the end-to-end check with the kernels of the `enabled` groups and the
    references everywhere else and returns whether the built model matched the original.
    """
    if not agrees(frozenset()):
        raise ReferencesDisagree("the built model disagrees with the original with every region on its reference")
    culprits = {g for g in groups if not agrees(frozenset({g}))}
    kept = [g for g in groups if g not in culprits]
    if kept and not agrees(frozenset(kept)):
        enabled: set[str] = set()
        for group in kept:
            if agrees(frozenset(enabled | {group})):
                enabled.add(group)
            else:
                culprits.add(group)
    return [g for g in groups if g in culprits]


# A snapshot bigger than this share of its device's free memory is kept in host memory: the
# caches of a decode step built for many rows are tens of GB (32 Llama-3-8B layers at 32 rows x
# 4096 positions: 17 GB), and a device copy of them beside the model, its build and the
# high-precision reference ran an H100 out of memory in the middle of a build (session 37).
# Restoring from the host costs a copy over PCIe per check, about a second for such caches.
DEVICE_SNAPSHOT_SHARE = 0.25


def snapshot_buffers(*modules, reserve: int = 0) -> Callable[[], None]:
    """A function that puts every buffer of `modules` (KV caches, running stats) back to its
    current value: each end-to-end check of the bisection starts from the same state. The copies
    stay on the buffers' device unless they would take more than DEVICE_SNAPSHOT_SHARE of its
    free memory less `reserve` bytes (what is still to be loaded beside them: the build a check
    loads next); then they are held in host memory."""
    import torch

    buffers = [buffer for module in modules for buffer in module.buffers()]
    home = _snapshot_home(buffers, reserve)
    saved = [(buffer, buffer.detach().to(home, copy=True) if home else buffer.detach().clone()) for buffer in buffers]

    def restore() -> None:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)

    return restore


def _snapshot_home(buffers, reserve: int = 0) -> str | None:
    """"cpu" where the CUDA buffers' copies would take more than DEVICE_SNAPSHOT_SHARE of the free
    memory of their device less `reserve`, else None (each copy beside its buffer)."""
    from coopt.verify.end_to_end import device_free_bytes

    on_cuda = [b for b in buffers if b.device.type == "cuda"]
    if not on_cuda:
        return None
    needed = sum(b.numel() * b.element_size() for b in on_cuda)
    free = max(0, device_free_bytes(on_cuda[0].device) - reserve)
    return "cpu" if needed > DEVICE_SNAPSHOT_SHARE * free else None


def copy_buffers(source, target) -> None:
    """Sets each buffer of `target` (a copy of `source` at another precision: the same names) to
    `source`'s value, cast: the copy starts from its source's state without a snapshot of its own."""
    import torch

    values = dict(source.named_buffers())
    with torch.no_grad():
        for name, buffer in target.named_buffers():
            buffer.copy_(values[name])


def regions_at_fault(built, regions, out, check: Callable[[], bool]) -> list[str]:
    """Names of the regions whose selected kernels break the end-to-end agreement.

    `built` is a loaded BuiltModel: its `_kernels` (region -> run) is switched in place between
    each region's selected kernel and its reference (out/kernels/<region>__reference.py) and put
    back as it was at the end. `regions` are the build's RegionBuilds; twins (`same_as`) share
    their leader's kernel and move with it. `check()` runs the end-to-end comparison once.
    """
    from coopt.candidates import REFERENCE

    groups: dict[str, list[str]] = {}
    for region in regions:
        if region.selected != REFERENCE:
            groups.setdefault(region.same_as or region.summary.name, []).append(region.summary.name)
    chosen = dict(built._kernels)
    reference = reference_runs(regions, out)

    def agrees(enabled: frozenset[str]) -> bool:
        for leader, members in groups.items():
            for name in members:
                built._kernels[name] = chosen[name] if leader in enabled else reference[name]
        return check()

    try:
        culprits = culprit_groups(list(groups), agrees)
    finally:
        built._kernels.update(chosen)
    return [name for group in culprits for name in groups[group]]


def reference_runs(regions, out) -> dict[str, Callable]:
    """{region: run} of the reference module of every region that selected a kernel."""
    from coopt.candidates import REFERENCE
    from coopt.runtime.kernel_loader import load_module_from_file

    runs = {}
    for region in regions:
        if region.selected != REFERENCE:
            entry = next(c for c in region.candidates if c.label == REFERENCE)
            runs[region.summary.name] = load_module_from_file(out / entry.module).run
    return runs
