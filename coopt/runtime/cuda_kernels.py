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
CLUSTER_DIMENSION, PROGRAMMATIC_STREAM_SERIALIZATION = 4, 6  # CUlaunchAttributeID (cuda.h)


class LaunchAttributeValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes, here its int flags and cluster dims
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int), ("dims", ctypes.c_uint * 3)]


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: the id, padded to 8 bytes, then the value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig, cuLaunchKernelEx's first argument
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def launch_config(grid, block, shared: int, stream: int, pdl: bool) -> LaunchConfig:
    """cuLaunchKernelEx's configuration; with `pdl`, programmatic stream serialization: the kernel
    may start while the previous kernel of the stream drains (it must griddepcontrol.wait before
    reading what that kernel writes). The attribute array is kept alive on the config."""
    attributes = (LaunchAttribute * 1)()
    attributes[0].id = PROGRAMMATIC_STREAM_SERIALIZATION
    attributes[0].value.flag = 1
    config = LaunchConfig(*grid, *block, shared, stream, attributes, 1 if pdl else 0)
    config.keep = attributes
    return config


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: status {status}")


def torch_nvrtc() -> ctypes.CDLL:
    """The NVRTC library torch's CUDA build loads (libnvrtc.so.<CUDA major>)."""
    import torch

    names = (f"libnvrtc.so.{torch.version.cuda.split('.')[0]}", "libnvrtc.so")
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError(f"no NVRTC library ({', '.join(names)})")


def nvrtc_compile(source: str, arch: str, *, lib: ctypes.CDLL | None = None, cubin: bool = False,
                  verbose: bool = False) -> tuple[bytes, str]:
    """(PTX, or with `cubin` the machine code, for sm_<arch>; NVRTC's log) from NVRTC: torch's
    copy, or `lib` (the tests' pip-installed one, which compiles the CUDA templates on machines
    without a GPU). `verbose` puts ptxas's register, spill and shared-memory counts in the log."""
    lib = lib or torch_nvrtc()
    program = ctypes.c_void_p()
    check(lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"coopt_kernel.cu", 0, None, None), "nvrtcCreateProgram")
    options = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17", *([b"--ptxas-options=-v"] if verbose else [])]
    status = lib.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    if status != 0:
        raise RuntimeError(f"NVRTC: {log.value.decode(errors='replace')[:2000]}")
    get_size, get = (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if cubin else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
    get_size(program, ctypes.byref(size))
    code = ctypes.create_string_buffer(size.value)
    get(program, code)
    lib.nvrtcDestroyProgram(ctypes.byref(program))
    return code.raw, log.value.decode(errors="replace")


def nvrtc_ptx(source: str, arch: str, lib: ctypes.CDLL | None = None) -> bytes:
    """PTX for sm_<arch> from NVRTC (nvrtc_compile)."""
    return nvrtc_compile(source, arch, lib=lib)[0]


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

    def blocks_per_sm(self, threads: int) -> int:
        """How many blocks of `threads` threads (and this kernel's dynamic shared memory) one SM
        holds at once: the driver's occupancy calculator."""
        blocks = ctypes.c_int()
        check(self.libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), self.func, threads,
                                                                       ctypes.c_size_t(self.shared)),
              "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return blocks.value

    def max_active_clusters(self, threads: int, cluster: int) -> int:
        """How many clusters of `cluster` blocks of `threads` threads (and this kernel's dynamic
        shared memory) the GPU holds at once: the driver's count, which knows how the GPCs' SMs
        group (a cluster's blocks share one GPC)."""
        attributes = (LaunchAttribute * 1)()
        attributes[0].id = CLUSTER_DIMENSION
        attributes[0].value.dims[:] = [cluster, 1, 1]
        config = LaunchConfig(cluster, 1, 1, threads, 1, 1, self.shared, None, attributes, 1)
        count = ctypes.c_int()
        check(self.libcuda.cuOccupancyMaxActiveClusters(ctypes.byref(count), self.func, ctypes.byref(config)),
              "cuOccupancyMaxActiveClusters")
        return count.value

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], values: list, pdl: bool = False) -> None:
        """Launch on torch's current stream with the kernel's parameters as ctypes values, in order;
        with `pdl`, by programmatic dependent launch (launch_config)."""
        import torch

        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        stream = torch.cuda.current_stream().cuda_stream
        if pdl:
            config = launch_config(grid, block, self.shared, stream, pdl=True)
            check(self.libcuda.cuLaunchKernelEx(ctypes.byref(config), self.func, params, None), "cuLaunchKernelEx")
        else:
            check(self.libcuda.cuLaunchKernel(self.func, *grid, *block, self.shared, ctypes.c_void_p(stream), params, None),
                  "cuLaunchKernel")


def pointers(*tensors) -> list:
    """Tensors' data pointers as kernel parameters."""
    return [ctypes.c_void_p(t.data_ptr()) for t in tensors]
