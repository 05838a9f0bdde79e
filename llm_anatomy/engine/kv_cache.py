"""The paged KV cache: one preallocated pool of fixed-size blocks, and per-sequence block tables.

Bytes are exact: a sequence holds `len(blocks) * bytes_per_block`, and `bytes_per_token` is
layers x 2 (K and V) x kv_heads x head_dim x element size.
"""

from __future__ import annotations

from collections import deque

import torch

from ..errors import RequestError
from ..models.config import ModelConfig


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that hold `tokens` tokens."""
    return -(-tokens // block_size)


class KVCachePool:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        if num_blocks < 1:
            raise RequestError("the KV cache has room for no block; give it more memory or tokens")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # Zeroed, not empty: masked-out slots must hold finite values (0 x NaN would poison attention).
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.bytes_per_token = config.kv_bytes_per_token(dtype)
        self.bytes_per_block = self.bytes_per_token * block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def total_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    def can_allocate(self, blocks: int) -> bool:
        return blocks <= len(self._free)

    def allocate(self, blocks: int) -> list[int]:
        if blocks > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked {blocks} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(blocks)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class BlockTable:
    """The blocks one sequence holds, and the flat slot of each of its positions."""

    def __init__(self, pool: KVCachePool):
        self.pool = pool
        self.blocks: list[int] = []

    def ensure(self, tokens: int) -> bool:
        """Hold enough blocks for `tokens` positions; False (nothing taken) when the pool cannot."""
        need = self.pool.blocks_for(tokens) - len(self.blocks)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        self.blocks.extend(self.pool.allocate(need))
        return True

    def release(self) -> None:
        self.pool.free(self.blocks)
        self.blocks = []

    def slot(self, position: int) -> int:
        bs = self.pool.block_size
        return self.blocks[position // bs] * bs + position % bs

    def slots(self, start: int, end: int) -> torch.Tensor:
        """The flat slots of positions start..end-1, int64 (tensor ops: a long prompt has thousands)."""
        bs = self.pool.block_size
        positions = torch.arange(start, end)
        return torch.tensor(self.blocks, dtype=torch.int64)[positions // bs] * bs + positions % bs

    @property
    def bytes(self) -> int:
        return len(self.blocks) * self.pool.bytes_per_block
