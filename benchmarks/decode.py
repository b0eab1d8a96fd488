"""Decode speed and cache bytes vs context: the hybrid model (KDA + MLA) against an all-MLA model of the same size.

    python benchmarks/decode.py [--json] [--preset long] [--contexts 1024,8192,65536,262144] [--repeats 15]

Both models share every width (d_model, heads, experts) and the layer count; the all-MLA variant only sets
`layer_pattern = "M" * n_layers`. For each context length both caches are put in the state a prefill of that
many tokens leaves, then one-token decode steps are timed in alternating order; the speedup is the median
of the per-repeat ratios t(all-MLA) / t(hybrid). Cache bytes are `HybridCache.nbytes()`.

The caches are filled with random tensors of the exact shapes and dtypes a real prefill produces (KDA:
conv tail [B, 3HK, W-1] and state [B, H, K, V]; MLA: latent and shared key [B, context, kv_lora_rank + qk_rope_head_dim]) instead of by a
real prefill, which for the all-MLA model at 256k tokens is quadratic and would take hours on a CPU.
Decode time does not depend on the values. At `--check-context` tokens the script checks both claims:
a real chunked prefill gives caches of exactly the same shapes, dtypes and bytes, and decoding from it
takes the same time as from the random cache (`value_check`). Writes runs/bench/decode.json atomically.

Against a dense model (`peer`, `--peer-only` runs just this part and writes runs/bench/decode_peer.json): k3's
serving engine (`k3.serve.engine.Engine`) on `--peer-preset` (mini, random init) at batch 1 and 8 against an HF
`LlamaForCausalLM` of the same active parameter count, built as benchmarks/peers.py builds it (mini's width, depth
and heads, MLP width solved for the count). Both get the same prompts (`--peer-prompt` tokens) and decode
`--peer-tokens` tokens greedily after the prefill; only the decode is timed (k3: the engine steps after the one that
prefills and samples the first token; the Llama: its forward with a `DynamicCache` and an argmax per token, HF's
own decode loop without generate()'s extra work, and for reference generate() itself, its prefill subtracted).
The two run alternately, `--peer-repeats` times; `engine_over_dense_decode_bN` is the median of the per-repeat
ratios tokens/s(k3 engine) / tokens/s(Llama loop).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from k3.config import get_config
from k3.data.tokenizer import SPECIAL_TOKENS
from k3.benchtools import bench_out, loadavg, machine, paired, write_result, positive_int
from k3.model.cache import HybridCache, KDACache
from k3.model.kda import KimiDeltaAttention
from k3.model.transformer import K3Model

HEADLINE_CONTEXT = 262_144


def all_mla(config):
    """The same model with every token mixer an MLA layer."""
    return config.replace(name=f"{config.name}-all-mla", layer_pattern="M" * config.n_layers)


def fill_cache(model: K3Model, context: int, batch: int = 1, generator: torch.Generator | None = None) -> HybridCache:
    """A cache in the state a prefill of `context` tokens leaves, holding random values (see the module doc)."""
    cache = model.new_cache()
    dtype = model.embed.weight.dtype
    for block, slot in zip(model.layers, cache.slots):
        m = block.mixer
        if isinstance(m, KimiDeltaAttention):
            V = m.v_proj.out_features // m.n_heads
            slot.conv_state = torch.randn(batch, m.conv_weight.shape[0], m.conv_size - 1, generator=generator,
                                          dtype=dtype)
            # the delta rule keeps the state bounded; a small scale keeps random values in that range
            slot.state = 0.1 * torch.randn(batch, m.n_heads, m.head_dim, V, generator=generator, dtype=torch.float32)
        else:
            slot.latent = torch.randn(batch, context, m.kv_lora_rank + m.rope_dim, generator=generator, dtype=dtype)
    cache.seen_tokens = context
    return cache


@torch.no_grad()
def prefill_cache(model: K3Model, context: int, chunk: int = 2048,
                  generator: torch.Generator | None = None) -> HybridCache:
    """A real chunked prefill of `context` random tokens."""
    cache = model.new_cache()
    done = 0
    while done < context:
        n = min(chunk, context - done)
        model(torch.randint(len(SPECIAL_TOKENS), model.config.vocab_size, (1, n), generator=generator), cache)
        done += n
    return cache


def slot_signature(cache: HybridCache) -> list:
    """Per slot: kind and (shape, dtype) of every tensor it holds."""
    sig = []
    for s in cache.slots:
        tensors = (s.conv_state, s.state) if isinstance(s, KDACache) else (s.latent,)
        sig.append([type(s).__name__] + [None if t is None else [list(t.shape), str(t.dtype)] for t in tensors])
    return sig


@torch.no_grad()
def decode_step(model: K3Model, cache: HybridCache, token: torch.Tensor) -> torch.Tensor:
    return model(token, cache)[:, -1].argmax(-1, keepdim=True)


def _stepper(model: K3Model, cache: HybridCache):
    token = torch.tensor([[len(SPECIAL_TOKENS)]])
    return lambda: decode_step(model, cache, token)


def bench_context(hybrid: K3Model, mla: K3Model, context: int, repeats: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ch, cm = fill_cache(hybrid, context, generator=gen), fill_cache(mla, context, generator=gen)
    bytes_h, bytes_m = ch.nbytes(), cm.nbytes()  # before decoding appends to them
    p = paired(_stepper(hybrid, ch), _stepper(mla, cm), repeats, warmup=2)
    row = {
        "context": context,
        "hybrid": {"ms_per_token": 1e3 * p["a_median_s"], "tokens_per_s": 1 / p["a_median_s"], "cache_bytes": bytes_h},
        "all_mla": {"ms_per_token": 1e3 * p["b_median_s"], "tokens_per_s": 1 / p["b_median_s"], "cache_bytes": bytes_m},
        "speedup": p["ratio_median"],
        "speedup_range": [p["ratio_min"], p["ratio_max"]],
        "cache_ratio": bytes_h / bytes_m,
    }
    del ch, cm
    gc.collect()
    return row


def value_check(hybrid: K3Model, mla: K3Model, context: int, repeats: int, seed: int) -> dict:
    """Real prefill vs random fill at `context`: same slot shapes/dtypes/bytes, same decode time."""
    out = {"context": context}
    for name, model in (("hybrid", hybrid), ("all_mla", mla)):
        real = prefill_cache(model, context, generator=torch.Generator().manual_seed(seed))
        fake = fill_cache(model, context, generator=torch.Generator().manual_seed(seed + 1))
        same = slot_signature(real) == slot_signature(fake) and real.nbytes() == fake.nbytes() \
            and real.seen_tokens == fake.seen_tokens
        p = paired(_stepper(model, real), _stepper(model, fake), repeats, warmup=2)
        out[name] = {"shapes_and_bytes_match": same, "cache_bytes_real": real.nbytes(),
                     "cache_bytes_random": fake.nbytes(), "time_random_over_real": p["ratio_median"]}
    out["shapes_and_bytes_match"] = all(out[k]["shapes_and_bytes_match"] for k in ("hybrid", "all_mla"))
    return out


def run(preset: str = "long", contexts=(1024, 8192, 65536, HEADLINE_CONTEXT), repeats: int = 15,
        check_context: int | None = 8192, seed: int = 0) -> dict:
    config = get_config(preset)
    need = max(contexts) + repeats + 8
    if need > config.max_context:
        raise ValueError(f"contexts up to {max(contexts)} need max_context >= {need}; {preset} has "
                         f"{config.max_context} (use --preset long or smaller --contexts)")
    torch.manual_seed(seed)
    hybrid = K3Model(config).eval()
    torch.manual_seed(seed)
    mla = K3Model(all_mla(config)).eval()
    n_h = sum(p.numel() for p in hybrid.parameters())
    n_m = sum(p.numel() for p in mla.parameters())
    before = machine()
    check = value_check(hybrid, mla, check_context, max(5, repeats // 2), seed) if check_context else None
    rows = [bench_context(hybrid, mla, c, repeats, seed + i) for i, c in enumerate(contexts)]
    head = next((r for r in rows if r["context"] == HEADLINE_CONTEXT), None)
    return {
        "benchmark": "decode",
        "preset": preset,
        "config": config.to_dict(),
        "hybrid_pattern": config.pattern,
        "all_mla_pattern": all_mla(config).pattern,
        "params": {"hybrid": n_h, "all_mla": n_m},
        "contexts": list(contexts),
        "repeats": repeats,
        "batch": 1,
        "rows": rows,
        "decode_speedup_vs_all_mla_256k": head["speedup"] if head else None,
        "cache_ratio_vs_all_mla_256k": head["cache_ratio"] if head else None,
        "hybrid_tokens_per_s_256k": head["hybrid"]["tokens_per_s"] if head else None,
        "all_mla_tokens_per_s_256k": head["all_mla"]["tokens_per_s"] if head else None,
        "targets": {"decode_speedup_vs_all_mla_256k": ">= 3", "cache_ratio_vs_all_mla_256k": "<= 0.3"},
        "cache_fill": "random tensors of the shapes/dtypes a real prefill produces; checked at check_context "
                      "(value_check): equal shapes and bytes, equal decode time",
        "value_check": check,
        "definitions": {
            "speedup": "median over repeats of t(all-MLA decode step) / t(hybrid decode step), batch 1, greedy",
            "cache_ratio": "hybrid cache bytes / all-MLA cache bytes at the same context",
        },
        "machine": before,
        "loadavg_1m_after": loadavg(),
    }


# ---------------------------------------------------------------------------------------------- against a dense model
def dense_peer(model: K3Model):
    """The HF Llama of `model`'s active parameter count, as benchmarks/peers.py builds it: (model, its config)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peers import llama_config  # one recipe for the equal-active Llama
    from transformers import LlamaForCausalLM

    from k3.model.accounting import count_params

    c = model.config
    cfg, _ = llama_config(count_params(model)["active"], c.vocab_size, c.d_model, c.n_layers, c.d_model // 64,
                          c.max_context)
    cfg.use_cache = True
    return LlamaForCausalLM(cfg).eval(), cfg


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(len(SPECIAL_TOKENS), vocab, (batch, length), generator=g).tolist()


