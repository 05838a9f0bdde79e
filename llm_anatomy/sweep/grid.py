"""A sweep's axes and its points: prompt length, batch, output length and precision, validated up front."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..errors import AnatomyError

# vLLM's names: --quantization (None: the model's own dtype) and --kv-cache-dtype ("auto": the model's dtype).
QUANTIZATIONS = {"bf16": None, "none": None, "fp8": "fp8"}
KV_CACHE_DTYPES = {"auto": "auto", "bf16": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}

MAX_BATCH = 4096  # a bound on --batch; far past where any GPU's KV pool runs out at useful contexts


def parse_int_list(text: str, flag: str, low: int, high: int) -> tuple[int, ...]:
    """'128,512' or '128..32768' (doubling from the first, the last always included), or both: sorted, unique.
    Every value must lie in low..high; a descending range or a non-integer is refused with the flag named."""
    values: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            raise AnatomyError(f"{flag}: empty value in {text!r}; give integers such as 128,512 or a range 128..4096")
        if ".." in part:
            first, _, last = part.partition("..")
            a, b = _int(first, flag, text), _int(last, flag, text)
            if a > b:
                raise AnatomyError(f"{flag}: range {part} runs downwards; write it as {b}..{a}")
            _check(a, flag, low, high)
            _check(b, flag, low, high)
            v = a
            while v < b:
                values.add(v)
                v *= 2
            values.add(b)
        else:
            v = _int(part, flag, text)
            _check(v, flag, low, high)
            values.add(v)
    return tuple(sorted(values))


def _int(s: str, flag: str, text: str) -> int:
    try:
        return int(s.strip())
    except ValueError:
        raise AnatomyError(f"{flag}: {s.strip()!r} in {text!r} is not an integer") from None


def _check(v: int, flag: str, low: int, high: int) -> None:
    if not low <= v <= high:
        raise AnatomyError(f"{flag}: {v} is out of range; values must be in {low}..{high}")


def parse_choices(text: str, flag: str, choices: dict[str, str | None]) -> tuple[str, ...]:
    """A comma-separated list of names from `choices`, kept in the order given, without repeats."""
    names: list[str] = []
    for part in str(text).split(","):
        name = part.strip().lower()
        if name not in choices:
            raise AnatomyError(f"{flag}: unknown value {part.strip()!r}; use {', '.join(choices)}")
        if name not in names:
            names.append(name)
    return tuple(names)


@dataclass(frozen=True)
class Precision:
    """One engine's precision: quantization of the weights (None: the model's dtype) and the KV cache's dtype."""

    quantization: str | None = None
    kv_cache_dtype: str = "auto"

    @property
    def label(self) -> str:
        weights = self.quantization or "bf16"
        return weights if self.kv_cache_dtype == "auto" else f"{weights} / {self.kv_cache_dtype} KV"

    @property
    def key(self) -> str:
        return f"{self.quantization or 'bf16'}-kv{self.kv_cache_dtype}"

    def engine_settings(self) -> dict:
        """The Engine.from_pretrained keywords for this precision: none for the default, so that an engine
        without fp8 support runs bf16 as before."""
        settings = {}
        if self.quantization is not None:
            settings["quantization"] = self.quantization
        if self.kv_cache_dtype != "auto":
            settings["kv_cache_dtype"] = self.kv_cache_dtype
        return settings


@dataclass(frozen=True)
class Point:
    precision: Precision
    prompt_tokens: int
    batch: int
    output_tokens: int

    @property
    def key(self) -> str:
        return f"{self.precision.key}-p{self.prompt_tokens}-b{self.batch}-o{self.output_tokens}"

    @property
    def label(self) -> str:
        return f"{self.precision.label}, prompt {self.prompt_tokens}, batch {self.batch}, output {self.output_tokens}"

    @property
    def tokens_per_sequence(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class Grid:
    prompt_tokens: tuple[int, ...]
    batch: tuple[int, ...]
    output_tokens: tuple[int, ...]
    precisions: tuple[Precision, ...] = (Precision(),)

    @classmethod
    def parse(cls, prompt_tokens: str, batch: str, output_tokens: str, quantization: str = "bf16",
              kv_cache_dtype: str = "auto") -> "Grid":
        quants = parse_choices(quantization, "--quantization", QUANTIZATIONS)
        kvs = parse_choices(kv_cache_dtype, "--kv-cache-dtype", KV_CACHE_DTYPES)
        precisions = tuple(dict.fromkeys(Precision(QUANTIZATIONS[q], KV_CACHE_DTYPES[k])
                                         for q, k in itertools.product(quants, kvs)))
        return cls(parse_int_list(prompt_tokens, "--prompt-tokens", 1, 10 ** 7),
                   parse_int_list(batch, "--batch", 1, MAX_BATCH),
                   parse_int_list(output_tokens, "--output-tokens", 1, 10 ** 7), precisions)

    def check_context(self, max_len: int, model: str) -> None:
        """Refuse, before any work, a prompt plus output longer than the model's context."""
        longest = max(self.prompt_tokens) + max(self.output_tokens)
        if longest > max_len:
            raise AnatomyError(f"--prompt-tokens {max(self.prompt_tokens)} plus --output-tokens "
                               f"{max(self.output_tokens)} is {longest} tokens, past the context of {model} "
                               f"({max_len} tokens); lower them")

    def points(self) -> list[Point]:
        """Every point, precision by precision (one engine each), then small to large work."""
        return [Point(p, n, b, o) for p in self.precisions for o in self.output_tokens
                for n in self.prompt_tokens for b in self.batch]

    @property
    def max_batch(self) -> int:
        return max(self.batch)

    def describe(self) -> dict:
        return {"prompt_tokens": list(self.prompt_tokens), "batch": list(self.batch),
                "output_tokens": list(self.output_tokens),
                "precisions": [{"quantization": p.quantization, "kv_cache_dtype": p.kv_cache_dtype, "label": p.label}
                               for p in self.precisions]}
