"""K3's released layer forms against k3's earlier (pre-release) forms, trained side by side on `mini`.

    python benchmarks/forms.py [--json] [--quick] [--preset mini] [--steps N] [--seeds 0,1,2] [--variants ...]
    python benchmarks/forms.py --merge A.json B.json [--out OUT.json]    # seeds run in separate processes

The two variants differ only in the forms (docs/architecture.md, "Released forms"): the released preset, and the
same preset with k3's earlier forms (`k3.config.LEGACY_FORMS`: Kimi-Linear's unbounded softplus gate and
low-rank output gate with a bias, MLA without the shared key, SwiGLU, LatentMoE without the latent norm). Each
seed trains both on the same batches in the same order (benchmarks/qat.py's fp32 runs: same budget, schedule
and evaluation) and reports, per variant:
  val_bpb          validation bits per byte on the whole split
  cost_no_routed   validation loss (nats) with every routed path zeroed, minus the full model's: what the routed
                   experts carry (benchmarks/moe_contrib.py's measure)
  kda_chunk        the chunk / sub-chunk sizes `chunk_kda(chunk_size=None)` picks for each trained KDA layer's
                   gates on a training batch, and the most negative per-token log-decay seen
  kda_share        forward + backward time of the KDA op on those inputs over that of the whole training step
  tokens_per_s     training tokens per second over the run
The differences are paired per seed (released - earlier). Writes runs/bench/forms.json (--quick:
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
import moe_contrib  # noqa: E402  (the routed-path removal)
import qat as qat_bench  # noqa: E402  (the same presets, fp32 training and evaluation)

import k3.model.kda as kda_layer  # noqa: E402
from k3.benchtools import machine, write_result  # noqa: E402
from k3.config import LEGACY_FORMS, K3ConfigError  # noqa: E402
from k3.data import DEFAULT_VOCAB_SIZE, prepare_data  # noqa: E402
from k3.ops.kda.chunk import _auto_chunk_sizes  # noqa: E402

VARIANTS = ("released", "earlier")
# one released form each, reverted to k3's earlier one: together they make `earlier` on mini (its other
# LEGACY_FORMS fields, attn_res_block_size, the SiTU betas and the quantile estimator, change nothing there)
GROUPS = {"kda_gate": dict(gate_lower_bound=None), "output_gate": dict(use_full_rank_gate=False, kda_gate_bias=True),
          "mla_key": dict(qk_rope_head_dim=0), "situ": dict(hidden_act="silu"),
          "latent_norm": dict(latent_moe_use_norm=False)}
MAX_EXPONENT = 30.0  # chunk_kda's default


def variant_config(base, name: str):
    if name == "released":
        return base
    if name == "earlier":
        return base.replace(**LEGACY_FORMS, name=f"{base.name}-earlier")
    group = name.removeprefix("released-no-")
    if group not in GROUPS or not name.startswith("released-no-"):
        raise SystemExit(f"--variants: {name!r} is not one of released, earlier, "
                         + ", ".join(f"released-no-{g}" for g in GROUPS))
    return base.replace(**GROUPS[group], name=f"{base.name}-no-{group}")


def _median_s(fn, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kda_profile(model, files, args, seed: int) -> dict:
    """Capture each KDA layer's op inputs on one training batch; chunk sizes from the trained gates; the op's
    forward + backward time against the whole training step's on that batch."""
    calls = []
    real = kda_layer.kda

    def capture(*a, **kw):
        calls.append([t.detach().clone() for t in a])
        return real(*a, **kw)

    x, y = files.train.get_batch(args.steps, args.batch_size, args.seq_len, seed)  # the batch after the budget
    model.train()
    kda_layer.kda = capture
    try:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    finally:
        kda_layer.kda = real
    del loss
    chunks = [_auto_chunk_sizes(c[3], MAX_EXPONENT) for c in calls]

    def op_fwd_bwd():
        for q, k, v, g, beta in calls:
            args_ = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
            o, _ = real(*args_)
            o.sum().backward()

    def step_fwd_bwd():
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()

    op_s, step_s = _median_s(op_fwd_bwd), _median_s(step_fwd_bwd)
    model.zero_grad(set_to_none=True)
    return {"chunk_sizes": [list(c) for c in chunks], "min_log_decay": min(float(c[3].min()) for c in calls),
            "kda_op_s": round(op_s, 4), "step_s": round(step_s, 4), "kda_share": round(op_s / step_s, 4)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="tiny model, a few steps: a smoke test of the script")
    qat_bench.add_run_args(ap)
    ap.add_argument("--out", default=None, help="result JSON (default runs/bench/forms.json)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated: released, earlier, and released-no-GROUP (one form reverted) for GROUP in "
                         + ", ".join(GROUPS) + " (default released,earlier); differences are against released")
    ap.add_argument("--throughput", type=int, default=0, metavar="N",
                    help="train nothing to the end: time N training steps of each variant, interleaved step by step "
                         "on the same batches (host drift hits all alike), after 3 warm-up steps; writes "
                         "runs/bench/forms-throughput.json")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="train nothing: combine the seeds of these result files (the same preset and budget, "
                         "e.g. two processes of different --seeds) into --out")
    ap.set_defaults(preset="mini")
    args = qat_bench.finish_run_args(ap.parse_args(argv), "forms")
    if args.merge:
        return merge(args, argv)
    seeds = qat_bench.parse_seeds(args.seeds)
    try:
        base = qat_bench.base_config(args.preset, args.quick)
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        if "released" not in variants:
            variants.insert(0, "released")
        configs = {v: variant_config(base, v) for v in variants}
    except K3ConfigError as e:
        raise SystemExit(str(e)) from None
    data = args.data if base.vocab_size == DEFAULT_VOCAB_SIZE else f"{args.data}-v{base.vocab_size}"
    files = prepare_data(data, vocab_size=base.vocab_size)
    if args.throughput:
        return throughput(configs, files, args, argv)
    bpt = files.val.manifest.get("bytes_per_token")
    t0 = time.perf_counter()
    runs: dict[str, dict] = {}
    result: dict = {}
    for seed in seeds:
        runs[str(seed)] = {}
        for v in configs:
            model, rec, _ = qat_bench.train_run(configs[v], files, args, v, seed)
            r = {"val_loss": rec["val_loss"], "val_bpb": rec["val_loss"] / math.log(2) / bpt,
                 "tokens_per_s": rec["tokens_per_s"], "train_s": rec["train_s"]}
            with moe_contrib.removed(model, "routed"):
                r["cost_no_routed"] = qat_bench.val(model, files, args)["val_loss"] - rec["val_loss"]
            r.update(kda_profile(model, files, args, seed))
            print(f"seed {seed} {v}: {json.dumps(r)}", file=sys.stderr, flush=True)
            runs[str(seed)][v] = r
        result = {
            "benchmark": "forms", "preset": base.name, "quick": args.quick,
            "configs": {v: c.to_dict() for v, c in configs.items()},
            "budget": {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
                       "warmup_steps": args.warmup_steps, "tokens": args.steps * args.batch_size * args.seq_len},
            "bytes_per_token": bpt, **summaries(runs, list(configs)),
            "wall_s": round(time.perf_counter() - t0, 1), "machine": machine(threads=args.threads),
            "command": "python benchmarks/forms.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        write_result(args.out, result)
    report(result, args)
    return result


def throughput(configs: dict, files, args, argv) -> dict:
    """Median training-step time per variant, the variants' steps interleaved on the same batches."""
    trainers = {v: qat_bench.make_trainer(c, files, args, seed=0) for v, c in configs.items()}
    times: dict[str, list[float]] = {v: [] for v in configs}
    for i in range(3 + args.throughput):
        for v, t in trainers.items():
            t0 = time.perf_counter()
            t.train_step()
            if i >= 3:
                times[v].append(time.perf_counter() - t0)
    tokens = args.batch_size * args.seq_len
    per = {v: {"median_step_s": statistics.median(ts), "tokens_per_s": tokens / statistics.median(ts),
               "step_s": [round(x, 4) for x in ts]} for v, ts in times.items()}
    result = {"benchmark": "forms-throughput", "preset": next(iter(configs.values())).name, "steps": args.throughput,
              "batch_size": args.batch_size, "seq_len": args.seq_len, "threads": args.threads, "variants": per,
              **{f"released_over_{v}_tokens_per_s": per["released"]["tokens_per_s"] / per[v]["tokens_per_s"]
                 for v in per if v != "released"},
              "machine": machine(threads=args.threads),
              "command": "python benchmarks/forms.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = args.out if args.out != str(qat_bench.bench_out("forms", args.quick)) else \
        str(qat_bench.bench_out("forms-throughput", args.quick))
    write_result(out, result)
    if args.json:
        print(json.dumps(result))
    else:
        for v, r in per.items():
            print(f"{v}: {r['median_step_s']:.3f} s/step, {r['tokens_per_s']:.0f} tokens/s")
        print(f"wrote {out}")
    return result


KEYS = ("val_bpb", "val_loss", "cost_no_routed", "kda_share", "tokens_per_s", "min_log_decay")


def summaries(runs: dict, variants: list[str]) -> dict:
    """The per-variant summaries, and each variant's paired difference from released (released - variant), over
    the seeds that finished every variant."""
    done = {s: r for s, r in runs.items() if all(v in r for v in variants)}
    return {"variants": variants, "seeds": [int(s) for s in done], "runs": runs,
            **{v: {k: moe_contrib.summarize([r[v][k] for r in done.values()]) for k in KEYS} for v in variants},
            **{f"released_minus_{v}": {k: moe_contrib.summarize([r["released"][k] - r[v][k] for r in done.values()])
                                       for k in KEYS} for v in variants if v != "released"}}


def merge(args, argv) -> dict:
    parts = [json.loads(Path(p).read_text()) for p in args.merge]
    first = parts[0]
    for p, path in zip(parts[1:], args.merge[1:]):
        if (p["preset"], p["budget"], p["configs"]) != (first["preset"], first["budget"], first["configs"]):
            raise SystemExit(f"--merge {path}: another preset, budget or config than {args.merge[0]}")
    variants = first.get("variants", list(VARIANTS))
    runs = {}
    for p in parts:
        runs.update({s: r for s, r in p["runs"].items() if all(v in r for v in variants)})
    result = {**{k: first[k] for k in ("benchmark", "preset", "quick", "configs", "budget", "bytes_per_token")},
              **summaries(runs, variants), "wall_s": sum(p["wall_s"] for p in parts),
              "machine": parts[0]["machine"], "machines": [p["machine"] for p in parts],
              "merged_from": [p["command"] for p in parts],
              "command": "python benchmarks/forms.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    write_result(args.out, result)
    report(result, args)
    return result


def report(result: dict, args) -> None:
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['preset']}, {result['budget']['steps']} steps, seeds {result['seeds']} (released - variant, "
              "paired):")
        for v in result["variants"][1:]:
            d = result[f"released_minus_{v}"]
            for k in ("val_bpb", "cost_no_routed", "kda_share", "tokens_per_s"):
                sem = f" ± {d[k]['sem']:.4g}" if d[k]["sem"] is not None else ""
                print(f"  {v} {k}: {result['released'][k]['mean']:.4g} vs {result[v][k]['mean']:.4g}, "
                      f"difference {d[k]['mean']:+.4g}{sem}")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
