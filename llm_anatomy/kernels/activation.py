"""SiLU(gate) * up over the fused gate_up projection's output [rows, 2 x intermediate]."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .pdl import gdc_enter


@triton.jit
def silu_mul_rounded(gate, up):
    """SiLU(gate) * up in up's dtype (the model's), rounded as HF rounds it: SiLU to the model dtype, then the
    product. gate may be any float type."""
    g = gate.to(tl.float32)
    s = (g * tl.sigmoid(g)).to(up.dtype)
    return (s.to(tl.float32) * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    gdc_enter(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, silu_mul_rounded(g, u), mask=mask)


def silu_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    rows, two_inter = gate_up.shape
    inter = two_inter // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                        BLOCK=block, USE_PDL=pdl, launch_pdl=pdl,
                                                        num_warps=4)
    return out


def silu_mul_reference(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
