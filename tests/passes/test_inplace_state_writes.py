"""inplace-state-writes: cache writes become in-place updates, and the built model keeps the
buffer semantics of the original (state after several calls, values returned)."""

import torch

import coopt
from coopt.ir.dialect import StateUpdateOp, StateWriteOp
from pass_helpers import run_pipeline


class Cache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 8, 4))
        self.register_buffer("v", torch.zeros(1, 2, 8, 4))
        self.register_buffer("s", torch.zeros(2, 8))

    def forward(self, x, pos):
        self.k[:, :, pos] = x
        self.v.index_copy_(2, pos, x * 2)
        self.s[:, :1] = x[0, :, :, 0]
        return self.k.sum(-1) + self.v.sum(-1) + self.s.sum()


def test_writes_become_in_place_updates():
    module, counters = run_pipeline(Cache(), [torch.randn(1, 2, 1, 4), torch.tensor([3])], "inplace-state-writes")
    ops = list(module.walk())
    assert not [o for o in ops if isinstance(o, StateWriteOp)]
    assert sorted(o.target.data for o in ops if isinstance(o, StateUpdateOp)) == [
        "aten.index_copy_.default", "aten.index_put_.default", "coopt.slice_copy_"]
    assert counters["inplace.index_put"] == counters["inplace.index_copy"] == counters["inplace.slice_scatter"] == 1


class ReadsOldValueAfterWrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(4, 3))

    def forward(self, x):
        old = self.k.clone()
        self.k[1] = x
        return old * 2  # reads the value from before the write: must stay functional


def test_a_later_read_of_the_old_value_keeps_the_functional_form():
    module, counters = run_pipeline(ReadsOldValueAfterWrite(), [torch.randn(3)], "inplace-state-writes")
    assert not counters
    assert [o for o in module.walk() if isinstance(o, StateWriteOp)]


def test_built_model_matches_the_original_over_several_steps(tmp_path):
    original, steps = Cache(), [(torch.randn(1, 2, 1, 4), torch.tensor([p])) for p in (0, 5, 7)]
    coopt.Pipeline(top_k=1).build(Cache(), steps[0], tmp_path / "out")
    built = coopt.load(tmp_path / "out")
    for x, pos in steps:
        torch.testing.assert_close(built(x, pos), original(x, pos))
    torch.testing.assert_close(built.w_k, original.k)
    torch.testing.assert_close(built.w_s, original.s)
