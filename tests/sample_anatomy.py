"""Hand-made Anatomy records for tests of the report writers (no model, no GPU needed).

`sample_anatomy()` is a plausible Qwen3-8B call on an H200 (128-token prompt, 32 decode steps of ~4 ms, NVML
telemetry at 50 Hz, a kernel breakdown); `sample_cpu_anatomy()` is a synthetic-weights call on a CPU with no
telemetry and no kernels. Both take keyword overrides of any top-level `Anatomy` field, e.g.
`sample_anatomy(prompt_text='<script>alert(1)</script>')`.
"""

from __future__ import annotations

import dataclasses
import math

from llm_anatomy.anatomy import (
    Anatomy,
    percentile,
    BatchingRecord,
    Bound,
    Ceilings,
    DecodeStep,
    DecodeSummary,
    DeviceRecord,
    EnergyRecord,
    GpuSample,
    KernelBreakdown,
    KernelCategory,
    KVCacheRecord,
    MemoryCensus,
    ModelRecord,
    Phase,
    PrefillRecord,
    Roofline,
    Stall,
    StartupRecord,
    Telemetry,
    WeightsRecord,
)

GiB = 1024**3
MiB = 1024**2

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}

PROMPT = ("<|im_start|>user\nExplain, in two sentences, why decoding one token at a time is limited by memory "
          "bandwidth rather than compute.<|im_end|>\n<|im_start|>assistant\n")
OUTPUT_PIECES = [
    "Each", " decode", " step", " multiplies", " a", " single", " token", "'s", " activations", " by", " every",
    " weight", " matrix", ",", " so", " the", " GPU", " must", " stream", " all", " ~", "16", " GB", " of",
    " weights", " from", " HBM", " for", " only", " ~", "16", " GFLOP", ".",
]


