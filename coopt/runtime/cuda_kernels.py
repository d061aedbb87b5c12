"""CUDA C++ compiled at run time and launched through the driver: the CUDA template families'
kernels (templates/cuda/) and bench/'s CUDA probes.

The NVRTC that torch's CUDA wheels carry (libnvrtc.so.<CUDA major>, which torch loads itself)
compiles the source to PTX; the driver (libcuda, ctypes) loads it and launches it on torch's
current stream, so a CUDA graph captures the launch. No toolkit is needed on the GPU machine:
torch.cuda._compile_kernel would do the same but adds the toolkit's include paths and raises
without CUDA_HOME, which the GPU machine lacks. For the same reason the kernels include no
header: templates/cuda/_prelude.cuh.j2 holds the few device helpers they share.

A generated module builds its DriverKernel on first use (one a device) and launches it from its
`run`; building one on a machine without an NVIDIA GPU raises RuntimeError.
"""

from __future__ import annotations

import ctypes

MAX_DYNAMIC_SHARED_SIZE_BYTES, NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 8, 14  # CUfunction_attribute (cuda.h)
PORTABLE_CLUSTER = 8


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: status {status}")


def nvrtc_ptx(source: str, arch: str) -> bytes:
    """PTX for sm_<arch> from NVRTC, the copy torch's CUDA build loads (libnvrtc.so.<CUDA major>)."""
    import torch

    names = (f"libnvrtc.so.{torch.version.cuda.split('.')[0]}", "libnvrtc.so")
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise OSError(f"no NVRTC library ({', '.join(names)})")
    program = ctypes.c_void_p()
    check(lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"coopt_kernel.cu", 0, None, None), "nvrtcCreateProgram")
    options = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17"]
    status = lib.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    if status != 0:
        raise RuntimeError(f"NVRTC: {log.value.decode(errors='replace')[:2000]}")
    lib.nvrtcGetPTXSize(program, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(program, ptx)
    lib.nvrtcDestroyProgram(ctypes.byref(program))
    return ptx.raw


class DriverKernel:
    """One __global__ function of `source`, compiled for this GPU, with `shared` bytes of dynamic
    shared memory a block (past the default 48 KiB allowed) and, for a cluster past the portable
    8 blocks, the non-portable size allowed."""

    def __init__(self, source: str, name: str, shared: int, cluster: int = 1):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("a CUDA C++ kernel runs on an NVIDIA GPU only, and torch sees none here")
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the primary context current on this thread
        major, minor = torch.cuda.get_device_capability()
        ptx = nvrtc_ptx(source, f"{major}{minor}")
        self.shared = shared
        self.libcuda = ctypes.CDLL("libcuda.so.1")
        self.module, self.func = ctypes.c_void_p(), ctypes.c_void_p()
        check(self.libcuda.cuModuleLoadData(ctypes.byref(self.module), ptx), "cuModuleLoadData")
        check(self.libcuda.cuModuleGetFunction(ctypes.byref(self.func), self.module, name.encode()), "cuModuleGetFunction")
        check(self.libcuda.cuFuncSetAttribute(self.func, MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
              "cuFuncSetAttribute(max dynamic shared size)")
        if cluster > PORTABLE_CLUSTER:
            check(self.libcuda.cuFuncSetAttribute(self.func, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                  "cuFuncSetAttribute(non-portable cluster size)")

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], values: list) -> None:
        """Launch on torch's current stream with the kernel's parameters as ctypes values, in order."""
        import torch

        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(self.libcuda.cuLaunchKernel(self.func, *grid, *block, self.shared, stream, params, None), "cuLaunchKernel")


def pointers(*tensors) -> list:
    """Tensors' data pointers as kernel parameters."""
    return [ctypes.c_void_p(t.data_ptr()) for t in tensors]
