"""Calling a loaded build beside a CPU eager model, wherever the build was loaded, and pinning a
build's kernels where a GPU's measured selection kept references (importable from every test
directory: tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import json

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where coopt.load puts a build


def beside_eager(built):
    """`built` called as the tests' CPU eager models are: inputs moved to the device it was
    loaded on (the GPU where there is one), outputs brought back to the CPU."""
    # (a build without weights or state: where the build ran, the GPU where there is one)
    device = next((t.device for t in built.state_dict().values()),
                  torch.device("cuda" if torch.cuda.is_available() else "cpu"))

    def call(*args):
        out = built(*(a.to(device) if isinstance(a, torch.Tensor) else a for a in args))
        return out.cpu() if isinstance(out, torch.Tensor) else type(out)(t.cpu() for t in out)
    return call


def verified_kernel(region):
    """The region's first generated candidate (advisor rank) that passed verification, or None."""
    return next((c for c in region.candidates if c.verified and c.family != "reference"), None)


def pin_verified_kernels(out, result) -> None:
    """On a GPU, select each region's first verified kernel where the build kept the reference for
    speed, and rewrite out/selection.json: the measured selection (and the whole-program timing)
    keeps a tiny region's reference where ATen is faster, and a test that runs (or breaks) the
    region's kernel needs it in the build. Without a GPU the build selected by advisor rank and
    nothing changes; a region that fell back for a wrong result keeps the reference."""
    from coopt.compile import write_selection

    if not result.measured:
        return
    for region in result.regions:
        kernel = verified_kernel(region)
        if kernel is not None and region.selected == "reference" and "fell back" not in region.reason:
            region.selected, region.reason = kernel.label, "pinned by the test (first verified kernel)"
    pdl = json.loads((out / "selection.json").read_text()).get("pdl", [])
    write_selection(out, result.regions, result.measured, pdl)
