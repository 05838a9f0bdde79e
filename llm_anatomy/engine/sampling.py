"""Sampling parameters (validated before any work) and the batched sampler that runs on the device.

The sampler never reads a value back to the host: penalties, temperature, top-k, top-p and min-p are
masks and arithmetic on the logits, and the draw is argmax(probs / Exponential(1)) (the exponential-race
form of sampling from probs, as in gpt-fast), so the only sync per step is the engine reading the tokens.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields

import torch

from ..errors import RequestError


MAX_LOGPROBS = 20  # the OpenAI API's limit on top_logprobs
# Bounds on every value a request can set. A value past them would either overflow what the device or torch
# accepts (a seed outside int64 makes manual_seed raise, a top_k past int64 cannot become a tensor) or cost the
# whole batch host time (thousands of stop strings checked after every token).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
GREEDY_BELOW = 1e-5  # a temperature under this is greedy (as vLLM treats it): dividing by it overflows float32


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    min_tokens: int = 0  # EOS and stop_token_ids cannot be drawn, nor stop strings end the text, before this many
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end generation, besides the model's EOS ids
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # return each sampled token's log-probability and this many top alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit) before any sampling
    extra: dict = field(default_factory=dict, compare=False)  # not used by sampling; kept for records

    def __post_init__(self):
        def bad(param: str, why: str):
            raise RequestError(f"{param} {why}", param=param)

        def number(param: str) -> float:
            value = getattr(self, param)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(param, f"must be a finite number, got {value!r}")
            return value

        def integer(value, low: int, high: int) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

        if not integer(self.max_tokens, 1, INT32_MAX):
            bad("max_tokens", f"must be an integer >= 1 (at most {INT32_MAX}), got {self.max_tokens!r}")
        if not integer(self.min_tokens, 0, self.max_tokens):
            bad("min_tokens", f"must be an integer in 0..max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        if number("temperature") < 0:
            bad("temperature", f"must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < number("top_p") <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not integer(self.top_k, -1, INT32_MAX):
            bad("top_k", f"must be an integer >= 1 (at most {INT32_MAX}), or 0 / -1 to disable, got {self.top_k!r}")
        if not 0 <= number("min_p") <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for p in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(p) <= 2:
                bad(p, f"must be in [-2, 2], got {getattr(self, p)}")
        if self.seed is not None and not integer(self.seed, INT64_MIN, INT64_MAX):
            bad("seed", f"must be an integer in {INT64_MIN}..{INT64_MAX} (signed 64-bit), got {self.seed!r}")
        if isinstance(self.stop, str) or not isinstance(self.stop, (tuple, list)) or not all(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            bad("stop", f"must be a list of non-empty strings of at most {MAX_STOP_CHARS} characters")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or not all(integer(t, 0, INT32_MAX) for t in ids):
            bad("stop_token_ids", "must be a list of non-negative integers (token ids)")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and integer(pair[0], 0, INT32_MAX)
                    and isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool) and -100 <= pair[1] <= 100):
                bad("logit_bias", f"must map token ids (>= 0) to biases in [-100, 100], got {pair!r}")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            bad("logit_bias", "names a token id more than once")
        if self.logprobs is not None and not integer(self.logprobs, 0, MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in 0..{MAX_LOGPROBS} (top alternatives per token), "
                            f"got {self.logprobs!r}")

    def record(self) -> dict:
        """Its fields but `extra`, as an anatomy records what was asked (and a replay passes back in)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @functools.cached_property  # asked of every row of every step
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: an argmax and nothing else."""
        return self.greedy and not self.uses_penalties and not self.logit_bias

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def seed_for_choice(seed: int, index: int) -> int:
    """The seed of choice `index` of a request asking for several (seed + index), wrapped to stay a signed 64-bit
    integer (a seed at the top of the range plus an index would otherwise leave it)."""
    return (seed + index - INT64_MIN) % (1 << 64) + INT64_MIN


@dataclass
class _RowParams:
    """A batch's per-row sampling values as device tensors, built once per distinct set of values (through
    pinned memory, without a sync: building them from Python lists each step would wait for the step in
    flight)."""

    temperature: torch.Tensor  # [rows, 1]; 1 for greedy rows
    greedy: torch.Tensor  # [rows] bool
    top_k: torch.Tensor  # [rows, 1]; k_max for rows without top-k
    k_max: int  # 0: no row uses top-k
    k_all: bool  # every row uses top-k: top-p and min-p can work on the k best alone
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    frequency: torch.Tensor | None
    presence: torch.Tensor | None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values) of the logit biases
    pinned: list  # the host tensors the copies read from, kept alive


class Sampler:
    """Samples one token per row of logits. Rows carry their own parameters and, if seeded, generators."""

    def __init__(self, device: torch.device, seed: int | None = None):
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self._cache: dict[tuple, _RowParams] = {}

    def _rows(self, params: list[SamplingParams]) -> _RowParams:
        key = tuple((p.temperature, p.top_k, p.top_p, p.min_p, p.frequency_penalty, p.presence_penalty,
                     p.logit_bias) for p in params)
        rows = self._cache.get(key)
        if rows is not None:
            return rows
        if len(self._cache) > 256:
            self._cache.clear()
        pinned = []

        def dev(values, dtype=torch.float32, column=True):
            host = torch.tensor(values, dtype=dtype)
            if self.device.type == "cuda":
                host = host.pin_memory()
            pinned.append(host)
            t = host.to(self.device, non_blocking=True)
            return t[:, None] if column else t

        ks = [p.top_k if p.top_k > 0 else 0 for p in params]
        k_max = max(ks)
        rows = _RowParams(
            temperature=dev([p.temperature if not p.greedy else 1.0 for p in params]),
            greedy=dev([p.greedy for p in params], torch.bool, column=False),
            top_k=dev([k or k_max for k in ks], torch.int64), k_max=k_max, k_all=all(ks),
            top_p=dev([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
            min_p=dev([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
            frequency=dev([p.frequency_penalty for p in params]) if any(p.uses_penalties for p in params) else None,
            presence=dev([p.presence_penalty for p in params]) if any(p.uses_penalties for p in params) else None,
            bias=self._bias(params, pinned) if any(p.logit_bias for p in params) else None,
            pinned=pinned)
        self._cache[key] = rows
        return rows

    def _bias(self, params: list[SamplingParams], pinned: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The biases as (row, token, value) triples on the device: a few entries, not a [rows, vocab] tensor."""
        triples = [(row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias]
        rows, tokens, values = zip(*triples)
        out = []
        for data, dtype in ((rows, torch.int64), (tokens, torch.int64), (values, torch.float32)):
            host = torch.tensor(data, dtype=dtype)
            if self.device.type == "cuda":
                host = host.pin_memory()
            pinned.append(host)
            out.append(host.to(self.device, non_blocking=True))
        return tuple(out)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None], output_counts: list[torch.Tensor | None],
                 banned: list[tuple[int, ...]] | None = None) -> torch.Tensor:
        """logits: [rows, vocab] (the model's dtype) -> next token ids [rows] (int64, on the device). `banned`: per
        row, token ids that cannot be drawn this step (a row short of its min_tokens: its EOS and stop ids)."""
        if banned is not None and any(banned):
            logits = self._ban(logits, banned)
        if all(p.plain_greedy for p in params):
            return logits.argmax(dim=-1)
        logits = logits.float()  # penalties, temperature and the truncations in float32
        r = self._rows(params)
        if r.bias is not None:
            logits = logits.index_put(r.bias[:2], r.bias[2], accumulate=True)
        if r.frequency is not None:
            counts = torch.stack([c.float() if c is not None else torch.zeros_like(logits[0]) for c in output_counts])
            logits = logits - r.frequency * counts - r.presence * (counts > 0).float()
        greedy_tokens = logits.argmax(dim=-1)
        logits = logits / r.temperature
        if r.k_all:
            # Every row keeps at most k tokens: the k best (sorted) are all that top-p and min-p can keep.
            values, ids = logits.topk(min(r.k_max, logits.shape[-1]), dim=-1)
            rank = torch.arange(values.shape[-1], device=logits.device)
            values = values.masked_fill(rank[None, :] >= r.top_k, float("-inf"))
            probs = self._filter(values.softmax(dim=-1), r, is_sorted=True)
            choice = self._draw(probs, generators)
            sampled = ids.gather(1, choice[:, None]).squeeze(1)
        else:
            if r.k_max:
                kth = logits.topk(min(r.k_max, logits.shape[-1]), dim=-1).values
                threshold = kth.gather(1, r.top_k.clamp(max=kth.shape[-1]) - 1)
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            sampled = self._draw(self._filter(logits.softmax(dim=-1), r, is_sorted=False), generators)
        return torch.where(r.greedy, greedy_tokens, sampled)

    def _ban(self, logits: torch.Tensor, banned: list[tuple[int, ...]]) -> torch.Tensor:
        """-inf at the banned (row, token) pairs: a few entries, copied without a sync."""
        pairs = [(row, token) for row, tokens in enumerate(banned) for token in tokens if token < logits.shape[-1]]
        if not pairs:
            return logits
        index = torch.tensor(pairs, dtype=torch.int64).T
        if self.device.type == "cuda":
            index = index.pin_memory()  # the host allocator keeps the block until the copy has run
        index = index.to(self.device, non_blocking=True)
        return logits.index_put((index[0], index[1]), torch.tensor(float("-inf"), dtype=logits.dtype,
                                                                   device=logits.device))

    @staticmethod
    def _filter(probs: torch.Tensor, r: _RowParams, is_sorted: bool) -> torch.Tensor:
        """Top-p (the smallest prefix of the sorted distribution whose mass reaches p), then min-p."""
        if r.top_p is not None:
            sorted_probs, order = (probs, None) if is_sorted else probs.sort(dim=-1, descending=True)
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= r.top_p  # mass before it already >= p
            drop = drop_sorted if is_sorted else torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if r.min_p is not None:
            probs = probs.masked_fill(probs < r.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """argmax(probs / Exponential(1)) samples from probs (the exponential race); no host sync."""
        noise = torch.empty_like(probs)
        for i in range(probs.shape[0]):
            noise[i].exponential_(generator=generators[i] or self.generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a draw of exactly 0 would divide by zero
        return (probs / noise).argmax(dim=-1)

    def warmup(self, vocab: int) -> None:
        """Run every sampling path once, so that the first request does not pay for loading their kernels."""
        logits = torch.randn(2, vocab, device=self.device)
        gens = [torch.Generator(device=self.device).manual_seed(0), None]
        for a, b in ((SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05), SamplingParams(top_k=5)),
                     (SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, presence_penalty=0.5),
                      SamplingParams(temperature=0))):
            counts = torch.zeros(vocab, dtype=torch.int32, device=self.device)
            self(logits, [a, b], gens, [counts, None])
        self._cache.clear()


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                                 torch.Tensor | None]:
    """Log-probabilities of the sampled tokens under the model's own distribution (the raw logits: before
    temperature, penalties and truncation, as vLLM reports them), and the `top` most likely tokens' ids and
    log-probabilities. All on the device: no sync."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    if not top:
        return chosen, None, None
    values, ids = logp.topk(top, dim=-1)
    return chosen, ids, values