def engine_decode_s(model: K3Model, prompts: list[list[int]], new: int) -> float:
    """Seconds per decode step of k3's engine over every prompt, timed over the steps after the first one (which
    prefills, samples each first token and decodes once), until `new` + 1 tokens each."""
    from k3.model.sampling import SamplingParams
    from k3.serve.engine import Engine

    engine = Engine(model, max_batch=len(prompts))
    params = SamplingParams(max_tokens=new + 1, temperature=0.0, ignore_eos=True)
    reqs = [engine.submit(p, params) for p in prompts]
    engine.step()
    first = len(reqs[0].output_ids)
    assert all(len(r.output_ids) == first for r in reqs), "the first step should prefill every prompt"
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    dt = time.perf_counter() - t0
    assert all(len(r.output_ids) == new + 1 for r in reqs)
    return dt / (new + 1 - first)


@torch.inference_mode()
def llama_decode_s(llama, prompts: list[list[int]], new: int) -> float:
    """Seconds per greedy decode step of the Llama with its KV cache, over `new` steps after the prefill."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    out = llama(input_ids=torch.tensor(prompts), past_key_values=cache, use_cache=True)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(new):
        out = llama(input_ids=tok, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - t0) / new


@torch.inference_mode()
def llama_generate_s(llama, prompts: list[list[int]], new: int) -> float:
    """generate() for new + 1 tokens minus generate() for 1 (its prefill and first token), per decode step."""
    ids = torch.tensor(prompts)

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        llama.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    return (gen(new + 1) - gen(1)) / new


def run_peer(preset: str = "mini", batches=(1, 8), prompt: int = 32, new: int = 64, repeats: int = 5,
             seed: int = 0) -> dict:
    import transformers

    config = get_config(preset)
    torch.manual_seed(seed)
    model = K3Model(config).eval()
    llama, lcfg = dense_peer(model)
    from k3.model.accounting import count_params

    counts = count_params(model)
    out = {"preset": preset, "prompt_tokens": prompt, "new_tokens": new, "repeats": repeats,
           "threads": torch.get_num_threads(), "transformers": transformers.__version__,
           "llama_config": {k: getattr(lcfg, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                          "num_attention_heads", "num_key_value_heads",
                                                          "vocab_size", "tie_word_embeddings")},
           "params": {"k3_total": counts["total"], "k3_active": counts["active"],
                      "llama": sum(p.numel() for p in llama.parameters())},
           "machine": machine(), "batches": {}}
    for B in batches:
        prompts = _prompts(B, prompt, config.vocab_size)
        fns = {"k3": lambda: engine_decode_s(model, prompts, new), "llama": lambda: llama_decode_s(llama, prompts, new),
               "llama_generate": lambda: llama_generate_s(llama, prompts, new)}
        for f in fns.values():  # warm-up
            f()
        times = {k: [] for k in fns}
        for r in range(repeats):
            for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                times[k].append(fns[k]())
        rate = {k: B / statistics.median(v) for k, v in times.items()}
        ratios = [b / a for a, b in zip(times["k3"], times["llama"])]
        out["batches"][B] = {
            "k3_engine_tokens_per_s": rate["k3"], "llama_tokens_per_s": rate["llama"],
            "llama_generate_tokens_per_s": rate["llama_generate"],
            "engine_over_dense": statistics.median(ratios), "range": [min(ratios), max(ratios)],
            "engine_over_dense_generate": statistics.median(
                [b / a for a, b in zip(times["k3"], times["llama_generate"])])}
        out[f"engine_over_dense_decode_b{B}"] = out["batches"][B]["engine_over_dense"]
    out["targets"] = {"engine_over_dense_decode_b1": ">= 0.8"}
    out["definitions"] = {"engine_over_dense_decode_bN": "median over repeats of tokens/s(k3 Engine decode steps) / "
                          "tokens/s(HF Llama forward + DynamicCache + argmax), batch N, greedy, same prompts, "
                          "prefill excluded"}
    out["loadavg_1m_after"] = loadavg()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--preset", default="long")
    ap.add_argument("--contexts", default="1024,8192,65536,262144", help="comma-separated context lengths")
    ap.add_argument("--repeats", type=positive_int, default=15)
    ap.add_argument("--check-context", type=int, default=8192, help="real-prefill check length (0: skip)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--quick", action="store_true", help="contexts 256,1024, 3 repeats: a smoke test")
    ap.add_argument("--out", type=Path, default=None, help="default runs/bench/decode.json (quick runs: runs/bench/quick/)")
    ap.add_argument("--peer-only", action="store_true",
                    help="only the engine-vs-dense-Llama part (writes runs/bench/decode_peer.json)")
    ap.add_argument("--peer-preset", default="mini")
    ap.add_argument("--peer-prompt", type=positive_int, default=32, help="prompt tokens per request")
    ap.add_argument("--peer-tokens", type=positive_int, default=64, help="decoded tokens per request")
    ap.add_argument("--peer-repeats", type=positive_int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    contexts = (256, 1024) if args.quick else tuple(int(c) for c in args.contexts.split(","))
    repeats = 3 if args.quick else args.repeats
    check = (256 if args.quick else args.check_context) or None
    peer = run_peer(args.peer_preset, (1, 8), args.peer_prompt, 8 if args.quick else args.peer_tokens,
                    2 if args.quick else args.peer_repeats)
    if args.peer_only:
        result = {"benchmark": "decode_peer", **peer}
    else:
        result = run(args.preset, contexts, repeats, check)
        result["peer"] = peer
        result.update({k: v for k, v in peer.items() if k.startswith("engine_over_dense_decode_")})
    path = write_result(args.out or bench_out("decode_peer" if args.peer_only else "decode", args.quick), result,
                        args.json)
    if not args.json:
        for B, r in peer["batches"].items():
            print(f"batch {B}: k3 engine {r['k3_engine_tokens_per_s']:.1f} tokens/s, Llama {r['llama_tokens_per_s']:.1f} "
                  f"(generate {r['llama_generate_tokens_per_s']:.1f}): engine/dense {r['engine_over_dense']:.2f} "
                  f"(range {r['range'][0]:.2f}-{r['range'][1]:.2f})")
    if not args.json and not args.peer_only:
        for r in result["rows"]:
            print(f"context {r['context']:>8,}: hybrid {r['hybrid']['ms_per_token']:7.2f} ms/token "
                  f"({r['hybrid']['cache_bytes'] / 2**20:8.2f} MiB)  all-MLA {r['all_mla']['ms_per_token']:7.2f} "
                  f"ms/token ({r['all_mla']['cache_bytes'] / 2**20:8.2f} MiB)  speedup {r['speedup']:.2f}x  "
                  f"cache ratio {r['cache_ratio']:.3f}")
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
