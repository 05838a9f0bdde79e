"""Hand-written CUDA C++ kernels without nvcc: PyTorch's NVRTC (torch.cuda._compile_kernel, shipped with its CUDA
wheels) compiles the source, and the driver's cuLaunchKernelEx launches it with programmatic dependent launch
(PDL), which PyTorch's own launcher cannot ask for. Launches are captured into CUDA graphs like any other.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

# Device helpers for the streaming kernels' CUDA sources (stream_gemv.py):
# mbarrier waits and bulk copies into shared memory, bf16 <-> float, a dot product of 8 bf16 pairs, a warp's sum,
# a ring's barriers. A piece of a %-template (hence the %%), placed before the kernels and formatted with them.
STREAM_HELPERS = r"""
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ bool mbar_done(unsigned bar, unsigned parity) {
    unsigned ok;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%%1], %%2; selp.u32 %%0, 1, 0, p; }"
                 : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    return ok;
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) { while (!mbar_done(bar, parity)) {} }
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%%0];" :: "r"(bar) : "memory");
}
// Thread 0, then a block-wide sync: a ring's barriers. full[s] completes on the producer's arrival (and its
// bytes), empty[s] on `consumers` arrivals.
__device__ __forceinline__ void init_ring(unsigned long long* full, unsigned long long* empty, int stages,
                                          unsigned consumers) {
    for (int s = 0; s < stages; ++s) {
        asm volatile("mbarrier.init.shared::cta.b64 [%%0], 1;" :: "r"(smem_addr(&full[s])));
        asm volatile("mbarrier.init.shared::cta.b64 [%%0], %%1;" :: "r"(smem_addr(&empty[s])), "r"(consumers));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%%0], [%%1], %%2, [%%3];"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ float lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ unsigned rne(float f) {  // float -> bf16 bits, round to nearest even
    unsigned u = __float_as_uint(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float round_bf16(float f) { return __uint_as_float(rne(f) << 16); }
__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
    return lo(w.x) * lo(x.x) + hi(w.x) * hi(x.x) + lo(w.y) * lo(x.y) + hi(w.y) * hi(x.y)
         + lo(w.z) * lo(x.z) + hi(w.z) * hi(x.z) + lo(w.w) * lo(x.w) + hi(w.w) * hi(x.w);
}
__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
"""
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def launch(kernel, grid: int, block: int, args: list, pdl: bool, shared: int = 0) -> None:
    """cuLaunchKernelEx on the current stream, with the PDL attribute or without. args: tensors (their data
    pointers), ints (C int), floats (C float) and ctypes values (as they are, e.g. c_longlong)."""
    libcuda = torch.cuda._utils._get_gpu_runtime_library()
    attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    config = LaunchConfig((grid, 1, 1), (block, 1, 1), shared, torch.cuda.current_stream().cuda_stream,
                          ctypes.pointer(attr) if pdl else None, 1 if pdl else 0)
    held = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else a if isinstance(a, ctypes._SimpleCData)
            else ctypes.c_float(a) if isinstance(a, float) else ctypes.c_int(a) for a in args]
    params = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in held])
    result = libcuda.cuLaunchKernelEx(ctypes.byref(config), kernel.func, params, None)
    if result != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {result}")


@cache
def compile_kernel(source: str, name: str, device_index: int, shared_bytes: int):
    """NVRTC-compiled `name` from `source` for the device's architecture, allowed `shared_bytes` of dynamic shared
    memory (above 48 KB a kernel must opt in)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    kernel = torch.cuda._compile_kernel(source, name, compute_capability=f"{major}{minor}")
    kernel.set_shared_memory_config(shared_bytes)
    return kernel
