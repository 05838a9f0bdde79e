"""Issue 2 on the GPU: Qwen3-8B with synthetic bf16 weights, against HF transformers given the same weights.

Checks: load time; memory after load against weights + the KV pool asked for; logits of a 512-token prefill and
of 64 greedy decode steps against HF's bf16 model (and both against an fp32 copy, for scale).

    python benchmarks/check_core.py --model Qwen/Qwen3-8B --out $OUT/check_core.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from llm_anatomy import Engine
from llm_anatomy.models.attention import AttentionBatch
from llm_anatomy.models.loader import hf_state_dict


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def hf_model(engine: Engine, dtype: torch.dtype):
    """HF's Qwen3ForCausalLM holding a copy of the engine's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in engine.config.to_hf().items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    with torch.device(engine.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = hf_state_dict(engine.model)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


@torch.inference_mode()
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen/Qwen3-8B")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--kv-tokens", type=int, default=65536)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    results: dict = {"date": time.strftime("%Y-%m-%d"),
                     "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
                     "torch": torch.__version__, "python": platform.python_version()}
    import transformers
    results["transformers"] = transformers.__version__

    if cuda:
        torch.cuda.synchronize()
        free_before, total = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model, device=dev, dtype="bfloat16", weights="synthetic",
                                    kv_cache_tokens=args.kv_tokens)
    results["load_s"] = time.perf_counter() - t0
    results["init_weights_s"] = engine.weights.load_seconds
    weights, pool = engine.weights.bytes, engine.pool.total_bytes
    results.update(weight_bytes=weights, kv_pool_bytes=pool, kv_tokens=engine.pool.capacity_tokens,
                   params=engine.weights.num_parameters)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free_after, _ = torch.cuda.mem_get_info()
        results.update(allocated_after_load=torch.cuda.memory_allocated(), peak_after_load=peak,
                       reserved_after_load=torch.cuda.memory_reserved(),
                       device_used_by_load=free_before - free_after,
                       peak_over_weights_plus_pool=peak / (weights + pool) - 1)

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, min(151643, engine.config.vocab_size), (args.prefill,), generator=gen).tolist()
    seq = engine.add_request(prompt, engine.sampling_params(temperature=0, max_tokens=args.decode + 1,
                                                            ignore_eos=True))
    step_logits = []
    run = engine.runner.run

    def recording(batch, ahead=None):
        logits = run(batch, ahead)
        step_logits.append(logits[0].clone())
        return logits

    engine.runner.run = recording
    # Prefill: all positions' logits, through the same paged path the engine uses.
    engine.step()
    pool_ = engine.pool
    slots = seq.block_table.slots(0, args.prefill).to(dev)
    batch = AttentionBatch(pool_.k, pool_.v, slots, True,
                           torch.tensor([seq.block_table.blocks], dtype=torch.int32, device=dev),
                           torch.tensor([args.prefill], dtype=torch.int32, device=dev), (args.prefill,), (0,))
    ours_prefill = engine.model.compute_logits(engine.model(torch.tensor(prompt, device=dev),
                                                            torch.arange(args.prefill, device=dev), batch))
    while not seq.finished:
        engine.step()
    tokens = prompt + seq.output_token_ids
    ours_decode = torch.stack(step_logits[1:args.decode + 1])  # logits that chose output tokens 1..decode

    ref = {}
    for name, dtype in (("hf_bf16", torch.bfloat16), ("hf_fp32", torch.float32)):
        model = hf_model(engine, dtype)
        logits = model(torch.tensor([tokens], device=dev)).logits[0].float()
        ref[name] = (logits[: args.prefill], logits[args.prefill: args.prefill + args.decode])
        # HF's own greedy continuation in bf16, for agreement counting
        del model
        if cuda:
            torch.cuda.empty_cache()
    results["prefill_rel_err_vs_hf_bf16"] = rel(ours_prefill, ref["hf_bf16"][0])
    results["decode_rel_err_vs_hf_bf16"] = rel(ours_decode, ref["hf_bf16"][1])
    results["decode_rel_err_max_step_vs_hf_bf16"] = max(rel(a, b) for a, b in zip(ours_decode, ref["hf_bf16"][1]))
    results["prefill_rel_err_vs_fp32"] = rel(ours_prefill, ref["hf_fp32"][0])
    results["hf_bf16_prefill_rel_err_vs_fp32"] = rel(ref["hf_bf16"][0], ref["hf_fp32"][0])
    results["decode_rel_err_vs_fp32"] = rel(ours_decode, ref["hf_fp32"][1])
    results["hf_bf16_decode_rel_err_vs_fp32"] = rel(ref["hf_bf16"][1], ref["hf_fp32"][1])
    results["greedy_agreement_with_hf_bf16"] = float(
        (ours_decode.argmax(-1) == ref["hf_bf16"][1].argmax(-1)).float().mean())

    # Baseline timings of this (eager, un-graphed) engine: prefill and decode steps, host-timed with syncs.
    def timed_step():
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    for n in [n for n in (128, 2048, 8192) if n + 33 <= engine.max_model_len]:
        ids = torch.randint(0, min(151643, engine.config.vocab_size), (n,), generator=gen).tolist()
        s = engine.add_request(ids, engine.sampling_params(temperature=0, max_tokens=33, ignore_eos=True))
        results[f"eager_prefill_{n}_ms"] = timed_step()
        steps = [timed_step() for _ in range(32)]
        results[f"eager_decode_ctx{n}_median_ms"] = sorted(steps)[16]
        assert s.finished

    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print(f"\n== issue 2 core check: {args.model}, synthetic bf16, {results['device']} ==")
    for k, v in results.items():
        print(f"{k:40s} {v:.6g}" if isinstance(v, float) else f"{k:40s} {v}")


if __name__ == "__main__":
    main()
