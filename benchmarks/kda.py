"""Claim: k3's pure-torch chunked KDA is much faster on CPU than fla's torch references.

Times, in one process and round-robin (so load swings hit every contender alike), after a warm-up:
k3 `chunk_kda` vs fla's `naive_chunk_kda` and `naive_recurrent_kda`, forward and forward+backward, at
B=1, T=4096, H=4, K=V=128 fp32 (`--quick`: a small shape). Reports medians, min/max (noise), tokens/s,
matmul GFLOP/s of our forward (flops counted by torch's FlopCounterMode) against a measured 2048^2
matmul, and the max relative error of our output against fla's recurrent reference. The forward is timed
again on strong decay (g ~ -5 U(0,1) per token and channel; `strong_decay`): exp() of large negative
log-decays makes subnormal floats, which x86 CPUs compute through slow microcode assists, so that run is
slower; `--flush-denormal` repeats everything with subnormals flushed to zero for the whole process.
`train_shape`: our forward+backward at `mini`'s training shape (B=8, T=128, H=4, K=V=64) with the chunk size
fixed at 64 against the one chosen from the gates (`chunk_size=None`), side by side, on typical gates, on the
gates of a freshly initialised KDA layer (-exp(A_log) * softplus(.), A in [1, 16]) and on gates as strong as a
trained model's (-12 * U(0.5, 1.5) per token; `mini` after 150 steps has channels below -100), each checked
against fla's naive recurrent form.

    python benchmarks/kda.py --json          # prints one JSON object, writes runs/bench/kda.json
    python benchmarks/kda.py --flush-denormal  # writes runs/bench/kda-flush-denormal.json
    python benchmarks/kda.py --threads 1     # steadier on a shared machine: with 2 threads every small op
                                             # of fla's references can stall on a busy second core
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from k3.benchtools import bench_out, machine, matmul_peak, write_result, positive_int
from k3.ops.kda import chunk_kda
from k3.ops.kda.chunk import _auto_chunk_sizes


def make_inputs(B, T, H, K, V, strong=False, requires_grad=False):
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    # typical gates: log-sigmoid of a unit normal (mean ~ -0.8 per step); strong: uniform down to -5
    g = -5 * torch.rand(B, T, H, K) if strong else F.logsigmoid(torch.randn(B, T, H, K))
    beta = torch.rand(B, T, H)
    return [x.requires_grad_(requires_grad) for x in (q, k, v, g, beta)]


def fwd(fn, inputs):
    def run():
        with torch.no_grad():
            fn(*inputs)
    return run


def fwd_bwd(fn, inputs):
    w = torch.randn(inputs[2].shape)

    def run():
        for x in inputs:
            x.grad = None
        o, _ = fn(*inputs)
        (o * w).sum().backward()
    return run


def init_like_gates(B, T, H, K):
    """The gates of a freshly initialised KDA layer: -exp(A_log) * softplus(f + dt_bias), with A_log = log U(1, 16)
    per head (k3.model.kda), dt_bias = 0 and f a low-rank projection of unit-scale inputs (std ~0.1 here)."""
    A = torch.empty(H).uniform_(1, 16)
    return -A.view(H, 1) * F.softplus(0.1 * torch.randn(B, T, H, K))


def train_shape(reps: int, naive_recurrent_kda) -> dict:
    """Fixed chunk size 64 against the automatic choice, forward+backward at mini's training shape."""
    B, T, H, K = 8, 128, 4, 64
    out = {"shape": {"B": B, "T": T, "H": H, "K": K, "V": K}}
    for name, make_g in (("typical", lambda: F.logsigmoid(torch.randn(B, T, H, K))),
                         ("init", lambda: init_like_gates(B, T, H, K)),
                         ("trained_like", lambda: -12 * (0.5 + torch.rand(B, T, H, K)))):
        q, k, v, _, beta = make_inputs(B, T, H, K, K)
        inputs = [x.requires_grad_(True) for x in (q, k, v, make_g(), beta)]
        runs = {"c64": fwd_bwd(lambda *a: chunk_kda(*a, chunk_size=64), inputs),
                "auto": fwd_bwd(chunk_kda, inputs)}
        times = round_robin(runs, {n: reps for n in runs}, runs)
        with torch.no_grad():
            ref, _ = naive_recurrent_kda(*inputs)
            err = {n: ((chunk_kda(*inputs, **kw)[0] - ref).abs().max() / ref.abs().max()).item()
                   for n, kw in (("c64", {"chunk_size": 64}), ("auto", {}))}
        out[name] = {"auto_chunk_and_sub_chunk": list(_auto_chunk_sizes(inputs[3].detach(), 30.0)),
                     "c64_median_s": statistics.median(times["c64"]), "auto_median_s": statistics.median(times["auto"]),
                     "speedup_auto_vs_c64": statistics.median(times["c64"]) / statistics.median(times["auto"]),
                     "max_rel_err_vs_fla_naive_recurrent": err}
    return out


