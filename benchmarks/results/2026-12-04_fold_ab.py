"""A/B: batch-1 TPOT with the embedding's gather and the first layer's norm in qkv_proj's streaming GEMV
(Qwen3ForCausalLM.embedded) or as their own kernels; engines built in one process, variants alternating."""
import json, os, sys, time, torch
sys.path.insert(0, os.getcwd())
import llm_anatomy.models.qwen3 as Q
from llm_anatomy import Engine

FLAG = {}
_embedded = Q.Qwen3ForCausalLM.embedded
Q.Qwen3ForCausalLM.embedded = lambda self, ids, plan: (_embedded(self, ids, plan) if FLAG["fold"]
                                                       else (self.model.embed_tokens(ids), None))

def build(variant, prec):
    FLAG["fold"] = variant == "fold"
    kw = dict(quantization="fp8", kv_cache_dtype="fp8", quantize_lm_head=True) if prec == "fp8" else {}
    return Engine.from_pretrained("Qwen/Qwen3-8B", device="cuda", dtype="bfloat16", weights="synthetic",
                                  kv_cache_tokens=20000, max_num_seqs=1, **kw)

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

res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
for prec in sys.argv[1].split(","):
    engines = {}
    for v in ("base", "fold"):
        engines[v] = build(v, prec)
    for e in engines.values():
        tpot(e, 128, 16)
    r = {n: {"tpot_512": [], "tpot_1900": []} for n in engines}
    toks = {}
    for rnd in range(int(sys.argv[2])):
        for n, e in engines.items():
            FLAG["fold"] = n == "fold"
            ms, t = tpot(e)
            r[n]["tpot_512"].append(round(ms, 4)); toks[n] = t
        for n, e in engines.items():
            FLAG["fold"] = n == "fold"
            r[n]["tpot_1900"].append(round(tpot(e, 1900, 64, 5)[0], 4))
    r["same_tokens"] = toks["fold"] == toks["base"]
    r["first_diff"] = next((i for i, (a, b) in enumerate(zip(toks["fold"], toks["base"])) if a != b), None)
    res[prec] = r
    print(prec, json.dumps(r), flush=True)
    del engines; torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "fold_ab.json"), "w"), indent=1)
