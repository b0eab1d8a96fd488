"""Two CPU fixes to a training step, each against the step without it: the fused SiTU-GLU and the allocator tuning.

    python benchmarks/cpu_step.py [--json] [--quick] [--rounds 8] [--batch-size 8] [--threads 2]

One Trainer (`mini`, the demo's batch shape, random tokens, AdamW, fp32) steps through four variants in turn, round
after round, so that a slow phase of the machine hits all of them (separate processes, tried first, differed by
more than the effect: 0.71-0.98 s for the same variant): `fast` (both fixes, what k3 runs), `ref_glu` (the composed
SiTU formula, `situ_glu_ref`, in every GLU), `default_alloc` (glibc's mmap and trim thresholds set back to their
initial 128 KiB) and `neither`. The allocator is switched with mallopt between steps, as
k3.train.device.tune_cpu_allocator sets it. A ratio is the median over rounds of t(variant) / t(fast) within the
round. Also the SiTU op alone, fused against composed, forward and backward on the experts' shape [N*k, ffn]
(`glu_op`). Writes runs/bench/cpu_step.json.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import time

import torch

from k3.benchtools import RandomTokens, bench_out, machine, paired, positive_int, write_result
from k3.config import get_config
from k3.ops.glu import situ_glu, situ_glu_ref
from k3.train import device as dev
from k3.train.device import tune_cpu_allocator
from k3.train.trainer import TrainConfig, Trainer

VARIANTS = ("fast", "ref_glu", "default_alloc", "neither")
GLIBC_DEFAULT = 128 * 1024  # M_MMAP_THRESHOLD's and M_TRIM_THRESHOLD's initial values


def set_allocator(tuned: bool) -> None:
    """glibc's thresholds as tune_cpu_allocator sets them, or back to their initial values."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(dev._M_MMAP_THRESHOLD, dev._CPU_ALLOC_MMAP_BYTES if tuned else GLIBC_DEFAULT)
    libc.mallopt(dev._M_TRIM_THRESHOLD, dev._CPU_ALLOC_TRIM_BYTES if tuned else GLIBC_DEFAULT)


def set_glu(model: torch.nn.Module, fused: bool, beta: float, lbeta: float) -> None:
    fn = functools.partial(situ_glu if fused else situ_glu_ref, beta=beta, linear_beta=lbeta)
    for m in model.modules():
        if hasattr(m, "glu") and isinstance(getattr(m, "glu"), functools.partial):
            m.glu = fn


def glu_op(rows: int, ffn: int, repeats: int) -> dict:
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
    ap.add_argument("--quick", action="store_true", help="tiny preset, 1 round: a smoke test")
    ap.add_argument("--rounds", type=positive_int, default=8)
    ap.add_argument("--warmup", type=positive_int, default=2, help="steps per variant before the rounds")
    ap.add_argument("--batch-size", type=positive_int, default=8)
    ap.add_argument("--seq-len", type=positive_int, default=128)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--out", default=None, help="default runs/bench/cpu_step.json (quick: runs/bench/quick/)")
    args = ap.parse_args(argv)
    preset = "tiny" if args.quick else "mini"
    if args.quick:
        args.rounds, args.warmup = 1, 1
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tuned = tune_cpu_allocator()
    config = get_config(preset)
    steps = args.warmup * len(VARIANTS) + args.rounds * len(VARIANTS) + 1
    tc = TrainConfig(steps=steps, batch_size=args.batch_size, seq_len=args.seq_len, warmup_steps=1, measure_mfu=False)
    tr = Trainer(config, tc, RandomTokens(config.vocab_size))
    beta, lbeta = float(config.situ_beta), float(config.situ_linear_beta)

    def step(variant: str) -> float:
        set_glu(tr.model, variant in ("fast", "default_alloc"), beta, lbeta)
        if tuned:
            set_allocator(variant in ("fast", "ref_glu"))
        return tr.train_step()["step_time_s"]

    for v in VARIANTS:
        for _ in range(args.warmup):
            step(v)
    times = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in (VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))):
            times[v].append(step(v))
    if tuned:
        set_allocator(True)
    ratios = {v: statistics.median(times[v][i] / times["fast"][i] for i in range(args.rounds))
              for v in VARIANTS if v != "fast"}
    spread = {v: [min(times[v][i] / times["fast"][i] for i in range(args.rounds)),
                  max(times[v][i] / times["fast"][i] for i in range(args.rounds))] for v in ratios}
    tokens = args.batch_size * args.seq_len
    result = {
        "benchmark": "cpu_step", "preset": preset, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "threads": args.threads, "rounds": args.rounds, "allocator_switchable": tuned,
        "step_s": {v: statistics.median(times[v]) for v in VARIANTS},
        "tokens_per_s": {v: tokens / statistics.median(times[v]) for v in VARIANTS},
        "over_fast": ratios, "over_fast_range": spread, "times_s": times,
        "glu_op": glu_op(tokens * 8, 256, 3 if args.quick else 15),
        "definitions": {"over_fast": "median over rounds of step seconds(variant) / step seconds(fast) in the same "
                                     "round; one Trainer, variants in turn",
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
