"""Training throughput of `mini` on this machine: tokens/s, MFU, and where a step's time goes.

    python benchmarks/train.py [--json] [--quick] [--steps N] [--batch-size B] [--seq-len T] [--optimizer adamw|muon]
                               [--threads N] [--no-precision] [--val-seeds S --val-steps N]

Runs the real Trainer (fp32 on CPU, bf16 autocast on CUDA) on random tokens (throughput does not depend on
the text). After warm-up steps, `--steps` profiled steps are split into KDA, MLA, MoE, AttnRes, dense MLP,
embedding/head, the optimizer and the rest with k3.train.profiling.ComponentTimer (forward: timed calls;
backward: gradient hooks at each component's output and input; AttnRes backward: the gaps between
components); shares are medians over those steps of each part's fraction of its step. Then as many steps
again, without the profiler (its hooks cost time), give tokens/s (median step) and MFU against the measured
rate of a 2048^2 matmul in the same process (on a CPU the median of runs before and after the steps, whose
rate moves with other work on the machine). Writes runs/bench/train.json atomically.

On a CPU it then compares fp32 with bf16 autocast (`precision`; --no-precision skips it), at --threads threads
(default 1): two trainers of the same seed step in turn, profiled steps give each precision's component split,
unprofiled ones the step times; `bf16_over_fp32_step` is the median of the per-pair ratios fp32 / bf16, and
`bf16_matmul_over_fp32` the ratio of 2048^2 matmul rates measured in turn before and after. `--val-seeds S
--val-steps N` also trains the preset N steps in each precision for seeds 0..S-1 on the demo data (runs/data,
k3.data.prepare_data) and reports the full validation split's loss (evaluated in fp32) per seed, mean and std,
and whether the bf16 - fp32 difference lies within the seed spread: about 2 x 3 x 200 steps, for a quiet machine.
"""
from __future__ import annotations

import argparse
from collections import defaultdict
import json
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
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads of the fp32 / bf16 comparison")
    ap.add_argument("--no-precision", action="store_true", help="skip the fp32 / bf16 comparison")
    ap.add_argument("--val-seeds", type=int, default=0, help="seeds of the fp32 / bf16 validation-loss check")
    ap.add_argument("--val-steps", type=positive_int, default=200, help="training steps of each validation run")
    ap.add_argument("--data", default="runs/data", help="demo data folder of the validation check")
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
    if cpu and not args.no_precision:
        result["precision"] = compare_precisions(config, B, T, steps, args.warmup, args.optimizer, args.threads)
        result["bf16_over_fp32_step"] = result["precision"]["bf16_over_fp32_step"]
        result["bf16_matmul_over_fp32"] = result["precision"]["bf16_matmul_over_fp32"]
    if cpu and args.val_seeds > 0:
        result["precision_val"] = validation_check(config, args.data, args.val_seeds, args.val_steps, B, T,
                                                   args.optimizer, args.threads)
    # a GPU run goes to its own file: the CPU figure in docs/benchmarks.md stays the CPU one
    name = "train" if trainer.device.type == "cpu" else f"train_{trainer.device.type}"
    out = write_result(Path(args.out or bench_out(name, args.quick)), result, args.json)
    if not args.json:
        print(f"{preset} on {trainer.device} ({result['dtype']}), batch {B} x {T}: {result['tokens_per_s']:.0f} "
              f"tokens/s, step {dt * 1e3:.0f} ms, MFU {result['mfu'] * 100:.1f}% of a measured "
              f"{peak / 1e9:.0f} GFLOP/s")
        for name, v in sorted(breakdown.items(), key=lambda kv: -kv[1]["share"]):
            print(f"  {name:<11} {v['share'] * 100:5.1f}%")
        if "precision" in result:
            pr = result["precision"]
            print(f"bf16 / fp32 at {pr['threads']} thread(s): step {pr['bf16_over_fp32_step']:.2f}x faster "
                  f"(pairs {pr['step_ratio_all']}), 2048^2 matmul {pr['bf16_matmul_over_fp32']:.2f}x")
            for comp in pr["fp32"]["components_s"]:
                a, b = pr["fp32"]["components_s"][comp], pr["bf16"]["components_s"].get(comp, 0.0)
                print(f"  {comp:<11} fp32 {a:6.3f} s  bf16 {b:6.3f} s  {a / b if b else float('nan'):5.2f}x")
        if "precision_val" in result:
            print(json.dumps(result["precision_val"]["summary"]))
        print(f"wrote {out}")
    return result


