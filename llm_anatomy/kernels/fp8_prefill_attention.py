"""Causal prefill attention in fp8: cuDNN's fused SDPA (through cudnn-frontend's graph API) over Q, K and V in
float8 e4m3, for an engine whose weights and KV cache are fp8 (engine/plan.py).

Q, K and V come as an fp8 cache stores them (scale 1, vLLM's uncalibrated q/k/v scales: kernels/rope.py writes
them), so a prompt's attention reads the same keys and values its decode steps read later. The softmax's
probabilities go to fp8 at a scale of 448 (their range [0, 1] onto e4m3's); the output comes out in fp8 too (on
Hopper cuDNN writes no other type from this graph), at 448 / (1.125 max|V|): each output row is a weighted mean of
V's rows, so none exceeds max|V| (the margin covers the probabilities' rounding), and the rows at their own scale
are exactly what the o_proj's W8A8 product multiplies (a per-tensor activation scale, repeated per row). Rounding
Q, K, V, the probabilities and the output to fp8 costs precision: benchmarks/README.md measures it beside bf16's.

One cuDNN graph per attention shape, built on first use (a few tens of ms; start-up builds those of the eager
prefill lengths: engine/runner.py): a memo of compiled graphs, like cuDNN's own plan cache in PyTorch, not a
switch. Nothing here runs on a CPU.
"""

from __future__ import annotations

import math
import threading
from functools import cache

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
O_MARGIN = 1.125  # the output's range over max|V|: probabilities rounded to e4m3 can sum to a little over 1


@cache
def available(device: torch.device, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether cuDNN's fp8 SDPA runs this model's attention here: a Hopper GPU or later, cudnn-frontend installed,
    a cuDNN backend with the fp8 forward (9.1 and later, not 9.10.0), and a graph of these heads that builds."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    try:
        import cudnn

        version = cudnn.backend_version()
        if version < 90100 or 91000 <= version < 91001:
            return False
        prepare(device, 128, heads, kv_heads, head_dim)
    except Exception:  # noqa: BLE001 - no cudnn-frontend, no libcudnn it can open, or a graph it cannot build
        return False
    return True


class _Device:
    """A device's cuDNN handle and the stream it was last set to (cudnnSetStream queries the driver: it is called
    only when the stream changes)."""

    def __init__(self, index: int):
        import cudnn

        with torch.cuda.device(index):
            self.handle = cudnn.create_handle()
        self.stream = None

    def on(self, stream: int):
        if stream != self.stream:
            import cudnn

            cudnn.set_stream(self.handle, stream)
            self.stream = stream
        return self.handle


class _Graph:
    """One built cuDNN graph of an attention shape: its tensors' handles and its workspace's size."""

    def __init__(self, device: _Device, index: int, rows: int, heads: int, kv_heads: int, head_dim: int):
        import cudnn

        fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32,
                              handle=device.handle)

        def tokens_major(name: str, h: int):  # [1, h, rows, d] over memory laid out [rows, h, d]
            return graph.tensor(name=name, dim=[1, h, rows, head_dim],
                                stride=[rows * h * head_dim, head_dim, h * head_dim, 1], data_type=fp8)

        def scalar(name: str):
            return graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)

        self.q, self.k, self.v = tokens_major("q", heads), tokens_major("k", kv_heads), tokens_major("v", kv_heads)
        self.one, self.descale_s, self.scale_s, self.scale_o = map(scalar, ("one", "descale_s", "scale_s", "scale_o"))
        o, _, amax_s, amax_o = graph.sdpa_fp8(
            q=self.q, k=self.k, v=self.v, descale_q=self.one, descale_k=self.one, descale_v=self.one,
            descale_s=self.descale_s, scale_s=self.scale_s, scale_o=self.scale_o, is_inference=True,
            attn_scale=1.0 / math.sqrt(head_dim), use_causal_mask=True)
        o.set_output(True).set_dim([1, heads, rows, head_dim]).set_stride(
            [rows * heads * head_dim, head_dim, heads * head_dim, 1]).set_data_type(fp8)
        for amax in (amax_s, amax_o):  # outputs the graph must have; nothing reads them
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        self.o, self.amax_s, self.amax_o = o, amax_s, amax_o
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace_size = graph.get_workspace_size()
        # descale of Q, K and V (scale 1), and the probabilities' descale and scale
        self.constants = torch.tensor([1.0, 1.0 / FP8_MAX, FP8_MAX], device=f"cuda:{index}").view(3, 1, 1, 1, 1)


_devices: dict[int, _Device] = {}
_graphs: dict[tuple, _Graph] = {}
_lock = threading.Lock()


def _graph(device: torch.device, rows: int, heads: int, kv_heads: int, head_dim: int) -> tuple[_Device, _Graph]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, rows, heads, kv_heads, head_dim)
    with _lock:
        if index not in _devices:
            _devices[index] = _Device(index)
        if key not in _graphs:
            with torch.cuda.device(index):
                _graphs[key] = _Graph(_devices[index], index, rows, heads, kv_heads, head_dim)
        return _devices[index], _graphs[key]


def prepare(device: torch.device, rows: int, heads: int, kv_heads: int, head_dim: int) -> None:
    """Build the graph of this attention shape now (start-up), not in the first prompt that needs it."""
    _graph(device, rows, heads, kv_heads, head_dim)


@triton.jit
def _output_scales_kernel(v_amax_ptr, scale_o_ptr, descale_ptr, tokens, MARGIN: tl.constexpr, BLOCK: tl.constexpr):
    """The output's scale (448 / (margin max|V|)) for cuDNN, and its inverse once per row for the W8A8 product."""
    amax = tl.maximum(tl.load(v_amax_ptr) * MARGIN, 1e-30)  # an all-zero V gives zero rows at any scale
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(descale_ptr + i, tl.full([BLOCK], 0.0, tl.float32) + amax / 448.0, mask=i < tokens)
    if tl.program_id(0) == 0:
        tl.store(scale_o_ptr, 448.0 / amax)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_amax: torch.Tensor, tokens: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one fresh prompt: q [rows, H, D], k and v [rows, KVH, D] in float8 e4m3 (scale 1), the
    prompt's `tokens` rows first (the rest are padding, zeros, which causality hides from them), v_amax (float32
    [1]) the largest |v|. Returns the prompt's rows' output as fp8 [tokens, H x D] and its scale per row, float32
    [tokens, 1] (value x scale is the attention's output)."""
    rows, heads, head_dim = q.shape
    device, g = _graph(q.device, rows, heads, k.shape[1], head_dim)
    handle = device.on(torch.cuda.current_stream(q.device).cuda_stream)
    out = torch.empty(rows, heads * head_dim, dtype=torch.float8_e4m3fn, device=q.device)
    scale_o = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
    descale = torch.empty(tokens, 1, dtype=torch.float32, device=q.device)
    block = 1024
    _output_scales_kernel[(triton.cdiv(tokens, block),)](v_amax, scale_o, descale, tokens, MARGIN=O_MARGIN, BLOCK=block)
    amax = torch.empty(2, 1, 1, 1, 1, dtype=torch.float32, device=q.device)
    workspace = torch.empty(g.workspace_size, dtype=torch.uint8, device=q.device)
    g.graph.execute({g.q: q, g.k: k, g.v: v, g.one: g.constants[0], g.descale_s: g.constants[1],
                     g.scale_s: g.constants[2], g.scale_o: scale_o, g.o: out, g.amax_s: amax[0],
                     g.amax_o: amax[1]}, workspace, handle=handle)
    return out[:tokens], descale
