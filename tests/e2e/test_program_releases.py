"""with_releases: a generated function drops each intermediate after its last reader, so a long
prompt's activations do not all stay alive until the program returns."""

from __future__ import annotations

import weakref

import torch
from built_calls import beside_eager

import coopt
from coopt.codegen.torch_lines import with_releases


def test_each_value_is_released_once_right_after_its_last_reader():
    lines = [
        "v2 = self.w_weight",
        "v3, v4 = self._kernels['r0'](v0, v2)",
        "v5 = torch.ops.aten.add.Tensor(v3, v10)",  # v10 is not v1: whole names only
        "v6 = torch.ops.aten.mul.Tensor(v5, v3)",
    ]
    assert with_releases(lines, ["v6", "v1"]) == [
        "v2 = self.w_weight",
        "v3, v4 = self._kernels['r0'](v0, v2)",
        "del v0, v2, v4",  # v4 is never read: released where it is made
        "v5 = torch.ops.aten.add.Tensor(v3, v10)",
        "del v10",
        "v6 = torch.ops.aten.mul.Tensor(v5, v3)",
        "del v3, v5",
    ]
    assert with_releases(["v1 = v0 + 1", "v2 = v1 * 2"], ["v1", "(v2, v0)"]) == ["v1 = v0 + 1", "v2 = v1 * 2"]


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_a_built_program_frees_the_first_regions_output_before_it_returns(tmp_path):
    torch.manual_seed(0)
    model, x = Chain(), torch.randn(4, 16)
    coopt.Pipeline(top_k=1).build(model, (x,), tmp_path / "out")
    built = coopt.load(tmp_path / "out")
    first, last = built._kernels["r0_matmul_epilogue"], sorted(built._kernels)[-1]
    made, alive_at_last = [], []

    def recording_first(*inputs):
        outputs = first(*inputs)
        made.extend(weakref.ref(y) for y in outputs)
        return outputs

    def checking_last(*inputs, run=built._kernels[last]):
        alive_at_last.extend(ref() is not None for ref in made)
        return run(*inputs)

    built._kernels["r0_matmul_epilogue"], built._kernels[last] = recording_first, checking_last
    with torch.no_grad():
        torch.testing.assert_close(beside_eager(built)(x), model(x), rtol=1e-4, atol=1e-4)
    assert made and alive_at_last == [False] * len(made)
