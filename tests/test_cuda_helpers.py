"""The CUDA sources' shared shortcuts (kernels/cuda.py) against their plain forms for every input they can get,
run on the device: ROW_DIVISION against IEEE division (__fdiv_rn) for every bf16 value and every scale a bf16 row
can have, BF16X2's sums and products against float32's rounded to bf16 for every pair of bf16 values."""

import pytest
import torch

from llm_anatomy.kernels.cuda import BF16X2, ROW_DIVISION, STREAM_HELPERS

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                            reason="needs a Hopper-or-later CUDA device")

SOURCE = r"""
__device__ __forceinline__ unsigned e4m3_pair(float a, float b) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ unsigned bf16_bits(float f) {
    unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
// blockIdx.x: a row's largest magnitude (bf16 bits 0 .. 0x7f80, +inf last); every value of at most that magnitude
// (every value, NaN included, for +inf) divided by the row's scale: the same e4m3 byte as __fdiv_rn's quotient
// (clamped to +-448 as fp8_quant.to_fp8 clamps it; the fast one by e4m3_range, as the kernels clamp it, cvt's
// satfinite clamping above), always; and the same float wherever the quotient is at least 2^-11 in magnitude (a
// smaller one is an e4m3 zero whatever its last bits, and there __fdiv_rn's slow path may differ from the fast
// one's: counted apart, not asserted)
extern "C" __global__ void division_vs_ieee(unsigned* float_mismatches, unsigned* byte_mismatches,
                                            unsigned* tiny_float_mismatches) {
    const float amax = __uint_as_float(blockIdx.x << 16);
    const float scale = __fdiv_rn(fmaxf(amax, 1e-12f), 448.0f);
    const RowDivisor d = row_divisor(scale);
    unsigned bad_float = 0, bad_byte = 0, tiny_float = 0;
    for (unsigned v = threadIdx.x; v < 65536; v += blockDim.x) {
        const float x = __uint_as_float(v << 16);
        if (fabsf(x) > amax) continue;
        const float fast = divide(x, d), ieee = __fdiv_rn(x, scale);
        if (__float_as_uint(fast) != __float_as_uint(ieee) && !(x != x))
            ++(fabsf(ieee) >= 0.00048828125f ? bad_float : tiny_float);
        bad_byte += e4m3_pair(e4m3_range(x, d), 0.0f) != e4m3_pair(fminf(fmaxf(ieee, -448.0f), 448.0f), 0.0f);
    }
    if (bad_float) atomicAdd(float_mismatches, bad_float);
    if (bad_byte) atomicAdd(byte_mismatches, bad_byte);
    if (tiny_float) atomicAdd(tiny_float_mismatches, tiny_float);
}
// blockIdx.x: a's bits; each thread's b in the low lane and b ^ 0x8000 in the high one. NaN results compare as
// NaN (their payloads may differ)
__device__ __forceinline__ bool same_bf16(unsigned x, unsigned y) {
    const bool nx = (x & 0x7fffu) > 0x7f80u, ny = (y & 0x7fffu) > 0x7f80u;
    return nx || ny ? nx && ny : x == y;
}
extern "C" __global__ void bf16x2_vs_float(unsigned* sum_mismatches, unsigned* product_mismatches) {
    const unsigned a = blockIdx.x, aa = a | a << 16;
    const float fa = __uint_as_float(a << 16);
    unsigned bad_sum = 0, bad_product = 0;
    for (unsigned b = threadIdx.x; b < 65536; b += blockDim.x) {
        const unsigned bb = b | (b ^ 0x8000u) << 16;
        const float lo = __uint_as_float(b << 16), hi = __uint_as_float((b ^ 0x8000u) << 16);
        const unsigned s = add_bf16x2(aa, bb), p = mul_bf16x2(aa, bb), c = bf16x2(fa * lo, fa * hi);
        bad_sum += !same_bf16(s & 0xffffu, bf16_bits(__fadd_rn(fa, lo)));
        bad_sum += !same_bf16(s >> 16, bf16_bits(__fadd_rn(fa, hi)));
        bad_product += !same_bf16(p & 0xffffu, bf16_bits(__fmul_rn(fa, lo)));
        bad_product += !same_bf16(p >> 16, bf16_bits(__fmul_rn(fa, hi)));
        bad_product += !same_bf16(c, p);  // bf16x2 packs the two lanes' roundings as the two cvts do
    }
    if (bad_sum) atomicAdd(sum_mismatches, bad_sum);
    if (bad_product) atomicAdd(product_mismatches, bad_product);
}
"""


def _kernel(name):
    from llm_anatomy.kernels.cuda import compile_kernel

    return compile_kernel(ROW_DIVISION + BF16X2 + SOURCE, name, torch.cuda.current_device(), 0)


def test_the_helpers_go_into_templates_as_they_are():
    """ROW_DIVISION holds no '%' (it goes into stream_gemv's %-template unchanged); BF16X2's single ones double
    there; STREAM_HELPERS is written doubled."""
    assert "%" not in ROW_DIVISION
    assert "%%" not in BF16X2 and "%0" in BF16X2 and (BF16X2.replace("%", "%%") % {}) == BF16X2
    assert "%%0" in STREAM_HELPERS


@hopper
@pytest.mark.gpu
def test_the_row_division_is_ieee_division_for_every_row_a_bf16_row_can_be():
    from llm_anatomy.kernels.cuda import launch

    floats, bytes_, tiny = (torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(3))
    launch(_kernel("division_vs_ieee"), 0x7f81, 256, [floats, bytes_, tiny], pdl=False)
    print(f"quotients under 2^-11 that differ from __fdiv_rn's in their float bits: {tiny.item()}")
    assert (floats.item(), bytes_.item()) == (0, 0)


@hopper
@pytest.mark.gpu
def test_bf16x2_sums_and_products_are_float32_ones_rounded_for_every_pair():
    from llm_anatomy.kernels.cuda import launch

    sums, products = (torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2))
    launch(_kernel("bf16x2_vs_float"), 65536, 256, [sums, products], pdl=False)
    assert (sums.item(), products.item()) == (0, 0)
