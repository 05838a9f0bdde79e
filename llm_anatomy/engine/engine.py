"""The engine: loads a model, owns the KV pool, and runs requests to completion step by step."""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import AnatomyError, RequestError, WeightsError
from ..hub import ModelSource, presets, read_json, resolve
from ..models.attention import AttentionBatch
from ..models.config import ModelConfig, parse_dtype
from ..kernels import use_kernels
from ..models.loader import WeightsInfo, build_model, has_checkpoint, init_synthetic, load_checkpoint
from ..models.qwen3 import enable_fast_path
from ..prompt import render_prompt
from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .events import Observer, Step
from .kv_cache import BlockTable, KVCachePool
from .runner import ModelRunner
from .sampling import Sampler, SamplingParams, logprobs_of
from .scheduler import ScheduledBatch, Scheduler, Sequence

log = logging.getLogger("llm_anatomy")


@dataclass(frozen=True)
class GenerationDefaults:
    """What generation_config.json says (or the Qwen3 family defaults for a preset with no files)."""

    eos_token_ids: tuple[int, ...]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @classmethod
    def for_source(cls, source: ModelSource, config: ModelConfig) -> "GenerationDefaults":
        gen = {}
        if source.directory is not None and (source.directory / "generation_config.json").is_file():
            gen = read_json(source.directory / "generation_config.json")
        elif source.origin == "preset":
            gen = presets()["_family_facts"]["generation_config_defaults_thinking"]
        eos = gen.get("eos_token_id", config.eos_token_id)
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if not gen.get("do_sample", True):
            return cls(eos_ids, temperature=0.0)
        return cls(eos_ids, float(gen.get("temperature", 1.0)), float(gen.get("top_p", 1.0)),
                   int(gen.get("top_k", 0) or 0), float(gen.get("min_p", 0.0) or 0.0))


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str
    prompt_text: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per output token, when asked for


