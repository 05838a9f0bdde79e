"""The engine: loads a model, owns the KV pool, and runs requests to completion step by step."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import AnatomyError, RequestError, WeightsError
from ..hub import ModelSource, presets, read_json, resolve
from ..models.attention import AttentionBatch
from ..models.config import ModelConfig, dtype_name, parse_dtype
from ..models.loader import (WeightsInfo, build_model, has_checkpoint, init_synthetic, load_checkpoint,
                             quantize_loaded_head)
from ..models.quant import w8a8_gemms
from ..prompt import render_prompt
from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .config import EngineConfig
from .events import Observer, Step
from .graphs import PREFILL_GRAPH_TOKENS, GraphRunner
from .kv_cache import BlockTable, KVCachePool, blocks_for
from .plan import choose_plan
from .runner import ModelRunner
from .sampling import Sampler, SamplingParams, logprobs_of
from .scheduler import AheadInputs, ScheduledBatch, Scheduler, Sequence
from .tuning import TileTuning, tune_gemv_tiles

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


@dataclass(frozen=True)
class Admission:
    """What deciding whether a request can run reads of an engine (its generation defaults, vocabulary, context and
    KV pool), none of which changes once it is built: picklable, so that a server's front half in another process
    fills in and checks requests exactly as `add_request` will."""

    defaults: GenerationDefaults
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

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

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The checks `add_request` makes, without queueing anything (a server runs them in its handlers)."""
        ids = list(prompt_token_ids)
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        vocab = self.vocab_size
        plain = set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab  # the usual case, in C
        bad = [] if plain else [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
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
        if blocks_for(len(ids) + params.max_tokens, self.block_size) > self.num_blocks:
            raise RequestError(
                f"the prompt plus max_tokens needs {len(ids) + params.max_tokens} KV cache tokens but the pool holds "
                f"{self.capacity_tokens}; lower max_tokens or give the KV cache more memory", param="max_tokens")
        return ids


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_device(device: str | torch.device | None) -> torch.device:
    """The device asked for (None: the default), checked; a CUDA device always with its index (cuda:N), which
    torch.cuda.set_device and the engine core's process need."""
    if device is None:
        device = default_device()
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
    """One model on one device with its KV pool, scheduler, execution plan and graphs. Build it with
    `from_pretrained` (or `from_config`); run requests with `generate`, `generate_many`, or `add_request`
    and `step`."""

    def __init__(self, model, config: ModelConfig, tokenizer: Tokenizer, source: ModelSource, weights: WeightsInfo,
                 engine_config: EngineConfig, device: torch.device, dtype: torch.dtype, defaults: GenerationDefaults,
                 progress: Callable[[str], None] | None = None):
        self.startup_seconds: float | None = None  # set by from_config: the whole load, capture included
        self.model = model
        self.config = config  # the model's (config.json)
        self.engine_config = engine_config
        self.tokenizer = tokenizer
        self.source = source
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.defaults = defaults
        progress = progress or (lambda stage: None)
        cfg = engine_config
        if cfg.max_model_len is not None and cfg.max_model_len > config.max_position_embeddings:
            raise AnatomyError(f"max_model_len must be in 1..{config.max_position_embeddings} "
                               f"(the model's max_position_embeddings), got {cfg.max_model_len}")
        self.max_model_len = cfg.max_model_len or config.max_position_embeddings
        # Tokens forwarded per step: longer prompts are prefilled in chunks of this size.
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or min(self.max_model_len, 8192)
        self.block_size = cfg.block_size
        self.max_num_seqs = cfg.max_num_seqs
        self.kv_dtype = torch.float8_e4m3fn if cfg.kv_cache_fp8 else dtype  # what the KV pool stores
        self.plan = choose_plan(cfg, device, dtype_name(model.model.layers[0].self_attn.qkv_proj.weight.dtype),
                                dtype_name(self.kv_dtype), dtype_name(model.lm_head.weight.dtype),
                                (config.num_attention_heads, config.num_key_value_heads, config.head_dim),
                                w8a8_gemms(model, device, dtype))
        progress("sizing the KV cache")
        blocks = self._kv_blocks(cfg.kv_cache_tokens, cfg.gpu_memory_utilization)
        self.pool = KVCachePool(config, blocks, cfg.block_size, self.kv_dtype, device)
        self.admission = Admission(defaults, config.vocab_size, self.max_model_len, cfg.block_size, blocks)
        self.scheduler = Scheduler(self.pool, cfg.max_num_seqs, self.max_num_batched_tokens, cfg.mixed_steps,
                                   cfg.max_waiting_tokens, cfg.waiting_served_ratio)
        self.graphs: GraphRunner | None = None
        self.tile_tuning: TileTuning | None = None
        if self.plan.cuda_graphs:
            self.graphs = GraphRunner(model, self.pool, device, cfg.max_num_seqs, self.max_model_len)
            if self.plan.kernels:
                progress("tuning the decode GEMVs' tiles (once per GPU and version; cached)")
                self.plan, self.tile_tuning = tune_gemv_tiles(self.plan, model, self.graphs, device)
            progress("compiling kernels and capturing CUDA graphs")
            prefill_limit = min(self.max_model_len, self.max_num_batched_tokens, PREFILL_GRAPH_TOKENS
                                if cfg.prefill_graph_tokens is None else cfg.prefill_graph_tokens)
            self.graphs.capture(self.plan, prefill_limit)
        self.runner = ModelRunner(model, self.pool, device, self.plan, self.graphs)
        if self.plan.kernels and device.type == "cuda":  # a caller that named its longest prompt needs no more
            self.runner.build_attention_plans(min(self.max_model_len, self.max_num_batched_tokens,
                                                  cfg.prefill_graph_tokens or self.max_num_batched_tokens))
        self.sampler = Sampler(device, cfg.seed)
        if device.type == "cuda":
            self.sampler.warmup(config.vocab_size)
        self.observers: list[Observer] = []
        self._ids = itertools.count()
        self._steps = itertools.count()
        self._ahead: _Pending | None = None
        if device.type == "cuda":  # two steps' sampled tokens can be in flight at once
            self._host_tokens = torch.zeros(2, max(cfg.max_num_seqs, 1), dtype=torch.int64).pin_memory()
            self._host_flip = 0

    @property
    def lookahead(self) -> bool:
        """Launch step n+1 (the waiting prompts' prefill, or the next decode) before reading step n's tokens back,
        so the host's work (detokenizing, stop checks, scheduling) overlaps the device's. Pays only where the
        device runs asynchronously."""
        return self.plan.lookahead

    @contextlib.contextmanager
    def eager(self):
        """Steps inside run without CUDA graphs, programmatic dependent launch or lookahead: each kernel launched
        by the host on its own, as profilers (torch.profiler, Nsight Compute) need. The plan is back on exit."""
        self._ahead = None
        with self.runner.eager():
            plan, self.plan = self.plan, replace(self.plan, lookahead=False)
            try:
                yield
            finally:
                self.plan = plan

    def describe(self) -> dict:
        """The engine's settings, its plan and its graphs, as the anatomy records them."""
        return {"config": self.engine_config.describe(), "plan": self.plan.describe(),
                "graphs": self.graphs.describe() if self.graphs is not None else None,
                "tile_tuning": None if self.tile_tuning is None else {
                    "source": self.tile_tuning.source, "seconds": self.tile_tuning.seconds}}

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike = "Qwen/Qwen3-0.6B", device=None, dtype=None,
                        weights: str | os.PathLike = "auto", *, seed: int = 0,
                        progress: Callable[[str], None] | None = None, **settings) -> "Engine":
        """Load a model: `weights` is "auto" (real ones if found locally, else synthetic), "synthetic" or a
        directory; `settings` are EngineConfig's (kv_cache_tokens, max_num_seqs, quantization, ...). `progress`,
        if given, is called with a few words as start-up moves from stage to stage."""
        config = EngineConfig.from_settings(
            model=str(name_or_path), weights=str(weights), device=None if device is None else str(device),
            dtype=None if dtype is None else dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype,
            seed=seed, **settings)
        return cls.from_config(config, progress)

    @classmethod
    def from_config(cls, cfg: EngineConfig, progress: Callable[[str], None] | None = None) -> "Engine":
        start = time.perf_counter()
        progress = progress or (lambda stage: None)
        progress("resolving the model")
        source = resolve(cfg.model)
        config = ModelConfig.from_hf(source.config)
        device = parse_device(cfg.device)
        dtype = parse_dtype(cfg.dtype if cfg.dtype is not None else config.torch_dtype)
        weights_dir = cls._weights_dir(source, cfg.weights)
        tokenizer = Tokenizer.from_pretrained(source.directory or weights_dir or source.name)
        model = build_model(config, device, dtype, cfg.quantization)
        if weights_dir is not None:
            progress(f"loading weights from {weights_dir}")
            info = load_checkpoint(model, weights_dir)
        else:
            if cfg.weights == "auto":
                log.warning("No local weights for %s: running synthetic random weights (timings, memory and "
                            "energy are real; the text is not). For the real model: `hf download %s`, then "
                            "run again, or pass --weights DIR.", source.name, source.name)
            progress("initialising synthetic weights")
            info = init_synthetic(model, cfg.seed)
        if cfg.quantize_lm_head:
            progress("quantizing lm_head to fp8")
            info = quantize_loaded_head(model, info)
        engine = cls(model, config, tokenizer, source, info, cfg, device, dtype,
                     GenerationDefaults.for_source(source, config), progress)
        engine.startup_seconds = time.perf_counter() - start
        progress("ready")
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
        bytes_per_block = self.config.kv_bytes_per_token(self.kv_dtype) * self.block_size
        if kv_cache_tokens is not None:
            return blocks_for(kv_cache_tokens, self.block_size)
        if self.device.type == "cuda":
            activation_peak = self._measure_activation_peak()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - gpu_memory_utilization) * total - activation_peak
        else:  # the host: an eighth of available memory, at most 1 GiB (zeroing it costs about a second a GiB)
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(1 << 30, available // 8)
        blocks = int(budget // bytes_per_block)
        # never more than all sequences at full context
        full = blocks_for(self.max_model_len, self.block_size) * self.max_num_seqs
        return max(1, min(blocks, full))

    @torch.inference_mode()
    def _measure_activation_peak(self) -> int:
        """Peak bytes a prefill of max_num_batched_tokens needs beyond the weights (warm-up run, temporary pool)."""
        tokens = self.max_num_batched_tokens
        pool = KVCachePool(self.config, blocks_for(tokens, self.block_size), self.block_size, self.kv_dtype,
                           self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        batch = AttentionBatch.fresh_prompt(pool.k, pool.v, torch.arange(tokens, device=self.device))
        ids = torch.randint(0, self.config.vocab_size, (tokens,), device=self.device)
        plan = self.plan.eager()
        last = torch.full((1,), tokens - 1, device=self.device)
        hidden = self.model(ids, torch.arange(tokens, device=self.device), batch, plan, keep=last)
        self.model.compute_logits(hidden, plan)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del pool, batch, hidden
        torch.cuda.empty_cache()
        return peak

    # ---- requests -----------------------------------------------------------------------------------
    def sampling_params(self, **kwargs) -> SamplingParams:
        """SamplingParams with the model's generation defaults for every field left as None."""
        return self.admission.sampling_params(**kwargs)

    def render_prompt(self, prompt_token_ids=None, prompt: str | None = None, messages=None, *,
                      enable_thinking: bool = True, tools=None) -> tuple[list[int], str | None]:
        """Exactly one of token ids, a raw prompt, or chat messages -> (token ids, prompt text)."""
        rendered = render_prompt(self.tokenizer, messages=messages, prompt=prompt, prompt_token_ids=prompt_token_ids,
                                 enable_thinking=enable_thinking, tools=tools)
        return rendered.token_ids, rendered.text

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The checks `add_request` makes, without queueing anything (a server runs them in its handlers)."""
        return self.admission.check_request(prompt_token_ids, params)

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
        the next decode step is already running on the device). Returns the step's sequences.

        A failure never escapes: one confined to a sequence (its detokenizing, its stop checks) ends that sequence
        with finish_reason "error" and `seq.error`; a failure of the whole step (the forward, the sampler) ends
        every sequence of the step that way. Their KV blocks are freed and the engine goes on with the others."""
        seqs: list[Sequence] = []
        try:
            pending, self._ahead = self._ahead, None
            if pending is None:
                t_start = time.perf_counter_ns() if self.observers else 0
                batch = self.scheduler.schedule()
                if batch is None:
                    return []
                seqs = batch.seqs
                pending = self._launch(batch, t_start)
            seqs = pending.batch.seqs
            # The step after `pending`, launched before its tokens are read back where it needs none of them: the
            # waiting prompts' prefill (prefill first), else the next decode step
            if self.lookahead and pending.tokens is not None:
                in_p = {id(s): row for row, s in enumerate(pending.batch.sampled)}  # sequence -> its token's row
                if self._prompts_next(in_p):
                    batch = self.scheduler.schedule_prompts()
                    if batch is not None:
                        self._ahead = self._launch(batch, time.perf_counter_ns() if self.observers else 0)
                if self._ahead is None:
                    rows = self._ahead_rows(in_p)
                    if rows is not None:
                        self._ahead = self._launch_ahead(pending, rows)
            self._complete(pending)
            return seqs
        except Exception as e:  # noqa: BLE001 - the step's requests end with the error, the engine goes on
            log.exception("a step failed")
            return self._fail(seqs or list(self.scheduler.running), e)

    def _fail(self, seqs: list[Sequence], error: Exception) -> list[Sequence]:
        self._ahead = None  # a step launched ahead of a failed one cannot be trusted
        if isinstance(error, torch.cuda.OutOfMemoryError):
            why = "out of device memory while running this request; retry, or lower max_tokens or concurrency"
        else:
            why = f"the step running this request failed: {type(error).__name__}: {error}"
        for seq in seqs:
            if not seq.finished:
                seq.error = why
                self._finish(seq, "error")
        return seqs

    def _launch(self, batch: ScheduledBatch, t_start: int) -> "_Pending":
        step = None
        if self.observers:
            step = Step(next(self._steps), batch.is_prefill, batch.seqs, list(batch.query_lens),
                        [s.num_cached + n for s, n in zip(batch.seqs, batch.query_lens)], t_start,
                        t_launch_ns=time.perf_counter_ns())
        return self._run(_Pending(batch, step), None)

    def _launch_ahead(self, previous: "_Pending", rows: list[tuple[Sequence, int | None]]) -> "_Pending":
        """The decode step after `previous` (rows from _ahead_rows), the newest tokens of those in it taken straight
        from the device."""
        seqs = [s for s, _ in rows]
        ahead = self.runner.ahead_inputs(seqs, [row for _, row in rows], previous.tokens)
        step = None
        if self.observers:
            now = time.perf_counter_ns()
            step = Step(next(self._steps), False, seqs, [1] * len(seqs),
                        [s.num_tokens + off for s, off in zip(seqs, ahead.offsets)], now, t_launch_ns=now)
        batch = ScheduledBatch(seqs, [1] * len(seqs), False, seqs, len(seqs))
        self.scheduler.note_decode_step()
        return self._run(_Pending(batch, step), ahead)

    def _run(self, pending: "_Pending", ahead: AheadInputs | None) -> "_Pending":
        step, sampled = pending.step, pending.batch.sampled
        for o in self.observers:
            o.on_launch(step)
        top = max((s.params.logprobs for s in sampled if s.params.logprobs is not None), default=None)
        banned = self._banned(sampled)
        # every token the argmax of its logits, nothing more asked: a graph may pick them itself (plan.greedy_in_graph)
        greedy = None
        if sampled and top is None and banned is None and all(s.params.plain_greedy for s in sampled):
            greedy = self.runner.run_greedy(pending.batch, ahead)
        host = None
        if greedy is not None:
            logits, pending.tokens, host = greedy
        else:
            logits = self.runner.run(pending.batch, ahead)
            if sampled:
                pending.tokens = self.sampler(logits, [s.params for s in sampled], [s.generator for s in sampled],
                                              [s.output_counts for s in sampled], banned)
        if top is not None:  # only when a request asked: log-softmax and top-k over the vocabulary
            parts = logprobs_of(logits, pending.tokens, top)
            pending.logprobs = tuple(t.to("cpu", non_blocking=True) if t is not None and t.is_cuda else t
                                     for t in parts)
        if sampled and self.device.type == "cuda":  # queue the copy now, ahead of any step launched after this one
            if host is None:
                self._host_flip ^= 1
                host = self._host_tokens[self._host_flip, :len(sampled)]
                host.copy_(pending.tokens, non_blocking=True)
            pending.host_tokens = host  # (written by the graph itself where it picked the tokens)
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

    def _ahead_rows(self, in_p: dict[int, int]) -> list[tuple[Sequence, int | None]] | None:
        """The decode step that follows the step in flight p (`in_p`: id of each sequence p samples -> its row of
        p's tokens), when it can be launched before p's tokens are read back: every running sequence that decodes
        next, each with the row of p's sampled tokens that holds its newest token (None: the host has it, it was
        not in p), their cache blocks held now. Those whose token from p is their last (a length limit) are left
        out: they finish when p completes. None when the next step must be scheduled: a prompt being chunked, a
        sequence whose next draw needs p's token on the host (penalties' counts, min_tokens' bans), blocks short,
        or requests waiting under mixed steps (which admit them into the decode step). (Under prefill first,
        waiting prompts that fit are launched ahead before this is asked, when their prefill is due; those that do
        not wait for the step after.)"""
        if self.scheduler.waiting and self.scheduler.mixed_steps:
            return None
        rows = []
        for s in self.scheduler.running:
            row = in_p.get(id(s))
            if row is None:  # the host has its newest token; it decodes next unless it is a prompt being chunked
                if not s.decoding:
                    return None
                rows.append((s, None))
                continue
            # the host is one step behind p: p's token will make it num_tokens + 1
            if len(s.output_token_ids) + 1 >= s.params.max_tokens or s.num_tokens + 1 >= self.max_model_len:
                continue
            if s.output_counts is not None or len(s.output_token_ids) < s.params.min_tokens:
                return None
            rows.append((s, row))
        if not rows or not all(s.block_table.ensure(s.num_tokens + (row is not None)) for s, row in rows):
            return None
        return rows

    def _prompts_next(self, in_p: dict[int, int]) -> bool:
        """Whether the step after the one in flight (`in_p` as for _ahead_rows) is, by the prefill-first policy, a
        prefill of waiting prompts alone, which needs nothing of its tokens: requests wait, their prefill is due
        (Scheduler.prefill_due) and every running sequence decodes next (none is a prompt being chunked)."""
        if self.scheduler.mixed_steps or not self.scheduler.waiting or not self.scheduler.prefill_due():
            return False
        return all(id(s) in in_p or s.decoding for s in self.scheduler.running)

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
            try:
                if seq.logprobs is not None:
                    seq.logprobs.append(logprobs[i])
                self._append_token(seq, token)
            except Exception as e:  # noqa: BLE001 - this sequence's failure ends it alone
                log.exception("request %s failed", seq.request_id)
                self._fail([seq], e)
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