def _roofline(flops: float, nbytes: float, ms: float, c: Ceilings, kind: str, why: str) -> Roofline:
    tflops = flops / (ms * 1e-3) / 1e12
    gbps = nbytes / (ms * 1e-3) / 1e9
    return Roofline(
        flops=flops, bytes=nbytes, arithmetic_intensity=flops / nbytes, achieved_tflops=tflops, achieved_gbps=gbps,
        mfu=tflops / c.matmul_tflops if c.matmul_tflops else None,
        mbu=gbps / c.read_gbps if c.read_gbps else None,
        mfu_datasheet=tflops / c.datasheet_tflops if c.datasheet_tflops else None,
        mbu_datasheet=gbps / c.datasheet_gbps if c.datasheet_gbps else None,
        bound=Bound(kind=kind, why=why),
    )


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _build(*, cpu: bool, prompt_tokens: int, steps: int) -> Anatomy:
    cfg = QWEN3_06B if cpu else QWEN3_8B
    params = 751_632_384 if cpu else 8_190_735_360
    weight_bytes = params * 2
    layers, kv_heads, head_dim = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
    kv_per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, bf16
    flops_per_token = 2.0 * params

    if cpu:
        ceilings = Ceilings(device="cpu (AMD EPYC 9654, 16 threads)", read_gbps=38.0, gemv_gbps=31.0,
                            matmul_tflops=1.1, datasheet_gbps=None, datasheet_tflops=None,
                            datasheet_source="", measured_at="2025-06-01")
        device = DeviceRecord(name="cpu (AMD EPYC 9654, 16 threads)", type="cpu", total_memory=64 * GiB,
                              why="no CUDA device found", torch="2.6.0+cpu")
    else:
        ceilings = Ceilings(device="NVIDIA H200", read_gbps=4310.0, gemv_gbps=4020.0, matmul_tflops=724.0,
                            datasheet_gbps=4800.0, datasheet_tflops=989.0,
                            datasheet_source="NVIDIA H200 datasheet (SXM, dense BF16)", measured_at="2025-06-01")
        device = DeviceRecord(name="NVIDIA H200", type="cuda", total_memory=150_754_820_096,
                              why="default: first CUDA device", torch="2.6.0+cu124", cuda="12.4",
                              driver="550.127.05")

    # -- host phases before the GPU work
    t_parse, t_template, t_tokenize, t_queue = (0.0, 0.21), (0.21, 0.58), (0.58, 1.02), (1.02, 1.18)
    scale = 1.0 if not cpu else 1.6
    t_parse, t_template, t_tokenize, t_queue = [(a * scale, b * scale) for a, b in
                                                (t_parse, t_template, t_tokenize, t_queue)]

    # -- prefill
    prefill_flops = flops_per_token * prompt_tokens + 4.0 * layers * cfg["num_attention_heads"] * head_dim * \
        prompt_tokens * prompt_tokens / 2
    prefill_bytes = weight_bytes + kv_per_token * prompt_tokens + 2.0 * prompt_tokens * cfg["hidden_size"] * 24
    prefill_ms = 6.42 if not cpu else 612.0
    prefill_start = t_queue[1]
    prefill_host_ms = prefill_ms + (0.61 if not cpu else 4.0)
    prefill_rl = _roofline(prefill_flops, prefill_bytes, prefill_ms, ceilings, "memory",
                           "arithmetic intensity below the ridge: the weights are read once for only "
                           f"{prompt_tokens} tokens")
    ttft = prefill_start + prefill_host_ms + 0.09
    prefill = PrefillRecord(
        tokens=prompt_tokens, ms=prefill_ms, host_ms=prefill_host_ms, start_ms=prefill_start, flops=prefill_flops,
        bytes=prefill_bytes, mfu=prefill_rl.mfu, mbu=prefill_rl.mbu, roofline=prefill_rl,
        cost_breakdown={
            "matmul": {"flops": flops_per_token * prompt_tokens, "bytes": weight_bytes},
            "attention": {"flops": prefill_flops - flops_per_token * prompt_tokens,
                          "bytes": kv_per_token * prompt_tokens},
        },
    )

    # -- decode steps
    decode_steps: list[DecodeStep] = []
    itl: list[float] = []
    t = ttft
    for i in range(1, steps + 1):
        ctx = prompt_tokens + i + 1  # prompt + first token + this step's token
        kv_read = kv_per_token * (ctx - 1)
        nbytes = weight_bytes + kv_read + kv_per_token
        flops = flops_per_token + 4.0 * layers * cfg["num_attention_heads"] * head_dim * ctx
        if cpu:
            gpu_ms = 46.0 + 0.02 * i + (3.0 if i % 7 == 0 else 0.0)
            host_ms = gpu_ms
            gap = 0.4
        else:
            gpu_ms = nbytes / (ceilings.gemv_gbps * 1e9 * 0.93) * 1e3 + (0.05 if i % 5 == 0 else 0.0)
            host_ms = gpu_ms + 0.28 + (0.9 if i == 17 else 0.0)
            gap = 0.05
        start, end = t + gap, t + gap + host_ms
        piece = OUTPUT_PIECES[i % len(OUTPUT_PIECES)]
        tflops = flops / (gpu_ms * 1e-3) / 1e12
        gbps = nbytes / (gpu_ms * 1e-3) / 1e9
        decode_steps.append(DecodeStep(
            index=i, start_ms=start, end_ms=end, gpu_ms=gpu_ms, host_ms=host_ms, context_len=ctx, batch_size=1,
            token_id=1000 + 37 * i, token_text=piece, flops=flops, bytes=nbytes, kv_bytes_read=kv_read,
            mbu=gbps / ceilings.read_gbps, mfu=tflops / ceilings.matmul_tflops, bound="memory",
        ))
        itl.append(end - t)
        t = end
    last_token = t
    detok = (last_token, last_token + 0.12)
    e2e = detok[1]
    n_out = steps + 1
    text = "".join(OUTPUT_PIECES[k % len(OUTPUT_PIECES)] for k in range(n_out))  # step i made piece i

    gpu_list = [s.gpu_ms for s in decode_steps]
    host_list = [s.host_ms for s in decode_steps]
    med_bytes = _median([s.bytes for s in decode_steps]) if decode_steps else 0.0
    med_kv = _median([s.kv_bytes_read for s in decode_steps]) if decode_steps else 0.0
    decode = None
    if decode_steps:
        total_flops = sum(s.flops for s in decode_steps)
        total_bytes = sum(s.bytes for s in decode_steps)
        decode = DecodeSummary(
            steps=steps, gpu_ms_median=_median(gpu_list), host_ms_median=_median(host_list),
            itl_ms_median=_median(itl), itl_ms_p90=percentile(itl, 90),
            tokens_per_s=steps / ((last_token - ttft) * 1e-3), bytes_per_step_median=med_bytes,
            kv_share_of_bytes=med_kv / med_bytes,
            roofline=_roofline(total_flops, total_bytes, sum(gpu_list), ceilings, "memory",
                               "one token per step: every weight is read for ~2 FLOP per parameter"),
        )

    phases = [
        Phase("parse", *t_parse), Phase("template", *t_template), Phase("tokenize", *t_tokenize),
        Phase("queue", *t_queue, note="no other requests"),
        Phase("prefill", prefill_start, ttft, note=f"{prompt_tokens} tokens"),
        Phase("decode", ttft, last_token, note=f"{steps} steps"),
        Phase("detokenize", *detok, note="final flush (tokens are detokenized per step)"),
        Phase("e2e", 0.0, e2e),
    ]

    # -- KV cache
    block_size = 16
    block_bytes = block_size * kv_per_token
    tokens_end = prompt_tokens + steps  # the last sampled token is not cached
    blocks = math.ceil(tokens_end / block_size)
    pool_bytes = (4 * GiB) if cpu else (110 * GiB)
    pool_blocks = pool_bytes // block_bytes
    kv = KVCacheRecord(
        bytes_per_token=kv_per_token,
        formula=f"2 (K,V) x {layers} layers x {kv_heads} KV heads x {head_dim} head_dim x 2 bytes (bf16)",
        dtype="bfloat16", block_size=block_size, pool_blocks=pool_blocks, pool_bytes=pool_blocks * block_bytes,
        pool_share_of_device=(pool_blocks * block_bytes) / device.total_memory,
        blocks_allocated=blocks, tokens=tokens_end, bytes_used=tokens_end * kv_per_token,
        bytes_allocated=blocks * block_bytes,
        bytes_after_step=[(prompt_tokens + i) * kv_per_token for i in range(steps + 1)],
        fits_sequences_this_length=(pool_blocks * block_bytes) // (blocks * block_bytes),
        fits_sequences_full_context=(pool_blocks * block_bytes) // (cfg["max_position_embeddings"] * kv_per_token),
        full_context=cfg["max_position_embeddings"],
    )

    # -- memory census: every byte in exactly one row
    pool_real = pool_blocks * block_bytes
    if cpu:
        cuda_graphs, other, alloc_free, ctx_other = 0, 180 * MiB, 0, 2 * GiB + 311 * MiB
        source = ("host RAM: /proc/self/statm (this process) and sysconf (free = available pages); "
                  "other processes and the OS page cache are in context_and_other")  # as probe/memory.py says
    else:
        cuda_graphs, other, alloc_free, ctx_other = 412 * MiB, 1337 * MiB, 2 * GiB + 75 * MiB, 1 * GiB + 505 * MiB
        source = "torch.cuda.memory_stats + NVML device memory, after the call"
    used = weight_bytes + pool_real + cuda_graphs + other + alloc_free + ctx_other
    memory = MemoryCensus(
        total=device.total_memory, weights=weight_bytes, kv_pool=pool_real, cuda_graphs=cuda_graphs,
        other_allocated=other, allocator_free=alloc_free, context_and_other=ctx_other,
        free=device.total_memory - used, activation_peak=(38 * MiB if not cpu else None), source=source,
        kind="host" if cpu else "device",
    )

    # -- telemetry
    if cpu:
        telemetry = Telemetry(available=False,
                              note="no NVML: this call ran on the CPU, so there is no power, clock or energy data")
        samples: list[GpuSample] = []
    else:
        samples = []
        energy = 0.0
        n = int(e2e / 20.0) + 2
        for k in range(n):
            tm = k * 20.0
            in_prefill = prefill_start <= tm < ttft
            in_decode = ttft <= tm <= last_token
            power = 515.0 if in_prefill else (402.0 + 6.0 * math.sin(k)) if in_decode else 131.0
            if k:
                energy += power * 0.020
            samples.append(GpuSample(
                t_ms=tm, power_w=power, energy_j=round(energy, 3),
                sm_clock_mhz=1980 if (in_prefill or in_decode) else 1755 if k == 0 else 1980,
                mem_clock_mhz=3201, gpu_util=0 if k == 0 else 97, mem_util=0 if k == 0 else 88,
                mem_used=used, temperature_c=41 + k // 3,
                throttle=["power_cap"] if in_prefill else [],
            ))
        prefill_j = 515.0 * (ttft - prefill_start) * 1e-3
        decode_j = 404.0 * (last_token - ttft) * 1e-3
        telemetry = Telemetry(
            available=True, note="NVML, polled at 50 Hz on a background thread", sample_hz=50.0,
            counter_update_ms=20.0,
            energy=[
                EnergyRecord("prefill", prefill_j, 0.0, prefill_j + 9.4, prefill_j / prompt_tokens,
                             "NVML total-energy counter, interpolated to the phase edges", prefill_start, ttft, True),
                EnergyRecord("decode", decode_j, decode_j - 1.2, decode_j + 1.3, decode_j / max(1, steps),
                             "NVML total-energy counter, interpolated to the phase edges", ttft, last_token),
                EnergyRecord("call", prefill_j + decode_j + 0.3, prefill_j + decode_j - 1.6,
                             prefill_j + decode_j + 2.1, (prefill_j + decode_j + 0.3) / n_out,
                             "NVML total-energy counter, over the whole call", 0.0, e2e),
            ],
        )

    # -- kernels
    kernels: list[KernelBreakdown] = []
    if not cpu:
        kernels = [
            KernelBreakdown("prefill", 1, prefill_ms, [
                KernelCategory("gemm", 5.31, 253), KernelCategory("attention", 0.47, 36),
                KernelCategory("norm", 0.21, 145), KernelCategory("rope", 0.09, 36),
                KernelCategory("elementwise", 0.28, 180), KernelCategory("sampling", 0.06, 4),
            ], [
                {"name": "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "ms": 2.71, "count": 36},
                {"name": "flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "ms": 0.47, "count": 36},
            ]),
            KernelBreakdown("decode", steps, sum(gpu_list), [
                KernelCategory("gemv", 0.912 * sum(gpu_list), 253 * steps),
                KernelCategory("attention", 0.041 * sum(gpu_list), 36 * steps),
                KernelCategory("norm", 0.019 * sum(gpu_list), 145 * steps),
                KernelCategory("elementwise", 0.022 * sum(gpu_list), 216 * steps),
                KernelCategory("sampling", 0.006 * sum(gpu_list), 4 * steps),
            ], [
                {"name": "gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4>", "ms": 0.61 * sum(gpu_list),
                 "count": 144 * steps},
            ]),
        ]

    weights = (WeightsRecord(kind="synthetic", source="random init (torch.manual_seed)",
                             label="synthetic weights (random, seed 0): the text is meaningless", seed=0)
               if cpu else
               WeightsRecord(kind="checkpoint", source="Qwen/Qwen3-8B@b968826", label="Qwen/Qwen3-8B (bf16 safetensors)"))
    notes = ["the GPU time of each step comes from CUDA events around the forward; host time includes sampling "
             "and detokenization"]
    if cpu:
        notes.append("on the CPU, gpu_ms is the host time of the forward")

    return Anatomy(
        model=ModelRecord(name="Qwen3-0.6B" if cpu else "Qwen3-8B", config=dict(cfg), dtype="bfloat16",
                          parameters=params, weight_bytes=weight_bytes),
        weights=weights,
        device=device,
        request={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": steps + 1, "temperature": 0.0},
        prompt_text=PROMPT,
        prompt_token_ids=[151644 if k == 0 else 100 + k for k in range(prompt_tokens)],
        output_token_ids=[1000 + 37 * k for k in range(n_out)],
        text=text,
        finish_reason="length",
        phases=phases,
        ttft_ms=ttft,
        tpot_ms=(e2e - ttft) / (n_out - 1) if n_out > 1 else None,
        itl_ms=itl,
        e2e_ms=e2e,
        prefill=prefill,
        decode_steps=decode_steps,
        decode=decode,
        kv_cache=kv,
        memory=memory,
        ceilings=ceilings,
        telemetry=telemetry,
        gpu_samples=samples,
        host_ms=({"schedule": 1.1, "prepare_and_launch": 2.8, "detokenize": 0.31, "all_step_work": 4.2} if not cpu else
                 {"schedule": 0.9, "prepare_and_launch": 5.2, "detokenize": 0.52, "all_step_work": 6.6}),
        kernels=kernels,
        batching=None if cpu else BatchingRecord(
            queue_ms=0.7, max_batch_size=3, mean_batch_size=2.4, preemptions=0,
            co_scheduled={"req-b": steps, "req-<c>": steps // 2},
            stalls=[Stall(start_ms=ttft + 20.0, gpu_ms=13.5, requests=["req-<c>"], tokens=512)], stall_ms=13.5),
        startup=StartupRecord(total_s=17.4, compile_and_capture_s=14.2, cuda_graphs=20,
                              programmatic_dependent_launch=True, streaming_gemv=True, tile_tuning_s=6.3) if not cpu else None,
        notes=notes,
        id="call-0001" if not cpu else "call-cpu-0001",
        started_at_unix=1748779200.0,  # 2025-06-01 12:00:00 UTC
        tool_version="0.1.0",
    )


def sample_anatomy(*, prompt_tokens: int = 128, steps: int = 32, **overrides) -> Anatomy:
    """A Qwen3-8B call on an H200 with telemetry and kernels; `overrides` replace top-level Anatomy fields."""
    return dataclasses.replace(_build(cpu=False, prompt_tokens=prompt_tokens, steps=steps), **overrides)


def sample_cpu_anatomy(*, prompt_tokens: int = 24, steps: int = 8, **overrides) -> Anatomy:
    """A synthetic-weights Qwen3-0.6B call on the CPU: no NVML telemetry, no GPU samples, no kernels."""
    return dataclasses.replace(_build(cpu=True, prompt_tokens=prompt_tokens, steps=steps), **overrides)
