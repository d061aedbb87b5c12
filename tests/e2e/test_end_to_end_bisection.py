"""A kernel that passed its own check but breaks the whole model (here: made wrong after the
build) is found by bisection and falls back alone; the other kernels stay selected."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from built_calls import DEVICE, pin_verified_kernels

import coopt
from coopt.candidates import REFERENCE
from coopt.end_to_end import check_end_to_end


class TwoBlocks(torch.nn.Module):
    """Two different linear+epilogue regions (different widths: not twins)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


def test_bisection_drops_only_the_kernel_that_breaks_the_model(tmp_path):
    torch.manual_seed(0)
    # (on the build's device: the check runs the model beside the loaded build)
    model, inputs, out = TwoBlocks().to(DEVICE), (torch.randn(4, 16, device=DEVICE),), tmp_path / "out"
    result = coopt.Pipeline(top_k=1).build(model, inputs, out)
    pin_verified_kernels(out, result)
    kernels = [r for r in result.regions if r.selected != REFERENCE]
    assert len(kernels) == 2, [(r.summary.name, r.selected) for r in result.regions]
    broken, kept = kernels
    # the selected kernel of one region now returns twice its result
    chosen = next(c for c in broken.candidates if c.label == broken.selected)
    path = out / chosen.module
    path.write_text(path.read_text() + "\n\n_run = run\n\ndef run(*inputs):\n"
                    "    return tuple(2 * y for y in _run(*inputs))\n")
    warnings: list[str] = []
    rewrites = []
    record = check_end_to_end(model, inputs, result.regions, out, trials=2, seed=0, measured=False,
                              stateful=False, cuda_graphs=False, warnings=warnings,
                              write_selection=lambda: rewrites.append(coopt.compile.write_selection(
                                  out, result.regions, False)))
    assert record["ok"]
    assert broken.selected == REFERENCE and "bisection" in broken.reason
    assert kept.selected != REFERENCE
    assert broken.summary.name in warnings[0] and kept.summary.name not in warnings[0]
    selection = json.loads((out / "selection.json").read_text())["regions"]
    assert selection[broken.summary.name]["selected"] == REFERENCE
    with torch.no_grad():
        torch.testing.assert_close(coopt.load(out)(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)


class CachedBlocks(torch.nn.Module):
    """TwoBlocks over a cache written in place at `pos` (a decoder's state)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)
        self.register_buffer("cache", torch.randn(8, 32))

    def forward(self, x, pos):
        self.cache[pos] = torch.relu(self.up(x))
        return self.down(self.cache[:4]) + x


def test_a_stateful_check_runs_the_callers_model_and_puts_its_buffers_back(tmp_path, monkeypatch):
    import coopt.verify.end_to_end as e2e

    torch.manual_seed(0)
    model, out = CachedBlocks().to(DEVICE), tmp_path / "out"
    inputs = (torch.randn(4, 16, device=DEVICE), torch.arange(4, device=DEVICE))
    result = coopt.Pipeline(top_k=1).build(model, inputs, out)
    pin_verified_kernels(out, result)
    kernels = [r for r in result.regions if r.selected != REFERENCE]
    assert kernels, [(r.summary.name, r.selected) for r in result.regions]
    broken = kernels[-1]
    chosen = next(c for c in broken.candidates if c.label == broken.selected)
    path = out / chosen.module
    path.write_text(path.read_text() + "\n\n_run = run\n\ndef run(*inputs):\n"
                    "    return tuple(2 * y if y.is_floating_point() else y for y in _run(*inputs))\n")
    before = model.cache.clone()
    # a device without room for a float64 copy of the whole model: the reference is streamed
    monkeypatch.setattr(e2e, "_free_bytes", lambda module: e2e.native_bytes(module)
                        + int(e2e._copy_bytes(module, torch.float64) / e2e.COPY_SHARE) - 1)
    warnings: list[str] = []
    record = check_end_to_end(model, inputs, result.regions, out, trials=2, seed=0, measured=False,
                              stateful=True, cuda_graphs=False, warnings=warnings,
                              write_selection=lambda: coopt.compile.write_selection(out, result.regions, False))
    assert record["ok"] and record["reference_precision"] == "float64, streamed module by module"
    assert broken.selected == REFERENCE and "bisection" in broken.reason
    assert any("streamed module by module" in w for w in warnings)
    assert torch.equal(model.cache, before)  # the trials wrote the caller's cache; it is put back


class _OnCuda:
    """A parameter's size and place, as ensure_room_for_the_check reads them (no GPU here)."""

    def __init__(self, nbytes):
        self.device = torch.device("cuda", 0)
        self._bytes = nbytes

    def numel(self):
        return self._bytes

    def element_size(self):
        return 1


def test_a_build_whose_check_cannot_fit_is_refused_before_the_tuning(monkeypatch):
    """The check loads the build beside the model: weights larger than the free memory left with
    the model on the GPU fail that late (exit 11) after minutes of tuning; refused at once."""
    import coopt.verify.end_to_end as verify_e2e
    from coopt.end_to_end import ensure_room_for_the_check
    from coopt.errors import DeviceMemoryError

    monkeypatch.setattr(verify_e2e, "device_free_bytes", lambda device: 10 * 2**30)
    model = SimpleNamespace(parameters=lambda: [_OnCuda(6 * 2**30), _OnCuda(5 * 2**30)])
    with pytest.raises(DeviceMemoryError, match=r"build \(11\.0 GiB of weights\).* 10\.0 GiB are free"):
        ensure_room_for_the_check(model)
    ensure_room_for_the_check(SimpleNamespace(parameters=lambda: [_OnCuda(6 * 2**30), _OnCuda(4 * 2**30)]))  # fits
    ensure_room_for_the_check(torch.nn.Linear(4, 4))  # on the CPU: nothing to check
