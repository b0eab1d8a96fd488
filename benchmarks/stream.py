"""Streamed routed experts: tokens/s of a model whose MXFP4 experts on disk are 3x the RAM budget.

    python benchmarks/stream.py [--json] [--quick] [--expert-gb 12] [--budget-gb 4] [--tokens 12]

Builds a synthetic kimi_k3 folder (k3's writer, MXFP4 routed experts as the release packs them, random values)
shaped like K3 in everything but size: 896 experts, top-16, LatentMoE at half width with experts 6/7 of the
latent, two shared experts, 3:1 KDA:MLA, Block AttnRes, as many layers as --expert-gb needs. A child process
loads it with `k3.load(path, experts="stream", ram_budget=...)` and

1. calibrates the planner's rates from the parts: disk (random expert reads, page cache dropped), experts
   (dequantize + apply one layer's k experts held in memory), trunk (decode steps with the experts stubbed out),
   and the lookahead's share of guessed misses (the warm-up tokens);
2. decodes (random token ids fed one at a time) after a warm-up that fills the cache, alternating blocks with and without prefetch, and
   records per block tokens/s, cache hit rate, bytes read per token and the disk read throughput of the same
   reads, and the child's peak RSS;
3. puts `k3.plan.stream.stream_plan`'s prediction for the same shape and rates beside the measurement.

Every read goes to the disk: the checkpoint's pages are dropped from the OS page cache before the run and each
expert's range right after it is read (posix_fadvise DONTNEED; not O_DIRECT). The folder is deleted at the end.
Writes runs/bench/stream.json (--quick: runs/bench/quick/, a 0.3 GB model against a 0.25 GB budget).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from k3.benchtools import bench_out, machine, write_result
from k3.config import get_config

ROOT = Path(__file__).resolve().parent.parent


def synthetic_config(expert_gb: float, quick: bool):
    """K3's ratios (latent d/2, expert ffn 6/7 of the latent, 896 experts, top-16) at d_model 1024."""
    base = dict(d_model=1024, vocab_size=16384, kda_heads=8, kda_head_dim=128, kda_gate_rank=128,
                mla_heads=8, mla_q_lora_rank=192, mla_kv_lora_rank=256, mla_qk_head_dim=128, qk_rope_head_dim=64,
                mla_v_head_dim=128, dense_ffn=4096, moe_latent_dim=512, n_experts=896, n_active_experts=16,
                expert_ffn=448, n_shared_experts=2, shared_ffn=448, norm_eps=1e-5, kda_norm_eps=1e-5,
                qat={"expert_weights": "mxfp4"}, balancing="quantile")
    if quick:
        base.update(d_model=256, vocab_size=4096, kda_heads=2, mla_heads=2, dense_ffn=512, moe_latent_dim=128,
                    n_experts=256, n_active_experts=8, expert_ffn=96, shared_ffn=96, mla_q_lora_rank=64,
                    mla_kv_lora_rank=64)
    per_layer = base["n_experts"] * 3 * base["moe_latent_dim"] * base["expert_ffn"] * 4.25 / 8
    moe_layers = max(3, math.ceil(expert_gb * 1e9 / per_layer))
    n = moe_layers + 1
    config = get_config("tiny", n_layers=n, attn_res_block_size=12, attnres_sources=math.ceil(n / 12) + 1, **base)
    return config.replace(name="k3-synthetic-stream")


