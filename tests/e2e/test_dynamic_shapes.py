"""A model file with dynamic_shapes(): regions keep the symbolic dim, the verifier draws sizes
from its range, and the built model runs at sizes other than the example's."""

import json
import textwrap

import pytest
import torch
from built_calls import beside_eager, verified_kernel

import coopt
from coopt.emit.state_file import stored_state

MODEL = """
import torch
import torch.nn.functional as F

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 48)
        self.norm = torch.nn.LayerNorm(48)
    def forward(self, x):
        return self.norm(F.gelu(self.fc(x))) * 2.0

def get_inputs():
    return [torch.randn(6, 32)]

def dynamic_shapes():
    return ({0: torch.export.Dim("batch", min=1, max=64)},)
"""


def test_dynamic_batch_end_to_end(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MODEL))
    result = coopt.build(path, tmp_path / "out", top_k=1)
    selection = json.loads((tmp_path / "out" / "selection.json").read_text())
    for entry in selection["regions"].values():
        summary = entry["summary"]
        assert isinstance(summary["inputs"][0]["shape"][0], str), "batch dim lost its symbol"
        (symbol,) = summary["dims"]
        assert summary["dims"][symbol] == [1, 64] and summary["example_dims"][symbol] == 6
    # every region verified a kernel at the drawn sizes; without a GPU (selection by advisor rank)
    # the kernels run below, on a GPU the faster of kernel and reference does (measured latency)
    assert all(verified_kernel(r) for r in result.regions)
    if not torch.cuda.is_available():
        assert all(r.selected != "reference" for r in result.regions)
    from coopt.frontend.model_file import load_model_file

    original = load_model_file(path).model
    original.load_state_dict(stored_state(tmp_path / "out" / "weights.pt", "cpu"))
    built = coopt.load(tmp_path / "out")
    for batch in (1, 37, 64):
        x = torch.randn(batch, 32)
        with torch.no_grad():
            torch.testing.assert_close(beside_eager(built)(x), original(x), rtol=1e-4, atol=1e-4)


def test_inputs_on_another_device_get_a_one_line_error(tmp_path):
    """A built model called with tensors off its weights' device (CPU tensors for a build on the
    GPU) is refused before any launch, naming the input and the device to move it to."""
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MODEL))
    coopt.build(path, tmp_path / "out", top_k=1)
    built = coopt.load(tmp_path / "out")
    with pytest.raises(ValueError, match=r"^x: on meta, but the model's weights are on (cpu|cuda:0); move the inputs "
                                         r"there \(\.to\('(cpu|cuda:0)'\)\)$"):
        built(torch.randn(3, 32, device="meta"))
