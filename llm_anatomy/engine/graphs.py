"""CUDA graphs: capture a model's steps once at start-up, then replay them.

Decode steps replay one graph per batch-size bucket (batch 1 has a second for short contexts, see
DecodeAttentionPlan), captured over fixed input buffers that share one memory pool, so a step is a handful of
small copies and one launch instead of hundreds of kernel launches from Python (batch 1's greedy steps one after
the other: the launch alone, its graphs ending in the greedy kernel, kernels/greedy.py). Rows past the batch in a
bucket are padding: slot -1 (nothing is stored) and context 0 (nothing is read). A whole prompt of up to
PREFILL_GRAPH_TOKENS tokens replays a graph of its attention bucket's length (one sequence, nothing cached yet;
padded tokens sit after the real ones, so causality hides them): a prompt's prefill launches ~450 kernels, and
eagerly the host falls behind the device in the first layers. Several whole prompts of a step (a server's new
requests), up to BATCH_PREFILL_TOKENS[-1] tokens together, replay a graph of the next size of BATCH_PREFILL_TOKENS:
packed one after the other, attended by one variable-length call a layer whose boundaries are an input buffer
(attention.varlen_attention), the padding a last sequence of its own that stores nothing.

The graphs replay the plan they were captured with (ExecutionPlan): its kernels, tiles and launches are baked in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from ..models.attention import AttentionBatch, prefill_bucket, varlen_supported
from ..models.qwen3 import Qwen3ForCausalLM
from .kv_cache import KVCachePool
from .plan import ExecutionPlan
from .scheduler import AheadInputs, ScheduledBatch, Sequence

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
PREFILL_GRAPH_TOKENS = 2048
# Capturing the prefill buckets also compiles the QK-norm kernel's token blocks and builds cuDNN's attention
# plans for these lengths.
GRAPH_PREFILL_TOKENS = tuple(sorted({prefill_bucket(n) for n in range(1, PREFILL_GRAPH_TOKENS + 1)}))


# Batches of whole prompts: sizes 256 apart, so that padding costs at most 255 tokens' compute; each graph takes up
# to batch_prompts(size) prompts (the logits it computes: one row each).
BATCH_PREFILL_TOKENS = (256, 512, 768, 1024, 1280, 1536, 1792, 2048)
MAX_BATCH_PROMPTS = 64


def batch_prompts(size: int, max_batch: int) -> int:
    """Prompts a batch-prefill graph of `size` tokens takes: at least 8 tokens each, at most MAX_BATCH_PROMPTS."""
    return min(MAX_BATCH_PROMPTS, max_batch, size // 8)


def batch_graph_size(prompts: int, tokens: int, sizes, max_batch: int) -> int | None:
    """The batch-prefill graph (of `sizes`, ascending) that replays `prompts` whole fresh prompts of `tokens`
    together, if one does: the first size that holds the tokens, if it takes that many prompts."""
    size = next((t for t in sizes if t >= tokens), None)
    return size if size is not None and 2 <= prompts <= batch_prompts(size, max_batch) else None


def stage_prefill_batch(seqs: list[Sequence], size: int, prompts: int, stage: torch.Tensor,
                        bounds: torch.Tensor) -> None:
    """A batch of whole prompts' inputs into host tensors, packed one after the other and padded to `size`:
    stage [4, >= size] (token ids, positions, cache slots; row 3: each prompt's last row, `prompts` of them, 0
    past the batch) and bounds [prompts + 2] (the sequences' boundaries for varlen_attention: the prompts', empty
    ones up to `prompts`, then the padding's, which stores nothing (slot -1) and ends at `size`)."""
    lens = [seq.num_tokens for seq in seqs]
    total = sum(lens)
    stage[0, :total] = torch.tensor([t for seq in seqs for t in seq.token_ids(0, seq.num_tokens)])
    stage[1, :total] = torch.cat([torch.arange(n) for n in lens])
    stage[2, :total] = torch.tensor([slot for seq in seqs for slot in seq.block_table.slots(0, seq.num_tokens)])
    stage[:2, total:size] = 0
    stage[2, total:size] = -1
    ends = torch.tensor(lens).cumsum(0)
    stage[3, :len(seqs)] = ends - 1
    stage[3, len(seqs):prompts] = 0
    bounds[0] = 0
    bounds[1:len(seqs) + 1] = ends
    bounds[len(seqs) + 1:prompts + 1] = total
    bounds[prompts + 1] = size


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """The prefill buckets a whole prompt of up to max_tokens can use: those below it and the first at or above."""
    sizes = [t for t in GRAPH_PREFILL_TOKENS if t < max_tokens]
    return sizes + [t for t in GRAPH_PREFILL_TOKENS if t >= max_tokens][:1]


def decode_batch_sizes(max_batch: int) -> list[int]:
    return sorted({b for b in GRAPH_BATCH_SIZES if b < max_batch} | {max_batch})


def stage_decode_inputs(seqs: list[Sequence], ahead: tuple[int, ...] | None, rows: int, stage: torch.Tensor,
                        lens: torch.Tensor) -> int:
    """A decode step's inputs into host tensors: stage [3, >= rows] (token ids, positions, cache slots) and lens
    [>= rows] (context lengths), the rows past the sequences padding (slot -1: stored nowhere; length 0). `ahead`
    (AheadInputs.offsets): the step was launched before the previous one's tokens reached the host, so a sequence
    with offset 1 is one position further (its token id row is then not used). Returns the longest context."""
    # a row at a time from Python lists: element by element cost ~30x the host time at 512 (benchmarks/README.md)
    n = len(seqs)
    positions = [seq.num_tokens - 1 for seq in seqs] if ahead is None else \
        [seq.num_tokens - 1 + off for seq, off in zip(seqs, ahead)]
    stage[:, :n] = torch.tensor([[seq.last_token for seq in seqs], positions,
                                 [seq.block_table.slot(p) for seq, p in zip(seqs, positions)]])
    stage[:, n:rows] = 0
    stage[2, n:rows] = -1
    lens[:n] = torch.tensor(positions) + 1
    lens[n:rows] = 0
    return max(positions) + 1


class BlockTableRows:
    """The decode graphs' block tables on the device, [rows, width], kept in step with each batch's sequences.

    A host mirror holds what the device's rows hold and whose blocks each row has, so a step copies only the
    rows that changed (a sequence that gained a block; every row after a finished sequence, which the batch
    shifts up one), all of them in one copy of the row range they span: a copy per row is a launch of host time
    each, and one finish early in a batch of 512 shifts hundreds of rows."""

    def __init__(self, rows: int, width: int, device: torch.device):
        self.device_rows = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self._host = np.zeros((rows, width), dtype=np.int32)  # what device_rows holds
        self._held: list[tuple | None] = [None] * rows  # per row: (request id, preemptions) and its block count
        # Pinned staging, two used in turn: a step's copy may still be in flight when the next is prepared.
        pin = device.type == "cuda"
        self._stage = [torch.zeros(rows * width, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._turn = 0

    def sync(self, seqs: list[Sequence]) -> bool:
        """Row i of the device's tables holds seqs[i]'s blocks (past them, whatever was there: the context
        lengths mask it). Returns whether any row changed."""
        host, held = self._host, self._held
        first, end, width = len(seqs), 0, 0
        for row, seq in enumerate(seqs):
            blocks = seq.block_table.blocks
            owner = (seq.request_id, seq.num_preemptions)
            h = held[row]
            start = h[1] if h is not None and h[0] == owner else 0
            if h is not None and start == len(blocks):
                continue
            host[row, start:len(blocks)] = blocks[start:]
            held[row] = (owner, len(blocks))
            first, end, width = min(first, row), row + 1, max(width, len(blocks))
        if width == 0:
            return False
        stage = self._stage[self._turn][:(end - first) * width].view(end - first, width)
        self._turn ^= 1
        stage.copy_(torch.from_numpy(host[first:end, :width]))
        self.device_rows[first:end, :width].copy_(stage, non_blocking=True)
        return True

    def reset(self) -> None:
        """Zero the rows, on both sides."""
        self.device_rows.zero_()
        self._host[:] = 0
        self._held = [None] * len(self._held)


class GraphRunner:
    """The captured graphs of one engine and the fixed buffers they read. Used by the ModelRunner for the steps
    it can replay (can_decode, can_prefill)."""

    def __init__(self, model: Qwen3ForCausalLM, pool: KVCachePool, device: torch.device, max_batch: int,
                 max_model_len: int):
        self.model, self.pool, self.device = model, pool, device
        self.max_batch = max_batch
        self.decode_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.short_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # batch 1, short contexts
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.batch_prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by size; logits in batch_logits
        self.plan: ExecutionPlan | None = None  # the plan captured, once captured
        self.graph_bytes = 0
        self.capture_seconds = 0.0
        self._mempool = None
        n, width, dev = max_batch, pool.blocks_for(max_model_len), device
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.lens = torch.zeros(n, dtype=torch.int32, device=dev)
        # the short graph's one-kernel attention counts (AttentionBatch.decode_counts), this engine's own
        self.attention_counts = torch.zeros(model.config.num_key_value_heads, dtype=torch.int32, device=dev)
        self.block_tables = BlockTableRows(n, width, dev)
        # Batch 1's graphs end in the greedy kernel (plan.greedy_in_graph): its token on the device and in pinned
        # memory (two halves, the kernel flips `greedy_turn`, the host `_turn` with it), its scratch, and what it
        # left in the input buffers for the step after (see _replay_decode)
        self.greedy_tokens = torch.zeros(1, dtype=torch.int64, device=dev)
        self.greedy_host = torch.zeros(2, dtype=torch.int64).pin_memory()
        self.greedy_turn = torch.zeros(1, dtype=torch.int32, device=dev)
        self._turn = 0
        self._advanced: tuple[torch.Tensor, torch.Tensor] | None = None  # (its tokens, the positions it advanced to)
        # Pinned staging, double-buffered: a step's inputs may still be in flight when the next is prepared.
        self._stage = torch.zeros(2, 3, n, dtype=torch.int64).pin_memory()  # ids, positions, slots
        self._stage_lens = torch.zeros(2, n, dtype=torch.int32).pin_memory()
        self._flip = 0

    # ---- capture ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, plan: ExecutionPlan, max_prefill_tokens: int) -> None:
        """Capture the decode graphs (largest first, so smaller ones reuse its memory) and the prefill graphs a
        whole prompt of up to max_prefill_tokens can replay. Warm-up runs before each capture compile the kernels
        outside the graph (`capture_seconds` counts it all)."""
        start = time.perf_counter()
        self.plan = plan
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        short = plan.decode_attention
        if plan.greedy_in_graph:
            from ..kernels.greedy import GreedyScratch

            self._greedy_scratch = GreedyScratch(1, self.model.config.vocab_size, self.device)
        for b in reversed(decode_batch_sizes(self.max_batch)):
            splits, block_n = short.for_step(b, short.short_context + 1)
            greedy = plan.greedy_in_graph and b == 1
            self.decode_graphs[b] = self._capture(self._decode_forward(
                plan, b, splits, block_n, short.uses_fp8_cuda(b, short.short_context + 1), greedy=greedy))
            if b == 1:
                self.short_graphs[b] = self._capture(self._decode_forward(
                    plan, b, short.short_splits, short.short_block_n,
                    counts=self.attention_counts if short.rope_attention(b, short.short_context) else None,
                    greedy=greedy))
        self.greedy_turn.zero_()  # the warm-up runs flipped it
        self._turn = 0
        if max_prefill_tokens > 0:
            self._capture_prefill(plan, max_prefill_tokens)
            cfg = self.model.config  # (an engine of one sequence a step never prefills two prompts together)
            if self.max_batch >= 2 and varlen_supported(self.model.model.embed_tokens.weight.dtype, cfg.head_dim,
                                                        self.device):
                self._capture_prefill_batches(plan, len(self.prefill_ids))
        torch.cuda.synchronize(self.device)
        self.graph_bytes = torch.cuda.memory_allocated(self.device) - before
        self.capture_seconds = time.perf_counter() - start

    def _capture(self, forward: Callable[[], torch.Tensor], shared_pool: bool = True
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (compiles kernels outside the graph), then capture, sharing one memory pool
        across all the graphs kept (a graph made only to be timed gets its own, freed with it)."""
        dev = self.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool if shared_pool else None):
            out = forward()
        if shared_pool:
            self._mempool = self._mempool or graph.pool()
        return graph, out

    def _decode_forward(self, plan: ExecutionPlan, b: int, splits: int | None = None, block_n: int | None = None,
                        fp8_cuda: bool = False, counts: torch.Tensor | None = None, greedy: bool = False):
        """The batch-b decode step over the fixed buffers (attention as the arguments say), logits out. With
        `greedy` (batch 1) the greedy kernel follows: its token in greedy_tokens and greedy_host, the buffers
        advanced to the next step's inputs (kernels/greedy.py)."""
        tables = self.block_tables.device_rows[:b]
        batch = AttentionBatch(self.pool.k, self.pool.v, self.slots[:b], False, tables, self.lens[:b],
                               decode_splits=splits, decode_block_n=block_n, decode_fp8_cuda=fp8_cuda,
                               decode_counts=counts)

        def forward():
            logits = self.model.compute_logits(self.model(self.ids[:b], self.pos[:b], batch, plan), plan)
            if greedy:
                from ..kernels.greedy import DecodeInputs, greedy_next

                greedy_next(logits, self.greedy_tokens, self._greedy_scratch,
                            DecodeInputs(self.ids[:b], self.pos[:b], self.lens[:b], self.slots[:b], tables,
                                         self.pool.block_size),
                            self.greedy_host, self.greedy_turn, pdl=plan.pdl)
            return logits

        return forward

    def _capture_prefill(self, plan: ExecutionPlan, max_tokens: int) -> None:
        sizes = prefill_graph_sizes(max_tokens)
        n, dev = sizes[-1], self.device
        self.prefill_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.prefill_pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.prefill_slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.prefill_last = torch.zeros(1, dtype=torch.int64, device=dev)
        self._prefill_stage = torch.zeros(2, 4, n, dtype=torch.int64).pin_memory()  # ids, pos, slots, last
        for t in reversed(sizes):
            batch = AttentionBatch.fresh_prompt(self.pool.k, self.pool.v, self.prefill_slots[:t])

            def forward(t=t, batch=batch):
                hidden = self.model(self.prefill_ids[:t], self.prefill_pos[:t], batch, plan, keep=self.prefill_last)
                return self.model.compute_logits(hidden, plan)

            self.prefill_graphs[t] = self._capture(forward)

    def _capture_prefill_batches(self, plan: ExecutionPlan, max_tokens: int) -> None:
        """Graphs of whole prompts packed together (stage_prefill_batch), over the single prompts' input buffers.
        Their logits go to one buffer that they share (a graph's own output would stay allocated per graph)."""
        sizes = [t for t in BATCH_PREFILL_TOKENS if t <= max_tokens]
        if not sizes:
            return
        most = batch_prompts(sizes[-1], self.max_batch)
        dev = self.device
        self.batch_bounds = torch.zeros(most + 2, dtype=torch.int32, device=dev)
        self.batch_last = torch.zeros(most, dtype=torch.int64, device=dev)
        logits_dtype = self.model.model.embed_tokens.weight.dtype  # the model's, as compute_logits gives them
        self.batch_logits = torch.empty(most, self.model.config.vocab_size, dtype=logits_dtype, device=dev)
        self._batch_stage = torch.zeros(2, 4, sizes[-1], dtype=torch.int64).pin_memory()
        self._batch_bounds_stage = torch.zeros(2, most + 2, dtype=torch.int32).pin_memory()
        for t in reversed(sizes):
            p = batch_prompts(t, self.max_batch)
            self.batch_bounds[p + 1:].fill_(t)  # captured over one sequence of t tokens
            batch = replace(AttentionBatch.fresh_prompt(self.pool.k, self.pool.v, self.prefill_slots[:t]),
                            varlen=(self.batch_bounds[:p + 2], t))

            def forward(t=t, p=p, batch=batch):
                hidden = self.model(self.prefill_ids[:t], self.prefill_pos[:t], batch, plan, keep=self.batch_last[:p])
                return self.batch_logits[:p].copy_(self.model.compute_logits(hidden, plan))

            self.batch_prefill_graphs[t] = self._capture(forward)[0]

    def decode_step_timer(self, context: int) -> Callable[[ExecutionPlan], float]:
        """A function timing the batch-1 decode step, as captured with a given plan, at `context` tokens of the
        KV pool (nothing is stored): captured into a graph of its own and replayed (tile tuning, tuning.py).
        The buffers are left as they were found once the caller is done (see reset_buffers)."""
        bs = self.pool.block_size
        self.pos[0] = context - 1
        self.lens[0] = context
        self.block_tables.device_rows[0, :-(-context // bs)] = torch.arange(-(-context // bs), dtype=torch.int32)
        # (written past the mirror: the caller's reset_buffers resets both)

        def step_ms(plan: ExecutionPlan) -> float:
            graph, _ = self._capture(self._decode_forward(plan, 1), shared_pool=False)
            for _ in range(3):
                graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 10

        return step_ms

    def reset_buffers(self) -> None:
        self._advanced = None
        self.pos.zero_()
        self.lens.zero_()
        self.block_tables.reset()

    # ---- replay -------------------------------------------------------------------------------------------
    def describe(self) -> dict:
        return {"count": len(self.decode_graphs) + len(self.short_graphs) + len(self.prefill_graphs)
                + len(self.batch_prefill_graphs),
                "decode_batch_sizes": sorted(self.decode_graphs), "short_context_batch_sizes": sorted(self.short_graphs),
                "prefill_tokens": sorted(self.prefill_graphs),
                "batch_prefill_tokens": sorted(self.batch_prefill_graphs), "bytes": self.graph_bytes,
                "capture_seconds": self.capture_seconds}

    def can_decode(self, batch_size: int) -> bool:
        return bool(self.decode_graphs) and batch_size <= self.max_batch

    def can_prefill(self, batch: ScheduledBatch) -> bool:
        seqs = batch.seqs
        return (bool(self.prefill_graphs) and len(seqs) == 1 and seqs[0].num_cached == 0
                and batch.query_lens[0] == seqs[0].num_tokens <= max(self.prefill_graphs))

    def batch_size_for(self, batch: ScheduledBatch) -> int | None:
        """The batch-prefill graph that replays this step, if one does: two or more whole prompts with nothing
        cached (so no decodes, and each sampled) that fit its tokens and prompts."""
        seqs = batch.seqs
        if (not self.batch_prefill_graphs or len(seqs) < 2
                or any(s.num_cached or n != s.num_tokens for s, n in zip(seqs, batch.query_lens))):
            return None
        return batch_graph_size(len(seqs), sum(batch.query_lens), sorted(self.batch_prefill_graphs), self.max_batch)

    def prefill_batch(self, seqs: list[Sequence], size: int) -> torch.Tensor:
        """Replay the batch-prefill graph of `size` (batch_size_for) over these whole prompts: their last rows'
        logits, in order."""
        p = batch_prompts(size, self.max_batch)
        stage, bounds = self._batch_stage[self._flip], self._batch_bounds_stage[self._flip]
        self._flip ^= 1
        stage_prefill_batch(seqs, size, p, stage, bounds)
        self.prefill_ids[:size].copy_(stage[0, :size], non_blocking=True)
        self.prefill_pos[:size].copy_(stage[1, :size], non_blocking=True)
        self.prefill_slots[:size].copy_(stage[2, :size], non_blocking=True)
        self.batch_last[:p].copy_(stage[3, :p], non_blocking=True)
        self.batch_bounds[:p + 2].copy_(bounds[:p + 2], non_blocking=True)
        self.batch_prefill_graphs[size].replay()
        return self.batch_logits[:len(seqs)]

    def greedy_decodes(self, batch_size: int) -> bool:
        """Whether decode_greedy replays this batch size (batch 1 under plan.greedy_in_graph)."""
        return self.plan is not None and self.plan.greedy_in_graph and batch_size == 1

    def decode(self, seqs: list[Sequence], ahead: AheadInputs | None) -> torch.Tensor:
        """Replay the decode graph of the smallest bucket that holds the batch; `ahead.tokens` (on the device) as
        its input when the step was launched ahead. Returns the logits."""
        return self._replay_decode(seqs, ahead, False)

    def decode_greedy(self, seqs: list[Sequence], ahead: AheadInputs | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As decode, for a step whose tokens are the logits' argmax (greedy_decodes): (logits, the tokens on the
        device, the tokens in pinned host memory once the graph is done). The graph's greedy kernel picked them
        and left the next step's inputs in the buffers: a greedy step launched ahead of this one's tokens, in the
        same order, replays without copying anything up."""
        logits = self._replay_decode(seqs, ahead, True)
        written = self._turn ^ 1  # the half this replay's kernel wrote
        return logits, self._advanced[0], self.greedy_host[written:written + 1]

    def _replay_decode(self, seqs: list[Sequence], ahead: AheadInputs | None, greedy: bool) -> torch.Tensor:
        n = len(seqs)
        b = next(size for size in sorted(self.decode_graphs) if size >= n)
        stage, lens = self._stage[self._flip], self._stage_lens[self._flip]
        self._flip ^= 1
        longest = stage_decode_inputs(seqs, None if ahead is None else ahead.offsets, b, stage, lens)
        tables_changed = self.block_tables.sync(seqs)
        # The step before ended in the greedy kernel, whose tokens this step takes in order: the buffers already
        # hold its inputs (positions one further, each slot from a block table that has not changed since).
        advanced, self._advanced = self._advanced, None
        if not (ahead is not None and advanced is not None and ahead.tokens is advanced[0] and not tables_changed
                and torch.equal(stage[1, :b], advanced[1])):
            if ahead is None:
                self.ids[:b].copy_(stage[0, :b], non_blocking=True)
            else:
                self.ids[:n].copy_(ahead.tokens)
                self.ids[n:b].zero_()
            self.pos[:b].copy_(stage[1, :b], non_blocking=True)
            self.slots[:b].copy_(stage[2, :b], non_blocking=True)
            self.lens[:b].copy_(lens[:b], non_blocking=True)
        short = b in self.short_graphs and self.plan.decode_attention.is_short(b, longest)
        graph, logits = (self.short_graphs if short else self.decode_graphs)[b]
        graph.replay()
        if self.greedy_decodes(b):
            self._turn ^= 1  # as the kernel flipped greedy_turn
            if greedy:
                self._advanced = (self.greedy_tokens[:n], stage[1, :b] + (lens[:b] > 0))
        return logits[:n]

    def prefill(self, seq: Sequence) -> torch.Tensor:
        n = seq.num_tokens
        t = min(size for size in self.prefill_graphs if size >= n)
        stage = self._prefill_stage[self._flip]
        self._flip ^= 1
        stage[0, :n] = torch.tensor(seq.token_ids(0, n))
        stage[1, :n] = torch.arange(n)
        stage[2, :n] = seq.block_table.slots(0, n)
        stage[:2, n:t] = 0
        stage[2, n:t] = -1  # padded tokens store nothing
        stage[3, 0] = n - 1
        self.prefill_ids[:t].copy_(stage[0, :t], non_blocking=True)
        self.prefill_pos[:t].copy_(stage[1, :t], non_blocking=True)
        self.prefill_slots[:t].copy_(stage[2, :t], non_blocking=True)
        self.prefill_last.copy_(stage[3, :1], non_blocking=True)
        graph, logits = self.prefill_graphs[t]
        graph.replay()
        return logits
