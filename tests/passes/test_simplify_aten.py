"""simplify-aten and fold-constants: transformers' per-step rotary tables (a K = 1 matmul, a
transpose, a cat of the result with itself, cos and sin) become one elementwise kernel over a
weight computed at build time, and every rewrite is exact: a build of those passes alone is
bitwise the eager model."""

from __future__ import annotations

import pytest
import torch
from pass_helpers import beside_eager, kernel_families, run_pipeline

import coopt
from coopt.ir.dialect import AtenOp, WeightOp
from coopt.passes.fold_constants import CONST_PREFIX, constants_record
from coopt.passes.registry import DEFAULT_PIPELINE

HEAD_DIM = 16


class RotaryTables(torch.nn.Module):
    """transformers' LlamaRotaryEmbedding.forward, as written there."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.dtype = dtype

    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * x).to(self.dtype), (emb.sin() * x).to(self.dtype)


def rotary_inputs(batch=2, steps=3):
    return [torch.randn(batch, steps, HEAD_DIM), torch.randint(0, 4096, (batch, steps))]


def targets(module) -> list[str]:
    return [op.target.data for op in module.walk() if isinstance(op, AtenOp)]


def built_with(model, inputs, passes: str, out):
    coopt.Pipeline(passes=passes, top_k=1).build(model, tuple(inputs), out)
    return beside_eager(coopt.load(out))


def test_the_rotary_tables_lose_their_matmul_and_cat():
    module, counters = run_pipeline(RotaryTables(), rotary_inputs(), "simplify-aten,fold-constants")
    assert counters["simplify.outer_product"] == 1
    assert counters["simplify.cat_of_repeats"] == 1
    assert counters["simplify.transpose_sunk"] >= 1
    assert counters["fold.constants"] == 1
    ops = targets(module)
    assert "aten.matmul.default" not in ops and "aten.cat.default" not in ops
    # the folded weight is cat(inv_freq, inv_freq) laid out [1, 1, D]; inv_freq itself is no longer read
    refs = [op.ref.data for op in module.walk() if isinstance(op, WeightOp)]
    assert refs == [r for r in refs if r.startswith(CONST_PREFIX)] and len(refs) == 1
    assert list(constants_record(module)) == refs
    # without the passes: the matmul and the cat are there
    assert {"aten.matmul.default", "aten.cat.default"} <= set(targets(run_pipeline(RotaryTables(), rotary_inputs(), "cse-aten")[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rewrites_are_exact(tmp_path, dtype):
    model, inputs = RotaryTables(dtype), rotary_inputs()
    coopt.Pipeline(passes="simplify-aten,fold-constants", top_k=1).build(model, tuple(inputs), tmp_path / "out")
    built = coopt.load(tmp_path / "out")  # no kernels: the rewritten ATen calls alone, on the build's device
    device = next(iter(built.state_dict().values())).device
    on_device = [t.to(device) for t in inputs]
    for got, want in zip(built(*on_device), model.to(device)(*on_device)):
        assert torch.equal(got, want)


def test_the_default_build_makes_one_kernel_of_the_tables(tmp_path):
    model, inputs = RotaryTables(), rotary_inputs()
    module, _ = run_pipeline(model, inputs)
    assert kernel_families(module) == ["elementwise"]
    assert not [t for t in targets(module) if t in ("aten.matmul.default", "aten.cat.default", "aten.cos.default")]
    built = built_with(model, inputs, DEFAULT_PIPELINE, tmp_path / "out")
    for got, want in zip(built(*inputs), model(*inputs)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class NotRewritten(torch.nn.Module):
    """A real contraction (K = 2), a cat of two different values, a cat of a value read elsewhere."""

    def forward(self, a, b, c):
        product = a @ b  # [2, 3, 2] @ [2, 2, 4]
        pair = torch.cat((c * 2, c * 3), dim=-1)
        doubled = c * 2
        return product, pair, torch.cat((doubled, doubled), dim=-1), doubled + 1


def test_what_is_not_one_of_the_patterns_stays():
    inputs = [torch.randn(2, 3, 2), torch.randn(2, 2, 4), torch.randn(3, 4)]
    module, counters = run_pipeline(NotRewritten(), inputs, "simplify-aten")
    assert not any(k.startswith("simplify.") for k in counters)
    assert targets(module).count("aten.cat.default") == 2 and "aten.matmul.default" in targets(module)


class WeightExpressions(torch.nn.Module):
    """Gemma's (1 + weight) norm scale (foldable), a buffer the model writes (not), a broadcast that
    would grow past its weight (not)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8))
        self.register_buffer("count", torch.zeros(8))
        self.register_buffer("row", torch.randn(1, 32))

    def forward(self, x):
        self.count.add_(1)
        scaled = x * (1.0 + self.weight.float())
        counted = x * (self.count * 2)
        spread = self.row.expand(4096, 32) * 3  # 131072 elements from 32
        return scaled + counted, spread + x.sum()


def test_fold_constants_folds_weight_expressions_only(tmp_path):
    inputs = [torch.randn(4, 8)]
    module, counters = run_pipeline(WeightExpressions(), inputs, "inplace-state-writes,fold-constants")
    assert counters["fold.constants"] == 1
    (recipe,) = constants_record(module).values()
    assert any("aten.add" in line for line in recipe["lines"])
    refs = {op.ref.data for op in module.walk() if isinstance(op, WeightOp)}
    assert "weight" not in refs and "count" in refs and "row" in refs  # (1 + weight) read only folded
    # the build computes the folded weight and is the eager model, call after call (the written buffer advances)
    model, reference = WeightExpressions(), WeightExpressions()
    reference.load_state_dict(model.state_dict())
    coopt.Pipeline(passes="inplace-state-writes,fold-constants", top_k=1).build(model, tuple(inputs), tmp_path / "out")
    built = coopt.load(tmp_path / "out")  # no kernels: ATen calls on the build's device, as the reference's
    device = next(iter(built.state_dict().values())).device
    reference, on_device = reference.to(device), [t.to(device) for t in inputs]
    for _ in range(2):
        for got, want in zip(built(*on_device), reference(*on_device)):
            assert torch.equal(got, want)


class CastWeightsEachCall(torch.nn.Module):
    """Weights kept in fp64 and cast for each call (as mixed-precision code does): the casts fold,
    and the folded weights still merge as q|k|v."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wq, self.wk, self.wv = (torch.nn.Parameter(torch.randn(n, 16, dtype=torch.float64)) for n in (16, 8, 8))

    def forward(self, x):
        return tuple(torch.nn.functional.linear(x, w.to(torch.float32)) for w in (self.wq, self.wk, self.wv))


def test_folded_weights_merge_as_parallel_linears(tmp_path):
    passes = "fold-constants,raise-patterns,fuse-parallel-linears"
    model, x = CastWeightsEachCall(), torch.randn(2, 3, 16)
    module, counters = run_pipeline(model, [x], passes)
    assert counters["fold.constants"] == 3 and counters["fuse.parallel_linears"] == 1
    coopt.Pipeline(passes=passes, top_k=1).build(model, (x,), tmp_path / "out")
    stored = torch.load(tmp_path / "out" / "weights.pt", weights_only=True)
    (merged,) = stored.values()  # one fp32 q|k|v weight, made of the folded casts; no fp64 weight kept
    assert merged.dtype == torch.float32 and merged.shape == (32, 16)
    torch.testing.assert_close(merged.cpu(), torch.cat([model.wq, model.wk, model.wv]).float(), rtol=0, atol=0)
    with torch.no_grad():
        for got, want in zip(beside_eager(coopt.load(tmp_path / "out"))(x), model(x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
