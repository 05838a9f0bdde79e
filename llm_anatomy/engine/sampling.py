"""Sampling parameters (validated before any work) and the batched sampler that runs on the device.

The sampler never reads a value back to the host: penalties, temperature, top-k, top-p and min-p are
masks and arithmetic on the logits, and the draw is argmax(probs / Exponential(1)) (the exponential-race
form of sampling from probs, as in gpt-fast), so the only sync per step is the engine reading the tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
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
    extra: dict = field(default_factory=dict, compare=False)  # not used by sampling; kept for records

    def __post_init__(self):
        def bad(param: str, why: str):
            raise RequestError(f"{param} {why}", param=param)

        def number(param: str) -> float:
            value = getattr(self, param)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(param, f"must be a finite number, got {value!r}")
            return value

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if number("temperature") < 0:
            bad("temperature", f"must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < number("top_p") <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be an integer >= 1, or 0 / -1 to disable, got {self.top_k!r}")
        if not 0 <= number("min_p") <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for p in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(p) <= 2:
                bad(p, f"must be in [-2, 2], got {getattr(self, p)}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


class Sampler:
    """Samples one token per row of logits. Rows carry their own parameters and, if seeded, generators."""

    def __init__(self, device: torch.device, seed: int | None = None):
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None], output_counts: list[torch.Tensor | None]) -> torch.Tensor:
        """logits: [rows, vocab] float32 -> next token ids [rows] (int64, on the device)."""
        rows = logits.shape[0]
        if all(p.greedy and not p.uses_penalties for p in params):
            return logits.argmax(dim=-1)
        dev = logits.device
        if any(p.uses_penalties for p in params):
            counts = torch.stack([c.float() if c is not None else torch.zeros_like(logits[0]) for c in output_counts])
            freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
            pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
            logits = logits - freq * counts - pres * (counts > 0).float()
        greedy_rows = torch.tensor([p.greedy for p in params], device=dev)
        greedy_tokens = logits.argmax(dim=-1)
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)[:, None]
        logits = logits / temperature

        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        if any(top_k):
            k_max = max(top_k)
            kth = logits.topk(min(k_max, logits.shape[-1]), dim=-1).values  # [rows, k_max], descending
            ks = torch.tensor([k if k else k_max for k in top_k], device=dev).clamp(max=kth.shape[-1])
            threshold = kth.gather(1, (ks - 1)[:, None])
            disabled = torch.tensor([k == 0 for k in top_k], device=dev)[:, None]
            logits = logits.masked_fill((logits < threshold) & ~disabled, float("-inf"))
        probs = logits.softmax(dim=-1)
        if any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)

        noise = torch.empty_like(probs)
        for i in range(rows):
            noise[i].exponential_(generator=generators[i] or self.generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a draw of exactly 0 would divide by zero
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy_rows, greedy_tokens, sampled)
