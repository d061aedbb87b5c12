"""log_softmax over the last dim (log-probabilities of a classifier or a language model's head)
is raised to coopt.log_softmax and built into a row_reduction kernel, where it was an ATen op the
importer did not know; over another dim, or with a dtype, it stays ATen and still runs."""

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import beside_eager, run_pipeline

import coopt
from coopt.ir.dialect import LogSoftmaxOp


class Head(torch.nn.Module):
    def __init__(self, dim=-1, dtype=None):
        super().__init__()
        self.proj, self.dim, self.dtype = torch.nn.Linear(32, 50), dim, dtype

    def forward(self, x):
        return F.log_softmax(self.proj(x) * 4, dim=self.dim, dtype=self.dtype)


@pytest.mark.parametrize("model, raised", [(Head(), True), (Head(dim=1), False), (Head(dtype=torch.float64), False)],
                         ids=["last-dim", "other-dim", "with-dtype"])
def test_only_the_last_dims_log_softmax_is_raised(model, raised):
    module, counters = run_pipeline(model, [torch.randn(2, 3, 32)], "raise-patterns")
    assert counters.get("raise.log_softmax", 0) == int(raised)
    assert len([op for op in module.walk() if isinstance(op, LogSoftmaxOp)]) == int(raised)


def test_it_builds_into_a_row_reduction_kernel_that_matches(tmp_path):
    torch.manual_seed(0)
    model = Head()
    result = coopt.Pipeline(top_k=1).build(model, (torch.randn(2, 3, 32),), tmp_path / "out")
    kinds = [r.summary.attrs.get("kind") for r in result.regions if r.summary.family == "row_reduction"]
    assert kinds == ["log_softmax"]
    # every region has a generated candidate that verified (on a GPU the measured selection may
    # still keep the reference of a region this small: the tiny linear)
    assert all(any(c.verified and c.family != "reference" for c in r.candidates) for r in result.regions)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "log_softmax" not in report.split("## What fell back to PyTorch")[1].split("## Regions")[0]
    x = torch.randn(2, 3, 32) * 3
    with torch.no_grad():
        torch.testing.assert_close(beside_eager(coopt.load(tmp_path / "out"))(x), model(x), rtol=1e-4, atol=1e-4)
