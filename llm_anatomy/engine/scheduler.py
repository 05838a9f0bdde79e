"""Requests in flight and the scheduler that batches them (continuous batching over the paged pool).

A step forwards, within a token budget, new prompts or the running sequences' next tokens. A prompt is
prefilled whole when it fits; one longer than the whole budget is split, in chunks of a multiple of
CHUNK_ALIGN tokens (each new attention shape costs cuDNN a plan build of its own, so shapes are kept few).

Two policies:
- prefill first (the default): a step prefills new prompts (and continues chunked ones), or else decodes
  every running sequence. Running sequences wait during a prefill step (each request's anatomy shows these
  stalls), but every step has a shape the CUDA graphs cover: a decode of the batch, or a short prompt alone.
  With max_waiting_tokens (TGI's rule), while sequences decode, new prompts wait until that many decode steps
  have run since prompts last joined, or until they number waiting_served_ratio times the running sequences:
  fewer, fuller prefill steps, each of which stops every running sequence once, for a longer time to first token.
- mixed steps: every step decodes the running sequences and fills the rest of the budget with prompts, so
  their tokens ride along in the prefill's matrix products instead of waiting. Such steps run without CUDA
  graphs, so they trade throughput for time to first token (benchmarks/README.md).

When the pool runs out of blocks, the newest running sequence is preempted: its blocks are freed and it is
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
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # with finish_reason "error": what failed, for the caller to report
    num_cached: int = 0  # positions whose K/V are in the cache
    text: str = ""  # detokenized output (cut at a stop string)
    generator: torch.Generator | None = None  # set when the request has a seed
    output_counts: torch.Tensor | None = None  # [vocab] token counts, on the device, when penalties are used
    num_preemptions: int = 0
    detokenizer: "IncrementalDetokenizer | None" = None
    # when params.logprobs is set: per output token, (its log-probability, [(id, log-probability)] of the top ones)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

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

    @property
    def decoding(self) -> bool:
        """Everything but its newest token is cached: its next step forwards that one token."""
        return self.num_cached == self.num_tokens - 1


@dataclass
class ScheduledBatch:
    """One step: each sequence with the tokens it forwards (decoding ones first); `sampled` are those whose
    last token is among them, which get a new token (a chunk in the middle of a prompt does not)."""

    seqs: list[Sequence]
    query_lens: list[int]
    is_prefill: bool  # not a pure decode step: some sequence forwards more than its newest token
    sampled: list[Sequence]
    num_decodes: int  # the first num_decodes sequences each forward their newest token only


@dataclass(frozen=True)
class AheadInputs:
    """The inputs of a decode step launched before the step before it was read back: each row's newest token, on
    the device, and per row 1 where that token is the previous step's (the host has not counted it yet: the
    row's position is one further than the host's tokens say), 0 where the host has it."""

    tokens: torch.Tensor
    offsets: tuple[int, ...]


CHUNK_ALIGN = 256
TGI_WAITING_SERVED_RATIO = 1.2  # text-generation-inference's default


class Scheduler:
    def __init__(self, pool: KVCachePool, max_num_seqs: int, max_num_batched_tokens: int, mixed_steps: bool = False,
                 max_waiting_tokens: int = 0, waiting_served_ratio: float | None = None):
        self.pool = pool
        self.mixed_steps = mixed_steps
        self.max_waiting_tokens = max_waiting_tokens
        self.waiting_served_ratio = TGI_WAITING_SERVED_RATIO if waiting_served_ratio is None else waiting_served_ratio
        self.decode_steps_since_admit = 0  # TGI's waiting_tokens: decode steps since prompts last joined
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Chunks are a multiple of this; small enough that what the decodes leave of the budget always holds
        # one (a budget too small for alignment gets none).
        self.chunk_align = max(1, min(CHUNK_ALIGN, max_num_batched_tokens - max_num_seqs))

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens of a prompt to forward now: all that remain if they fit, else an aligned chunk (maybe 0)."""
        return remaining if remaining <= budget else budget // self.chunk_align * self.chunk_align

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def prefill_due(self) -> bool:
        """Whether waiting prompts may be prefilled now: always without max_waiting_tokens or with nothing running;
        else once max_waiting_tokens decode steps have run since prompts last joined, or once waiting_served_ratio
        times the running sequences wait."""
        return (not self.max_waiting_tokens or not self.running
                or self.decode_steps_since_admit >= self.max_waiting_tokens
                or len(self.waiting) >= self.waiting_served_ratio * len(self.running))

    def note_decode_step(self) -> None:
        """A decode step was launched (by schedule, or by the engine ahead of the step before it)."""
        self.decode_steps_since_admit += 1

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or None when there is nothing to run."""
        seqs, lens = [], []
        budget = self.max_num_batched_tokens
        if self.mixed_steps:  # running sequences first, decoding ones before chunked prompts: decodes always fit
            budget = self._take_running(sorted(self.running, key=lambda s: not s.decoding), budget, seqs, lens)
        else:  # prefill first: prompts being chunked, then new ones when due; decode only when there are none
            budget = self._take_running([s for s in self.running if not s.decoding], budget, seqs, lens)
        if self.mixed_steps or self.prefill_due():
            self._admit(budget, seqs, lens)
        if not seqs and not self.mixed_steps:
            self._take_running([s for s in self.running if s.decoding], budget, seqs, lens)
            if seqs:
                self.note_decode_step()
        return self._batch(seqs, lens)

    def schedule_prompts(self) -> ScheduledBatch | None:
        """A step of waiting prompts alone, in the whole budget: what the prefill-first policy runs next when no
        prompt is being chunked (and prefill_due), for the engine to launch while the step before it still runs.
        None if none fits (for lack of a sequence slot or blocks)."""
        seqs, lens = [], []
        self._admit(self.max_num_batched_tokens, seqs, lens)
        return self._batch(seqs, lens)

    @staticmethod
    def _batch(seqs: list[Sequence], lens: list[int]) -> ScheduledBatch | None:
        if not seqs:
            return None
        decodes = 0  # the leading run of single-token decodes
        while decodes < len(seqs) and lens[decodes] == 1 and seqs[decodes].decoding:
            decodes += 1
        sampled = [s for s, n in zip(seqs, lens) if s.num_cached + n == s.num_tokens]
        return ScheduledBatch(seqs, lens, decodes < len(seqs), sampled, decodes)

    def _take_running(self, candidates: list[Sequence], budget: int, seqs: list, lens: list) -> int:
        """Schedule running sequences' next tokens (preempting the newest when blocks run out); the budget left."""
        for seq in candidates:
            if seq.status is not Status.RUNNING:
                continue  # preempted below while making room for an earlier one
            take = self._chunk(seq.num_tokens - seq.num_cached, budget)
            if take <= 0:
                continue
            while not seq.block_table.ensure(seq.num_cached + take):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                seqs.append(seq)
                lens.append(take)
                budget -= take
        return budget

    def _admit(self, budget: int, seqs: list, lens: list) -> None:
        """New requests into what is left of the budget: whole prompts, or the first chunk of one longer than
        the whole budget (a shorter one that does not fit waits for the next step)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            remaining = seq.num_tokens - seq.num_cached
            take = remaining if remaining <= budget else (
                self._chunk(remaining, budget) if remaining > self.max_num_batched_tokens else 0)
            if take <= 0 or not seq.block_table.ensure(seq.num_cached + take):
                break  # it waits (for budget, or for running sequences to free blocks)
            self.waiting.popleft()
            self.decode_steps_since_admit = 0
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            lens.append(take)
            budget -= take

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