def compare_precisions(config, B: int, T: int, steps: int, warmup: int, optimizer: str, threads: int) -> dict:
    """fp32 against bf16 autocast on this CPU, interleaved so that load from other work hits both alike."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trainers, timers = {}, {}
        for p in ("fp32", "bf16"):
            tc = TrainConfig(steps=warmup + 2 * steps + 1, batch_size=B, seq_len=T, optimizer=optimizer, device="cpu",
                             warmup_steps=1, measure_mfu=False, record_attnres=True, precision=p)
            trainers[p] = Trainer(config, tc, RandomTokens(config.vocab_size))
            timers[p] = ComponentTimer(trainers[p].model)
        mm = {p: [] for p in trainers}

        def matmuls():
            for p, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                mm[p].append(matmul_peak(5, dtype=dt)["median_gflops"])

        matmuls()
        for _ in range(warmup):
            for tr in trainers.values():
                tr.train_step()
        parts = {p: defaultdict(list) for p in trainers}
        for _ in range(steps):  # profiled: where each precision's time goes
            for p, tr in trainers.items():
                timers[p].enabled = True
                timers[p].reset()
                rec = tr.train_step()
                timers[p].enabled = False
                split = timers[p].split(rec["forward_s"], rec["backward_s"])
                for comp in set(split["forward"]) | set(split["backward"]):
                    parts[p][comp].append(split["forward"].get(comp, 0.0) + split["backward"].get(comp, 0.0))
                parts[p]["optimizer"].append(rec["optimizer_s"])
                parts[p]["other"][-1] += max(0.0, rec["step_time_s"] - rec["forward_s"] - rec["backward_s"]
                                             - rec["optimizer_s"])
        times = {p: [] for p in trainers}
        for _ in range(steps):  # unprofiled, in turn: the step times and their per-pair ratios
            for p, tr in trainers.items():
                times[p].append(tr.train_step()["step_time_s"])
        matmuls()
    finally:
        torch.set_num_threads(before)
    ratios = [a / b for a, b in zip(times["fp32"], times["bf16"])]
    out = {"threads": threads, "pairs": steps,
           "bf16_over_fp32_step": round(statistics.median(ratios), 3),
           "step_ratio_all": [round(r, 3) for r in ratios],
           "bf16_matmul_over_fp32": round(statistics.median(mm["bf16"]) / statistics.median(mm["fp32"]), 3),
           "matmul_gflops": {p: [round(g, 1) for g in v] for p, v in mm.items()}}
    for p in trainers:
        out[p] = {"step_time_s_median": round(statistics.median(times[p]), 4),
                  "step_time_s_all": [round(t, 4) for t in times[p]],
                  "components_s": {c: round(statistics.median(v), 4) for c, v in sorted(parts[p].items())}}
    out["definition"] = ("bf16_over_fp32_step: median over pairs of consecutive unprofiled steps (fp32, then bf16, "
                         "same seed and batch) of fp32 s / bf16 s; components_s: median s per profiled step "
                         "(forward + backward; as the breakdown above); bf16_matmul_over_fp32: median bf16 / median "
                         "fp32 rate of a 2048^2 matmul, measured in turn before and after the steps")
    return out


def validation_check(config, data: str, seeds: int, steps: int, B: int, T: int, optimizer: str,
                     threads: int) -> dict:
    """Train `steps` steps per seed and precision on the demo data; the full validation split's loss in fp32."""
    from k3.data import prepare_data
    from k3.train.batches import evaluate

    from k3.data import DEFAULT_VOCAB_SIZE

    # the demo's folder holds its 8192-token vocabulary; another preset's vocabulary gets a folder beside it
    files = prepare_data(data if config.vocab_size == DEFAULT_VOCAB_SIZE else f"{data}-v{config.vocab_size}",
                         vocab_size=config.vocab_size, replace=False)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    runs: dict[str, dict[str, float]] = {}
    try:
        for seed in range(seeds):
            runs[str(seed)] = {}
            for p in ("fp32", "bf16"):
                tc = TrainConfig(steps=steps, batch_size=B, seq_len=T, optimizer=optimizer, device="cpu", seed=seed,
                                 measure_mfu=False, record_attnres=False, doc_mask=False, precision=p)
                tr = Trainer(config, tc, files.train)
                for _ in range(steps):
                    tr.train_step()
                runs[str(seed)][p] = round(evaluate(tr.model, files.val, None, B, T), 5)
    finally:
        torch.set_num_threads(before)
    summary = {}
    for p in ("fp32", "bf16"):
        xs = [r[p] for r in runs.values()]
        summary[p] = {"mean": round(statistics.fmean(xs), 5),
                      "std": round(statistics.stdev(xs), 5) if len(xs) > 1 else None}
    diffs = [r["bf16"] - r["fp32"] for r in runs.values()]
    summary["bf16_minus_fp32_mean"] = round(statistics.fmean(diffs), 5)
    spread = max((summary[p]["std"] or 0.0) for p in ("fp32", "bf16"))
    summary["within_seed_spread"] = (abs(summary["bf16_minus_fp32_mean"]) <= spread) if seeds > 1 else None
    return {"seeds": seeds, "steps": steps, "threads": threads, "data": data, "val_loss": runs, "summary": summary,
            "definition": "val_loss: the whole validation split, evaluated in fp32 after `steps` steps; "
                          "within_seed_spread: |mean(bf16 - fp32)| <= the larger of the two precisions' seed std"}


if __name__ == "__main__":
    main()
