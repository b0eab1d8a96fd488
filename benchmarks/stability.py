"""Does a config change make early training steadier? Per-step traces of paired fp32 runs, one per value.

    python benchmarks/stability.py [--json] [--quick] [--preset mini] [--steps N] [--seeds 0,1,2,3]
                                   --vary FIELD=A,B [--set FIELD=VALUE ...] [--merge A.json ...]

For each seed and each value of the varied config field, train exactly as benchmarks/qat.py's fp32 runs do
(same corpus, budget, schedule, seeds and trainer; the first value of --vary is the reference) and record
every step: training loss, gradient norm before clipping, max/mean expert load averaged over MoE layers.
Then evaluate on the validation split (--eval-batches, default the whole split). Reported per value
(summary.v0 is the reference, v1, ... the others): the validation loss per seed, its mean, the paired
difference to the reference (mean, sample std, standard error over seeds), the largest gradient norm, the
number of steps whose gradient norm exceeded --spike (default 10; the trainer clips at 1, so such a step
spends its update on whatever produced the spike), and the mean training loss over consecutive --window-step
windows. A plot of the training-loss curves goes next to the JSON (PNG, same name). Writes
runs/bench/stability.json (--quick: runs/bench/quick/) atomically after every run; --merge keeps the runs of
other files of the same experiment (seeds split over processes), and runs already there are not repeated.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qat as qat_bench  # noqa: E402  (the same model presets, fp32 training and evaluation)

from k3.ablate.cli import parse_sets  # noqa: E402
from k3.benchtools import machine, write_result  # noqa: E402
from k3.config import K3ConfigError  # noqa: E402
from k3.data import DEFAULT_VOCAB_SIZE, prepare_data  # noqa: E402
from k3.train.plots import save_figure  # noqa: E402


def parse_vary(spec: str) -> tuple[str, list]:
    """'kda_norm_eps=1e-6,1e-4' -> ('kda_norm_eps', [1e-06, 0.0001]); values parsed as by --set."""
    field, sep, raw = spec.partition("=")
    values = [v for v in raw.split(",") if v.strip()]
    if not sep or len(values) < 2:
        raise SystemExit(f"--vary {spec!r}: give FIELD=A,B (two or more values; the first is the reference)")
    try:
        parsed = [parse_sets([f"{field}={v.strip()}"])[field] for v in values]
    except K3ConfigError as e:
        raise SystemExit(str(e)) from None
    if len({json.dumps(v) for v in parsed}) != len(parsed):
        raise SystemExit(f"--vary {spec!r}: the values must differ")
    return field, parsed


def trace_run(config, files, args, seed: int) -> dict:
    """Train one fp32 run step by step (qat.py's trainer), keep the per-step trace, evaluate at the end."""
    trainer = qat_bench.make_trainer(config, files, args, seed)
    records: list[dict] = []
    t0 = time.perf_counter()
    qat_bench._run_steps(trainer, args.steps, [], f"seed {seed}", records=records)
    steps = [{"loss": r["loss"], "grad_norm": r["grad_norm"], "load_max_mean": r.get("expert_load_max_mean_overall")}
             for r in records]
    return {"steps": steps, "train_s": round(time.perf_counter() - t0, 1), **qat_bench.val(trainer.model, files, args)}


def summarize_value(runs: dict, ref: dict | None, args) -> dict:
    """One value's runs {seed: run} -> summary; ref: the reference value's runs (paired by seed)."""
    seeds = sorted(runs, key=int)
    vals = [runs[s]["val_loss"] for s in seeds]
    mean, std, sem = qat_bench.mean_std_sem(vals)
    gnorms = [st["grad_norm"] for s in seeds for st in runs[s]["steps"]]
    n = len(runs[seeds[0]]["steps"])
    windows = [[_mean_of(runs[s]["steps"][i:i + args.window], "loss") for s in seeds]
               for i in range(0, n, args.window)]
    out = {"val_loss": dict(zip(seeds, vals)), "val_loss_mean": mean, "val_loss_std": std,
           "max_grad_norm": max(gnorms),
           "spike_steps": (spikes := {s: sum(st["grad_norm"] > args.spike for st in runs[s]["steps"]) for s in seeds}),
           "spike_steps_total": sum(spikes.values()),
           "window_loss_mean": [sum(w) / len(w) for w in windows],
           "load_max_mean": sum(_mean_of(runs[s]["steps"], "load_max_mean") or 0 for s in seeds) / len(seeds)}
    if ref is not None:
        diffs = [runs[s]["val_loss"] - ref[s]["val_loss"] for s in seeds]
        d_mean, d_std, d_sem = qat_bench.mean_std_sem(diffs)
        out["minus_reference"] = {"per_seed": dict(zip(seeds, diffs)), "mean": d_mean, "std": d_std, "sem": d_sem}
    return out


def _mean_of(steps: list[dict], key: str) -> float | None:
    xs = [s[key] for s in steps if s.get(key) is not None]
    return sum(xs) / len(xs) if xs else None


def plot(result: dict, path: Path) -> Path:
    """Training loss per step, one panel per seed, one line per value (a rolling mean over 5 steps)."""
    import matplotlib.pyplot as plt  # after k3.train.plots, which selects the Agg backend
    seeds = result["seeds"]
    fig, axes = plt.subplots(1, len(seeds), figsize=(3.6 * len(seeds), 3.2), sharey=True, squeeze=False)
    for ax, seed in zip(axes[0], seeds):
        for label, runs in result["runs"].items():
            losses = [st["loss"] for st in runs[str(seed)]["steps"]]
            smooth = [sum(losses[max(0, i - 4):i + 1]) / len(losses[max(0, i - 4):i + 1]) for i in range(len(losses))]
            ax.plot(range(1, len(losses) + 1), smooth, label=f"{result['field']}={label}", lw=1.2)
        ax.set_title(f"seed {seed}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training loss (5-step mean)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{result['preset']}: {result['budget']['steps']} steps, lr {result['budget']['lr']}", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="tiny model, a few steps: a smoke test of the script")
    qat_bench.add_run_args(ap)  # --preset --steps --batch-size --seq-len --lr --warmup-steps --seeds ... --data
    ap.add_argument("--vary", required=True, metavar="FIELD=A,B",
                    help="the config field to compare and its values; the first value is the reference")
    ap.add_argument("--set", metavar="FIELD=VALUE", action="append", default=[],
                    help="override one model config field for every run (repeatable)")
    ap.add_argument("--spike", type=float, default=10.0, help="gradient norm that counts as a spike (default 10)")
    ap.add_argument("--window", type=int, default=20, help="steps per loss window (default 20)")
    ap.add_argument("--merge", nargs="+", default=(), metavar="JSON",
                    help="also keep the runs of these result files (same experiment, other seeds)")
    ap.add_argument("--out", default=None, help="result JSON (default runs/bench/stability.json)")
    args = qat_bench.finish_run_args(ap.parse_args(argv), "stability")
    if args.steps < 1 or args.window < 1 or not args.spike > 0:
        raise SystemExit("--steps and --window must be >= 1 and --spike > 0")
    seeds = qat_bench.parse_seeds(args.seeds)
    field, values = parse_vary(args.vary)
    try:
        base = qat_bench.base_config(args.preset, args.quick)
        if args.set:
            base = base.replace(**parse_sets(args.set))
        configs = {json.dumps(v): base.replace(**{field: v}) for v in values}
    except K3ConfigError as e:
        raise SystemExit(str(e)) from None
    data = args.data if base.vocab_size == DEFAULT_VOCAB_SIZE else f"{args.data}-v{base.vocab_size}"
    files = prepare_data(data, vocab_size=base.vocab_size)
    budget = {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
              "warmup_steps": args.warmup_steps, "eval_batches": args.eval_batches}
    runs: dict[str, dict[str, dict]] = {label: {} for label in configs}
    for path in args.merge:
        other = json.loads(Path(path).read_text())
        same = (other.get("preset"), other.get("budget"), other.get("field"), other.get("values"),
                other.get("base_config"))
        if same != (base.name, budget, field, values, base.replace(**{field: values[0]}).to_dict()):
            raise SystemExit(f"--merge {path}: it measured another experiment (preset, budget, field, values or "
                             "config differ); merge only files of the same command with other --seeds")
        for label in runs:
            runs[label].update(other["runs"].get(label, {}))
    t0 = time.perf_counter()
    ref_label = next(iter(configs))

    def build() -> dict:
        done = sorted(set.intersection(*(set(v) for v in runs.values())), key=int)  # seeds with every value
        return {
            "benchmark": "stability", "preset": base.name, "quick": args.quick, "field": field,
            "values": values, "reference": values[0], "budget": budget,
            "base_config": base.replace(**{field: values[0]}).to_dict(),
            "seeds": [int(s) for s in done], "runs": runs, "spike_threshold": args.spike, "window": args.window,
            # keyed v0 (the reference), v1, ...: dot-free paths for benchmarks/report.py
            "summary": {f"v{i}": {"value": values[i], **summarize_value(
                {s: runs[lab][s] for s in done}, None if i == 0 else {s: runs[ref_label][s] for s in done}, args)}
                for i, lab in enumerate(configs)} if done else {},
            "wall_s": round(time.perf_counter() - t0, 1), "machine": machine(threads=args.threads),
            "command": "python benchmarks/stability.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }

    for seed in seeds:
        for label, config in configs.items():
            if str(seed) in runs[label]:  # kept from a --merge file
                continue
            runs[label][str(seed)] = r = trace_run(config, files, args, seed)
            print(f"seed {seed} {field}={label}: val loss {r['val_loss']:.4f}, max grad norm "
                  f"{max(s['grad_norm'] for s in r['steps']):.1f}", file=sys.stderr, flush=True)
            write_result(args.out, build())
    result = build()
    write_result(args.out, result)
    if result.get("seeds"):
        result["plot"] = plot(result, Path(args.out).with_suffix(".png")).name
        write_result(args.out, result)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{base.name}, {args.steps} steps, seeds {result['seeds']}, {field}:")
        for s in result["summary"].values():
            lab, d = s["value"], s.get("minus_reference")
            diff = f", minus {values[0]}: {d['mean']:+.4f}" + (f" ± {d['sem']:.4f} (SE)" if d["sem"] else "") \
                if d else " (reference)"
            print(f"  {lab}: val loss {s['val_loss_mean']:.4f}{diff}; max grad norm {s['max_grad_norm']:.1f}, "
                  f"spike steps {s['spike_steps_total']}")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
