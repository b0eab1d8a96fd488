"""Training throughput of `mini` on this machine: tokens/s, MFU, and where a step's time goes.

    python benchmarks/train.py [--json] [--quick] [--steps N] [--batch-size B] [--seq-len T] [--optimizer adamw|muon]

Runs the real Trainer (fp32 on CPU, bf16 autocast on CUDA) on random tokens (throughput does not depend on
the text). After warm-up steps, `--steps` profiled steps are split into KDA, MLA, MoE, AttnRes, dense MLP,
embedding/head, the optimizer and the rest with k3.train.profiling.ComponentTimer (forward: timed calls;
backward: gradient hooks at each component's output and input; AttnRes backward: the gaps between
components); shares are medians over those steps of each part's fraction of its step. Then as many steps
again, without the profiler (its hooks cost time), give tokens/s (median step) and MFU against the measured
rate of a 2048^2 matmul in the same process (on a CPU the median of runs before and after the steps, whose
rate moves with other work on the machine). Writes runs/bench/train.json atomically.
"""
from __future__ import annotations

import argparse
from collections import defaultdict
import statistics
from pathlib import Path

import torch

from k3.benchtools import RandomTokens, bench_out, loadavg, machine, matmul_peak, positive_int, write_result
from k3.config import get_config
from k3.train.metrics import measured_peak_flops
from k3.train.profiling import ComponentTimer
from k3.train.trainer import TrainConfig, Trainer


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="the tiny preset and a few steps, for smoke tests")
    ap.add_argument("--preset", default=None, help="model preset (default mini; tiny with --quick)")
    ap.add_argument("--steps", type=positive_int, default=None, help="timed steps (default 5; 3 with --quick)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=None, help="default 8 (2 with --quick)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 128 (32 with --quick)")
    ap.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--out", default=None, help="default runs/bench/train.json (quick runs: runs/bench/quick/)")
    args = ap.parse_args(argv)
    preset = args.preset or ("tiny" if args.quick else "mini")
    steps = args.steps or (3 if args.quick else 5)
    B = args.batch_size or (2 if args.quick else 8)
    T = args.seq_len or (32 if args.quick else 128)

    config = get_config(preset)
    data = RandomTokens(config.vocab_size)
    tc = TrainConfig(steps=args.warmup + 2 * steps + 1, batch_size=B, seq_len=T, optimizer=args.optimizer,
                     device=args.device, warmup_steps=1, measure_mfu=False, record_attnres=True)
    trainer = Trainer(config, tc, data)
    timer = ComponentTimer(trainer.model, sync=trainer.device.type == "cuda")
    machine_before = machine()
    cpu = trainer.device.type == "cpu"
    # on a CPU shared with other work the matmul rate moves within minutes: it is measured before and after the
    # steps and the median of the two is the peak (as benchmarks/moe.py does); on a GPU one bf16 measurement
    peak_runs = [matmul_peak(5)] if cpu else []
    for _ in range(args.warmup):
        trainer.train_step()
    shares = defaultdict(list)
    timer.enabled = True
    for _ in range(steps):
        timer.reset()
        rec = trainer.train_step()
        dt_step = rec["step_time_s"]
        parts = timer.split(rec["forward_s"], rec["backward_s"])
        for comp in set(parts["forward"]) | set(parts["backward"]):
            shares[comp].append((parts["forward"].get(comp, 0.0) + parts["backward"].get(comp, 0.0)) / dt_step)
            shares[comp + ".forward_s"].append(parts["forward"].get(comp, 0.0))
            shares[comp + ".backward_s"].append(parts["backward"].get(comp, 0.0))
        shares["optimizer"].append(rec["optimizer_s"] / dt_step)
        shares["optimizer.s"].append(rec["optimizer_s"])
        rest = dt_step - rec["forward_s"] - rec["backward_s"] - rec["optimizer_s"]
        shares["other"][-1] += max(0.0, rest) / dt_step  # data loading, QK-Clip, balancing, bookkeeping
    timer.enabled = False
    # throughput and MFU from as many steps again without the profiler, whose hooks (and, on CUDA, its
    # synchronisations at every component) would slow the steps it times
    times = [trainer.train_step()["step_time_s"] for _ in range(steps)]
    dt = statistics.median(times)
    if cpu:
        peak_runs.append(matmul_peak(5))
        peak = statistics.median(r["median_gflops"] for r in peak_runs) * 1e9
    else:
        peak = measured_peak_flops(trainer.device, torch.bfloat16)
    tokens = B * T
    flops = trainer.flops_per_token * tokens / dt
    breakdown = {}
    for comp in sorted(k for k in shares if "." not in k):
        entry = {"share": round(statistics.median(shares[comp]), 4)}
        if comp == "optimizer":
            entry["s"] = round(statistics.median(shares["optimizer.s"]), 4)
        else:
            entry["forward_s"] = round(statistics.median(shares[comp + ".forward_s"]), 4)
            entry["backward_s"] = round(statistics.median(shares[comp + ".backward_s"]), 4)
        breakdown[comp] = entry
    accounted = sum(v["share"] for v in breakdown.values())

    from k3.model.accounting import count_params

    counts = count_params(trainer.model)
    result = {
        "benchmark": "train",
        "quick": args.quick,
        "preset": preset,
        "params": counts["total"],
        "active_params": counts["active"],
        "shapes": {"batch_size": B, "seq_len": T, "tokens_per_step": tokens},
        "optimizer": args.optimizer,
        "device": str(trainer.device),
        "dtype": "bf16 autocast" if trainer.device.type == "cuda" else "fp32",
        "timed_steps": steps,
        "step_time_s_median": round(dt, 4),
        "step_time_s_all": [round(t, 4) for t in times],
        "tokens_per_s": round(tokens / dt, 1),
        "flops_per_token": trainer.flops_per_token,
        "achieved_flops": flops,
        "peak_flops_measured": peak,
        "matmul_peak_runs": peak_runs,
        "mfu": round(flops / peak, 4),
        "breakdown": breakdown,
        "breakdown_accounted_share": round(accounted, 4),
        "definitions": {
            "mfu": "model FLOPs per token (k3.train.metrics.flops_per_token: 6 x active non-embedding params + "
                   "attention/KDA/AttnRes terms) x tokens/s / measured 2048^2 matmul FLOP/s (CPU: the median of "
                   "runs before and after the steps, each the median of 5); tokens/s and the "
                   "step times from timed_steps steps run without the component profiler, after the profiled ones",
            "share": "median over timed steps of (forward + backward s) / step s; backward from gradient hooks "
                     "at component boundaries, AttnRes backward = gaps between components (includes the "
                     "pre-norms); 'other' = loss, norms, embedding backward, data, clipping excluded "
                     "(in optimizer), QK-Clip, balancing",
        },
        "machine": machine_before,
        "loadavg_1m_after": loadavg(),
    }
    # a GPU run goes to its own file: the CPU figure in docs/benchmarks.md stays the CPU one
    name = "train" if trainer.device.type == "cpu" else f"train_{trainer.device.type}"
    out = write_result(Path(args.out or bench_out(name, args.quick)), result, args.json)
    if not args.json:
        print(f"{preset} on {trainer.device} ({result['dtype']}), batch {B} x {T}: {result['tokens_per_s']:.0f} "
              f"tokens/s, step {dt * 1e3:.0f} ms, MFU {result['mfu'] * 100:.1f}% of a measured "
              f"{peak / 1e9:.0f} GFLOP/s")
        for name, v in sorted(breakdown.items(), key=lambda kv: -kv[1]["share"]):
            print(f"  {name:<11} {v['share'] * 100:5.1f}%")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
