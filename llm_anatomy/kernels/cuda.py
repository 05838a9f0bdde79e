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
# x / scale for the per-token fp8 quantization (fp8_quant.to_fp8: IEEE division), the reciprocal taken once a row.
# __fdiv_rn is CUDA's fast path (a refined approximate reciprocal, then one correction of the quotient) behind a
# guard (FCHK) that sends operands it cannot vouch for to a slow path, all of it for each value. Here the guard is
# left out: a zero keeps its sign as the correction is taken negated (-(-r * rem - q)), and an infinite scale (a
# row holding an infinity) gives r = b = 0, which makes a finite value's quotient a zero of its sign and an
# infinity's NaN, as IEEE division. The GPU test (tests/test_cuda_helpers.py) divides every bf16 value by every
# scale a bf16 row can have: the same e4m3 byte as __fdiv_rn always, the same float wherever the quotient is at
# least 2^-11; below that a quotient may differ in its last bits, and rounds to an e4m3 zero either way. No '%':
# the text goes into %-templates as it is.
ROW_DIVISION = r"""
struct RowDivisor { float b, r; };  // b and CUDA's refined reciprocal of it
__device__ __forceinline__ RowDivisor row_divisor(float b) {
    if (b == __int_as_float(0x7f800000)) return {0.0f, 0.0f};
    const float r0 = __fdividef(1.0f, b);  // rcp.approx (MUFU.RCP) for b in [2^-126, 2^126]
    return {b, __fmaf_rn(__fmaf_rn(r0, -b, 1.0f), r0, r0)};
}
__device__ __forceinline__ float divide(float a, RowDivisor d) {  // __fdiv_rn(a, d.b) as e4m3 sees it
    const float q = __fmul_rn(a, d.r);
    return -__fmaf_rn(-d.r, __fmaf_rn(q, -d.b, a), -q);
}
// fp8_quant.to_fp8 before its rounding: a / scale clamped to +-448 for cvt.rn.satfinite.e4m3x2, which clamps above
// itself (the lower clamp stays: it turns a NaN into -448, as there)
__device__ __forceinline__ float e4m3_range(float a, RowDivisor d) { return fmaxf(divide(a, d), -448.0f); }
"""
# Two bf16 lanes at once, each result rounded to bf16 once. The sum or product of two bf16 values rounded to bf16
# is their float32 sum or product rounded to bf16: the product is exact in float32, and a sum that float32 rounds
# has operands 17 or more binades apart, which leaves it far from any bf16 rounding boundary (the GPU test,
# tests/test_cuda_helpers.py, checks every pair). (Its '%' are single: a %-template doubles them.)
BF16X2 = r"""
__device__ __forceinline__ unsigned add_bf16x2(unsigned a, unsigned b) {
    unsigned r; asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r;
}
__device__ __forceinline__ unsigned mul_bf16x2(unsigned a, unsigned b) {
    unsigned r; asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r;
}
// both rounded to nearest even; cvt puts its first operand in the upper half
__device__ __forceinline__ unsigned bf16x2(float lo, float hi) {
    unsigned r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
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
