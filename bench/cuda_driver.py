"""CUDA C++ compiled at run time and launched through the driver, for the probes' hand-written kernels.

The NVRTC that torch's CUDA wheels carry (libnvrtc.so.<CUDA major>, which torch loads itself)
compiles the source to PTX; the driver (libcuda, ctypes) loads it and launches it on torch's
current stream, so a CUDA graph captures the launch. No toolkit is needed on the GPU machine:
torch.cuda._compile_kernel would do the same but adds the toolkit's include paths and raises
without CUDA_HOME, which the GPU machine lacks. For the same reason the kernels include no
header: PRELUDE holds the few device helpers they share.
"""

from __future__ import annotations

import ctypes

MAX_DYNAMIC_SHARED_SIZE_BYTES, NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 8, 14  # CUfunction_attribute (cuda.h)
PORTABLE_CLUSTER = 8

PRELUDE = r"""
typedef unsigned short bf16_t;
struct alignas(16) u32x4 { unsigned int x, y, z, w; };
#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000u)

// bf16 pairs of a 32-bit word (the lower element first, as memory holds them) as fp32
__device__ __forceinline__ float lo_bf16(unsigned int w) { return __int_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(unsigned int w) { return __int_as_float(w & 0xffff0000u); }

__device__ __forceinline__ bf16_t to_bf16(float f) {  // round to nearest even, NaN kept
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float round_bf16(float f) { return __int_as_float(((unsigned int)to_bf16(f)) << 16); }

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ unsigned int shared_address(const void* p) {
  unsigned int a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void copy16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(shared_address(dst)), "l"(src) : "memory");
}

// 16 bytes from src, or 16 zero bytes where !valid (src must still be a mapped address)
__device__ __forceinline__ void copy16_or_zeros(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N> __device__ __forceinline__ void wait_groups() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// a float of block `rank`'s shared memory, at the address `p` has in this block's
__device__ __forceinline__ float cluster_load(const float* p, unsigned int rank) {
  unsigned int remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(p)), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
"""


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
    check(lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"probe.cu", 0, None, None), "nvrtcCreateProgram")
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
