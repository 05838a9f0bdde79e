"""A/B: batch-1 TPOT with the one-kernel attention's merge over half the splits where a short context fills no more
(SPLITS_HALF) or over all of them; engines built in one process, alternating rounds; fp8 weights, KV, lm_head."""
import inspect, json, os, sys, time, torch
sys.path.insert(0, os.getcwd())
import llm_anatomy.kernels.decode_attention as DA
import llm_anatomy.models.qwen3 as Q
from llm_anatomy import Engine

FLAG = {}
src = inspect.getsource(DA.rope_decode_attention).replace(
    "SPLITS_HALF=max(1, splits_pad // 2)", "SPLITS_HALF=splits_pad if FLAG['full'] else max(1, splits_pad // 2)")
assert "FLAG['full']" in src
ns = dict(vars(DA)); ns["FLAG"] = FLAG
exec(src, ns)
DA.rope_decode_attention = Q.rope_decode_attention = ns["rope_decode_attention"]

def build(variant):
    FLAG["full"] = variant == "full"
    return Engine.from_pretrained("Qwen/Qwen3-8B", device="cuda", dtype="bfloat16", weights="synthetic",
                                  kv_cache_tokens=20000, max_num_seqs=1, quantization="fp8", kv_cache_dtype="fp8",
                                  quantize_lm_head=True)

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
engines = {v: build(v) for v in ("full", "half")}
for e in engines.values():
    tpot(e, 128, 16)
r = {n: {"tpot_512": [], "tpot_1200": []} for n in engines}
toks = {}
for rnd in range(3):
    for n, e in engines.items():
        FLAG["full"] = n == "full"
        ms, t = tpot(e)
        r[n]["tpot_512"].append(round(ms, 4)); toks[n] = t
    for n, e in engines.items():
        FLAG["full"] = n == "full"
        r[n]["tpot_1200"].append(round(tpot(e, 1100, 64, 5)[0], 4))
r["same_tokens"] = toks["full"] == toks["half"]
res["fp8"] = r
print("fp8", json.dumps(r), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "merge_ab.json"), "w"), indent=1)
