"""Probe (not kept): does o_proj's streaming GEMV become resident during the batch-1 attention chain?
Variants built in one process (graphs fixed at capture), TPOT alternating."""
import ctypes, json, math, os, sys, time, torch
sys.path.insert(0, os.getcwd())
import llm_anatomy.kernels.stream_gemv as SG
import llm_anatomy.kernels.decode_attention as DA
from llm_anatomy import Engine
from llm_anatomy.kernels.cuda import compile_kernel

orig_plan, orig_stages = SG.plan, DA.NUM_STAGES
def capped_plan(n, k, gated, blocks, weight_bytes=2):
    stages, shared = orig_plan(n, k, gated, blocks, weight_bytes)
    rows = SG.rows_per_stage(n, k, gated, weight_bytes)
    need = max(2, -(-(n // rows) // blocks))
    if need < stages:
        stage = (2 if gated else 1) * rows * k * weight_bytes
        shared -= (stages - need) * (stage + 16)
        stages = need
    return stages, shared

VARIANTS = {"base": {}, "cap": {"cap": 1}, "st1": {"st": 1}, "cap_st1": {"cap": 1, "st": 1}}
sel = sys.argv[1].split(",")
fp8 = dict(quantization="fp8", kv_cache_dtype="fp8", quantize_lm_head=True)
engines = {}
for name in sel:
    v = VARIANTS[name]
    SG.plan = capped_plan if v.get("cap") else orig_plan
    DA.NUM_STAGES = v.get("st", orig_stages)
    t = time.time()
    engines[name] = Engine.from_pretrained("Qwen/Qwen3-8B", device="cuda", dtype="bfloat16", weights="synthetic",
                                           kv_cache_tokens=20000, max_num_seqs=1, **fp8)
    print(name, "built", round(time.time() - t), "s", flush=True)
SG.plan, DA.NUM_STAGES = orig_plan, orig_stages

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

libcuda = torch.cuda._utils._get_gpu_runtime_library()
def attr(func, a):
    v = ctypes.c_int(); libcuda.cuFuncGetAttribute(ctypes.byref(v), a, func); return v.value
res = {"resources": {}}
for (n, k, gated) in [(6144, 4096, False), (4096, 4096, False), (12288, 4096, True), (4096, 12288, False), (151936, 4096, False)]:
    kern = compile_kernel(SG.source(n, k, gated, False, 1), "stream_gemv", 0, SG.SHARED_LIMIT)
    res["resources"][f"gemv {n}x{k}{' gated' if gated else ''}"] = {
        "regs": attr(kern.func, 4), "local": attr(kern.func, 3), "plan": orig_plan(n, k, gated, 132, 1),
        "capped": capped_plan(n, k, gated, 132, 1)}
for kname in ("_decode_attention_split_kernel", "_decode_attention_merge_kernel"):
    jit = getattr(DA, kname)
    try:
        for dev, entry in jit.device_caches.items():
            for key, ck in entry[0].items():
                res["resources"].setdefault(kname, []).append({"regs": ck.n_regs, "spills": ck.n_spills,
                    "shared": ck.metadata.shared, "warps": ck.metadata.num_warps, "stages": ck.metadata.num_stages})
    except Exception as e:
        res["resources"][kname] = repr(e)
import llm_anatomy.kernels.rope as R
for kname in dir(R):
    jit = getattr(R, kname)
    if hasattr(jit, "device_caches"):
        try:
            for dev, entry in jit.device_caches.items():
                for key, ck in entry[0].items():
                    res["resources"].setdefault(kname, []).append({"regs": ck.n_regs, "shared": ck.metadata.shared,
                                                                   "warps": ck.metadata.num_warps})
        except Exception as e:
            res["resources"][kname] = repr(e)
print(json.dumps(res["resources"], indent=0)[:3000], flush=True)
for eng in engines.values():
    tpot(eng, 128, 16)
res["tpot"] = {n: [] for n in engines}
res["tokens"] = {}
for rnd in range(3):
    for n, eng in engines.items():
        ms, toks = tpot(eng)
        res["tpot"][n].append(round(ms, 4)); res["tokens"][n] = toks[:32]
    print(rnd, {n: v[-1] for n, v in res["tpot"].items()}, flush=True)
print("same tokens", len({json.dumps(t) for t in res["tokens"].values()}) == 1)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "coreside.json"), "w"), indent=1)
for n, v in res["tpot"].items():
    print(f"{n:10s} {min(v):.4f} {sorted(v)[len(v)//2]:.4f}")
