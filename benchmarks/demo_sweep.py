"""The demo's settings from a sweep: `k3 demo` itself, run at each point of learning rate x batch size x precision,
its validation bits/byte collected.

    python benchmarks/demo_sweep.py [--json] [--quick] [--minutes 10] [--lrs 1e-3,2e-3,3e-3] [--batch-sizes 4,8]
        [--precisions fp32,bf16] [--threads N] [--resume]

Each point is one `k3 demo --minutes M --lr X --batch-size B --precision P --out runs/bench/demo_sweep/POINT` in its
own process, so the figure is the demo's own (its data preparation, time reserve, schedule fitted to the budget,
final evaluation and save all inside the --minutes). From its summary.json come val_bpb_end, steps and tokens.
The demo scores 16 batches of B windows, so batch sizes are scored on different (evenly spread) validation windows;
each point's checkpoint is therefore also rescored on the batch-4 windows (the default demo's: the same tokens for
every point, `val_bpb_fixed`), then deleted (--keep-checkpoints keeps them; each is ~0.7 GB for mini). Results are
written atomically after every point to runs/bench/demo_sweep.json (--quick: runs/bench/quick/); `--resume` skips
finished points. The best point by val_bpb_fixed is what the demo's defaults should be; a plot of bits/byte
against lr per (batch, precision) goes to runs/bench/demo_sweep.png.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(ROOT / "src"))

from k3.benchtools import bench_out, machine, shown_path, write_result  # noqa: E402

K3 = [sys.executable, "-c", "import sys; from k3.cli import main; sys.exit(main())"]  # `k3` of this interpreter
FIXED_BATCH = 4  # the windows every point is rescored on: batch 4, the demo's default until this sweep chose 8


def point_key(p: dict) -> str:
    return f"lr{p['lr']:g}-b{p['batch_size']}-{p['precision']}"


def parse_list(text: str, flag: str, kind=float) -> list:
    try:
        vals = [kind(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: give a comma-separated list") from None
    if not vals or len(set(vals)) != len(vals) or any(isinstance(v, (int, float)) and not v > 0 for v in vals):
        raise SystemExit(f"{flag} {text!r}: give distinct positive values")
    return vals


def demo_takes_precision() -> bool:
    """Whether this checkout's `k3 demo` has a --precision flag."""
    from k3.cli import build_parser

    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return any("--precision" in a.option_strings for a in subs.choices["demo"]._actions)


def rescore(run_dir: Path, data: str, eval_batches: int, seq_len: int) -> dict:
    """The point's final checkpoint on the fixed validation windows (batch FIXED_BATCH), documents masked as the
    demo evaluates them."""
    from k3.data import load_data
    from k3.io import load_with_manifest
    from k3.train.batches import evaluate
    from k3.train.metrics import bits_per_byte

    model, _ = load_with_manifest(run_dir / "checkpoint", device="cpu")
    files = load_data(data)
    loss = evaluate(model, files.val, eval_batches, FIXED_BATCH, seq_len, doc_mask=True)
    return {"val_loss_fixed": loss, "val_bpb_fixed": bits_per_byte(loss, files.val.manifest["bytes_per_token"])}


def run_point(p: dict, args, run_dir: Path, with_precision: bool) -> dict:
    cmd = [*K3, "demo", "--minutes", f"{args.minutes:g}", "--lr", f"{p['lr']:g}",
           "--batch-size", str(p["batch_size"]), "--data", args.data, "--out", str(run_dir),
           "--seq-len", str(args.seq_len), "--sample-tokens", "8"]
    if with_precision:
        cmd += ["--precision", p["precision"]]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    cmd += args.demo_args
    t0 = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:  # its report; its progress bar stays on stderr
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log).returncode
    if rc in (130, 137, 143) or rc < 0:
        raise KeyboardInterrupt(f"k3 demo stopped (exit {rc})")
    summary = run_dir / "summary.json"
    # the command as recorded: paths inside the repository relative to it (no machine paths in the JSON)
    shown = ["k3", *(shown_path(a, ROOT) if a in (args.data, str(run_dir)) else a for a in cmd[len(K3):])]
    if rc != 0 or not summary.is_file():
        return {**p, "error": f"k3 demo exited with {rc}", "command": " ".join(shown)}
    s = json.loads(summary.read_text())
    out = {**p, **{k: s.get(k) for k in ("val_bpb_end", "val_bpb_start", "steps", "planned_steps", "tokens",
                                        "train_minutes", "total_minutes", "unigram_bpb", "val_tokens_scored")},
           "tokens_per_s": round(s["tokens"] / (s["train_minutes"] * 60), 1) if s.get("train_minutes") else None,
           "wall_s": round(time.perf_counter() - t0, 1), "command": " ".join(shown)}
    out.update(rescore(run_dir, args.data, args.eval_batches, args.seq_len))
    if not args.keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
    return out


def best(points: dict) -> dict | None:
    done = [p for p in points.values() if p.get("val_bpb_fixed") is not None]
    if not done:
        return None
    b = min(done, key=lambda p: p["val_bpb_fixed"])
    return {k: b[k] for k in ("lr", "batch_size", "precision", "val_bpb_fixed", "val_bpb_end", "steps",
                              "tokens_per_s") if k in b}


