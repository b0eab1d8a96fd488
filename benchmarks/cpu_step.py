"""Two CPU fixes to a training step, each against the step without it: the fused SiTU-GLU and the allocator tuning.

    python benchmarks/cpu_step.py [--json] [--quick] [--rounds 3] [--steps 8] [--batch-size 4] [--threads 2]

Each variant trains `mini` (the demo's batch shape, random tokens, AdamW, fp32) in its own process, because the
allocator setting (k3.train.device.tune_cpu_allocator, glibc's mmap and trim thresholds) is process-wide and
cannot be undone: `fast` (both fixes, what k3 runs), `ref_glu` (the composed SiTU formula, `situ_glu_ref`, put
in place of the fused one), `default_alloc` (K3_CPU_MALLOPT=0) and `neither`. Rounds run the four in turn, so a slow
phase of the machine hits all of them; each process reports the median of its timed steps after warm-up, and a
ratio is the median over rounds of t(variant) / t(fast). Also the SiTU op alone, fused against composed, forward
and backward on the experts' shape [N*k, ffn], in one process (`glu_op`). Writes runs/bench/cpu_step.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from k3.benchtools import bench_out, machine, paired, positive_int, write_result

VARIANTS = {"fast": {}, "ref_glu": {"K3_BENCH_REF_GLU": "1"}, "default_alloc": {"K3_CPU_MALLOPT": "0"},
            "neither": {"K3_BENCH_REF_GLU": "1", "K3_CPU_MALLOPT": "0"}}


def child(steps: int, batch: int, seq: int, threads: int, warmup: int) -> dict:
    """One variant's run, in this process (environment as the parent set it): median step seconds, peak RSS."""
    import resource

    torch.set_num_threads(threads)
    if os.environ.get("K3_BENCH_REF_GLU") == "1":
        import k3.ops.glu as glu

        glu.situ_glu = glu.situ_glu_ref  # glu_for reads the module attribute when the model is built
    from k3.benchtools import RandomTokens
    from k3.config import get_config
    from k3.train.device import tune_cpu_allocator
    from k3.train.trainer import TrainConfig, Trainer

    config = get_config("mini")
    tc = TrainConfig(steps=warmup + steps + 1, batch_size=batch, seq_len=seq, warmup_steps=1, measure_mfu=False)
    tr = Trainer(config, tc, RandomTokens(config.vocab_size))
    for _ in range(warmup):
        tr.train_step()
    times = [tr.train_step()["step_time_s"] for _ in range(steps)]
    return {"step_s": statistics.median(times), "tuned_allocator": tune_cpu_allocator(),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def glu_op(threads: int, rows: int, ffn: int, repeats: int) -> dict:
    from k3.ops.glu import situ_glu, situ_glu_ref

    torch.set_num_threads(threads)
    g = torch.randn(rows, ffn, requires_grad=True)
    u = torch.randn(rows, ffn, requires_grad=True)
    dh = torch.randn(rows, ffn)

    def fb(fn):
        return lambda: torch.autograd.grad(fn(g, u, 4.0, 25.0), (g, u), dh)

    r = paired(fb(situ_glu), fb(situ_glu_ref), repeats)
    return {"shape": [rows, ffn], "fused_s": r["a_median_s"], "composed_s": r["b_median_s"],
            "composed_over_fused": r["ratio_median"], "range": [r["ratio_min"], r["ratio_max"]]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="1 round of 2 steps: a smoke test")
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--steps", type=positive_int, default=8, help="timed steps per process")
    ap.add_argument("--warmup", type=positive_int, default=3)
    ap.add_argument("--batch-size", type=positive_int, default=4)
    ap.add_argument("--seq-len", type=positive_int, default=128)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--out", default=None, help="default runs/bench/cpu_step.json (quick: runs/bench/quick/)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    if args.child:
        print(json.dumps(child(args.steps, args.batch_size, args.seq_len, args.threads, args.warmup)))
        return {}
    t0 = time.perf_counter()
    runs = {v: [] for v in VARIANTS}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--threads", str(args.threads)]
    base_env = {k: v for k, v in os.environ.items() if k not in ("K3_BENCH_REF_GLU", "K3_CPU_MALLOPT")}
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for v in order:
            out = subprocess.run(cmd, env={**base_env, **VARIANTS[v]}, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"variant {v} failed:\n{out.stderr[-2000:]}")
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds} {v}: {runs[v][-1]['step_s']:.3f} s/step", file=sys.stderr)
    ratios = {v: statistics.median(runs[v][i]["step_s"] / runs["fast"][i]["step_s"] for i in range(args.rounds))
              for v in VARIANTS if v != "fast"}
    tokens = args.batch_size * args.seq_len
    result = {
        "benchmark": "cpu_step", "preset": "mini", "batch_size": args.batch_size, "seq_len": args.seq_len,
        "threads": args.threads, "rounds": args.rounds, "steps": args.steps,
        "step_s": {v: statistics.median(x["step_s"] for x in runs[v]) for v in VARIANTS},
        "tokens_per_s": {v: tokens / statistics.median(x["step_s"] for x in runs[v]) for v in VARIANTS},
        "peak_rss_mb": {v: max(x["peak_rss_mb"] for x in runs[v]) for v in VARIANTS},
        "over_fast": ratios,
        "allocator_tuned": {v: runs[v][0]["tuned_allocator"] for v in VARIANTS},
        "glu_op": glu_op(args.threads, tokens * 8, 256, 3 if args.quick else 15),
        "definitions": {"over_fast": "median over rounds of step seconds(variant) / step seconds(fast, both fixes)",
                        "glu_op": "SiTU forward + backward on [tokens * top-k, expert ffn]: paired(a = fused "
                                  "situ_glu, b = composed situ_glu_ref)"},
        "machine": machine(), "wall_s": round(time.perf_counter() - t0, 1),
    }
    path = write_result(args.out or bench_out("cpu_step", args.quick), result, args.json)
    if not args.json:
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
