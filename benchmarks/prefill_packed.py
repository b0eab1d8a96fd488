"""Prefill of several prompts of different lengths: packed into one row vs one at a time vs a padded batch.

    python benchmarks/prefill_packed.py [--json] [--quick] [--preset mini] [--repeats 3] [--threads 1]

Eight prompts of 16, 32, ..., 2048 tokens (4,080 in all) on `mini` (random weights: speed does not depend on
them), each strategy filling a cache per prompt as the engine does:
  packed        one forward of the 4,080 tokens with doc_ids and a fresh cache per prompt (k3.model.segments)
  one_at_a_time eight forwards, one per prompt
  padded        one forward of a [8, 2048] batch, every prompt right-padded to the longest (the padding's work
                is wasted; its outputs are not used)
The three run in turn within each repeat (host drift hits all alike); the median time per strategy gives
prompt tokens per second and the speedups over one-at-a-time. What packing can save at most: each prompt's
prefill is also timed alone, a least-squares line t = a + b * n through those times gives the fixed cost a
of one forward call (per-layer Python, allocation) and `packing_bound` = one_at_a_time / (one_at_a_time -
(k - 1) a), the speedup if packing removed every call's fixed cost but one and changed nothing else. Before timing, the packed prefill's last-token
logits are checked against one-at-a-time in fp64 (equal within 1e-9): in fp32 the two differ in rounding
(1e-7 relative per layer), which can flip a router's near-tie and send one token to another expert, a
difference of routing, not of the packing. Writes runs/bench/prefill_packed.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from k3.benchtools import bench_out, machine, write_result
from k3.config import get_config
from k3.model.transformer import K3Model


def strategies(model, prompts):
    V = model.config.vocab_size

    def packed():
        row = torch.cat(prompts, 1)
        doc = torch.cat([torch.full((1, p.shape[1]), i) for i, p in enumerate(prompts)], 1)
        caches = [model.new_cache() for _ in prompts]
        h = model.hidden_states(row, doc_ids=doc, doc_caches=caches)
        ends = torch.tensor([p.shape[1] for p in prompts]).cumsum(0) - 1
        return model.head(h[0, ends])

    def one_at_a_time():
        return torch.cat([model(p, model.new_cache())[:, -1] for p in prompts])

    def padded():
        T = max(p.shape[1] for p in prompts)
        batch = torch.cat([torch.nn.functional.pad(p, (0, T - p.shape[1]), value=V - 1) for p in prompts])
        return model(batch, model.new_cache())[:, -1]

    return {"packed": packed, "one_at_a_time": one_at_a_time, "padded": padded}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny model, short prompts")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = get_config("tiny" if args.quick else args.preset)
    model = K3Model(config).eval()
    lengths = [4, 8, 16, 32] if args.quick else [16, 32, 64, 128, 256, 512, 1024, 2048]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size - 1, (1, n), generator=g) for n in lengths]
    fns = strategies(model, prompts)
    with torch.no_grad():
        exact = strategies(copy.deepcopy(model).double(), prompts)
        err = ((exact["packed"]() - exact["one_at_a_time"]()).abs().max()).item()
        if err > 1e-9:
            raise SystemExit(f"packed prefill differs from one-at-a-time by {err} in fp64")
        times = {k: [] for k in fns}
        alone = {n: [] for n in lengths}
        for _ in range(1 + args.repeats):  # the first round warms up
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
            for p in prompts:
                t0 = time.perf_counter()
                model(p, model.new_cache())
                alone[p.shape[1]].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    per_prompt = {n: statistics.median(v[1:]) for n, v in alone.items()}
    n_mean = statistics.fmean(lengths)
    t_mean = statistics.fmean(per_prompt.values())
    slope = sum((n - n_mean) * (t - t_mean) for n, t in per_prompt.items()) / sum((n - n_mean) ** 2 for n in lengths)
    fixed = t_mean - slope * n_mean
    bound = med["one_at_a_time"] / (med["one_at_a_time"] - (len(lengths) - 1) * max(fixed, 0.0))
    tokens = sum(lengths)
    result = {
        "benchmark": "prefill_packed", "preset": config.name, "lengths": lengths, "prompt_tokens": tokens,
        "threads": args.threads, "repeats": args.repeats, "max_abs_logit_diff_packed_vs_single_fp64": err,
        "seconds": {k: round(v, 4) for k, v in med.items()},
        "tokens_per_s": {k: round(tokens / v, 1) for k, v in med.items()},
        "packed_over_one_at_a_time": med["one_at_a_time"] / med["packed"],
        "packed_over_padded": med["padded"] / med["packed"],
        "per_prompt_s": {str(n): round(t, 4) for n, t in per_prompt.items()},
        "fixed_cost_per_call_s": round(fixed, 4), "seconds_per_token": slope, "packing_bound": bound,
        "machine": machine(threads=args.threads),
    }
    path = write_result(bench_out("prefill_packed", args.quick), result)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in med.items():
            print(f"{k:14s} {v:.3f} s, {tokens / v:.0f} prompt tokens/s")
        print(f"packed / one-at-a-time {result['packed_over_one_at_a_time']:.2f}x, packed / padded "
              f"{result['packed_over_padded']:.2f}x; a forward call's fixed cost {fixed * 1e3:.1f} ms, so packing "
              f"{len(lengths)} prompts can give at most {bound:.2f}x; wrote {path}")
    return result


if __name__ == "__main__":
    main()
