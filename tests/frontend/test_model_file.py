"""Bad model files: each gives one ModelFileError line naming the file and the cause."""

import textwrap

import pytest

from coopt.errors import ModelFileError
from coopt.frontend.model_file import load_model_file

GOOD = """
import torch
class Model(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc = torch.nn.Linear(n, n)
    def forward(self, x):
        return self.fc(x)
def get_init_inputs():
    return [4]
def get_inputs():
    return [torch.randn(2, 4)]
"""


def write(tmp_path, text, name="model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_good_file_loads_in_eval_mode(tmp_path):
    loaded = load_model_file(write(tmp_path, GOOD))
    assert not loaded.model.training
    assert loaded.example_inputs[0].shape == (2, 4)
    assert loaded.dynamic_shapes is None


def test_entry_points_hook_gives_inputs_and_dynamic_shapes(tmp_path):
    path = write(tmp_path, GOOD + "\ndef entry_points():\n    return {'wide': ([torch.randn(8, 4)], None), 'plain': [torch.randn(1, 4)]}\n")
    entries = load_model_file(path).entry_points
    assert sorted(entries) == ["plain", "wide"]
    assert entries["wide"][0][0].shape == (8, 4) and entries["wide"][1] is None
    assert entries["plain"][0][0].shape == (1, 4)


def test_load_weights_hook_runs(tmp_path):
    path = write(tmp_path, GOOD + "\ndef load_weights(model):\n    torch.nn.init.zeros_(model.fc.bias)\n    model.fc.bias.data += 3\n")
    assert float(load_model_file(path).model.fc.bias[0].detach()) == 3.0


@pytest.mark.parametrize(
    "text, message",
    [
        ("x = (", "model.py:1: syntax error"),
        ("import torch\n", "defines no class `Model`"),
        (GOOD.replace("def get_inputs", "def not_inputs"), "no function `get_inputs()`"),
        (GOOD.replace("return [torch.randn(2, 4)]", "raise ValueError('no data')"), "get_inputs() failed: ValueError: no data"),
        (GOOD.replace("return [4]", "return ['x']"), "Model(*get_init_inputs()) failed"),
        ("import torch\nraise RuntimeError('boom')\n", "model.py:2: importing the model file failed: RuntimeError: boom"),
        (GOOD.replace("return [torch.randn(2, 4)]", "return torch.randn(2, 4)"), "must return a list or tuple"),
        (GOOD + "\ndef entry_points():\n    return [1]\n", "entry_points() must return a dict"),
        (GOOD + "\ndef entry_points():\n    return {'forward': [torch.randn(3, 4)]}\n", "'forward' is not a usable entry name"),
        (GOOD + "\ndef entry_points():\n    return {'wide': torch.randn(3, 4)}\n", "entry_points()['wide'] must be"),
    ],
)
def test_bad_files_give_one_clear_line(tmp_path, text, message):
    with pytest.raises(ModelFileError) as info:
        load_model_file(write(tmp_path, text))
    assert message in info.value.message
    assert "\n" not in info.value.message
    assert info.value.exit_code == 3


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        load_model_file(tmp_path / "nope.py")


def test_random_weights_and_inputs_are_the_same_every_load(tmp_path):
    import torch

    path = write(tmp_path, GOOD)
    torch.manual_seed(123)
    caller_state = torch.random.get_rng_state()
    first, second = load_model_file(path), load_model_file(path)
    assert torch.equal(first.model.fc.weight, second.model.fc.weight)
    assert torch.equal(first.example_inputs[0], second.example_inputs[0])
    assert torch.equal(torch.random.get_rng_state(), caller_state)  # the caller's generator untouched
    other = load_model_file(path, seed=1)
    assert not torch.equal(first.model.fc.weight, other.model.fc.weight)


def test_two_builds_of_a_random_model_file_write_the_same_artifact(tmp_path):
    import coopt

    path = write(tmp_path, GOOD)
    for name in ("a", "b"):
        coopt.Pipeline(top_k=1).build_file(path, tmp_path / name)
    for name in ("weights.pt", "selection.json", "program.py"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
