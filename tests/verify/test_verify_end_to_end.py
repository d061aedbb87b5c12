"""verify_end_to_end: the built model against the original on fresh inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim

from coopt.verify.end_to_end import reference_copy, verify_end_to_end


class TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        return {"y": self.norm(x + self.down(torch.nn.functional.gelu(self.up(x)))),
                "shape": list(x.shape)}


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return TinyMLP().to(dtype).eval()


class ShapeRecorder(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.shapes = inner, []

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return self.inner(x)


def test_identical_build_passes_in_fp32_and_bf16():
    for dtype in (torch.float32, torch.bfloat16):
        model = _model(dtype)
        result = verify_end_to_end(model, copy.deepcopy(model),
                                   (torch.randn(4, 16).to(dtype),), trials=2)
        assert result.ok, result.failure
        assert result.examples == 2


def test_perturbed_weight_is_caught():
    model = _model()
    built = copy.deepcopy(model)
    with torch.no_grad():
        built.down.weight[3, 5] += 0.05
    result = verify_end_to_end(model, built, (torch.randn(4, 16),))
    assert not result.ok
    assert result.failure.startswith("output['y']: max abs err")
    assert "[trial 0, input shapes [(4, 16)]]" in result.failure


def test_raising_build_is_a_failure():
    def built(x):
        raise RuntimeError("kernel launch failed")

    result = verify_end_to_end(_model(), built, (torch.randn(4, 16),))
    assert result.failure.startswith("built model raised RuntimeError: kernel launch failed")


def test_a_build_out_of_device_memory_raises_rather_than_failing_the_check():
    """Out of memory says nothing about the kernels: a failed verdict would send the build to
    bisect them (which itself ran the H100 out of memory, session 37)."""
    def built(x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1002.00 MiB.")

    with pytest.raises(torch.OutOfMemoryError):
        verify_end_to_end(_model(), built, (torch.randn(4, 16),))


def test_a_high_precision_reference_out_of_memory_raises_rather_than_judging_by_the_floor():
    """A reference that raises for want of an op's dtype is dropped (the floor around eager
    judges); one out of memory is not: the floor alone fails deep bf16 models, and bisection
    would then blame the kernels."""
    model = _model()

    class OutOfMemory(torch.nn.Module):
        def forward(self, x):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB.")

    class NoFloat64(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Double'")

    inputs = (torch.randn(4, 16),)
    assert verify_end_to_end(model, copy.deepcopy(model), inputs, high_model=NoFloat64()).ok
    with pytest.raises(torch.OutOfMemoryError):
        verify_end_to_end(model, copy.deepcopy(model), inputs, high_model=OutOfMemory())


def test_dynamic_dims_are_varied_between_trials():
    model = _model()
    built = ShapeRecorder(copy.deepcopy(model))
    batch = Dim("batch", min=1, max=64)
    result = verify_end_to_end(model, built, (torch.randn(6, 16),),
                               dynamic_shapes=({0: batch},), trials=4, seed=3)
    assert result.ok, result.failure
    assert built.shapes[0] == (6, 16) and built.shapes[1] == (1, 16)  # example, then minimum
    assert all(1 <= s[0] <= 6 for s in built.shapes)  # never beyond the example's size


class TiedCache(torch.nn.Module):
    """Tied weights and a KV-cache-like buffer, in bf16."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 16)
        self.head = torch.nn.Linear(16, 8, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("cache", torch.randn(4, 16))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens):
        return self.head(self.embed(tokens) + self.cache[: tokens.shape[0]])


def test_reference_copy_is_float64_without_a_native_copy_and_keeps_ties(monkeypatch):
    model = TiedCache().to(torch.bfloat16)
    # a deepcopy at the model's own dtype would meet this; the converted copy never makes one
    copied = []
    original_deepcopy = torch.Tensor.__deepcopy__
    monkeypatch.setattr(torch.Tensor, "__deepcopy__", lambda self, memo: copied.append(self) or original_deepcopy(self, memo))
    high, precision = reference_copy(model)
    assert precision == "float64" and copied == []
    assert high.embed.weight.dtype == high.cache.dtype == torch.float64 and high.steps.dtype == torch.int64
    assert isinstance(high.embed.weight, torch.nn.Parameter) and high.head.weight is high.embed.weight
    assert high.cache.data_ptr() != model.cache.data_ptr() and model.cache.dtype == torch.bfloat16
    torch.testing.assert_close(high.cache, model.cache.double())


