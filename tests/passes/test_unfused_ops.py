"""coopt.ir.unfused.unfused_ops: what a program still launches through PyTorch between its
kernels (the report's list), views left out."""

import torch

from coopt.ir.unfused import unfused_ops
from pass_helpers import run_pipeline


class Gather(torch.nn.Module):
    """An embedding gather (no region takes it), views of it, a linear fusion takes, and a
    buffer write."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(4, 8))

    def forward(self, tokens, pos):
        x = self.emb(tokens).reshape(-1, 8).transpose(0, 1).transpose(0, 1)
        self.cache[pos] = x
        return self.fc(x)


INPUTS = [torch.tensor([1, 2]), torch.tensor([0, 3])]


def test_views_are_not_counted_and_fused_ops_leave_the_list():
    imported, _ = run_pipeline(Gather(), INPUTS, "")
    before = unfused_ops(imported)
    # views (reshape, transpose) launch nothing; the write is a functional index_put + copy_
    assert before == {"aten.embedding.default": 1, "aten.index_put.default": 1, "aten.linear.default": 1,
                      "coopt.state_write": 1}, before
    fused, _ = run_pipeline(Gather(), INPUTS, "inplace-state-writes,raise-patterns,fuse-linear-epilogue")
    after = unfused_ops(fused)
    # the linear is a region now; the write an in-place update of one row (still PyTorch's)
    assert after == {"aten.embedding.default": 1, "aten.index_put_.default": 1}, after


class OnTheFlyRotary(torch.nn.Module):
    """Rotary angles computed in the forward (positions x frequencies), then their cos and sin."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.01, 1.0, 8))

    def forward(self, x, pos):
        angles = pos[:, None] * self.freq[None, :]
        return x * angles.cos() + x * angles.sin()


def test_sin_and_cos_fuse_with_the_arithmetic_around_them():
    inputs = [torch.randn(4, 8), torch.tensor([0.0, 1.0, 700.0, 32767.0])]
    imported, _ = run_pipeline(OnTheFlyRotary(), inputs, "")
    assert unfused_ops(imported)["aten.cos.default"] == 1
    fused, _ = run_pipeline(OnTheFlyRotary(), inputs, "raise-patterns,fuse-elementwise")
    assert unfused_ops(fused) == {}, unfused_ops(fused)
