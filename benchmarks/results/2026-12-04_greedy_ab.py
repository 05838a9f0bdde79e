"""A/B: batch-1 TPOT with the greedy kernel at the end of batch 1's graphs (plan.greedy_in_graph): off (torch
argmax, the copies), on with the token copied to the host, on with the token written to pinned memory by the kernel.
Engines built in one process (graphs fixed at capture), variants alternating over rounds."""
import json, os, sys, time, torch
from dataclasses import replace
sys.path.insert(0, os.getcwd())
import llm_anatomy.engine.engine as E
import llm_anatomy.engine.graphs as G
from llm_anatomy import Engine

FLAGS = {}
_choose, _capture = E.choose_plan, G.GraphRunner.capture
E.choose_plan = lambda *a, **k: replace(_choose(*a, **k), greedy_in_graph=FLAGS["greedy"])
def capture(self, plan, n):
    self.host_tokens_direct = FLAGS["direct"]
    return _capture(self, plan, n)
G.GraphRunner.capture = capture

def build(variant, prec):
    FLAGS.update(greedy=variant != "base", direct=variant == "direct")
    kw = dict(quantization="fp8", kv_cache_dtype="fp8", quantize_lm_head=True) if prec == "fp8" else {}
    e = Engine.from_pretrained("Qwen/Qwen3-8B", device="cuda", dtype="bfloat16", weights="synthetic",
                               kv_cache_tokens=20000, max_num_seqs=1, **kw)
    assert e.plan.greedy_in_graph == (variant != "base") and e.graphs.host_tokens_direct == (variant == "direct")
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
variants = sys.argv[3].split(",") if len(sys.argv) > 3 else ["base", "copy", "direct"]
for prec in sys.argv[1].split(","):
    vs = variants if prec == "fp8" else ["base", "direct"]
    engines = {v: build(v, prec) for v in vs}
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
    r["same_tokens"] = all(toks[n] == toks["base"] for n in toks)
    res[prec] = r
    print(prec, json.dumps(r), flush=True)
    del engines; torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "greedy_ab.json"), "w"), indent=1)
