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
"""
from __future__ import annotations

import argparse
import gc
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
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    contexts = (256, 1024) if args.quick else tuple(int(c) for c in args.contexts.split(","))
    repeats = 3 if args.quick else args.repeats
    check = (256 if args.quick else args.check_context) or None
    result = run(args.preset, contexts, repeats, check)
    path = write_result(args.out or bench_out("decode", args.quick), result, args.json)
    if not args.json:
        for r in result["rows"]:
            print(f"context {r['context']:>8,}: hybrid {r['hybrid']['ms_per_token']:7.2f} ms/token "
                  f"({r['hybrid']['cache_bytes'] / 2**20:8.2f} MiB)  all-MLA {r['all_mla']['ms_per_token']:7.2f} "
                  f"ms/token ({r['all_mla']['cache_bytes'] / 2**20:8.2f} MiB)  speedup {r['speedup']:.2f}x  "
                  f"cache ratio {r['cache_ratio']:.3f}")
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
