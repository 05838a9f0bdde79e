"""A/B: batch-1 TPOT with the short graph's attention in one kernel (short_rope_attention) or three; engines built
in one process (the graphs fixed at capture), alternating rounds; fp8 (weights, KV, lm_head) and bf16."""
import dataclasses, json, os, sys, time, torch
sys.path.insert(0, os.getcwd())
import llm_anatomy.engine.plan as P
from llm_anatomy import Engine

def build(one: bool, prec: str):
    f = P.DecodeAttentionPlan.__dataclass_fields__
    f["short_rope_attention"].default = one
    P.DecodeAttentionPlan.__init__.__defaults__ = tuple(f_.default for f_ in f.values() if f_.default is not dataclasses.MISSING)
    kw = dict(quantization="fp8", kv_cache_dtype="fp8", quantize_lm_head=True) if prec == "fp8" else {}
    e = Engine.from_pretrained("Qwen/Qwen3-8B", device="cuda", dtype="bfloat16", weights="synthetic",
                               kv_cache_tokens=20000, max_num_seqs=1, **kw)
    assert e.plan.decode_attention.short_rope_attention == one
    return e

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
    engines = {"one": build(True, prec), "three": build(False, prec)}
    for e in engines.values():
        tpot(e, 128, 16)
    r = {n: {"tpot_512": [], "tpot_1900": []} for n in engines}
    toks = {}
    for rnd in range(int(sys.argv[2])):
        for n, e in engines.items():
            ms, t = tpot(e)
            r[n]["tpot_512"].append(round(ms, 4)); toks[n] = t
        for n, e in engines.items():
            r[n]["tpot_1900"].append(round(tpot(e, 1900, 64, 5)[0], 4))
    r["same_tokens"] = toks["one"] == toks["three"]
    r["first_diff"] = next((i for i, (a, b) in enumerate(zip(toks["one"], toks["three"])) if a != b), None)
    res[prec] = r
    print(prec, json.dumps(r), flush=True)
    del engines; torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "rope_attention_ab.json"), "w"), indent=1)
