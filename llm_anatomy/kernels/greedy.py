"""Greedy decoding's next token on the device, as the last kernel of a batch-1 decode graph (engine/graphs.py).

Between two batch-1 decode steps the device used to wait on the host's side of the step: PyTorch's argmax over
the vocabulary (one block, several microseconds), the token's copy to the host, then the next step's inputs (the
token, its position, its cache slot, the context length) copied up one by one, each copy a switch between the
copy engine and the kernels. Here the argmax is many programs, the last of a row to finish picks the row's token,
writes it where the host reads it (pinned host memory, so no copy follows the graph) and advances the next step's
inputs in the graph's own buffers (token, position + 1, context length + 1, the slot from the block table), so
that a greedy step that follows in order uploads nothing (GraphRunner.decode checks that it does follow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import gdc_enter

BLOCK = 4096  # logits a program reads: 38 programs over Qwen3's 151,936


@triton.jit
def _greedy_kernel(logits_ptr, stride_l, vocab, chunks, part_v_ptr, part_i_ptr, count_ptr, tokens_ptr, host_ptr,
                   turn_ptr, ids_ptr, pos_ptr, lens_ptr, slot_ptr, table_ptr, stride_t, width, page_size,
                   BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr, HOST: tl.constexpr, ADVANCE: tl.constexpr,
                   USE_PDL: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    gdc_enter(USE_PDL)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(logits_ptr + r * stride_l + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    v = tl.where(v != v, float("inf"), v)  # a NaN ranks above every number, as in torch.argmax
    tl.store(part_v_ptr + r * CHUNKS_PAD + c, tl.max(v, 0))
    tl.store(part_i_ptr + r * CHUNKS_PAD + c, c * BLOCK + tl.argmax(v, 0, tie_break_left=True))
    # The last program of the row to finish picks its token: the barrier, then the count's release, order this
    # program's stores before it; the acquire orders the last one's loads (from L2) after every other's.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + r, 1, sem="acq_rel", scope="gpu")
    if arrived == chunks - 1:
        tl.atomic_xchg(count_ptr + r, 0, sem="relaxed", scope="gpu")  # for the next launch
        k = tl.arange(0, CHUNKS_PAD)
        pv = tl.load(part_v_ptr + r * CHUNKS_PAD + k, mask=k < chunks, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(part_i_ptr + r * CHUNKS_PAD + k, mask=k < chunks, other=0, cache_modifier=".cg")
        first = tl.argmax(pv, 0, tie_break_left=True)  # the first chunk holding the largest: the first index
        token = tl.sum(tl.where(k == first, pi, 0), 0).to(tl.int64)
        tl.store(tokens_ptr + r, token)
        if HOST:  # the host's copy, in the half it reads for this step; the next launch writes the other half
            turn = tl.load(turn_ptr)
            tl.store(host_ptr + turn, token)
            tl.store(turn_ptr, 1 - turn)
        if ADVANCE:
            n = tl.load(lens_ptr + r)
            if n > 0:  # a padded row (no context) stays as it is
                p = tl.load(pos_ptr + r) + 1
                page = p // page_size
                block = tl.load(table_ptr + r * stride_t + page, mask=page < width, other=-1)
                tl.store(ids_ptr + r, token)
                tl.store(pos_ptr + r, p)
                tl.store(lens_ptr + r, n + 1)
                # a block the table does not hold yet gives a wrong slot: the host then uploads the step's inputs
                tl.store(slot_ptr + r, tl.where(block >= 0, block.to(tl.int64) * page_size + p % page_size, -1))


@dataclass(frozen=True)
class DecodeInputs:
    """A decode graph's input buffers, which greedy_next advances by one token: ids [B] int64, positions [B]
    int64, context_lens [B] int32, slots [B] int64 (position's cache slot), block_tables [B, width] int32."""
    ids: torch.Tensor
    positions: torch.Tensor
    context_lens: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    page_size: int


class GreedyScratch:
    """The kernel's partial results and per-row counts (left at zero by each launch), for up to `rows` rows of
    `vocab` logits; one per graph runner (its graphs replay one at a time on one stream)."""

    def __init__(self, rows: int, vocab: int, device: torch.device):
        self.block = min(BLOCK, triton.next_power_of_2(vocab))
        self.chunks = triton.cdiv(vocab, self.block)
        self.chunks_pad = max(2, triton.next_power_of_2(self.chunks))
        self.rows, self.vocab = rows, vocab
        self.values = torch.empty(rows * self.chunks_pad, dtype=torch.float32, device=device)
        self.indices = torch.empty(rows * self.chunks_pad, dtype=torch.int32, device=device)
        self.counts = torch.zeros(rows, dtype=torch.int32, device=device)


def greedy_next(logits: torch.Tensor, tokens: torch.Tensor, scratch: GreedyScratch,
                inputs: DecodeInputs | None = None, host: torch.Tensor | None = None, turn: torch.Tensor | None = None,
                pdl: bool = False) -> torch.Tensor:
    """tokens[:B] = logits [B, V].argmax(-1) (the first index of the largest; NaN as the largest). With `inputs`,
    each row with context also becomes the next decode step's: its id the token, position and context length one
    further, slot from the block table. With `host` (pinned int64 [2], one row) and `turn` (int32 [1] on the
    device, 0 or 1), the token is also written to host[turn], and turn flips: a launch writes the half the one
    before did not, so the host can read one step's token while the next step runs. Returns tokens[:B]."""
    rows, vocab = logits.shape
    if vocab != scratch.vocab or rows > scratch.rows:
        raise ValueError(f"scratch for {scratch.rows} rows of {scratch.vocab} logits, got {rows} of {vocab}")
    if logits.stride(1) != 1 or tokens.dtype != torch.int64 or tokens.numel() < rows:
        raise ValueError("logits must be row-contiguous, tokens int64 with a row each")
    if (host is None) != (turn is None) or host is not None and (
            rows != 1 or host.dtype != torch.int64 or host.numel() != 2 or turn.dtype != torch.int32):
        raise ValueError("host (int64 [2]) and turn (int32 [1]) come together, for a single row")
    if host is not None and logits.is_cuda and not host.is_pinned():
        raise ValueError("host must be pinned host memory, which the kernel writes through")
    advance = inputs is not None
    i = inputs
    _greedy_kernel[(rows, scratch.chunks)](
        logits, logits.stride(0), vocab, scratch.chunks, scratch.values, scratch.indices, scratch.counts, tokens,
        host if host is not None else tokens, turn if turn is not None else scratch.counts,
        i.ids if advance else tokens, i.positions if advance else tokens, i.context_lens if advance else scratch.counts,
        i.slots if advance else tokens, i.block_tables if advance else scratch.counts,
        i.block_tables.stride(0) if advance else 0, i.block_tables.shape[1] if advance else 0,
        i.page_size if advance else 1, BLOCK=scratch.block, CHUNKS_PAD=scratch.chunks_pad, HOST=host is not None,
        ADVANCE=advance, USE_PDL=pdl, launch_pdl=pdl, num_warps=4)
    return tokens[:rows]
