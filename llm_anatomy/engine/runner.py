"""Turns a scheduled batch into tensors, runs the network as the engine's plan says, and returns the logits of
each sampled sequence's last token. The steps its GraphRunner can replay (graphs.py) are replayed; the others run
eagerly, launch by launch.
"""

from __future__ import annotations

import contextlib

import torch

from ..models.attention import FP8_PREFILL_MIN_TOKENS, AttentionBatch, prefill_attention, prefill_bucket
from ..models.qwen3 import Qwen3ForCausalLM
from .graphs import GRAPH_PREFILL_TOKENS, GraphRunner
from .kv_cache import KVCachePool
from .plan import ExecutionPlan
from .scheduler import AheadInputs, ScheduledBatch


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, pool: KVCachePool, device: torch.device, plan: ExecutionPlan,
                 graphs: GraphRunner | None = None):
        self.model = model
        self.pool = pool
        self.device = device
        self.plan = plan
        self.graphs = graphs
        self._eager = False  # see eager()
        self._pinned: dict[tuple, tuple[torch.Tensor, torch.cuda.Event]] = {}  # see _upload
        self._turns = {"step": 0, "ahead": 0, "groups": 0}  # which of a slot's two buffers is next (see _upload)
        # the one-kernel attention's counts (AttentionBatch.decode_counts) for the eager steps that take it
        self.attention_counts = torch.zeros(model.config.num_key_value_heads, dtype=torch.int32, device=device)

    @contextlib.contextmanager
    def eager(self):
        """Run steps without the graphs and without programmatic dependent launch (ExecutionPlan.eager), each
        kernel launched by the host as a profiler expects; as before on exit."""
        was, self._eager = self._eager, True
        try:
            yield
        finally:
            self._eager = was

    @property
    def step_plan(self) -> ExecutionPlan:
        """The plan eager steps run with."""
        return self.plan.eager() if self._eager else self.plan

    def _upload(self, host: torch.Tensor, slot: str = "step") -> torch.Tensor:
        """One host-to-device copy; on CUDA through a pinned buffer kept for the purpose (pinning a fresh
        tensor each step costs milliseconds), two per dtype and slot used in turn, without blocking.
        A buffer's previous copy has long finished when its turn comes again; its event makes sure. (Slots keep
        apart uploads that alternate at different paces: a step's integers, a lookahead's token rows.)"""
        if self.device.type != "cuda":
            return host
        key = (host.dtype, slot, self._turns[slot])
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

    def ahead_inputs(self, seqs: list, rows: list[int | None], tokens: torch.Tensor) -> AheadInputs:
        """A step's inputs launched ahead: sequence i's newest token is tokens[rows[i]] (on the device) or, where
        rows[i] is None, its last token on the host. The common case, every row in order, costs nothing; else
        one upload and one gather on the device (no wait for the step in flight)."""
        offsets = tuple(int(row is not None) for row in rows)
        if rows == list(range(len(tokens))):
            return AheadInputs(tokens, offsets)
        n, known = len(seqs), len(tokens)
        host = torch.tensor([s.last_token if row is None else 0 for s, row in zip(seqs, rows)]
                            + [known + i if row is None else row for i, row in enumerate(rows)], dtype=torch.int64)
        self._turns["ahead"] ^= 1
        up = self._upload(host, slot="ahead")
        return AheadInputs(torch.cat([tokens, up[:n]]).index_select(0, up[n:]), offsets)

    def _upload_groups(self, host: torch.Tensor) -> torch.Tensor:
        """A prefill step's grouped-attention indices (AttentionBatch.fresh_groups, at most once a step)."""
        self._turns["groups"] ^= 1
        return self._upload(host, slot="groups")

    def prepare(self, batch: ScheduledBatch, ahead: tuple[int, ...] | None = None):
        """Inputs of a step. `ahead` (AheadInputs.offsets): a decode step launched before the previous one's
        tokens reached the host, its input ids already on the device; a row with offset 1 is one position further
        than its host-side tokens say.

        Positions and slots are computed with tensor ops (a long prompt's 8192 of each took milliseconds as
        Python lists, the device idle meanwhile), and all of the step's integers go up in two copies."""
        seqs, width = len(batch.seqs), max(len(s.block_table.blocks) for s in batch.seqs)
        ints = torch.zeros(seqs * (1 + width), dtype=torch.int32)  # context lengths, then the block tables
        tables = ints[seqs:].view(seqs, width)  # padded with block 0, masked out by the context lengths
        input_ids, positions, slots, prefix_lens = [], [], [], []
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.query_lens)):
            # ahead: the host has not yet counted the step before as cached; it forwards the newest token
            start = seq.num_tokens - 1 + ahead[row] if ahead else seq.num_cached
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
        longest = int(ints[:seqs].max())
        splits, block_n = (None, None) if batch.is_prefill else self.plan.decode_attention.for_step(seqs, longest)
        self._turns["step"] ^= 1
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
            decode_counts=None if batch.is_prefill or not self.plan.decode_attention.rope_attention(seqs, longest)
            else self.attention_counts,
            decode_fp8_cuda=self.plan.decode_attention.uses_fp8_cuda(batch.num_decodes if batch.is_prefill else seqs,
                                                                    longest),
            upload=self._upload_groups,
        )
        return longs[:n_ids], longs[n_ids:n_ids + tokens], attn, longs[n_ids + 2 * tokens:]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, ahead: AheadInputs | None = None) -> torch.Tensor:
        """Forward the batch, write its K/V, and return the logits [len(batch.sampled), vocab] in the model's dtype.
        With `ahead` (ahead_inputs) this decode step takes its input ids from the device."""
        graphs = None if self._eager else self.graphs
        if graphs is not None:
            if not batch.is_prefill and graphs.can_decode(len(batch.seqs)):
                return graphs.decode(batch.seqs, ahead)
            if batch.is_prefill and graphs.can_prefill(batch):
                return graphs.prefill(batch.seqs[0])
            size = graphs.batch_size_for(batch) if batch.is_prefill else None
            if size is not None:
                return graphs.prefill_batch(batch.seqs, size)
        input_ids, positions, attn, last = self.prepare(batch, None if ahead is None else ahead.offsets)
        if ahead is not None:
            input_ids = ahead.tokens
        plan = self.step_plan
        if batch.is_prefill:  # the last layer past its K/V store for the sampled rows alone (Qwen3ForCausalLM)
            return self.model.compute_logits(self.model(input_ids, positions, attn, plan, keep=last), plan)
        return self.model.compute_logits(self.model(input_ids, positions, attn, plan)[last], plan)

    @torch.inference_mode()
    def run_greedy(self, batch: ScheduledBatch, ahead: AheadInputs | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A decode step whose tokens are its logits' argmax, where a graph picks them itself
        (GraphRunner.decode_greedy): (logits, the tokens on the device, in pinned host memory). None where
        no graph does: run the step and sample."""
        graphs = None if self._eager else self.graphs
        n = len(batch.seqs)
        if graphs is None or batch.is_prefill or not graphs.can_decode(n) or not graphs.greedy_decodes(n):
            return None
        return graphs.decode_greedy(batch.seqs, ahead)

    @torch.inference_mode()
    def build_attention_plans(self, max_tokens: int) -> None:
        """Attention once at each eager bucket length above the graphs' up to max_tokens, so that cuDNN builds
        its plans now rather than in the first prompt of that length (and its fp8 graphs, where the plan has them)."""
        cfg, dev = self.model.config, self.device
        dtype = self.model.model.embed_tokens.weight.dtype  # the attention's, whatever the KV cache stores
        t = prefill_bucket(GRAPH_PREFILL_TOKENS[-1] + 1)
        while t <= prefill_bucket(max_tokens):
            q = torch.zeros(t, cfg.num_attention_heads, cfg.head_dim, dtype=dtype, device=dev)
            k = torch.zeros(t, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=dev)
            batch = AttentionBatch.fresh_prompt(self.pool.k, self.pool.v,
                                                torch.full((t,), -1, dtype=torch.int64, device=dev))
            prefill_attention(q, k, torch.zeros_like(k), self.pool.k[0], self.pool.v[0], batch)
            if self.plan.fp8_prefill_attention and t >= FP8_PREFILL_MIN_TOKENS:
                from ..kernels.fp8_prefill_attention import prepare

                prepare(dev, t, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
            t = prefill_bucket(t + 1)
