"""What do the MoE's routed experts contribute after training? Validation loss with parts of every MoE removed.

    python benchmarks/moe_contrib.py [--json] [--quick] [--preset mini-s|mini] [--steps N] [--seeds 0,1,2]
                                     [--set FIELD=VALUE ...]

For each seed: train the model in fp32 exactly as benchmarks/qat.py does (same corpus, budget, schedule and
seeds, so its fp32 runs are the same runs), then evaluate the trained weights on the whole validation split
  full         as trained
  no_routed    every MoE layer's routed path replaced by zero (the shared expert still runs)
  no_shared    every MoE layer's shared expert replaced by zero (the routed experts still run)
Removal is a forward hook that returns zeros for that submodule's output; the weights are not touched. Per
part: the loss it costs (ablated - full), mean, sample std and standard error over seeds, all paired (same
weights). Also the RMS of each part's output relative to the RMS of the MoE input, over the first
`--norm-batches` validation batches and all MoE layers: how large each part's contribution to the residual
stream is. Writes runs/bench/moe_contrib.json (--quick: runs/bench/quick/) atomically after every seed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qat as qat_bench  # noqa: E402  (the same model presets, fp32 training and evaluation)

from k3.ablate.cli import parse_sets  # noqa: E402
from k3.benchtools import machine, write_result  # noqa: E402
from k3.config import K3ConfigError  # noqa: E402
from k3.data import DEFAULT_VOCAB_SIZE, prepare_data  # noqa: E402
from k3.model.moe import MoE  # noqa: E402
from k3.train.batches import evaluate  # noqa: E402

PARTS = ("routed", "shared")


def _zero_output(module, inputs, output):
    return torch.zeros_like(output)


def part_module(moe: MoE, part: str) -> torch.nn.Module | None:
    """The submodule whose output is `part`'s contribution: the routed path ends in W_up (LatentMoE) or in the
    experts' combine (standard MoE); None when the layer has no such part (no shared expert)."""
    if part == "routed":
        return moe.w_up if moe.latent else moe.experts
    if part == "shared":
        return moe.shared
    raise ValueError(f"part {part!r} is unknown; use one of {PARTS}")


@contextmanager
def removed(model: torch.nn.Module, part: str):
    """Within the block, every MoE layer's `part` outputs zeros (a forward hook; weights untouched)."""
    handles = [m.register_forward_hook(_zero_output) for moe in model.modules() if isinstance(moe, MoE)
               if (m := part_module(moe, part)) is not None]
    if not handles:
        raise ValueError(f"the model has no MoE layer with a {part} part to remove")
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _rms(t: torch.Tensor) -> float:
    return t.float().pow(2).mean().sqrt().item()


def output_rms(model: torch.nn.Module, files, args) -> dict:
    """RMS of each part's output over the RMS of the MoE input, averaged over MoE layers and batches."""
    sums: dict[str, list[float]] = {p: [] for p in PARTS}
    current: dict[int, float] = {}
    handles = []
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        handles.append(moe.register_forward_pre_hook(
            lambda mod, inp: current.__setitem__(id(mod), _rms(inp[0]))))
        for part in PARTS:
            sub = part_module(moe, part)
            if sub is not None:
                handles.append(sub.register_forward_hook(
                    lambda mod, inp, out, moe=moe, part=part:
                    sums[part].append(_rms(out) / current[id(moe)])))
    try:
        evaluate(model, files.val, args.norm_batches, args.batch_size, args.seq_len)
    finally:
        for h in handles:
            h.remove()
    return {f"{p}_rms_over_input": (sum(v) / len(v) if v else None) for p, v in sums.items()}


def summarize(costs: list[float]) -> dict:
    mean, std, sem = qat_bench.mean_std_sem(costs)
    return {"mean": mean, "std": std, "sem": sem, "per_seed": costs}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="tiny model, a few steps: a smoke test of the script")
    qat_bench.add_run_args(ap)  # --preset --steps --batch-size --seq-len --lr --warmup-steps --seeds ... --data
    ap.add_argument("--norm-batches", type=int, default=4, help="validation batches for the output RMS (default 4)")
    ap.add_argument("--set", metavar="FIELD=VALUE", action="append", default=[],
                    help="override one model config field, e.g. --set routed_scale=2.827 (repeatable)")
    ap.add_argument("--out", default=None, help="result JSON (default runs/bench/moe_contrib.json)")
    args = qat_bench.finish_run_args(ap.parse_args(argv), "moe_contrib")
    if args.quick:
        args.norm_batches = 1
    seeds = qat_bench.parse_seeds(args.seeds)
    if args.steps < 1 or args.norm_batches < 1:
        raise SystemExit("--steps and --norm-batches must be >= 1")
    try:
        config = qat_bench.base_config(args.preset, args.quick)
        if args.set:
            config = config.replace(**parse_sets(args.set))
    except K3ConfigError as e:
        raise SystemExit(str(e)) from None
    if config.n_layers <= config.n_dense_layers:
        raise SystemExit(f"preset {args.preset!r} has no MoE layer: nothing to measure")
    data = args.data if config.vocab_size == DEFAULT_VOCAB_SIZE else f"{args.data}-v{config.vocab_size}"
    files = prepare_data(data, vocab_size=config.vocab_size)
    t0 = time.perf_counter()
    runs: dict[str, dict] = {}
    result: dict = {}
    for seed in seeds:
        model, rec, _ = qat_bench.train_run(config, files, args, "fp32", seed)
        r = runs[str(seed)] = {"full": rec["val_loss"], "train_s": rec["train_s"], **output_rms(model, files, args)}
        for part in PARTS:
            if config.n_shared_experts == 0 and part == "shared":
                continue
            with removed(model, part):
                r[f"no_{part}"] = qat_bench.val(model, files, args)["val_loss"]
            print(f"seed {seed} no_{part}: {r[f'no_{part}'] - r['full']:+.5f} nats", file=sys.stderr, flush=True)
        result = {
            "benchmark": "moe_contrib", "preset": config.name, "quick": args.quick, "config": config.to_dict(),
            "budget": {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
                       "warmup_steps": args.warmup_steps, "tokens": args.steps * args.batch_size * args.seq_len},
            "seeds": [int(s) for s in runs], "runs": runs,
            "val_loss": summarize([r["full"] for r in runs.values()]),
            **{f"cost_no_{p}": summarize([r[f"no_{p}"] - r["full"] for r in runs.values()])
               for p in PARTS if all(f"no_{p}" in r for r in runs.values())},
            **{f"{p}_rms_over_input": statistics.fmean(r[f"{p}_rms_over_input"] for r in runs.values())
               for p in PARTS if all(r[f"{p}_rms_over_input"] is not None for r in runs.values())},
            "wall_s": round(time.perf_counter() - t0, 1), "machine": machine(threads=args.threads),
            "command": "python benchmarks/moe_contrib.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        write_result(args.out, result)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{config.name}, {args.steps} steps, seeds {result['seeds']}: val loss {result['val_loss']['mean']:.4f}")
        for p in PARTS:
            c = result.get(f"cost_no_{p}")
            if c is not None:
                sem = f" ± {c['sem']:.4f} (SE)" if c["sem"] is not None else ""
                print(f"  without the {p} part: {c['mean']:+.4f}{sem} nats; its output RMS / input RMS "
                      f"{result.get(f'{p}_rms_over_input', float('nan')):.3g}")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
