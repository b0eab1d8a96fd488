"""Document masking in training (`k3 train`'s default) against training across document boundaries (`--no-doc-mask`),
side by side on `mini`.

    python benchmarks/doc_mask.py [--json] [--quick] [--preset mini] [--steps N] [--seeds 0,1,2]

Per seed, the two runs are built from the same seed and trained on the same batches, one step of each in turn
(so host drift slows both alike), to the same step count. Reported per arm and paired per seed (masked - not):
  val_bpb_masked   validation bits per byte with each packed document read on its own, as a prompt is served
  val_bpb_packed   the same windows read across document boundaries (how `--no-doc-mask` trains)
  step_s           median training step time
and the share of training windows that hold a document boundary. Writes runs/bench/doc_mask.json (--quick:
runs/bench/quick/) atomically after every seed.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_contrib  # noqa: E402  (summarize)
import qat as qat_bench  # noqa: E402  (the same presets, budget flags and data)

from k3.benchtools import machine, write_result  # noqa: E402
from k3.data import DEFAULT_VOCAB_SIZE, prepare_data  # noqa: E402
from k3.train.batches import evaluate  # noqa: E402
from k3.train.config import TrainConfig  # noqa: E402
from k3.train.trainer import Trainer  # noqa: E402

ARMS = ("doc_mask", "no_doc_mask")
KEYS = ("val_bpb_masked", "val_bpb_packed", "step_s", "train_loss_last10")


def boundary_share(files, args, n_batches: int = 50) -> float:
    """The share of training windows (of the first steps' batches) in which a document ends and another starts."""
    crossing = total = 0
    for step in range(n_batches):
        _, _, d = files.train.get_batch(step, args.batch_size, args.seq_len, 0, docs=True)
        crossing += int((d[:, 1:] != d[:, :-1]).any(1).sum())
        total += d.shape[0]
    return crossing / total


def run_seed(config, files, args, seed: int, bpt: float) -> dict:
    trainers = {}
    for arm in ARMS:
        tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                         warmup_steps=args.warmup_steps, seed=seed, measure_mfu=False, record_attnres=False,
                         doc_mask=arm == "doc_mask")
        trainers[arm] = Trainer(config, tc, files.train, None)
        assert trainers[arm].doc_mask == (arm == "doc_mask")
    records = {arm: [] for arm in ARMS}
    from tqdm.auto import tqdm

    tty = sys.stderr.isatty()
    for _ in tqdm(range(args.steps), desc=f"seed {seed}", unit="step", file=sys.stderr, dynamic_ncols=tty,
                  mininterval=0.5 if tty else 30.0):
        for arm in ARMS:
            records[arm].append(trainers[arm].train_step())
    out = {}
    for arm in ARMS:
        model, recs = trainers[arm].model, records[arm]
        r = {"train_loss_last10": statistics.fmean(x["loss"] for x in recs[-10:]),
             "step_s": statistics.median(x["step_time_s"] for x in recs[1:])}  # the first carries start-up
        for how, mask in (("masked", True), ("packed", False)):
            loss = evaluate(model, files.val, args.eval_batches, args.batch_size, args.seq_len, doc_mask=mask)
            r[f"val_loss_{how}"] = loss
            r[f"val_bpb_{how}"] = loss / math.log(2) / bpt
        print(f"seed {seed} {arm}: {json.dumps(r)}", file=sys.stderr, flush=True)
        out[arm] = r
    return out


def summaries(runs: dict) -> dict:
    done = {s: r for s, r in runs.items() if all(a in r for a in ARMS)}
    return {"seeds": [int(s) for s in done], "runs": runs,
            **{a: {k: moe_contrib.summarize([r[a][k] for r in done.values()]) for k in KEYS} for a in ARMS},
            "masked_minus_not": {k: moe_contrib.summarize([r["doc_mask"][k] - r["no_doc_mask"][k]
                                                          for r in done.values()]) for k in KEYS},
            "step_time_ratio": moe_contrib.summarize([r["doc_mask"]["step_s"] / r["no_doc_mask"]["step_s"]
                                                      for r in done.values()])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="tiny model, a few steps: a smoke test of the script")
    qat_bench.add_run_args(ap)
    ap.add_argument("--out", default=None, help="result JSON (default runs/bench/doc_mask.json)")
    ap.set_defaults(preset="mini")
    args = qat_bench.finish_run_args(ap.parse_args(argv), "doc_mask")
    seeds = qat_bench.parse_seeds(args.seeds)
    config = qat_bench.base_config(args.preset, args.quick)
    data = args.data if config.vocab_size == DEFAULT_VOCAB_SIZE else f"{args.data}-v{config.vocab_size}"
    files = prepare_data(data, vocab_size=config.vocab_size)
    bpt = files.val.manifest["bytes_per_token"]
    share = boundary_share(files, args)
    t0 = time.perf_counter()
    runs: dict[str, dict] = {}
    result: dict = {}
    for seed in seeds:
        runs[str(seed)] = run_seed(config, files, args, seed, bpt)
        result = {"benchmark": "doc_mask", "preset": config.name, "quick": args.quick,
                  "budget": {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                             "lr": args.lr, "warmup_steps": args.warmup_steps,
                             "tokens": args.steps * args.batch_size * args.seq_len},
                  "windows_with_a_boundary": round(share, 4), "bytes_per_token": bpt, **summaries(runs),
                  "wall_s": round(time.perf_counter() - t0, 1), "machine": machine(threads=args.threads),
                  "command": "python benchmarks/doc_mask.py " + " ".join(argv if argv is not None else sys.argv[1:])}
        write_result(args.out, result)
    if args.json:
        print(json.dumps(result))
    else:
        d = result["masked_minus_not"]
        print(f"{result['preset']}, {args.steps} steps x {args.batch_size} x {args.seq_len}, seeds {result['seeds']}; "
              f"{share:.1%} of windows cross a document boundary")
        for k in KEYS:
            print(f"  {k:<18} masked {result['doc_mask'][k]['mean']:.4f}  not {result['no_doc_mask'][k]['mean']:.4f}"
                  f"  diff {d[k]['mean']:+.4f} +- {d[k].get('sem') or 0:.4f}")
    return result


if __name__ == "__main__":
    main()
