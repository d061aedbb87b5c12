"""Capture falls back to strict torch.export where non-strict cannot functionalise the model, and
generated kernels run in the interpreter even when triton was imported before coopt switched it on
(both met building transformers' exportable StaticCache wrapper on a CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import coopt
from coopt.compile import moved_in_place
from coopt.frontend.capture import capture


class Holder:
    """A plain object holding a tensor, as transformers' StaticCache layers hold their keys."""

    def __init__(self, tensor):
        self.tensor = tensor


class AliasedState(torch.nn.Module):
    """The cache is a registered buffer and, the same tensor, an attribute of a plain object the
    forward writes through: non-strict export lifts it twice (buffer and constant) and fails."""

    def __init__(self):
        super().__init__()
        self.holder = Holder(torch.zeros(4, 3))
        self.register_buffer("cache", self.holder.tensor)

    def forward(self, x, pos):
        self.holder.tensor.index_copy_(0, pos, x)
        return self.holder.tensor * 2


def test_strict_export_serves_where_non_strict_fails_and_says_so():
    notes: list[str] = []
    program = capture(AliasedState(), (torch.randn(1, 3), torch.tensor([2])), notes=notes)
    assert list(program.graph_signature.buffers_to_mutate.values()) == ["cache"]
    assert len(notes) == 1 and notes[0].startswith("captured with strict torch.export (non-strict failed: ")
    # a model non-strict export takes is captured so, with nothing to say
    notes.clear()
    capture(torch.nn.Linear(3, 3), (torch.randn(2, 3),), notes=notes)
    assert notes == []


def test_the_build_of_such_a_model_keeps_its_state_semantics(tmp_path):
    result = coopt.Pipeline(top_k=1).build(AliasedState(), (torch.randn(1, 3), torch.tensor([2])), tmp_path / "out")
    assert any("strict torch.export" in w for w in result.warnings)
    built, eager = coopt.load(tmp_path / "out"), AliasedState()
    built.w_cache.zero_()
    device = built.w_cache.device  # the GPU where there is one; the eager model stays on the CPU
    for pos in (0, 3, 1):
        x = torch.randn(1, 3)
        torch.testing.assert_close(built(x.to(device), torch.tensor([pos], device=device)).cpu(), eager(x, torch.tensor([pos])))
    torch.testing.assert_close(built.w_cache.cpu(), eager.cache)


def test_kernels_run_in_the_interpreter_after_triton_was_imported_first(tmp_path):
    """In a fresh process without a GPU: triton.language imported (its helpers compiled-mode
    JITFunctions), then a build whose GEMV kernel calls tl.cdiv: its check must pass; and a kernel
    calling helpers as tensor methods runs."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter is for machines without a GPU")
    script = textwrap.dedent(f"""
        import triton.language as tl
        from triton.runtime.jit import JITFunction
        assert type(tl.cdiv) is JITFunction  # decorated before any interpreter was asked for
        import torch, coopt
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU())
        result = coopt.Pipeline(top_k=1).build(model, (torch.randn(1, 64),), {str(tmp_path / "out")!r})
        assert result.e2e["ok"] and not result.warnings, result.warnings
        assert any(r.summary.family == "matmul_epilogue" for r in result.regions)
        # a kernel of its own calling the helpers as tensor methods (x.sum(0), x.sigmoid())
        from coopt.runtime.kernel_loader import load_module_from_file
        kernel = load_module_from_file({str(tmp_path / "methods.py")!r})
        x, out = torch.randn(8), torch.zeros(8)
        kernel.methods[(1,)](x, out, N=8)
        torch.testing.assert_close(out, x.sum() + torch.sigmoid(x))
        print("ok")
    """)
    (tmp_path / "methods.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def methods(x_ptr, out_ptr, N: tl.constexpr):
            offsets = tl.arange(0, N)
            x = tl.load(x_ptr + offsets)
            tl.store(out_ptr + offsets, x.sum(0) + x.sigmoid())
    """))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_a_model_moved_in_place_keeps_the_state_its_plain_objects_hold():
    """The build moves a GPU build's model copy with compile.moved_in_place: `.to()` makes new
    buffer objects, and a forward writing through the plain object's reference then writes the
    old tensor (on a GPU: CPU caches with GPU rows, session 42)."""
    x, pos = torch.randn(1, 3, dtype=torch.float64), torch.tensor([2])
    with pytest.raises(RuntimeError):  # the plain object still holds the float32 tensor
        AliasedState().double()(x, pos)
    model = AliasedState()
    model.proj = torch.nn.Linear(3, 3)
    weight, cache = model.proj.weight, model.cache
    moved_in_place(model, dtype=torch.float64)
    assert model.cache is cache is model.holder.tensor and model.proj.weight is weight
    assert cache.dtype == weight.dtype == torch.float64 and isinstance(weight, torch.nn.Parameter)
    assert torch.equal(model(x, pos)[2], 2 * x[0]) and torch.equal(model.cache[2], x[0])
    moved_in_place(model, torch.device("meta"))  # (a device move, where this machine has no GPU)
    assert model.holder.tensor is cache and cache.device.type == "meta"


class DeviceOfItsOwn(torch.nn.Module):
    """Keeps a device as a plain attribute (as transformers' StaticCache does): moving its
    tensors leaves that device behind."""

    def __init__(self):
        super().__init__()
        self.device = "meta"

    def forward(self, x):
        return x + torch.arange(x.shape[-1], device=self.device)


def test_a_device_kept_outside_the_tensors_is_named_in_the_capture_error():
    from coopt.errors import CaptureError

    with pytest.raises(CaptureError, match="keeps a tensor or a device elsewhere.*make the model on that device"):
        capture(DeviceOfItsOwn(), (torch.randn(2, 4),))
