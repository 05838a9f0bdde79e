"""Turns a scheduled batch into tensors, runs the network and returns the logits of each sampled sequence's
last token.

On CUDA, decode steps replay CUDA graphs: one per batch-size bucket (batch 1 has a second for short contexts,
see SHORT_CONTEXT), captured once at start-up over fixed input buffers (sharing one memory pool), so a step is
a handful of small copies and one launch instead of hundreds of kernel launches from Python. Rows past the
batch in a bucket are padding: slot -1 (nothing is stored) and context 0 (nothing is read).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..models.attention import AttentionBatch, prefill_attention, prefill_bucket
from ..models.qwen3 import Qwen3ForCausalLM
from .kv_cache import KVCachePool
from .scheduler import ScheduledBatch, Sequence
from .tuning import TileTuning, device_tag, tune_tiles

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# A prompt's prefill launches ~450 kernels, and eagerly the host falls behind the device in the first layers.
# So a whole prompt of up to 2048 tokens replays a graph of its attention bucket's length (one sequence,
# nothing cached yet; padded tokens sit after the real ones, so causality hides them). Capturing them also
# compiles the QK-norm kernel's token blocks and builds cuDNN's attention plans for these lengths.
GRAPH_PREFILL_TOKENS = tuple(sorted({prefill_bucket(n) for n in range(1, 2049)}))
# A single sequence's decode attention splits its context over 33 programs per KV head (enough to read a 32k
# context at full bandwidth); at short contexts most of them find nothing to do and still cost the step, as
# does merging 33 partials. So batch 1 has a second decode graph for contexts up to SHORT_CONTEXT, with 16
# splits of 64-token tiles: 4.21 against 4.31 ms a step at 128 tokens, 4.25 against 4.34 at 1024, 4.34
# against 4.38 at 2048 (benchmarks/probe_decode_attention.py, Qwen3-8B on the H200). That was with a one-warp
# merge, which spilled at 33 splits; with the merge's warps fitted to the splits, 36 layers of attention alone
# still took 0.194 against 0.245 ms at 512 tokens, and 0.317 against 0.326 at 2048 (benchmarks/probe_kv_layout.py).
SHORT_CONTEXT, SHORT_SPLITS, SHORT_BLOCK_N = 2048, 16, 64
# Beyond it, batch 1 splits each KV head's context 48 ways rather than the default 33 (two programs a
# multiprocessor): with the streaming GEMVs beside it, the Qwen3-8B step at 32k took 5.08 against 5.13 ms on the
# H200 (benchmarks/probe_stream_gemv.py, section splits). Splits past a shorter context leave at once.
LONG_SPLITS = 48


def short_decode_attention(batch_size: int, longest_context: int) -> bool:
    """Whether a decode step runs the short-context attention (SHORT_SPLITS of SHORT_BLOCK_N tokens): a single
    sequence of up to SHORT_CONTEXT tokens. The graphs and the eager steps (a profiled replay) decide alike."""
    return batch_size == 1 and longest_context <= SHORT_CONTEXT


def decode_attention_plan(batch_size: int, longest_context: int) -> tuple[int | None, int | None]:
    """(splits, tile) of a decode step's attention, None for the kernel's defaults: the short-context graph's,
    batch 1's long-context graph's, or the defaults for batches."""
    if short_decode_attention(batch_size, longest_context):
        return SHORT_SPLITS, SHORT_BLOCK_N
    return (LONG_SPLITS if batch_size == 1 else None), None


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """The prefill buckets a whole prompt of up to max_tokens can use: those below it and the first at or above."""
    sizes = [t for t in GRAPH_PREFILL_TOKENS if t < max_tokens]
    return sizes + [t for t in GRAPH_PREFILL_TOKENS if t >= max_tokens][:1]


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, pool: KVCachePool, device: torch.device):
        self.model = model
        self.pool = pool
        self.device = device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.short_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # batch 1 only: see SHORT_CONTEXT
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_bytes = 0
        self.capture_seconds = 0.0
        self.tile_tuning: TileTuning | None = None
        self._mempool = None
        self._pinned: dict[tuple, tuple[torch.Tensor, torch.cuda.Event]] = {}  # see _upload
        self._upload_flip = 0

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """One host-to-device copy; on CUDA through a pinned buffer kept for the purpose (pinning a fresh
        tensor each step took 2.7 ms in a profiled H200 step), two per dtype used in turn, without blocking.
        A buffer's previous copy has long finished when its turn comes again; its event makes sure."""
        if self.device.type != "cuda":
            return host
        key = (host.dtype, self._upload_flip)
        buf, copied = self._pinned.get(key, (None, None))
        if copied is not None:
            copied.synchronize()
        n = host.numel()
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(1 << 14, 1 << (n - 1).bit_length()), dtype=host.dtype, pin_memory=True)
        buf[:n].copy_(host.flatten())
        dev = buf[:n].to(self.device, non_blocking=True).view(host.shape)
        copied = torch.cuda.Event()
        copied.record()
        self._pinned[key] = (buf, copied)
        return dev

    def prepare(self, batch: ScheduledBatch, ahead: int = 0):
        """Inputs of a step. `ahead`=1: a decode step launched before the previous one's tokens reached the
        host, so each sequence is one position further than its host-side tokens say.

        Positions and slots are computed with tensor ops (a long prompt's 8192 of each took milliseconds as
        Python lists, the device idle meanwhile), and all of the step's integers go up in two copies."""
        seqs, width = len(batch.seqs), max(len(s.block_table.blocks) for s in batch.seqs)
        ints = torch.zeros(seqs * (1 + width), dtype=torch.int32)  # context lengths, then the block tables
        tables = ints[seqs:].view(seqs, width)  # padded with block 0, masked out by the context lengths
        input_ids, positions, slots, prefix_lens = [], [], [], []
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.query_lens)):
            # ahead: the host has not yet counted the step before as cached; it forwards the newest token
            start = seq.num_tokens - 1 + ahead if ahead else seq.num_cached
            if not ahead:
                input_ids += seq.token_ids(start, start + n)
            positions.append(torch.arange(start, start + n))
            slots.append(seq.block_table.slots(start, start + n))
            prefix_lens.append(start)
            ints[row] = start + n
            tables[row, :len(seq.block_table.blocks)] = torch.tensor(seq.block_table.blocks, dtype=torch.int32)
        tokens = sum(batch.query_lens)
        sampled = set(map(id, batch.sampled))
        ends = torch.tensor(batch.query_lens).cumsum(0) - 1
        last = ends[[i for i, s in enumerate(batch.seqs) if id(s) in sampled]]
        longs = torch.cat([torch.tensor(input_ids, dtype=torch.int64), *positions, *slots, last])
        splits, block_n = (None, None) if batch.is_prefill else decode_attention_plan(seqs, int(ints[:seqs].max()))
        self._upload_flip ^= 1
        longs, ints = self._upload(longs), self._upload(ints)
        n_ids = 0 if ahead else tokens
        attn = AttentionBatch(
            k_cache=self.pool.k, v_cache=self.pool.v,
            slot_mapping=longs[n_ids + tokens:n_ids + 2 * tokens],
            is_prefill=batch.is_prefill,
            block_tables=ints[seqs:].view(seqs, width),
            context_lens=ints[:seqs],
            query_lens=tuple(batch.query_lens), prefix_lens=tuple(prefix_lens), num_decodes=batch.num_decodes,
            decode_splits=splits, decode_block_n=block_n,
        )
        return longs[:n_ids], longs[n_ids:n_ids + tokens], attn, longs[n_ids + 2 * tokens:]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, ahead_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Forward the batch, write its K/V, and return float32 logits [len(batch.sampled), vocab]. With
        `ahead_tokens` (a decode step's sampled tokens, still on the device) this decode step takes them as
        its input."""
        seqs = batch.seqs
        if not batch.is_prefill and self.graphs and len(seqs) <= self.max_graph_batch:
            return self._replay(seqs, ahead_tokens)
        if batch.is_prefill and self.prefill_graphs and len(seqs) == 1 and seqs[0].num_cached == 0 \
                and batch.query_lens[0] == seqs[0].num_tokens <= max(self.prefill_graphs):
            return self._replay_prefill(seqs[0])
        input_ids, positions, attn, last = self.prepare(batch, ahead=int(ahead_tokens is not None))
        if ahead_tokens is not None:
            input_ids = ahead_tokens
        hidden = self.model(input_ids, positions, attn)
        return self.model.compute_logits(hidden[last])

    # ---- CUDA graphs for decode ------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, max_batch: int, max_model_len: int, max_prefill_tokens: int) -> None:
        """Capture one decode graph per batch bucket up to max_batch (largest first, so smaller ones reuse
        its memory), and the prefill graphs a whole prompt of up to max_prefill_tokens can replay. Warm-up runs
        before each capture compile the kernels outside the graph (`capture_seconds` counts it all)."""
        start = time.perf_counter()
        sizes = sorted({b for b in GRAPH_BATCH_SIZES if b < max_batch} | {max_batch})
        self.max_graph_batch = sizes[-1]
        width = self.pool.blocks_for(max_model_len)
        n = self.max_graph_batch
        dev = self.device
        self.static_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.static_pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.static_slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.static_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.static_tables = torch.zeros(n, width, dtype=torch.int32, device=dev)
        # Pinned staging, double-buffered: a step's inputs may still be in flight when the next is prepared.
        self._stage = torch.zeros(2, 3, n, dtype=torch.int64).pin_memory()  # ids, positions, slots
        self._stage_lens = torch.zeros(2, n, dtype=torch.int32).pin_memory()
        self._stage_tables = torch.zeros(2, n, width, dtype=torch.int32).pin_memory()
        self._flip = 0
        self._rows: list[tuple | None] = [None] * n  # which sequence's blocks each table row holds, how many
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        self.tile_tuning = self._tune_gemv_tiles()
        for b in reversed(sizes):
            self.graphs[b] = self._capture_one(self._decode_forward(b, *decode_attention_plan(b, SHORT_CONTEXT + 1)))
            if b == 1:
                self.short_graphs[b] = self._capture_one(self._decode_forward(b, SHORT_SPLITS, SHORT_BLOCK_N))
        self._capture_prefill(max_prefill_tokens)
        self._build_attention_plans(max_prefill_tokens)
        torch.cuda.synchronize(dev)
        self.graph_bytes = torch.cuda.memory_allocated(dev) - before
        self.capture_seconds = time.perf_counter() - start

    def _capture_one(self, forward, shared_pool: bool = True) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
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

    def _decode_forward(self, b: int, splits: int | None = None, block_n: int | None = None):
        """The batch-b decode step over the static buffers (attention as the arguments say), logits out."""
        batch = AttentionBatch(self.pool.k, self.pool.v, self.static_slots[:b], False, self.static_tables[:b],
                               self.static_lens[:b], decode_splits=splits, decode_block_n=block_n)
        return lambda: self.model.compute_logits(self.model(self.static_ids[:b], self.static_pos[:b], batch))

    def _gemv_keys(self) -> list[tuple]:
        """The decode step's GEMV shapes (the linear layers whose inputs the kernel takes), largest first."""
        from ..kernels.gemv import tile_key

        keys = {}
        for name, m in self.model.named_modules():
            if isinstance(m, nn.Linear) and m.in_features % 512 == 0:
                gated = name.endswith("gate_up_proj")
                n = m.out_features // 2 if gated else m.out_features
                keys[tile_key(n, m.in_features, gated, m.weight.dtype)] = m.weight.numel()
        return sorted(keys, key=lambda k: -keys[k])

    def _tune_gemv_tiles(self) -> TileTuning:
        """Each GEMV shape's tile, timed inside the captured batch-1 decode step (see tuning.py) at a context of
        up to 512 tokens (whatever the KV pool holds; nothing is stored), or read from the cache."""
        from ..kernels import gemv
        from ..kernels.pdl import PDL
        from ..kernels.stream_gemv import STREAM

        bs = self.pool.block_size
        context = min(512, self.pool.num_blocks * bs, self.static_tables.shape[1] * bs)
        self.static_pos[0] = context - 1
        self.static_lens[0] = context
        self.static_tables[0, :-(-context // bs)] = torch.arange(-(-context // bs), dtype=torch.int32)
        forward = self._decode_forward(1)

        def step_ms() -> float:
            graph, _ = self._capture_one(forward, shared_pool=False)
            for _ in range(3):
                graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 10

        # the tiles serve the Triton GEMV (batches of 2-16 rows, and batch 1 where the streaming GEMV is off):
        # time them with batch 1 on it
        streaming, STREAM.on = STREAM.on, False
        try:
            return tune_tiles(self._gemv_keys(), gemv.TILES, step_ms, device_tag(self.device), PDL.on)
        finally:
            STREAM.on = streaming
            self.static_pos.zero_()
            self.static_lens.zero_()
            self.static_tables.zero_()

    def _capture_prefill(self, max_tokens: int) -> None:
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
                hidden = self.model(self.prefill_ids[:t], self.prefill_pos[:t], batch)
                return self.model.compute_logits(hidden[self.prefill_last])

            self.prefill_graphs[t] = self._capture_one(forward)

    def _build_attention_plans(self, max_tokens: int) -> None:
        """Attention once at each eager bucket length above the graphs' up to max_tokens, so that cuDNN builds
        its plans now rather than in the first prompt of that length."""
        cfg, dev, dtype = self.model.config, self.device, self.pool.k.dtype
        t = prefill_bucket(GRAPH_PREFILL_TOKENS[-1] + 1)
        while t <= prefill_bucket(max_tokens):
            q = torch.zeros(t, cfg.num_attention_heads, cfg.head_dim, dtype=dtype, device=dev)
            k = torch.zeros(t, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=dev)
            batch = AttentionBatch.fresh_prompt(self.pool.k, self.pool.v,
                                                torch.full((t,), -1, dtype=torch.int64, device=dev))
            prefill_attention(q, k, torch.zeros_like(k), self.pool.k[0], self.pool.v[0], batch)
            t = prefill_bucket(t + 1)

    def _replay(self, seqs: list[Sequence], ahead_tokens: torch.Tensor | None) -> torch.Tensor:
        n = len(seqs)
        b = next(size for size in sorted(self.graphs) if size >= n)
        stage, lens, tables = self._stage[self._flip], self._stage_lens[self._flip], self._stage_tables[self._flip]
        self._flip ^= 1
        stage[:, n:b] = 0
        stage[2, n:b] = -1
        lens[n:b] = 0
        ahead = int(ahead_tokens is not None)
        longest = 0
        for i, seq in enumerate(seqs):
            pos = seq.num_tokens - 1 + ahead
            stage[0, i] = seq.last_token
            stage[1, i] = pos
            stage[2, i] = seq.block_table.slot(pos)
            lens[i] = pos + 1
            longest = max(longest, pos + 1)
            self._sync_table_row(i, seq, tables)
        if ahead_tokens is None:
            self.static_ids[:b].copy_(stage[0, :b], non_blocking=True)
        else:
            self.static_ids[:n].copy_(ahead_tokens)
            self.static_ids[n:b].zero_()
        self.static_pos[:b].copy_(stage[1, :b], non_blocking=True)
        self.static_slots[:b].copy_(stage[2, :b], non_blocking=True)
        self.static_lens[:b].copy_(lens[:b], non_blocking=True)
        short = b in self.short_graphs and short_decode_attention(b, longest)
        graph, logits = (self.short_graphs if short else self.graphs)[b]
        graph.replay()
        return logits[:n]

    def _sync_table_row(self, row: int, seq: Sequence, stage: torch.Tensor) -> None:
        """Keep the device's block-table row in step with the sequence, copying only blocks it lacks (through
        pinned memory: a pageable copy would wait for the step in flight)."""
        owner = (seq.request_id, seq.num_preemptions)
        blocks = seq.block_table.blocks
        held = self._rows[row]
        start = held[1] if held is not None and held[0] == owner else 0
        if start < len(blocks):
            stage[row, start:len(blocks)] = torch.tensor(blocks[start:], dtype=torch.int32)
            self.static_tables[row, start:len(blocks)].copy_(stage[row, start:len(blocks)], non_blocking=True)
            self._rows[row] = (owner, len(blocks))

    def _replay_prefill(self, seq: Sequence) -> torch.Tensor:
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
