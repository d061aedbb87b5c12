"""Root test configuration.

Without a GPU every generated kernel runs in Triton's interpreter; that must be decided before
anything imports triton.language (its helpers are decorated at import), hence at conftest load.
`@pytest.mark.gpu` tests are skipped when no CUDA device is present.
"""

from __future__ import annotations

import re
import shutil
import subprocess

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


@pytest.fixture
def hopper_registers(tmp_path):
    """compile(source) -> registers a thread: the CUDA source compiled for sm_90a by the toolkit's
    nvcc (the CUDA templates and probes compile with NVRTC on the GPU machine; this machine may
    have nvcc instead), asserted to compile and not to spill. Skips where no nvcc is installed."""
    if shutil.which("nvcc") is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")

    def compile_source(source: str) -> int:
        path = tmp_path / "kernel.cu"
        path.write_text(source)
        result = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-std=c++17", "-Xptxas", "-v", "-o",
                                 str(tmp_path / "kernel.cubin"), str(path)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr[-2000:]
        assert re.search(r"0 bytes spill stores, 0 bytes spill loads", result.stderr), result.stderr[-2000:]
        return int(re.search(r"Used (\d+) registers", result.stderr).group(1))

    return compile_source
