"""Root test configuration.

Without a GPU every generated kernel runs in Triton's interpreter; that must be decided before
anything imports triton.language (its helpers are decorated at import), hence at conftest load.
`@pytest.mark.gpu` tests are skipped when no CUDA device is present.
"""

from __future__ import annotations

import ctypes
import functools
import re
import shutil
import subprocess
from pathlib import Path

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


@functools.cache
def pip_nvrtc():
    """NVRTC from the nvidia-cuda-nvrtc wheel of the test extra (the CUDA 13.0 NVRTC the GPU
    machine's torch loads), or None. It makes machine code too, and with ptxas's counts in its log."""
    try:
        import nvidia
    except ImportError:
        return None
    for lib in (Path(root) / "cu13" / "lib" for root in nvidia.__path__):
        if (lib / "libnvrtc.so.13").exists():
            for builtins in sorted(lib.glob("libnvrtc-builtins.so.13*")):  # NVRTC opens it by name: load it first
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(str(lib / "libnvrtc.so.13"))
    return None


def compile_for_hopper(tmp_path, source: str, output: str, *, verbose: bool = False) -> str:
    """`source` compiled for sm_90a to tmp_path / output (".ptx" or ".cubin"); the compiler's log
    (with `verbose`, ptxas's register, spill and shared-memory counts). nvcc where one is
    installed, else NVRTC from the test extra's wheel (the compiler the GPU machine uses: the
    templates include no header); skips where neither is. Asserts that it compiles."""
    target = tmp_path / output
    if shutil.which("nvcc") is not None:
        (tmp_path / "kernel.cu").write_text(source)
        options = ["-ptx"] if output.endswith(".ptx") else ["-cubin", *(["-Xptxas", "-v"] if verbose else [])]
        result = subprocess.run(["nvcc", "-arch=sm_90a", "-std=c++17", *options, "-o", str(target),
                                 str(tmp_path / "kernel.cu")], capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stderr
    nvrtc = pip_nvrtc()
    if nvrtc is None:
        pytest.skip("no CUDA compiler here (nvcc, or the nvidia-cuda-nvrtc wheel of the test extra)")
    from coopt.runtime.cuda_kernels import nvrtc_compile

    code, log = nvrtc_compile(source, "90a", lib=nvrtc, cubin=output.endswith(".cubin"), verbose=verbose)
    target.write_bytes(code.rstrip(b"\0") if output.endswith(".ptx") else code)
    return log


@pytest.fixture
def hopper_registers(tmp_path):
    """compile(source) -> registers a thread: the CUDA source compiled for sm_90a (compile_for_hopper),
    asserted not to spill."""

    def compile_source(source: str) -> int:
        log = compile_for_hopper(tmp_path, source, "kernel.cubin", verbose=True)
        assert re.search(r"0 bytes spill stores, 0 bytes spill loads", log), log[-2000:]
        return int(re.search(r"Used (\d+) registers", log).group(1))

    return compile_source


@pytest.fixture
def hopper_static_shared(tmp_path):
    """compile(source) -> bytes of static __shared__ a block of the kernel holds (ptxas's count).
    The CUDA templates keep none: it goes before the dynamic part and moves their cp.async rings
    off a 128-byte boundary, where each slab's write takes twice the wavefronts (session 31)."""

    def compile_source(source: str) -> int:
        log = compile_for_hopper(tmp_path, source, "kernel.cubin", verbose=True)
        used = re.search(r"Used \d+ registers[^\n]*", log).group(0)
        found = re.search(r"(\d+) bytes smem", used)
        return int(found.group(1)) if found else 0

    return compile_source


@pytest.fixture
def hopper_ptx(tmp_path):
    """compile(source) -> the PTX of the CUDA source for sm_90a (compile_for_hopper)."""

    def compile_source(source: str) -> str:
        compile_for_hopper(tmp_path, source, "kernel.ptx")
        return (tmp_path / "kernel.ptx").read_text()

    return compile_source


@pytest.fixture
def hopper_sass(tmp_path):
    """compile(source) -> the kernel's sm_90a machine instructions in order (opcode and operands,
    one string each): the cubin (compile_for_hopper) through the cuobjdump that ships with Triton. ptxas reorders
    across branches and inline asm, so the order a test asserts is read here, not in the PTX."""

    def compile_source(source: str) -> list[str]:
        from template_helpers import triton_cuobjdump  # tests/templates/, where its users live, is on sys.path

        tool = triton_cuobjdump()
        if not tool.exists():
            pytest.skip("no cuobjdump beside Triton")
        compile_for_hopper(tmp_path, source, "kernel.cubin")
        listing = subprocess.run([str(tool), "-sass", str(tmp_path / "kernel.cubin")], capture_output=True,
                                 text=True, check=True).stdout
        return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", listing)]

    return compile_source

