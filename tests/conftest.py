"""Root test configuration.

Without a GPU every generated kernel runs in Triton's interpreter; that must be decided before
anything imports triton.language (its helpers are decorated at import), hence at conftest load.
`@pytest.mark.gpu` tests are skipped when no CUDA device is present.
"""

from __future__ import annotations

import pytest
import torch

from coopt.runtime.kernel_loader import use_interpreter_without_gpu

use_interpreter_without_gpu()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# A KernelBench-style model file with no KV cache and no dynamic dims (one linear + relu): the
# model CLI tests build when an option must be refused for such a model.
PLAIN_MODEL_FILE = """
import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
    def forward(self, x):
        return torch.relu(self.fc(x))
def get_init_inputs():
    return []
def get_inputs():
    return [torch.randn(2, 8)]
"""


@pytest.fixture
def plain_model_file(tmp_path):
    """tmp_path / "model.py" holding PLAIN_MODEL_FILE."""
    path = tmp_path / "model.py"
    path.write_text(PLAIN_MODEL_FILE)
    return path
