"""Repeated layers give identical regions: candidates are made, verified (and timed) once and
shared, and every copy follows the first one's selection."""

import json

import torch
from built_calls import beside_eager

import coopt


class Stack(torch.nn.Module):
    def __init__(self, layers=3, width=32):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return x


def test_identical_layers_share_one_set_of_candidates(tmp_path):
    model = Stack()
    result = coopt.Pipeline(top_k=2).build(model, (torch.randn(4, 32),), tmp_path / "out")
    leaders = [r for r in result.regions if r.same_as is None]
    twins = [r for r in result.regions if r.same_as is not None]
    assert len(leaders) == 1 and len(twins) == 2
    assert all(t.selected == leaders[0].selected for t in twins)
    kernel_files = sorted(p.name for p in (tmp_path / "out" / "kernels").iterdir())
    assert all(name.startswith(leaders[0].summary.name) for name in kernel_files)
    verified = json.loads((tmp_path / "out" / "verify" / "results.json").read_text())
    assert list(verified) == [leaders[0].summary.name]
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(beside_eager(coopt.load(tmp_path / "out"))(x), model(x), rtol=1e-4, atol=1e-4)
    assert "identical to " + leaders[0].summary.name in (tmp_path / "out" / "report.md").read_text()
