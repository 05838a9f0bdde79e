"""Probe (not kept unless it wins): the qkv GEMV's ring capped at 128 KB, so that the one-kernel attention after it
(36 KB of shared memory) is resident beside it and reads its first tile during the GEMV; engines in one process."""
import json, os, sys, time, torch
sys.path.insert(0, os.getcwd())
import llm_anatomy.kernels.stream_gemv as SG
from llm_anatomy import Engine
orig = SG.plan
def capped(n, k, gated, blocks, weight_bytes=2):
    stages, shared = orig(n, k, gated, blocks, weight_bytes)
    if (n, k) in CAPPED and not gated:
        rows = SG.rows_per_stage(n, k, gated, weight_bytes)
        stage = rows * k * weight_bytes
        keep = max(2, CAP_BYTES // stage)
        if keep < stages:
            shared -= (stages - keep) * (stage + 16)
            stages = keep
    return stages, shared
CAPPED, CAP_BYTES = set(), 128 * 1024
VARIANTS = {"plain": set(), "qkv": {(6144, 4096)}, "oproj": {(4096, 4096)}, "both": {(6144, 4096), (4096, 4096)}}

def ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151643, (n,), generator=g).tolist()
def tpot(eng, n_prompt=384, new=128, seed=1):
    seq = eng.add_request(ids(n_prompt, seed), eng.sampling_params(temperature=0, max_tokens=new, ignore_eos=True))
    while not seq.output_token_ids:
        eng.step()
    torch.cuda.synchronize()
    k = len(seq.output_token_ids); t = time.perf_counter()
    while not seq.finished:
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / (len(seq.output_token_ids) - k), seq.output_token_ids
res = {}
for prec in sys.argv[1].split(","):
    kw = dict(quantization="fp8", kv_cache_dtype="fp8", quantize_lm_head=True) if prec == "fp8" else {}
    engines = {}
    for name, shapes in VARIANTS.items():
        CAPPED.clear(); CAPPED.update(shapes)
        SG.plan = capped
        engines[name] = Engine.from_pretrained("Qwen/Qwen3-8B", device="cuda", dtype="bfloat16", weights="synthetic",
                                               kv_cache_tokens=20000, max_num_seqs=1, **kw)
    SG.plan = orig
    for e in engines.values():
        tpot(e, 128, 16)
    r = {n: [] for n in engines}; toks = {}
    for rnd in range(int(sys.argv[2])):
        for n, e in engines.items():
            ms, t = tpot(e); r[n].append(round(ms, 4)); toks[n] = t
    r["same_tokens"] = len({json.dumps(t) for t in toks.values()}) == 1
    res[prec] = r
    print(prec, json.dumps(r), flush=True)
    del engines; torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "qkv_ring_ab.json"), "w"), indent=1)
