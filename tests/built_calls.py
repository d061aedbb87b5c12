"""Calling a loaded build beside a CPU eager model, wherever the build was loaded (importable from
every test directory: tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import torch


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
