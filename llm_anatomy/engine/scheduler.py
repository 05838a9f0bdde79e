"""Requests in flight and the scheduler that batches them (continuous batching over the paged pool).

Each step is either a prefill of newly admitted sequences or a decode of every running one. When the pool
runs out of blocks mid-decode, the newest running sequence is preempted: its blocks are freed and it is
recomputed later from its tokens (prompt + output so far), so nothing is lost.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import torch

from ..tokenizer import IncrementalDetokenizer
from .kv_cache import BlockTable, KVCachePool
from .sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_table: BlockTable
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached: int = 0  # positions whose K/V are in the cache
    text: str = ""  # detokenized output (cut at a stop string)
    generator: torch.Generator | None = None  # set when the request has a seed
    output_counts: torch.Tensor | None = None  # [vocab] token counts, on the device, when penalties are used
    num_preemptions: int = 0
    detokenizer: "IncrementalDetokenizer | None" = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_ids(self, start: int, end: int) -> list[int]:
        prompt = len(self.prompt_token_ids)
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


class Scheduler:
    def __init__(self, pool: KVCachePool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next step, and whether it is a prefill."""
        batch, tokens = [], 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            new_tokens = seq.num_tokens - seq.num_cached
            if batch and tokens + new_tokens > self.max_num_batched_tokens:
                break
            if not seq.block_table.ensure(seq.num_tokens):
                break  # wait for running sequences to free blocks
            self.waiting.popleft()
            seq.status = Status.RUNNING
            batch.append(seq)
            tokens += new_tokens
        if batch:
            self.running.extend(batch)
            return batch, True

        # Decode: every running sequence writes one more position.
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below while making room for an earlier one
            while not seq.block_table.ensure(seq.num_tokens):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
        return list(self.running), False

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.block_table.release()
        seq.num_cached = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.block_table.release()