def plot(points: dict, path: Path, title: str) -> Path | None:
    from k3.train.plots import plt, save_figure

    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    series = sorted({(p["batch_size"], p["precision"]) for p in points.values() if p.get("val_bpb_fixed")})
    for b, prec in series:
        pts = sorted((p["lr"], p["val_bpb_fixed"]) for p in points.values()
                     if p.get("val_bpb_fixed") and (p["batch_size"], p["precision"]) == (b, prec))
        ax.plot(*zip(*pts), "o-", label=f"batch {b}, {prec}")
    if not series:
        plt.close(fig)
        return None
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel(f"validation bits/byte (batch-{FIXED_BATCH} windows)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    return save_figure(fig, path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="tiny preset, a few seconds per point: a smoke test")
    ap.add_argument("--minutes", type=float, default=None, help="each demo's --minutes (default 10)")
    ap.add_argument("--lrs", default="1e-3,2e-3,3e-3", help="peak learning rates (default %(default)s)")
    ap.add_argument("--batch-sizes", default="4,8", help="demo batch sizes (default %(default)s)")
    ap.add_argument("--precisions", default="fp32", help="fp32 and/or bf16 (default %(default)s)")
    ap.add_argument("--seq-len", type=int, default=128, help="(default 128: the demo's)")
    ap.add_argument("--eval-batches", type=int, default=16, help="batches of the rescoring (default 16: the demo's)")
    ap.add_argument("--threads", type=int, default=0, help="each demo's --threads (default: the demo's choice)")
    ap.add_argument("--data", default=None, help="the demo's data dir (default runs/data)")
    ap.add_argument("--out", default=None, help="result JSON (default runs/bench/demo_sweep.json)")
    ap.add_argument("--resume", action="store_true", help="keep the finished points of --out and run the rest")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep each point's checkpoint")
    args, demo_args = ap.parse_known_args(argv)
    args.demo_args = demo_args  # anything else goes to every `k3 demo` (e.g. --set, --max-bytes)
    q = args.quick
    lrs = parse_list(args.lrs, "--lrs")
    batches = parse_list(args.batch_sizes, "--batch-sizes", int)
    precisions = parse_list(args.precisions, "--precisions", str)
    if any(p not in ("fp32", "bf16") for p in precisions):
        raise SystemExit(f"--precisions {args.precisions!r}: choose from fp32, bf16")
    with_precision = demo_takes_precision()
    if not with_precision and precisions != ["fp32"]:
        raise SystemExit("this k3 demo has no --precision flag yet: sweep --precisions fp32 only")
    args.minutes = args.minutes or (0.4 if q else 10.0)
    args.data = args.data or str(ROOT / "runs" / ("data-quick" if q else "data"))
    if q:  # the tiny preset on a small corpus (its own data dir)
        args.seq_len, args.eval_batches = 32 if args.seq_len == 128 else args.seq_len, 2
        args.demo_args = ["--preset", "tiny", "--max-bytes", "300000", "--eval-batches", "2", "--max-steps", "6",
                          *args.demo_args]
    out = Path(args.out or bench_out("demo_sweep", q))
    runs_dir = out.with_suffix("")
    settings = {"minutes": args.minutes, "seq_len": args.seq_len, "eval_batches": args.eval_batches,
                "threads": args.threads, "data": shown_path(args.data, ROOT), "demo_args": args.demo_args}
    points: dict[str, dict] = {}
    if args.resume and out.is_file():
        old = json.loads(out.read_text())
        if old.get("settings") != settings:
            raise SystemExit(f"--resume: {out} was run with other settings ({old.get('settings')}); give the same "
                             "flags, or another --out")
        points = {k: p for k, p in old.get("points", {}).items() if "error" not in p}
    grid = [{"lr": lr, "batch_size": b, "precision": prec} for prec in precisions for b in batches for lr in lrs]
    todo = [p for p in grid if point_key(p) not in points]
    print(f"demo_sweep: {len(todo)} point(s) of `k3 demo --minutes {args.minutes:g}` ({len(grid) - len(todo)} done), "
          f"about {len(todo) * args.minutes:.0f} min; writing {out}", file=sys.stderr)
    t0 = time.perf_counter()

    def record() -> dict:
        res = {"benchmark": "demo_sweep", "quick": q, "settings": settings, "fixed_batch": FIXED_BATCH,
               "points": points, "best": best(points), "wall_s": round(time.perf_counter() - t0, 1),
               "machine": machine(threads=args.threads or os.cpu_count()),
               "command": "python benchmarks/demo_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])}
        write_result(out, res)
        return res

    result = record()
    for i, p in enumerate(todo, 1):
        key = point_key(p)
        print(f"demo_sweep [{i}/{len(todo)}] {key}", file=sys.stderr, flush=True)
        points[key] = run_point(p, args, runs_dir / key, with_precision)
        result = record()
        r = points[key]
        print(f"demo_sweep [{i}/{len(todo)}] {key}: " + (r.get("error") or
              f"val {r['val_bpb_end']:.4f} bits/byte (fixed windows {r['val_bpb_fixed']:.4f}), {r['steps']} steps"),
              file=sys.stderr, flush=True)
    png = plot(points, out.with_suffix(".png"), f"k3 demo, {args.minutes:g} min per point")
    if png is not None:
        result["plot"] = shown_path(png, ROOT)
        write_result(out, result)
    if args.json:
        print(json.dumps(result))
    elif result["best"]:
        b = result["best"]
        print(f"best: lr {b['lr']:g}, batch {b['batch_size']}, {b['precision']}: {b['val_bpb_fixed']:.4f} bits/byte "
              f"(the demo's own figure {b['val_bpb_end']:.4f}), {b['steps']} steps")
    return result


if __name__ == "__main__":
    main()
