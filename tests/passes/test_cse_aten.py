"""cse-aten: the same ATen call on the same operands runs once, an alias is its source, and a
copy into a tensor of its own type is its source; the per-layer position bookkeeping of transformers 5's StaticCache
(a copy of cache_position[0] into each layer's cumulative_length, arange(1) + it, it + 1) becomes
one computation, and the built model keeps every buffer's value."""

from __future__ import annotations

import pytest
import torch
from pass_helpers import beside_eager, kernel_families, run_pipeline
from xdsl.dialects.builtin import TensorType, f32, i64
from xdsl.ir import Block

import coopt
from coopt.ir.dialect import AtenOp
from coopt.passes.cse_aten import _copied_value
from coopt.passes.registry import DEFAULT_PIPELINE

LAYERS = 3


class PositionBookkeeping(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for i in range(LAYERS):
            self.register_buffer(f"length{i}", torch.tensor(0))
            self.register_buffer(f"cache{i}", torch.zeros(8, 4))

    def forward(self, x, cache_position):
        out = x
        for i in range(LAYERS):
            length, cache = getattr(self, f"length{i}"), getattr(self, f"cache{i}")
            length.copy_(cache_position[0])
            positions = torch.arange(1, device=length.device) + length
            length.add_(1)
            cache.index_copy_(0, positions, out)
            out = out + cache.sum(0, keepdim=True)
        return out


def targets(module) -> list[str]:
    return [op.target.data for op in module.walk() if isinstance(op, AtenOp)]


def test_each_layers_positions_are_one_computation():
    inputs = [torch.randn(1, 4), torch.tensor([2])]
    module, counters = run_pipeline(PositionBookkeeping(), inputs, "inplace-state-writes,cse-aten")
    assert counters["cse.aten.copy_folded"] == LAYERS
    ops = targets(module)
    assert "aten.copy.default" not in ops
    assert ops.count("aten.arange.default") == 1 and ops.count("aten.select.int") == 1
    # arange(1) + position and position + 1, once each; the rest are the layers' own sums
    assert ops.count("aten.add.Tensor") == 2 + LAYERS
    # without the pass every layer makes its own
    module, _ = run_pipeline(PositionBookkeeping(), inputs, "inplace-state-writes")
    assert targets(module).count("aten.arange.default") == LAYERS


def test_the_built_model_keeps_every_buffer(tmp_path):
    coopt.Pipeline(top_k=1).build(PositionBookkeeping(), (torch.randn(1, 4), torch.tensor([2])), tmp_path / "out")
    built, eager = coopt.load(tmp_path / "out"), PositionBookkeeping()
    for name, buffer in built.named_buffers():
        buffer.zero_()
    for pos in (0, 5, 3):
        x = torch.randn(1, 4)
        torch.testing.assert_close(beside_eager(built)(x, torch.tensor([pos])), eager(x, torch.tensor([pos])))
    for i in range(LAYERS):
        assert int(getattr(built, f"w_length{i}")) == 4  # the last position + 1, in every layer's buffer
        torch.testing.assert_close(getattr(built, f"w_cache{i}").cpu(), getattr(eager, f"cache{i}"))
    # the write positions, arange(1) + cache_position[0], are the input's value: bounded at call time
    for outside in (8, -1):
        with pytest.raises(ValueError, match=rf"cache_position: holds {outside}, outside \[0, 8\)"):
            beside_eager(built)(torch.randn(1, 4), torch.tensor([outside]))


class TwoDraws(torch.nn.Module):
    def forward(self, x):
        return x + torch.rand(3) + torch.rand(3)  # two draws are two values


def test_random_draws_are_kept():
    module, counters = run_pipeline(TwoDraws(), [torch.randn(3)], "inplace-state-writes,cse-aten")
    draws = [op for op in module.walk() if getattr(op, "target", None) and op.target.data == "aten.rand.default"]
    assert len(draws) == 2 and not counters["cse.aten.merged"]


def test_only_a_copy_into_its_own_type_is_its_source():
    block = Block(arg_types=[TensorType(i64, [4]), TensorType(f32, [4]), TensorType(i64, [1]), TensorType(i64, [4])])
    dst, converted, broadcast, same = block.args

    def copy(src):
        return AtenOp("aten.copy.default", {"args": [{"$t": 0}, {"$t": 1}], "kwargs": {}}, [dst, src], [dst.type])

    assert _copied_value(copy(same)) is same
    assert _copied_value(copy(converted)) is None  # a float into int64: truncated values
    assert _copied_value(copy(broadcast)) is None  # one value broadcast over four


class Snapshot(torch.nn.Module):
    """A copy of a cache row taken before the row is written: a snapshot, not a view of the cache."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, x, pos):
        snap = torch.zeros(4, device=self.cache.device).copy_(self.cache[3])
        self.cache.index_copy_(0, pos, x)
        return snap * 2.0


def test_a_copy_of_a_buffers_rows_stays_a_snapshot(tmp_path):
    _, counters = run_pipeline(Snapshot(), [torch.randn(1, 4), torch.tensor([0])], "inplace-state-writes,cse-aten")
    assert not counters["cse.aten.copy_folded"]
    coopt.Pipeline(top_k=1).build(Snapshot(), (torch.randn(1, 4), torch.tensor([0])), tmp_path / "out")
    built, eager = coopt.load(tmp_path / "out"), Snapshot()
    built.w_cache.zero_()
    for pos in (3, 3):  # the second call's snapshot is the row the first wrote, not its own
        x = torch.randn(1, 4)
        torch.testing.assert_close(beside_eager(built)(x, torch.tensor([pos])), eager(x, torch.tensor([pos])))


class MovingOffset(torch.nn.Module):
    """Writes at offset + rel, the offset a buffer holding [0] at import that every call moves:
    not arange(1), so rel alone is not the written row and is not bounded as one."""

    def __init__(self):
        super().__init__()
        self.register_buffer("offset", torch.zeros(1, dtype=torch.long))
        self.register_buffer("cache", torch.zeros(64, 4))

    def forward(self, x, rel):
        self.cache.index_copy_(0, self.offset + rel, x)
        self.offset.add_(1)
        return self.cache.sum(0, keepdim=True)


def test_a_buffer_the_program_writes_is_no_arange(tmp_path):
    coopt.Pipeline(top_k=1).build(MovingOffset(), (torch.randn(1, 4), torch.tensor([0])), tmp_path / "out")
    built, eager = coopt.load(tmp_path / "out"), MovingOffset()
    for _, buffer in built.named_buffers():
        buffer.zero_()
    for rel in (0, 0, 0, -1):  # the last call writes row 3 - 1 = 2: legal, and must not be refused
        x = torch.randn(1, 4)
        torch.testing.assert_close(beside_eager(built)(x, torch.tensor([rel])), eager(x, torch.tensor([rel])))


class AliasedHead(torch.nn.Module):
    """transformers 5's causal-LM head: the final norm's output sliced by logits_to_keep = 0,
    which exports as aten.alias."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(64, eps=1e-5)
        self.head = torch.nn.Linear(64, 128, bias=False)

    def forward(self, h):
        return self.head(self.norm(h)[:, slice(-0, None), :])


def test_an_alias_folds_so_the_final_norm_joins_the_head():
    inputs = [torch.randn(1, 1, 64)]
    module, _ = run_pipeline(AliasedHead(), inputs, "inplace-state-writes")
    assert "aten.alias.default" in targets(module)  # what export makes of the slice
    module, counters = run_pipeline(AliasedHead(), inputs)
    assert counters["cse.aten.alias_folded"] == 1
    assert kernel_families(module) == ["matmul_epilogue"]  # the norm in the head GEMV's prologue
    module, _ = run_pipeline(AliasedHead(), inputs, DEFAULT_PIPELINE.replace("cse-aten,", ""))
    assert len(kernel_families(module)) == 2  # without the fold: the norm its own kernel


def test_only_a_write_that_moves_with_the_models_own_state_is_not_repeatable():
    from coopt.codegen.input_bounds import state_moved_writes

    module, _ = run_pipeline(MovingOffset(), [torch.randn(1, 4), torch.tensor([0])], "inplace-state-writes")
    assert state_moved_writes(module) == ["cache"]
    # transformers' positions: a copy of cache_position into each layer's buffer is cache_position's
    # value, with or without cse-aten folding the copies
    for pipeline in ("inplace-state-writes", "inplace-state-writes,cse-aten"):
        module, _ = run_pipeline(PositionBookkeeping(), [torch.randn(1, 4), torch.tensor([2])], pipeline)
        assert state_moved_writes(module) == []


def test_a_build_that_measured_its_regions_does_not_time_a_moving_write_end_to_end(tmp_path, monkeypatch):
    """On a GPU the end-to-end timing calls the model hundreds of times on the example input; the
    MovingOffset model would write past its 64 rows (session 41, an H100: a device-side assert).
    Here the regions' timing is said to have run (as on a GPU); the build checks, warns, and
    times nothing else (on a CPU a timing would have failed the build)."""
    import coopt.compile

    monkeypatch.setattr(coopt.compile, "_select", lambda *args, **kwargs: True)
    result = coopt.Pipeline(top_k=1).build(MovingOffset(), (torch.randn(1, 4), torch.tensor([0])), tmp_path / "out")
    assert any("not timed end to end: the model writes cache" in w for w in result.warnings)
