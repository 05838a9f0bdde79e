"""Probe (not kept): o_proj's streaming GEMV, resident during the attention (its ring capped at its share), asks
gate_up's first stages into L2 while the DRAM is idle; variants built in one process, TPOT alternating."""
import json, os, sys, time, torch
sys.path.insert(0, os.getcwd())
import llm_anatomy.kernels.stream_gemv as SG
import llm_anatomy.engine.graphs as G
from llm_anatomy import Engine

VARIANTS = {"base": {}, "cap": {"cap": 1}, "pf2": {"cap": 1, "pf": 2}, "pf4": {"cap": 1, "pf": 4},
            "pf6": {"cap": 1, "pf": 6}, "pf4h": {"cap": 1, "pf": 4, "head": 3}, "pf2h": {"cap": 1, "pf": 2, "head": 3},
            "head": {"cap": 1, "head": 3}, "nomerge": {"cap": 1, "nomerge": 1}, "norope": {"cap": 1, "norope": 1},
            "noattn": {"cap": 1, "norope": 1, "noattn": 1}, "nosplit": {"cap": 1, "nosplit": 1},
            "base_nomerge": {"nomerge": 1}, "nomerge_norope": {"cap": 1, "nomerge": 1, "norope": 1},
            "sp8": {"cap": 1, "splits": 8}, "sp4": {"cap": 1, "splits": 4}, "sp4_128": {"cap": 1, "splits": 4, "bn": 128},
            "sp4_nomerge": {"cap": 1, "splits": 4, "nomerge": 1},
            "fused": {"cap": 1, "fused": 1}, "fused_nocap": {"fused": 1}, "fused_nopre": {"cap": 1, "fused": 1, "nopre": 1},
            "fused_sp8": {"cap": 1, "fused": 1, "splits": 8}, "fused_bn32": {"cap": 1, "fused": 1, "bn": 32},
            "f_m1": {"cap": 1, "fused": 1, "kw": {"merge": 1}}, "f_m0": {"cap": 1, "fused": 1, "kw": {"merge": 0}},
            "f_norope": {"cap": 1, "fused": 1, "kw": {"rope": False}},
            "f_m0_norope": {"cap": 1, "fused": 1, "kw": {"merge": 0, "rope": False}},
            "f_m2_sp8": {"cap": 1, "fused": 1, "splits": 8},
            "f16_128": {"cap": 1, "fused": 1, "bn": 128}, "f16_128w8": {"cap": 1, "fused": 1, "bn": 128, "kw": {"num_warps": 8}},
            "f8_128": {"cap": 1, "fused": 1, "bn": 128, "splits": 8}, "f8_64w8": {"cap": 1, "fused": 1, "splits": 8, "kw": {"num_warps": 8}},
            "f32_64": {"cap": 1, "fused": 1, "splits": 32},
            "f16_64w8": {"cap": 1, "fused": 1, "kw": {"num_warps": 8}},
            "f8_64w8s2": {"cap": 1, "fused": 1, "splits": 8, "kw": {"num_warps": 8, "num_stages": 2}},
            "f32_64w8": {"cap": 1, "fused": 1, "splits": 32, "kw": {"num_warps": 8}},
            "f8_64w8h": {"cap": 1, "fused": 1, "splits": 8, "head": 3, "kw": {"num_warps": 8}},
            "f16_64w8h": {"cap": 1, "fused": 1, "head": 3, "kw": {"num_warps": 8}}}
sel = sys.argv[1].split(",")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
fp8 = dict(quantization="fp8", kv_cache_dtype="fp8", quantize_lm_head=True)
orig_capture = G.GraphRunner.capture
current = {}
def capture(self, plan, max_prefill_tokens):
    m = self.model
    for layer in m.model.layers:
        layer.self_attn.o_proj.prefetch_next = (layer.mlp.gate_up_proj.weight, True, current["pf"]) if current.get("pf") else None
    m.lm_head.prefetch_next = (m.model.layers[0].self_attn.qkv_proj.weight, False, current["head"]) if current.get("head") else None
    return orig_capture(self, plan, max_prefill_tokens)
G.GraphRunner.capture = capture
import llm_anatomy.models.qwen3 as Q
import llm_anatomy.kernels.decode_attention as DA
import functools
orig_rope_attend = Q.rope_attend
orig_rope, orig_attn, orig_merge, orig_split = Q.qk_norm_rope_store, Q.paged_decode_attention, DA._decode_attention_merge_kernel, DA._decode_attention_split_kernel
class Nop:
    def __getitem__(self, grid):
        return lambda *a, **k: None
def rope_nop(qkv, n_heads, n_kv_heads, head_dim, *a, **k):
    if qkv.shape[0] == 1 and not k.get("kv_out") and k.get("fp8_rows") is None:
        return qkv[:, :n_heads * head_dim].view(1, n_heads, head_dim)
    return orig_rope(qkv, n_heads, n_kv_heads, head_dim, *a, **k)
def attn_nop(q, *a, **k):
    return torch.empty_like(q)
def patch(v):
    Q.qk_norm_rope_store = rope_nop if v.get("norope") else orig_rope
    Q.paged_decode_attention = attn_nop if v.get("noattn") else orig_attn
    DA._decode_attention_merge_kernel = Nop() if v.get("nomerge") else orig_merge
    DA._decode_attention_split_kernel = Nop() if v.get("nosplit") else orig_split
engines = {}
for name in sel:
    current.clear(); current.update(VARIANTS[name])
    SG.CAP_RING = bool(current.get("cap"))
    patch(current)
    t = time.time()
    import llm_anatomy.engine.plan as P
    P.DecodeAttentionPlan.__init__.__defaults__  # (frozen dataclass: defaults patched below)
    dflt = P.DecodeAttentionPlan.__dataclass_fields__
    dflt["short_rope_attend"].default = bool(current.get("fused"))
    Q.rope_attend = functools.partial(orig_rope_attend, preload=not current.get("nopre"), **current.get("kw", {}))
    dflt["short_splits"].default = current.get("splits", 16); dflt["short_block_n"].default = current.get("bn", 64)
    P.DecodeAttentionPlan.__init__.__defaults__ = tuple(
        f.default for f in dflt.values() if f.default is not __import__("dataclasses").MISSING)
    engines[name] = Engine.from_pretrained("Qwen/Qwen3-8B", device="cuda", dtype="bfloat16", weights="synthetic",
                                           kv_cache_tokens=20000, max_num_seqs=1, **fp8)
    print(name, "built", round(time.time() - t), "s", flush=True)
SG.CAP_RING = False
patch({})

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
for eng in engines.values():
    tpot(eng, 128, 16)
res = {"tpot": {n: [] for n in engines}, "tokens": {}, "tpot_8k": {n: [] for n in engines}}
for rnd in range(rounds):
    for n, eng in engines.items():
        ms, toks = tpot(eng)
        res["tpot"][n].append(round(ms, 4)); res["tokens"][n] = toks[:32]
    print(rnd, {n: v[-1] for n, v in res["tpot"].items()}, flush=True)
if os.environ.get("LONG"):
    for n, eng in engines.items():
        res["tpot_8k"][n].append(round(tpot(eng, int(os.environ["LONG"]), 64, 5)[0], 4))
print("same tokens", len({json.dumps(t) for t in res["tokens"].values()}) == 1)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "prefetch_ab.json"), "w"), indent=1)
for n, v in res["tpot"].items():
    print(f"{n:6s} min {min(v):.4f} med {sorted(v)[len(v)//2]:.4f}  8k {res['tpot_8k'][n]}")