def write_folder(config, out: Path) -> int:
    """The folder, written tensor by tensor: random MXFP4 codes (E8M0 scales around 2^-4), norms at one and a
    zero router bias, so that routing follows the tokens as a trained model's does (norm weights of 0.02 would
    shrink every token to the same router input and send all of them to the same experts), 0.02 N(0, 1) else."""
    from k3.io.kimi import kimi_config, kimi_tensors, write_safetensors
    from k3.quant.export import build_packed_model

    with torch.device("meta"):
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in build_packed_model(config).state_dict().items()}
    import numpy as np

    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)  # several times faster than torch.randint for gigabytes of bytes

    def get(name: str) -> torch.Tensor:
        shape, dtype = shapes[name]
        if dtype == torch.uint8:
            lo, hi = (0, 256) if name.endswith("codes") else (118, 124)
            return torch.from_numpy(rng.integers(lo, hi, size=shape, dtype=np.uint8))
        if "norm" in name:
            return torch.ones(shape, dtype=torch.bfloat16)
        if name.endswith("router.bias"):
            return torch.zeros(shape, dtype=torch.bfloat16)
        return (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)

    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(kimi_config(config, "kimi_k3"), indent=2))
    write_safetensors(kimi_tensors(config, get, "kimi_k3"), out)
    os.sync()  # dirty pages cannot be dropped; written back, the next DONTNEED empties the page cache
    return sum(p.stat().st_size for p in out.glob("*.safetensors"))


# ---------------------------------------------------------------------------------------------- the child
def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def calibrate(model, k: int) -> dict:
    """The planner's rates, each measured on its own part of the streamed model."""
    from k3.io.stream import StreamedExperts

    cache = model.expert_cache
    cache.prefetch_on = False  # each part alone: no background reads competing for the cores
    store = cache.store
    n_layers, n_exp = len(store.spans), len(store.spans[0])
    g = torch.Generator().manual_seed(1)
    keys = [(int(torch.randint(n_layers, (1,), generator=g)), int(torch.randint(n_exp, (1,), generator=g)))
            for _ in range(96)]
    store.drop_page_cache()
    t0 = time.perf_counter()
    packed = [store.read(*key) for key in keys]
    disk_gbps = len(keys) * store.expert_bytes / (time.perf_counter() - t0) / 1e9
    # experts: one token's k experts of a layer, already in memory, dequantized and applied
    ex = model.moe_layers()[0].experts
    x = torch.randn(1, ex.dim)
    ids = torch.arange(k).view(1, k)
    w = torch.full((1, k), 1 / k)
    real = cache.acquire
    cache.acquire = lambda keys_: packed[:len(keys_)]
    try:
        with torch.no_grad():
            ex(x, w, ids)
            t0 = time.perf_counter()
            reps = 20
            for _ in range(reps):
                ex(x, w, ids)
            expert_gbps = reps * k * store.expert_bytes / (time.perf_counter() - t0) / 1e9
    finally:
        cache.acquire = real
    # trunk: decode steps with every routed expert stubbed out (zero output, no read)
    fwd = StreamedExperts.forward
    StreamedExperts.forward = lambda self, x, weights, experts: x.new_zeros(x.shape[0], self.dim)
    try:
        trunk_s = _decode_times(model, 2, 6)
    finally:
        StreamedExperts.forward = fwd
        cache.prefetch_on = True
    trunk_read = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("embed"))
    return {"disk_gbps": disk_gbps, "expert_gbps": expert_gbps, "trunk_s_per_token": trunk_s,
            "mem_gbps": trunk_read / trunk_s / 1e9}


def _tokens(vocab: int, n: int, seed: int) -> list[torch.Tensor]:
    """Decode inputs: random token ids, one at a time. A random model's greedy output repeats one token, whose
    routing repeats too, and every expert would hit; random ids route like varied text."""
    ids = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    return [ids[i].view(1, 1) for i in range(n)]


