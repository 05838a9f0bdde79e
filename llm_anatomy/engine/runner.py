"""Turns a scheduled batch into tensors, runs the network and returns the logits of each sequence's last token."""

from __future__ import annotations

import torch

from ..models.attention import AttentionBatch
from ..models.qwen3 import Qwen3ForCausalLM
from .kv_cache import KVCachePool
from .scheduler import Sequence


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, pool: KVCachePool, device: torch.device):
        self.model = model
        self.pool = pool
        self.device = device

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table.blocks) for s in seqs)
        return self._tensor([s.block_table.blocks + [0] * (width - len(s.block_table.blocks)) for s in seqs],
                            torch.int32)

    def prepare(self, seqs: list[Sequence], is_prefill: bool):
        input_ids, positions, slots = [], [], []
        query_lens, prefix_lens = [], []
        for seq in seqs:
            start, end = (seq.num_cached, seq.num_tokens) if is_prefill else (seq.num_tokens - 1, seq.num_tokens)
            input_ids += seq.token_ids(start, end)
            positions += range(start, end)
            slots += seq.block_table.slots(start, end)
            query_lens.append(end - start)
            prefix_lens.append(start)
        batch = AttentionBatch(
            k_cache=self.pool.k, v_cache=self.pool.v,
            slot_mapping=self._tensor(slots),
            is_prefill=is_prefill,
            block_tables=self._block_tables(seqs),
            context_lens=self._tensor([s.num_tokens for s in seqs], torch.int32),
            query_lens=tuple(query_lens), prefix_lens=tuple(prefix_lens),
        )
        last = torch.tensor(query_lens).cumsum(0) - 1
        return self._tensor(input_ids), self._tensor(positions), batch, last.to(self.device)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """Forward the batch, write its K/V, and return float32 logits [len(seqs), vocab]."""
        input_ids, positions, batch, last = self.prepare(seqs, is_prefill)
        hidden = self.model(input_ids, positions, batch)
        return self.model.compute_logits(hidden[last] if is_prefill else hidden)