def test_reference_copy_streams_then_gives_up_as_memory_shrinks(monkeypatch):
    import coopt.verify.end_to_end as e2e

    model = TiedCache()
    build = e2e.native_bytes(model)  # what the checked build takes beside the copy once loaded

    def free_for(need):
        monkeypatch.setattr(e2e, "_free_bytes", lambda module: build + int(need / e2e.COPY_SHARE))

    free_for(e2e._copy_bytes(model, torch.float64))
    assert isinstance(reference_copy(model)[0], torch.nn.Module)  # the whole float64 copy
    free_for(e2e._copy_bytes(model, torch.float64) - 64)
    high, precision = reference_copy(model)
    assert isinstance(high, e2e.StreamedCopy) and high.dtype == torch.float64 and high.module is model
    assert precision == "float64, streamed module by module"
    # the largest submodule's own tensors: the embedding table (shared with the head), 8 x 16
    assert e2e._streamed_bytes(model, torch.float64) == 8 * 16 * 8
    free_for(e2e._streamed_bytes(model, torch.float64) - 1)
    high, precision = reference_copy(model)
    assert isinstance(high, e2e.StreamedCopy) and high.dtype == torch.float32
    free_for(e2e._streamed_bytes(model, torch.float32) - 1)
    high, precision = reference_copy(model)
    assert high is None and precision.startswith("none: even one submodule's float32 copy needs")
    # room for the copy, but not for the build beside it (session 9: 32 layers ran out of memory)
    monkeypatch.setattr(e2e, "_free_bytes", lambda module: int(e2e._copy_bytes(model, torch.float64) / e2e.COPY_SHARE))
    assert isinstance(reference_copy(model)[0], e2e.StreamedCopy)


class WritesItsCache(torch.nn.Module):
    """A decode-step-like block: writes its cache row in place, then reads the whole cache."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.register_buffer("cache", torch.randn(4, 16))

    def forward(self, x, pos):
        self.cache[pos] = self.proj(x)
        return self.cache.sum(0) * x


class TwoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = WritesItsCache(), WritesItsCache()

    def forward(self, x, pos):
        return self.second(self.first(x, pos), pos)


def test_a_streamed_copy_computes_what_the_float64_copy_does_and_changes_nothing():
    import coopt.verify.end_to_end as e2e

    torch.manual_seed(0)
    model = TwoBlocks().to(torch.bfloat16)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    x, pos = torch.randn(16, dtype=torch.float64), torch.tensor(2)
    with torch.inference_mode():
        want = e2e._converted_copy(model, torch.float64)(x, pos)
        got = e2e.StreamedCopy(model, torch.float64)(x, pos)
    assert got.dtype == torch.float64 and torch.equal(got, want)  # the same float64 arithmetic
    for name, tensor in model.state_dict().items():  # the cache writes went to the casts
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state[name]), name
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_streamed_copy_puts_every_tensor_back_when_the_forward_raises():
    import coopt.verify.end_to_end as e2e

    model = TwoBlocks().to(torch.bfloat16)
    weights = {name: t for name, t in model.named_parameters()}
    with pytest.raises(IndexError):
        e2e.StreamedCopy(model, torch.float64)(torch.randn(16, dtype=torch.float64), torch.tensor(9))  # row 9 of 4
    assert all(t is weights[name] for name, t in model.named_parameters())
    assert all(t.dtype == torch.bfloat16 for t in model.state_dict().values())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_streamed_reference_judges_a_bf16_build_as_the_whole_copy_does(monkeypatch):
    import coopt.verify.end_to_end as e2e

    model = _model(torch.bfloat16)
    x = (torch.randn(4, 16).to(torch.bfloat16),)
    whole = verify_end_to_end(model, copy.deepcopy(model), x)
    monkeypatch.setattr(e2e, "_free_bytes", lambda module: e2e.native_bytes(module)
                        + int(e2e._copy_bytes(module, torch.float64) / e2e.COPY_SHARE) - 1)
    assert isinstance(reference_copy(model)[0], e2e.StreamedCopy)
    streamed = verify_end_to_end(model, copy.deepcopy(model), x)
    # errors measured from the float64 reference (from the native output they would be 0)
    assert streamed.ok and whole.ok and streamed.max_abs_err == whole.max_abs_err > 0
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.down.weight[3, 5] += 0.5
    assert not verify_end_to_end(model, broken, (torch.randn(4, 16).to(torch.bfloat16),)).ok