@dataclass
class _Pending:
    """A launched step whose sampled tokens are still on the device."""

    batch: ScheduledBatch
    step: Step | None
    tokens: torch.Tensor | None = None  # on the device, one per batch.sampled
    host_tokens: torch.Tensor | None = None  # their copy in pinned host memory (CUDA), in flight
    copied: torch.cuda.Event | None = None  # recorded after that copy
    logprobs: tuple | None = None  # (chosen, top ids, top values) per sampled row, on the host once copied

    def read_tokens(self) -> list[int]:
        """Wait for this step's tokens only (not for a later step queued behind them) and return them."""
        if self.copied is None:
            return self.tokens.tolist()
        self.copied.synchronize()
        return self.host_tokens.tolist()


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise AnatomyError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise AnatomyError(f"device {device!r} asked for, but this machine has no CUDA GPU; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise AnatomyError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    if dev.type != "cpu":
        raise AnatomyError(f"device type {dev.type!r} is not supported; use cpu or cuda")
    return dev


class Engine:
    def __init__(self, model, config: ModelConfig, tokenizer: Tokenizer, source: ModelSource, weights: WeightsInfo,
                 device: torch.device, dtype: torch.dtype, defaults: GenerationDefaults, *,
                 kv_cache_tokens: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int | None = None, block_size: int = 16, seed: int | None = None,
                 fast_path: bool | None = None, cuda_graphs: bool = True, lookahead: bool | None = None,
                 pdl: bool = True, stream_gemv: bool = True, mixed_steps: bool = False):
        self.startup_seconds: float | None = None  # set by from_pretrained: the whole load, capture included
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.source = source
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.defaults = defaults
        for name, switch in (("cuda_graphs", cuda_graphs), ("pdl", pdl), ("stream_gemv", stream_gemv),
                             ("mixed_steps", mixed_steps)):
            if not isinstance(switch, bool):  # a string such as "false" would read as on
                raise AnatomyError(f"{name} must be True or False, got {switch!r}")
        if max_model_len is not None and not 0 < max_model_len <= config.max_position_embeddings:
            raise AnatomyError(f"max_model_len must be in 1..{config.max_position_embeddings} "
                               f"(the model's max_position_embeddings), got {max_model_len}")
        self.max_model_len = max_model_len or config.max_position_embeddings
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise AnatomyError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        # Tokens forwarded per step: longer prompts are prefilled in chunks of this size.
        self.max_num_batched_tokens = max_num_batched_tokens or min(self.max_model_len, 8192)
        self._whole_prompt_tokens = min(self.max_model_len, self.max_num_batched_tokens)  # longest unchunked
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        # The fused Triton kernels and decode CUDA graphs: on by default on CUDA; the PyTorch path elsewhere.
        self.fast_path = use_kernels(device) and device.type == "cuda" if fast_path is None else fast_path
        if self.fast_path and not use_kernels(device):
            raise AnatomyError("fast_path needs Triton and a CUDA device")
        enable_fast_path(model, self.fast_path)
        blocks = self._kv_blocks(kv_cache_tokens, gpu_memory_utilization)
        self.pool = KVCachePool(config, blocks, block_size, dtype, device)
        self.scheduler = Scheduler(self.pool, max_num_seqs, self.max_num_batched_tokens, mixed_steps)
        self.runner = ModelRunner(model, self.pool, device)
        self.pdl = self.stream_gemv = False
        if cuda_graphs and self.fast_path and device.type == "cuda":  # graphs replay the fused-kernel path
            from ..kernels.pdl import enable_pdl
            from ..kernels.stream_gemv import enable_stream_gemv

            self.pdl = enable_pdl(device, pdl)
            # batch-1 GEMVs stream their weights before their PDL wait (kernels/stream_gemv.py): without PDL
            # nothing overlaps, and the Triton GEMV serves
            self.stream_gemv = enable_stream_gemv(device, stream_gemv and self.pdl)
            try:
                self.runner.capture(max_num_seqs, self.max_model_len, self._whole_prompt_tokens)
            except RuntimeError as e:  # a driver that cannot capture programmatic launches: without them
                if not self.pdl:
                    raise
                log.warning("CUDA graph capture with programmatic dependent launch failed (%s); retrying "
                            "without it", str(e).splitlines()[0])
                self.pdl = enable_pdl(device, False)
                self.stream_gemv = enable_stream_gemv(device, False)
                self.runner = ModelRunner(model, self.pool, device)
                self.runner.capture(max_num_seqs, self.max_model_len, self._whole_prompt_tokens)
        self.sampler = Sampler(device, seed)
        if device.type == "cuda":
            self.sampler.warmup(config.vocab_size)
        self.observers: list[Observer] = []
        self._ids = itertools.count()
        self._steps = itertools.count()
        # Launch decode step n+1 before reading step n's tokens back, so the host's work (detokenizing,
        # stop checks, scheduling) overlaps the device's. Pays only where the device runs asynchronously.
        self.lookahead = device.type == "cuda" if lookahead is None else lookahead
        self._ahead: _Pending | None = None
        if device.type == "cuda":  # two steps' sampled tokens can be in flight at once
            self._host_tokens = torch.zeros(2, max(max_num_seqs, 1), dtype=torch.int64).pin_memory()
            self._host_flip = 0

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike = "Qwen/Qwen3-0.6B", device=None, dtype=None,
                        weights: str | os.PathLike = "auto", *, seed: int = 0, **engine_args) -> "Engine":
        """Load a model: `weights` is "auto" (real ones if found locally, else synthetic), "synthetic" or a directory."""
        start = time.perf_counter()
        source = resolve(name_or_path)
        config = ModelConfig.from_hf(source.config)
        device = parse_device(device)
        dtype = parse_dtype(dtype if dtype is not None else config.torch_dtype)
        weights_dir = cls._weights_dir(source, weights)
        tokenizer = Tokenizer.from_pretrained(source.directory or weights_dir or source.name)
        model = build_model(config, device, dtype)
        if weights_dir is not None:
            info = load_checkpoint(model, weights_dir)
        else:
            if str(weights) == "auto":
                log.warning("No local weights for %s: running synthetic random weights (timings, memory and "
                            "energy are real; the text is not). For the real model: `hf download %s`, then "
                            "run again, or pass --weights DIR.", source.name, source.name)
            info = init_synthetic(model, seed)
        engine = cls(model, config, tokenizer, source, info, device, dtype,
                     GenerationDefaults.for_source(source, config), seed=seed, **engine_args)
        engine.startup_seconds = time.perf_counter() - start
        return engine

    @staticmethod
    def _weights_dir(source: ModelSource, weights) -> Path | None:
        if str(weights) == "synthetic":
            return None
        if str(weights) == "auto":
            return source.directory if has_checkpoint(source.directory) else None
        path = Path(weights).expanduser()
        if not path.is_dir():
            raise WeightsError(f"weights {str(weights)!r} is not a directory; use auto, synthetic or a checkpoint dir")
        return path

    def _kv_blocks(self, kv_cache_tokens: int | None, gpu_memory_utilization: float) -> int:
        bytes_per_block = self.config.kv_bytes_per_token(self.dtype) * self.block_size
        if kv_cache_tokens is not None:
            if kv_cache_tokens < 1:
                raise AnatomyError(f"kv_cache_tokens must be >= 1, got {kv_cache_tokens}")
            return -(-kv_cache_tokens // self.block_size)
        if self.device.type == "cuda":
            if not 0 < gpu_memory_utilization <= 1:
                raise AnatomyError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
            activation_peak = self._measure_activation_peak()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - gpu_memory_utilization) * total - activation_peak
        else:  # the host: an eighth of available memory, at most 1 GiB (zeroing it costs about a second a GiB)
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(1 << 30, available // 8)
        blocks = int(budget // bytes_per_block)
        full = -(-self.max_model_len // self.block_size) * self.max_num_seqs  # never more than all seqs at full context
        return max(1, min(blocks, full))

    @torch.inference_mode()
    def _measure_activation_peak(self) -> int:
        """Peak bytes a prefill of max_num_batched_tokens needs beyond the weights (warm-up run, temporary pool)."""
        tokens = self.max_num_batched_tokens
        pool = KVCachePool(self.config, -(-tokens // self.block_size), self.block_size, self.dtype, self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        batch = AttentionBatch.fresh_prompt(pool.k, pool.v, torch.arange(tokens, device=self.device))
        ids = torch.randint(0, self.config.vocab_size, (tokens,), device=self.device)
        hidden = self.model(ids, torch.arange(tokens, device=self.device), batch)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del pool, batch, hidden
        torch.cuda.empty_cache()
        return peak

    # ---- requests -----------------------------------------------------------------------------------
    def sampling_params(self, **kwargs) -> SamplingParams:
        """SamplingParams with the model's generation defaults for every field left as None."""
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if kwargs.get(name) is None:
                kwargs[name] = getattr(self.defaults, name)
        if kwargs.get("max_tokens") is None:
            kwargs.pop("max_tokens", None)
        kwargs["stop"] = tuple([kwargs["stop"]] if isinstance(kwargs.get("stop"), str) else kwargs.get("stop") or ())
        kwargs["stop_token_ids"] = tuple(kwargs.get("stop_token_ids") or ())
        return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})

    def render_prompt(self, prompt_token_ids=None, prompt: str | None = None, messages=None, *,
                      enable_thinking: bool = True, tools=None) -> tuple[list[int], str | None]:
        """Exactly one of token ids, a raw prompt, or chat messages -> (token ids, prompt text)."""
        rendered = render_prompt(self.tokenizer, messages=messages, prompt=prompt, prompt_token_ids=prompt_token_ids,
                                 enable_thinking=enable_thinking, tools=tools)
        return rendered.token_ids, rendered.text

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The checks `add_request` makes, without queueing anything (a server runs them in its handlers)."""
        ids = list(prompt_token_ids)
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        vocab = self.config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token {bad[0]!r} is outside the model's vocabulary (0..{vocab - 1})",
                               param="prompt")
        bad_bias = [t for t, _ in params.logit_bias if t >= vocab]
        if bad_bias:
            raise RequestError(f"logit_bias names token {bad_bias[0]}, outside the vocabulary (0..{vocab - 1})",
                               param="logit_bias")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens",
                param="max_tokens" if len(ids) < self.max_model_len else "prompt")
        if self.pool.blocks_for(len(ids) + params.max_tokens) > self.pool.num_blocks:
            raise RequestError(
                f"the prompt plus max_tokens needs {len(ids) + params.max_tokens} KV cache tokens but the pool holds "
                f"{self.pool.capacity_tokens}; lower max_tokens or give the KV cache more memory", param="max_tokens")
        return ids

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> Sequence:
        """Validate and queue one request; nothing runs until `step`."""
        ids = self.check_request(prompt_token_ids, params)
        seq = Sequence(request_id or f"req-{next(self._ids)}", ids, params, BlockTable(self.pool))
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if params.uses_penalties:
            seq.output_counts = torch.zeros(self.config.vocab_size, dtype=torch.int32, device=self.device)
        if params.logprobs is not None:
            seq.logprobs = []
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.scheduler.add(seq)
        for o in self.observers:
            o.on_add(seq, time.perf_counter_ns())
        return seq

    def abort(self, seq: Sequence) -> None:
        if not seq.finished:
            self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        for o in self.observers:
            o.on_finish(seq, time.perf_counter_ns())

    def reset_pipeline(self) -> None:
        """Forget a step launched ahead (after a step failed, its state cannot be trusted)."""
        self._ahead = None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One prefill or decode step over the scheduled batch: its tokens are appended (and, with lookahead,
        the next decode step is already running on the device). Returns the step's sequences."""
        pending, self._ahead = self._ahead or self._launch(), None
        if pending is None:
            return []
        if self._can_run_ahead(pending):
            self._ahead = self._launch_ahead(pending)
        self._complete(pending)
        return pending.batch.seqs

    def _launch(self) -> "_Pending | None":
        observers = self.observers
        t_start = time.perf_counter_ns() if observers else 0
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        step = None
        if observers:
            step = Step(next(self._steps), batch.is_prefill, batch.seqs, list(batch.query_lens),
                        [s.num_cached + n for s, n in zip(batch.seqs, batch.query_lens)], t_start,
                        t_launch_ns=time.perf_counter_ns())
        return self._run(_Pending(batch, step), None)

    def _launch_ahead(self, previous: "_Pending") -> "_Pending":
        """The decode step after `previous`, taking its sampled tokens straight from the device."""
        seqs = previous.batch.seqs
        step = None
        if self.observers:
            now = time.perf_counter_ns()
            step = Step(next(self._steps), False, seqs, [1] * len(seqs), [s.num_tokens + 1 for s in seqs], now,
                        t_launch_ns=now)
        batch = ScheduledBatch(seqs, [1] * len(seqs), False, seqs, len(seqs))
        return self._run(_Pending(batch, step), previous.tokens)

    def _run(self, pending: "_Pending", ahead_tokens) -> "_Pending":
        step, sampled = pending.step, pending.batch.sampled
        for o in self.observers:
            o.on_launch(step)
        logits = self.runner.run(pending.batch, ahead_tokens)
        if sampled:
            pending.tokens = self.sampler(logits, [s.params for s in sampled], [s.generator for s in sampled],
                                          [s.output_counts for s in sampled], self._banned(sampled))
        top = max((s.params.logprobs for s in sampled if s.params.logprobs is not None), default=None)
        if top is not None:  # only when a request asked: log-softmax and top-k over the vocabulary
            parts = logprobs_of(logits, pending.tokens, top)
            pending.logprobs = tuple(t.to("cpu", non_blocking=True) if t is not None and t.is_cuda else t
                                     for t in parts)
        if sampled and self.device.type == "cuda":  # queue the copy now, ahead of any step launched after this one
            self._host_flip ^= 1
            pending.host_tokens = self._host_tokens[self._host_flip, :len(sampled)]
            pending.host_tokens.copy_(pending.tokens, non_blocking=True)
            pending.copied = torch.cuda.Event()
            pending.copied.record()
        if step is not None:
            step.t_launched_ns = time.perf_counter_ns()
        for o in self.observers:
            o.on_launched(step)
        return pending

    def _banned(self, seqs: list[Sequence]) -> list[tuple[int, ...]] | None:
        """Per sequence, the ids it cannot draw yet: its EOS and stop ids while short of min_tokens."""
        if not any(s.params.min_tokens for s in seqs):
            return None
        return [(tuple(s.params.stop_token_ids) + (() if s.params.ignore_eos else self.defaults.eos_token_ids))
                if len(s.output_token_ids) < s.params.min_tokens else () for s in seqs]

    def _can_run_ahead(self, p: "_Pending") -> bool:
        """Only when the next step is certain to be a decode of exactly these sequences (nothing waiting to be
        admitted, nobody about to hit a length limit) and its cache blocks can be held now."""
        seqs = p.batch.seqs
        if not self.lookahead or self.scheduler.waiting or self.scheduler.running != seqs or p.batch.sampled != seqs:
            return False
        for s in seqs:  # the host is one step behind p: p's tokens will make it num_tokens + 1
            if s.output_counts is not None or len(s.output_token_ids) + 1 >= s.params.max_tokens or \
                    len(s.output_token_ids) < s.params.min_tokens or \
                    s.num_tokens + 1 >= self.max_model_len:
                return False
        return all(s.block_table.ensure(s.num_tokens + 1) for s in seqs)

    def _complete(self, p: "_Pending") -> None:
        """Read the step's tokens back (the one sync per step) and append them."""
        step, batch = p.step, p.batch
        tokens = self._per_seq(batch, p.read_tokens() if batch.sampled else [])
        logprobs = None
        if p.logprobs is not None:  # copied before the event read_tokens waited for
            chosen, ids, values = (t.tolist() if t is not None else None for t in p.logprobs)
            logprobs = self._per_seq(batch, [
                (chosen[row], list(zip(ids[row][:k], values[row][:k])) if ids else []) if k is not None else None
                for row, k in enumerate(s.params.logprobs for s in batch.sampled)])
        if step is not None:
            step.t_sampled_ns = time.perf_counter_ns()
            step.tokens = tokens
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.query_lens)):
            if seq.finished:  # ended (stop token, abort) while this step was already in flight
                continue
            seq.num_cached += n
            token = tokens[i]
            if token is None:  # a chunk of a prompt: no token yet
                continue
            t = time.perf_counter_ns() if step is not None else 0
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs[i])
            self._append_token(seq, token)
            if step is not None:
                step.detokenize_ns += time.perf_counter_ns() - t
                if seq.finished:
                    step.finished.append(seq.request_id)
        if step is not None:
            step.t_end_ns = time.perf_counter_ns()
            for o in self.observers:
                o.on_step(step)

    @staticmethod
    def _per_seq(batch: ScheduledBatch, values: list) -> list:
        """Values of the sampled sequences, one per sequence of the batch (None for a prompt chunk)."""
        if len(values) == len(batch.seqs):  # every sequence sampled, in order (always so in a decode step)
            return values
        got = dict(zip(map(id, batch.sampled), values))
        return [got.get(id(s)) for s in batch.seqs]

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.output_token_ids.append(token)
        if seq.output_counts is not None:
            seq.output_counts[token] += 1
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.defaults.eos_token_ids):
            seq.text += seq.detokenizer.flush()  # the stop token's own text is not kept
            self._finish(seq, "stop")
            return
        before = len(seq.text)
        seq.text += seq.detokenizer.add(token)
        if params.stop and len(seq.output_token_ids) >= params.min_tokens and self._cut_at_stop(seq, before):
            self._finish(seq, "stop")
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.text += seq.detokenizer.flush()
            self._finish(seq, "length")

    @staticmethod
    def _cut_at_stop(seq: Sequence, before: int) -> bool:
        """Cut the text at the first stop string that the new text completes (the stop string is not kept)."""
        longest = max(len(s) for s in seq.params.stop)
        window_start = max(0, before - longest + 1)
        hits = [i for s in seq.params.stop if (i := seq.text.find(s, window_start)) >= 0]
        if not hits:
            return False
        seq.text = seq.text[:min(hits)]
        return True

    def result(self, seq: Sequence, prompt_text: str | None = None) -> GenerationResult:
        return GenerationResult(seq.request_id, list(seq.prompt_token_ids), list(seq.output_token_ids), seq.text,
                                seq.finish_reason or "running", prompt_text,
                                list(seq.logprobs) if seq.logprobs is not None else None)

    def generate(self, prompt_token_ids=None, prompt: str | None = None, messages=None, *,
                 enable_thinking: bool = True, tools=None, **sampling) -> GenerationResult:
        """Run one request to completion. Sampling fields left as None take the model's generation defaults."""
        ids, text = self.render_prompt(prompt_token_ids, prompt, messages, enable_thinking=enable_thinking,
                                       tools=tools)
        seq = self.add_request(ids, self.sampling_params(**sampling))
        while not seq.finished:
            self.step()
        return self.result(seq, text)

    def generate_many(self, prompts: list[list[int]], **sampling) -> list[GenerationResult]:
        """Run several token-id prompts together (continuous batching) with the same sampling settings."""
        params = self.sampling_params(**sampling)
        seqs = [self.add_request(ids, params) for ids in prompts]
        while not all(s.finished for s in seqs):
            self.step()
        return [self.result(s) for s in seqs]
