"""Whether a build times its candidates in CUDA graphs: by default only a stateful step (a model
that writes its own buffers, like a decoder's KV cache) is, because only such a step is replayed
as a graph by the runtime; the choice is recorded for `coopt tune` and the report."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import coopt


class Stateless(nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2


class WritesItsCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 16))

    def forward(self, x, pos):
        self.cache[pos] = x
        return torch.relu(self.cache) * 2


def _build(model, inputs, out, **options) -> dict:
    coopt.Pipeline(top_k=1, **options).build(model, inputs, out)
    return json.loads((out / "build.json").read_text())


@pytest.mark.parametrize(
    "model, inputs, options, expected",
    [
        (Stateless, lambda: (torch.randn(4, 16),), {}, False),
        (WritesItsCache, lambda: (torch.randn(1, 16), torch.tensor([3])), {}, True),
        (Stateless, lambda: (torch.randn(4, 16),), {"cuda_graphs": True}, True),
        (WritesItsCache, lambda: (torch.randn(1, 16), torch.tensor([3])), {"cuda_graphs": False}, False),
    ],
    ids=["stateless", "stateful", "forced-on", "forced-off"],
)
def test_graph_timing_follows_the_model_unless_forced(tmp_path, model, inputs, options, expected):
    record = _build(model(), inputs(), tmp_path / "out", **options)
    assert record["cuda_graphs"] is expected
    report = (tmp_path / "out" / "report.md").read_text()
    if torch.cuda.is_available():
        assert ("CUDA graphs" in report) is expected