def round_robin(runs: dict, repeats: dict, warmups: dict) -> dict:
    """Warm every contender up, then time them interleaved (contender a, b, c, a, b, c, ...), so that
    load from other processes on a shared machine falls on all of them alike."""
    for name, warm in warmups.items():
        warm()
    times = {name: [] for name in runs}
    for i in range(max(repeats.values())):
        for name, run in runs.items():
            if i < repeats[name]:
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    return times


def summary(ts: list, tokens: int) -> dict:
    med = statistics.median(ts)
    return {"median_s": med, "min_s": min(ts), "max_s": max(ts), "max_over_min": max(ts) / min(ts),
            "tokens_per_s": tokens / med, "repeats": len(ts)}


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="small shape, few repeats")
    ap.add_argument("--repeats", type=positive_int, default=None, help="timed runs of ours (fla's: 3)")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--flush-denormal", action="store_true",
                    help="flush subnormal floats to zero for the whole process (set before any thread starts, so "
                         "torch's worker threads inherit it); writes runs/bench/kda-flush-denormal.json")
    args = ap.parse_args()
    if args.flush_denormal:
        torch.set_flush_denormal(True)  # before the first parallel op: threads created later inherit MXCSR
    if args.threads:
        torch.set_num_threads(args.threads)
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda
    import fla

    torch.manual_seed(0)
    B, T, H, K, V = (1, 512, 2, 64, 64) if args.quick else (1, 4096, 4, 128, 128)
    repeats = args.repeats or (3 if args.quick else 7)                        # ours; fla's are slow
    ref_repeats = 3
    tokens = B * T
    load_before = os.getloadavg()
    peak = matmul_peak()["best_gflops"]
    contenders = {"ours_chunk": chunk_kda, "fla_naive_chunk": naive_chunk_kda, "fla_naive_recurrent": naive_recurrent_kda}

    # fla's references take seconds per call at full size: warm them up on a short sequence instead
    small = make_inputs(B, 128, H, K, V)
    small_grad = make_inputs(B, 128, H, K, V, requires_grad=True)
    inputs = make_inputs(B, T, H, K, V)
    grad_inputs = make_inputs(B, T, H, K, V, requires_grad=True)
    reps = {"ours_chunk": repeats, "fla_naive_chunk": ref_repeats, "fla_naive_recurrent": ref_repeats}

    forward = round_robin({n: fwd(f, inputs) for n, f in contenders.items()}, reps,
                          {n: fwd(f, inputs if n == "ours_chunk" else small) for n, f in contenders.items()})
    with torch.no_grad():
        o_ref, _ = naive_recurrent_kda(*inputs)
        o_ours, _ = chunk_kda(*inputs)
        with FlopCounterMode(display=False) as counter:
            chunk_kda(*inputs)
    max_rel_err = ((o_ours - o_ref).abs().max() / o_ref.abs().max()).item()
    both = round_robin({n: fwd_bwd(f, grad_inputs) for n, f in contenders.items()}, reps,
                       {n: fwd_bwd(f, grad_inputs if n == "ours_chunk" else small_grad) for n, f in contenders.items()})
    # strong decay (g ~ U(-5, 0) per token and channel): the same contenders on those gates. fla's naive forms do
    # the same work whatever the gates; ours picks smaller sub-chunks (docs/benchmarks.md), so it is timed too
    strong_inputs = make_inputs(B, T, H, K, V, strong=True)
    small_strong = make_inputs(B, 128, H, K, V, strong=True)
    strong = round_robin({n: fwd(f, strong_inputs) for n, f in contenders.items()}, reps,
                         {n: fwd(f, strong_inputs if n == "ours_chunk" else small_strong)
                          for n, f in contenders.items()})

    f_sum = {n: summary(ts, tokens) for n, ts in forward.items()}
    b_sum = {n: summary(ts, tokens) for n, ts in both.items()}
    ours_s = f_sum["ours_chunk"]["median_s"]
    gflops = counter.get_total_flops() / ours_s / 1e9
    result = {
        "benchmark": "kda",
        "claim": "k3 chunk_kda (pure torch) vs fla naive_chunk_kda / naive_recurrent_kda on CPU",
        "flush_denormal": args.flush_denormal,
        "shape": {"B": B, "T": T, "H": H, "K": K, "V": V, "dtype": "float32", "chunk_size": 64,
                  "g": "logsigmoid(N(0,1)) per channel", "quick": args.quick},
        "machine": machine(loadavg_before=load_before, loadavg_after=os.getloadavg()),
        "torch": torch.__version__,
        "fla": getattr(fla, "__version__", "unknown"),
        "speedup_vs_fla_naive_chunk": f_sum["fla_naive_chunk"]["median_s"] / ours_s,
        "speedup_vs_fla_naive_recurrent": f_sum["fla_naive_recurrent"]["median_s"] / ours_s,
        "fwd_bwd_speedup_vs_fla_naive_chunk": b_sum["fla_naive_chunk"]["median_s"] / b_sum["ours_chunk"]["median_s"],
        "fwd_bwd_speedup_vs_fla_naive_recurrent":
            b_sum["fla_naive_recurrent"]["median_s"] / b_sum["ours_chunk"]["median_s"],
        "tokens_per_s": {n: s["tokens_per_s"] for n, s in f_sum.items()},
        "fwd_bwd_tokens_per_s": {n: s["tokens_per_s"] for n, s in b_sum.items()},
        "forward": f_sum,
        "fwd_bwd": b_sum,
        "strong_decay": {
            "g": "-5 * U(0, 1) per channel",
            "forward": {n: summary(ts, tokens) for n, ts in strong.items()},
            "speedup_vs_fla_naive_chunk": statistics.median(strong["fla_naive_chunk"])
            / statistics.median(strong["ours_chunk"]),
            "speedup_vs_fla_naive_recurrent": statistics.median(strong["fla_naive_recurrent"])
            / statistics.median(strong["ours_chunk"]),
        },
        "ours_forward_matmul_gflop": counter.get_total_flops() / 1e9,
        "gflops": gflops,
        "matmul_peak_gflops": peak,
        "fraction_of_matmul_peak": gflops / peak,
        "max_rel_err_vs_fla_naive_recurrent": max_rel_err,
        "train_shape": train_shape(repeats, naive_recurrent_kda),
    }
    out_path = write_result(bench_out("kda-flush-denormal" if args.flush_denormal else "kda", args.quick), result,
                            args.json)
    if not args.json:
        print(f"forward: {result['speedup_vs_fla_naive_chunk']:.1f}x vs fla naive_chunk, "
              f"{result['speedup_vs_fla_naive_recurrent']:.1f}x vs fla naive_recurrent; "
              f"fwd+bwd: {result['fwd_bwd_speedup_vs_fla_naive_chunk']:.1f}x / "
              f"{result['fwd_bwd_speedup_vs_fla_naive_recurrent']:.1f}x; "
              f"{gflops:.1f} GFLOP/s = {result['fraction_of_matmul_peak']:.0%} of matmul peak; at mini's training "
              "shape, the chunk size chosen from the gates against 64: " + ", ".join(
                  f"{n} {result['train_shape'][n]['speedup_auto_vs_c64']:.2f}x"
                  for n in ("typical", "init", "trained_like")) + f"; wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
