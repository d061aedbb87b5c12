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


def nvcc_for_hopper(tmp_path, source: str, output: str, *options: str) -> subprocess.CompletedProcess:
    """nvcc on `source` for sm_90a, writing tmp_path / output; skips where no nvcc is installed
    (the CUDA templates and probes compile with NVRTC on the GPU machine; this machine may have
    nvcc instead), asserts that it compiles."""
    if shutil.which("nvcc") is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    path = tmp_path / "kernel.cu"
    path.write_text(source)
    result = subprocess.run(["nvcc", "-arch=sm_90a", "-std=c++17", *options, "-o", str(tmp_path / output), str(path)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


@pytest.fixture
def hopper_registers(tmp_path):
    """compile(source) -> registers a thread: the CUDA source compiled for sm_90a by nvcc, asserted
    not to spill."""

    def compile_source(source: str) -> int:
        result = nvcc_for_hopper(tmp_path, source, "kernel.cubin", "-cubin", "-Xptxas", "-v")
        assert re.search(r"0 bytes spill stores, 0 bytes spill loads", result.stderr), result.stderr[-2000:]
        return int(re.search(r"Used (\d+) registers", result.stderr).group(1))

    return compile_source


@pytest.fixture
def hopper_static_shared(tmp_path):
    """compile(source) -> bytes of static __shared__ a block of the kernel holds (ptxas's count).
    The CUDA templates keep none: it goes before the dynamic part and moves their cp.async rings
    off a 128-byte boundary, where each slab's write takes twice the wavefronts (session 31)."""

    def compile_source(source: str) -> int:
        result = nvcc_for_hopper(tmp_path, source, "kernel.cubin", "-cubin", "-Xptxas", "-v")
        used = re.search(r"Used \d+ registers[^\n]*", result.stderr).group(0)
        found = re.search(r"(\d+) bytes smem", used)
        return int(found.group(1)) if found else 0

    return compile_source


@pytest.fixture
def hopper_ptx(tmp_path):
    """compile(source) -> the PTX nvcc makes of the CUDA source for sm_90a."""

    def compile_source(source: str) -> str:
        nvcc_for_hopper(tmp_path, source, "kernel.ptx", "-ptx")
        return (tmp_path / "kernel.ptx").read_text()

    return compile_source


@pytest.fixture
def hopper_sass(tmp_path):
    """compile(source) -> the kernel's sm_90a machine instructions in order (opcode and operands,
    one string each): nvcc's cubin through the cuobjdump that ships with Triton. ptxas reorders
    across branches and inline asm, so the order a test asserts is read here, not in the PTX."""

    def compile_source(source: str) -> list[str]:
        from template_helpers import triton_cuobjdump  # tests/templates/, where its users live, is on sys.path

        tool = triton_cuobjdump()
        if not tool.exists():
            pytest.skip("no cuobjdump beside Triton")
        nvcc_for_hopper(tmp_path, source, "kernel.cubin", "-cubin")
        listing = subprocess.run([str(tool), "-sass", str(tmp_path / "kernel.cubin")], capture_output=True,
                                 text=True, check=True).stdout
        return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", listing)]

    return compile_source