def _decode_times(model, warm: int, n: int) -> float:
    cache = model.new_cache()
    times = []
    with torch.no_grad():
        for i, tok in enumerate(_tokens(model.config.vocab_size, warm + n, 5)):
            t0 = time.perf_counter()
            model(tok, cache)
            if i >= warm:
                times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def child(args) -> dict:
    import k3

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = k3.load(args.folder, experts="stream", ram_budget=args.budget_gb * 1e9, prefetch=True)
    load_s = time.perf_counter() - t0
    info = model.stream_info
    cfg = model.config
    cache = model.expert_cache
    cal = calibrate(model, cfg.n_active_experts)
    cache.clear()
    cache.reset_stats()
    cache.store.drop_page_cache()
    # the prompt and the warm-up (prefetch on): fill the cache; the lookahead's guessed share is measured here
    kv = model.new_cache()
    ids = torch.randint(3, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0))
    feed = iter(_tokens(cfg.vocab_size, args.warmup + 4 * max(1, args.tokens // 2), 6))
    with torch.no_grad():
        model(ids, kv)
        for _ in range(args.warmup):
            model(next(feed), kv)
    s = cache.stats()
    guessed = s["prefetch_used"] + s["waited_on_prefetch"]
    lookahead = guessed / max(1, guessed + s["misses"])
    blocks = []
    per_block = max(1, args.tokens // 2)
    for b in range(4):  # on, off, off, on: a slow phase of the shared machine hits both
        prefetch = b in (0, 3)
        cache.prefetch_on = prefetch
        cache.reset_stats()
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(per_block):
                model(next(feed), kv)
        wall = time.perf_counter() - t0
        st = cache.stats()
        blocks.append({"prefetch": prefetch, "tokens": per_block, "wall_s": wall, **st})
    cache.close()

    def agg(pf: bool) -> dict:
        bs = [b for b in blocks if b["prefetch"] == pf]
        n = sum(b["tokens"] for b in bs)
        wall = sum(b["wall_s"] for b in bs)
        hits, misses = sum(b["hits"] for b in bs), sum(b["misses"] for b in bs)
        read, read_s = sum(b["bytes_read"] for b in bs), sum(b["read_s"] for b in bs)
        return {"tokens": n, "tokens_per_s": n / wall, "s_per_token": wall / n, "hit_rate": hits / (hits + misses),
                "bytes_read_per_token": read / n, "disk_read_gbps": read / read_s / 1e9 if read_s else None,
                "prefetched_per_token": sum(b["prefetched"] for b in bs) / n,
                "prefetch_used_per_token": sum(b["prefetch_used"] + b["waited_on_prefetch"] for b in bs) / n}

    return {"load_s": load_s, "stream_info": info, "calibration": cal, "lookahead_measured": lookahead,
            "warmup_tokens": args.warmup, "blocks": blocks, "prefetch": agg(True), "no_prefetch": agg(False),
            "peak_rss_gb": _rss_gb()}


# ---------------------------------------------------------------------------------------------- the parent
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="a 0.3 GB model against a 0.25 GB budget: a smoke test")
    ap.add_argument("--expert-gb", type=float, default=12.0, help="packed routed-expert bytes on disk (GB)")
    ap.add_argument("--budget-gb", type=float, default=4.0, help="--ram-budget of the streamed model (GB)")
    ap.add_argument("--tokens", type=int, default=12, help="decoded tokens measured with and without prefetch each")
    ap.add_argument("--warmup", type=int, default=16, help="decoded tokens that fill the cache first")
    ap.add_argument("--dir", default=None, help="where the folder goes (default: a temporary folder)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        Path(args.child).write_text(json.dumps(child(args)))
        return {}
    if args.quick:
        args.expert_gb, args.budget_gb, args.tokens, args.warmup = 0.3, 0.25, 4, 4
    config = synthetic_config(args.expert_gb, args.quick)
    work = Path(tempfile.mkdtemp(prefix="k3-stream-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        folder_bytes = write_folder(config, work / "model")
        write_s = time.perf_counter() - t0
        res = work / "child.json"
        cmd = [sys.executable, __file__, "--child", str(res), "--folder", str(work / "model"),
               "--budget-gb", str(args.budget_gb), "--tokens", str(args.tokens), "--warmup", str(args.warmup)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"the streamed run failed ({r.returncode}): {r.stderr[-3000:]}")
        m = json.loads(res.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from k3.plan.stream import stream_plan

    cal, info = m["calibration"], m["stream_info"]
    plan = stream_plan(config, args.budget_gb, cal["disk_gbps"], cal["mem_gbps"], cal["expert_gbps"],
                       dense_precision="fp32", lookahead=m["lookahead_measured"], overhead_gb=0.0)  # the loader's own split
    pred = {"tokens_per_s_prefetch": plan["tokens_per_s_prefetch"],
            "tokens_per_s_no_prefetch": plan["tokens_per_s_no_prefetch"], "hit_rate": plan["hit_rate"],
            "bytes_read_per_token": plan["bytes_read_per_token"]}
    meas = {"tokens_per_s_prefetch": m["prefetch"]["tokens_per_s"],
            "tokens_per_s_no_prefetch": m["no_prefetch"]["tokens_per_s"], "hit_rate": m["no_prefetch"]["hit_rate"],
            "bytes_read_per_token": m["no_prefetch"]["bytes_read_per_token"]}
    result = {
        "benchmark": "stream", "quick": args.quick, "config": config.to_dict(), "folder_bytes": folder_bytes,
        "experts_on_disk_bytes": info["experts_on_disk_bytes"], "ram_budget_bytes": info["ram_budget"],
        "disk_over_budget": info["experts_on_disk_bytes"] / info["ram_budget"],
        "trunk_bytes": info["trunk_bytes"], "cache_capacity_bytes": info["cache_capacity"],
        "expert_bytes": info["expert_bytes"], "write_folder_s": round(write_s, 1), "load_s": round(m["load_s"], 1),
        "page_cache": "dropped per file before the run and per expert range after each read (posix_fadvise "
                      "DONTNEED), not O_DIRECT",
        "calibration": cal, "lookahead_measured": m["lookahead_measured"], "warmup_tokens": m["warmup_tokens"],
        "prefetch": m["prefetch"], "no_prefetch": m["no_prefetch"], "blocks": m["blocks"],
        "prefetch_speedup": m["prefetch"]["tokens_per_s"] / m["no_prefetch"]["tokens_per_s"],
        "peak_rss_gb": m["peak_rss_gb"], "rss_limit_gb": (info["ram_budget"] + info["trunk_bytes"]) / 1e9,
        "rss_under_budget_plus_trunk": m["peak_rss_gb"] * 1e9 < info["ram_budget"] + info["trunk_bytes"],
        "predicted": pred, "measured": meas,
        "predicted_over_measured": {k: pred[k] / meas[k] if meas[k] else None for k in pred},
        "plan": plan, "plan_command": (f"k3 plan --stream-experts --ram {args.budget_gb:g} --disk-gbps "
                                       f"{cal['disk_gbps']:.2f} --mem-gbps {cal['mem_gbps']:.1f} --expert-gbps "
                                       f"{cal['expert_gbps']:.3f} --lookahead {m['lookahead_measured']:.2f} "
                                       "--dense-precision fp32 (on this synthetic config)"),
        "machine": machine(),
    }
    path = write_result(bench_out("stream", args.quick), result)
    if args.json:
        print(json.dumps(result))
    else:
        for name in ("prefetch", "no_prefetch"):
            p, q = result[name], pred[f"tokens_per_s_{name}"]
            print(f"{name}: {p['tokens_per_s']:.3f} tokens/s (plan {q:.3f}), hit rate {p['hit_rate']:.1%}, "
                  f"{p['bytes_read_per_token'] / 1e6:.1f} MB read/token at {p['disk_read_gbps'] or 0:.2f} GB/s")
        print(f"peak RSS {result['peak_rss_gb']:.2f} GB (budget {args.budget_gb:g} GB + trunk "
              f"{info['trunk_bytes'] / 1e9:.2f} GB); wrote {path}")
    return result


if __name__ == "__main__":
    main()
