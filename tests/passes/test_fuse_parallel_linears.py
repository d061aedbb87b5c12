"""fuse-parallel-linears: linears sharing an input become one linear over concatenated weights
(q/k/v, gate/up); the build stores the concatenation and not the parts; results are unchanged."""

import torch
import torch.nn.functional as F

from pass_helpers import beside_eager, run_pipeline
from test_raise_patterns import Lambda

import coopt
from coopt.ir.dialect import AtenOp, LinearOp, WeightOp
from coopt.passes.fuse_parallel_linears import concat_parts, concat_ref

x = torch.randn(2, 3, 16)
RAISE_AND_MERGE = "raise-patterns,fuse-parallel-linears"


def qkv(m, x):
    return F.linear(x, m.wq) * 2.0, F.linear(x, m.wk) + 1.0, F.linear(x, m.wv)


QKV = dict(wq=torch.randn(16, 16), wk=torch.randn(8, 16), wv=torch.randn(8, 16))


def linears(module):
    return [op for op in module.walk() if isinstance(op, LinearOp)]


def test_three_projections_of_one_input_become_one_linear_and_three_slices():
    module, counters = run_pipeline(Lambda(qkv, **QKV), [x], RAISE_AND_MERGE)
    (merged,) = linears(module)
    assert merged.results[0].type.get_shape() == (2, 3, 32)
    assert concat_parts(merged.w.owner.ref.data) == ["wq", "wk", "wv"]
    slices = [op for op in module.walk() if isinstance(op, AtenOp) and op.target.data == "aten.slice.Tensor"]
    assert sorted(tuple(op.call["args"][1:]) for op in slices) == [(2, 0, 16), (2, 16, 24), (2, 24, 32)]
    assert {op.ref.data for op in module.walk() if isinstance(op, WeightOp)} == {concat_ref(["wq", "wk", "wv"])}
    assert counters["fuse.parallel_linears"] == 1 and counters["fuse.parallel_linears.members"] == 3


def test_different_inputs_a_biased_linear_beside_a_bias_free_one_and_lone_linears_stay_apart():
    def model(m, x, y):
        return F.linear(x, m.a), F.linear(y, m.b), F.linear(x, m.c, m.bias)

    params = dict(a=torch.randn(4, 16), b=torch.randn(4, 16), c=torch.randn(4, 16), bias=torch.randn(4))
    module, counters = run_pipeline(Lambda(model, **params), [x, x.clone()], RAISE_AND_MERGE)
    assert len(linears(module)) == 3
    assert counters["fuse.parallel_linears"] == 0


def biased_qkv(m, x):  # Qwen2's projections: q, k and v with biases
    return F.linear(x, m.wq, m.bq), F.linear(x, m.wk, m.bk), F.linear(x, m.wv, m.bv)


BIASED_QKV = {**QKV, "bq": torch.randn(16), "bk": torch.randn(8), "bv": torch.randn(8)}


def test_biased_projections_merge_with_their_biases_concatenated(tmp_path):
    module, counters = run_pipeline(Lambda(biased_qkv, **BIASED_QKV), [x], RAISE_AND_MERGE)
    (merged,) = linears(module)
    assert concat_parts(merged.bias.owner.ref.data) == ["bq", "bk", "bv"]
    assert counters["fuse.parallel_linears.with_bias"] == 1
    model = Lambda(biased_qkv, **BIASED_QKV).eval()
    coopt.Pipeline(top_k=1).build(model, (x,), tmp_path / "out")
    stored = torch.load(tmp_path / "out" / "weights.pt", weights_only=True)
    assert torch.equal(stored[concat_ref(["bq", "bk", "bv"])].cpu(), torch.cat([BIASED_QKV[b] for b in ("bq", "bk", "bv")]))
    fresh = torch.randn(2, 3, 16)
    with torch.no_grad():
        for got, want in zip(beside_eager(coopt.load(tmp_path / "out"))(fresh), model(fresh)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_max_group_knob_bounds_each_merge():
    module, counters = run_pipeline(Lambda(qkv, **QKV), [x], "raise-patterns,fuse-parallel-linears{max-group=2}")
    assert [len(concat_parts(op.w.owner.ref.data) or []) for op in linears(module)] == [2, 0]
    assert counters["fuse.parallel_linears.members"] == 2


def test_built_swiglu_and_qkv_match_eager_and_store_only_the_merged_weights(tmp_path):
    def block(m, x):
        q, k, v = qkv(m, x)
        y = x + 1.0  # the MLP reads another input (in a decoder: the second norm's output)
        h = F.silu(F.linear(y, m.gate)) * F.linear(y, m.up)
        return q + F.linear(h, m.down), k * v

    params = {**QKV, "gate": torch.randn(24, 16), "up": torch.randn(24, 16), "down": torch.randn(16, 24)}
    model = Lambda(block, **params).eval()
    out = tmp_path / "out"
    result = coopt.Pipeline(top_k=1).build(model, (x,), out)
    assert result.counters["fuse.parallel_linears"] == 2
    stored = torch.load(out / "weights.pt", weights_only=True)
    assert set(stored) == {concat_ref(["wq", "wk", "wv"]), concat_ref(["gate", "up"]), "down"}
    assert torch.equal(stored[concat_ref(["gate", "up"])].cpu(), torch.cat([params["gate"], params["up"]]))
    fresh = torch.randn(2, 3, 16)
    with torch.no_grad():
        for got, want in zip(beside_eager(coopt.load(out))(fresh), model(fresh)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_broadcast_bias_or_a_bias_the_model_writes_is_not_concatenated():
    def broadcast(m, x):  # biases of one element, broadcast over each output
        return F.linear(x, m.wq, m.bq), F.linear(x, m.wk, m.bk)

    params = {"wq": torch.randn(8, 16), "wk": torch.randn(4, 16), "bq": torch.randn(1), "bk": torch.randn(1)}
    _, counters = run_pipeline(Lambda(broadcast, **params), [x], RAISE_AND_MERGE)
    assert counters["fuse.parallel_linears"] == 0

    class MovingBias(torch.nn.Module):  # a bias buffer every call updates: a build-time concatenation goes stale
        def __init__(self):
            super().__init__()
            self.wq, self.wk = torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(4, 16))
            self.register_buffer("bq", torch.zeros(8))
            self.register_buffer("bk", torch.zeros(4))

        def forward(self, x):
            out = F.linear(x, self.wq, self.bq), F.linear(x, self.wk, self.bk)
            self.bq.add_(1.0)
            return out

    _, counters = run_pipeline(MovingBias(), [x], "inplace-state-writes," + RAISE_AND_MERGE)
    assert counters["fuse.parallel_linears"] == 0
