"""A standing peer benchmark: k3 `mini` against a Hugging Face `LlamaForCausalLM` of equal active parameters, each at
its best learning rate of a small sweep, on the demo's data, batch shape, schedule, time budget and evaluation.

    python benchmarks/peers.py [--json] [--quick] [--minutes 5] [--lrs-k3 1e-3,2e-3,3e-3]
        [--lrs-llama 5e-4,1e-3,2e-3] [--models k3,llama] [--batch-size 4] [--precision fp32] [--resume]

What is the same for both (the fairness points):
  data        the demo's: `prepare_data(--data, vocab_size=8192)` (tokenizer + packed train/val splits of the Python
              standard library); both read the same batches, `get_batch(step, B, T, seed)`, in the same order
  model size  the Llama's parameter count (dense: all active) equals mini's *active* count
              (k3.model.accounting.count_params) within 0.5%: mini's width, depth and attention heads (d 256,
              8 layers, 4 heads of 64), untied embedding and head as mini has them, vocabulary 8192; the MLP width
              is solved for the count (1,654 for mini: 16,457,984 against 16,457,752). --llama-hidden/-layers/-heads pick another shape.
  loop        both are trained by k3's one loop (`k3.train.loop.Loop`, through `Trainer`'s step function): AdamW
              (betas 0.9/0.95, weight decay 0.1 on matrices, embedding and head, none on norms), gradient clipping
              1.0, the WSD schedule re-planned to the time budget (`fit_steps_to_budget`, as `k3 demo`), warmup
              10 steps, decay the last 20%, min lr 0.1 x peak, `--precision` (fp32 or bf16 autocast) for both
  documents   each packed document is kept to itself in both, in training and evaluation: k3 by its doc_mask
              (KDA state, convolution and MLA restart at every <|eos|>); the Llama by position ids that restart at
              every document, which transformers turns into a block-diagonal causal mask (and per-document RoPE
              positions). `--no-doc-mask` trains and evaluates both across boundaries.
  budget      `--minutes` of wall clock per run for training plus its evaluations (the start and final ones), no
              checkpoint saves; the same thread count (`--threads`) for every run
  scoring     validation bits/byte by the demo's method: `--eval-batches` (16) batches of B windows spread evenly
              over the validation split, the same tokens for every run of one batch size
Each run is its own subprocess (fresh memory and seed; `--in-process` runs them here, one after another), model
init and data order from `--seed`. Results are written atomically after every run to runs/bench/peers.json
(--quick: runs/bench/quick/), so a killed sweep keeps its finished runs and `--resume` skips them; each run's
metrics records go to runs/bench/peers/RUN.jsonl and a plot of bits/byte against learning rate to
runs/bench/peers.png. Reported per run: val_bpb (end), tokens/s (trained tokens over the steps' own time) and the
steps; per model the best run; between them the bits/byte difference and the tokens/s ratio.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(ROOT / "src"))

from k3.benchtools import bench_out, machine, shown_path, write_result  # noqa: E402
from k3.config import get_config  # noqa: E402

MODELS = ("k3", "llama")
ACTIVE_TOLERANCE = 0.005  # |llama - k3 active| / k3 active
DEFAULT_LRS = {"k3": "1e-3,2e-3,3e-3", "llama": "5e-4,1e-3,2e-3"}
QUICK_LRS = {"k3": "1e-3,3e-3", "llama": "1e-3,3e-3"}


# ---------------------------------------------------------------------- the Llama peer
def llama_config(k3_active: int, vocab_size: int, hidden: int, layers: int, heads: int, max_positions: int):
    """An HF LlamaConfig of `hidden` x `layers` with `heads` full (MHA) heads, untied embedding and head, whose MLP
    width is solved so that its parameter count equals `k3_active`. Returns (config, its parameter count)."""
    from transformers import LlamaConfig

    if hidden % heads:
        raise SystemExit(f"--llama-hidden {hidden} is not a multiple of --llama-heads {heads}")
    fixed = 2 * vocab_size * hidden + layers * (4 * hidden * hidden + 2 * hidden) + hidden  # emb, head, attn, norms
    intermediate = round((k3_active - fixed) / (3 * hidden * layers))
    if intermediate < 1:
        raise SystemExit(f"a Llama of {hidden} x {layers} has {fixed:,} parameters without its MLP, more than k3's "
                         f"{k3_active:,} active ones: give a smaller --llama-hidden or --llama-layers")
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=False, attention_dropout=0.0,
                      use_cache=False)
    return cfg, count_llama(cfg)


def count_llama(cfg) -> int:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())


def doc_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> each token's position inside its document's part of the window (0 at every start)."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.zeros_like(doc_ids)
    starts[:, 1:] = torch.where(doc_ids[:, 1:] != doc_ids[:, :-1], idx[:, 1:], 0)
    return idx - starts.cummax(1).values


class LlamaLM(nn.Module):
    """An HF LlamaForCausalLM with k3's model call: `forward(x, doc_ids=None) -> logits`, `aux_loss()`. Its
    embedding and head are also children named `embed` and `head`, so k3's optimizer groups them as it groups
    k3's own (AdamW with weight decay)."""

    def __init__(self, config):
        from transformers import LlamaForCausalLM

        super().__init__()
        self.lm = LlamaForCausalLM(config)
        self.embed, self.head = self.lm.model.embed_tokens, self.lm.lm_head

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        pos = doc_positions(doc_ids) if doc_ids is not None else None
        return self.lm(input_ids=x, position_ids=pos, use_cache=False).logits

    def aux_loss(self) -> float:
        return 0.0


def llama_trainer(model: nn.Module, tc, train_data, val_data, bytes_per_token: float):
    """A `Trainer` around a model it did not build: the same step function (micro-batches, doc ids, autocast,
    loss), evaluation and loop as k3's; no MFU, expert or AttnRes metrics, no checkpoints."""
    from types import SimpleNamespace

    from k3.train.batches import check_dataset, has_documents
    from k3.train.device import resolve_device
    from k3.train.loop import LocalContext, Loop
    from k3.train.trainer import Trainer

    class PeerTrainer(Trainer):
        def __init__(self):  # Trainer.__init__ builds a K3Model; the rest of its state is set as it sets it
            tc.validate()
            vocab = SimpleNamespace(vocab_size=model.lm.config.vocab_size)
            check_dataset(train_data, "training", vocab, tc.batch_size, tc.seq_len, tc.seed,
                          min_tokens=tc.batch_size * tc.seq_len + 1)
            check_dataset(val_data, "validation", vocab, tc.batch_size, tc.seq_len, tc.seed)
            ctx = LocalContext(resolve_device(tc.device))
            Loop.__init__(self, model.to(ctx.device), tc, ctx=ctx)
            self.config, self.train_data, self.val_data = model.lm.config, train_data, val_data
            self.doc_mask = tc.doc_mask and has_documents(train_data)
            self.bytes_per_token, self.device = bytes_per_token, ctx.device
            self.qk_clip, self.forward, self.flops_per_token, self._loads = None, self.model, None, None

        def step_metrics(self) -> dict:
            return {}

    return PeerTrainer()


# ---------------------------------------------------------------------- one run
def run_key(spec: dict) -> str:
    return f"{spec['model']}-lr{spec['lr']:g}-b{spec['batch_size']}-{spec['precision']}"


def build(spec: dict, files):
    """(trainer, parameter counts) for one run."""
    from k3.model.accounting import count_params
    from k3.train.config import TrainConfig
    from k3.train.trainer import Trainer

    tc = TrainConfig(steps=spec["max_steps"], batch_size=spec["batch_size"], seq_len=spec["seq_len"], lr=spec["lr"],
                     warmup_steps=spec["warmup_steps"], eval_every=0, eval_batches=spec["eval_batches"],
                     eval_at_start=True, max_minutes=spec["minutes"], fit_steps_to_budget=True, seed=spec["seed"],
                     doc_mask=spec["doc_mask"], precision=spec["precision"], device="cpu", measure_mfu=False,
                     record_attnres=False)
    bpt = files.val.manifest["bytes_per_token"]
    if spec["model"] == "k3":
        trainer = Trainer(get_config(spec["preset"]), tc, files.train, files.val, bytes_per_token=bpt)
        counts = count_params(trainer.model)
        return trainer, {"total": counts["total"], "active": counts["active"]}
    from transformers import LlamaConfig

    torch.manual_seed(spec["seed"])  # model init is a function of the seed, as in Trainer
    model = LlamaLM(LlamaConfig.from_dict(spec["llama_config"]))
    n = sum(p.numel() for p in model.lm.parameters())
    return llama_trainer(model, tc, files.train, files.val, bpt), {"total": n, "active": n}


def run_one(spec: dict, label: str = "") -> dict:
    """Train one (model, lr) point to its time budget; the run's figures."""
    from tqdm.auto import tqdm

    from k3.data import prepare_data
    from k3.train.metrics import bits_per_byte

    torch.set_num_threads(spec["threads"])
    files = prepare_data(spec["data"], vocab_size=spec["vocab_size"], max_bytes=spec["max_bytes"], replace=False)
    bpt = files.val.manifest["bytes_per_token"]
    trainer, counts = build(spec, files)
    budget = spec["minutes"] * 60
    tty = sys.stderr.isatty()
    bar = tqdm(total=round(budget), desc=label or run_key(spec), unit="s", file=sys.stderr, leave=False,
               dynamic_ncols=tty, mininterval=0.5 if tty else 30.0, disable=spec.get("quiet", False),
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}")
    t0 = time.perf_counter()

    def on_step(rec):
        bar.set_postfix_str(f"step {rec['step']}/{trainer.tc.steps} loss {rec['loss']:.3f}", refresh=False)
        bar.update(max(0, min(round(time.perf_counter() - t0), bar.total) - bar.n))  # redraws at its own pace

    out = {**{k: spec[k] for k in ("model", "lr", "batch_size", "seq_len", "precision", "doc_mask", "seed")},
           "params": counts["total"], "active_params": counts["active"]}
    try:
        result = trainer.fit(on_step=on_step)
    except ValueError as e:
        if "diverged" not in str(e):
            raise
        bar.close()
        return {**out, "diverged": str(e), "val_bpb": None}
    finally:
        bar.close()
    train = [r for r in result.records if r.get("kind") == "train"]
    timed = train[1:] or train  # the first step carries one-off start-up costs
    step_s = sum(r["step_time_s"] for r in timed)
    tok = sum(r["tokens_per_s"] * r["step_time_s"] for r in timed)
    start, end = result.val[0], result.val[-1]
    out.update({
        "steps": result.steps_done, "planned_steps": trainer.tc.steps, "tokens": result.tokens,
        "elapsed_s": round(result.elapsed_s, 1), "train_s": round(sum(r["step_time_s"] for r in train), 1),
        "tokens_per_s": round(tok / step_s, 1) if step_s else None,
        "tokens_per_s_wall": round(result.tokens / result.elapsed_s, 1) if result.elapsed_s else None,
        "val_loss_start": start["val_loss"], "val_loss": end["val_loss"],
        "val_bpb_start": bits_per_byte(start["val_loss"], bpt), "val_bpb": bits_per_byte(end["val_loss"], bpt),
        "last_train_loss": result.losses[-1] if result.losses else None,
        "stopped_by_time_budget": result.stopped_early, "threads": torch.get_num_threads(),
    })
    if spec.get("metrics"):
        from k3.fileio import atomic_write_text

        atomic_write_text(spec["metrics"], "".join(json.dumps(r) + "\n" for r in result.records))
    return out


def run_subprocess(spec: dict, label: str) -> dict:
    """run_one in a fresh interpreter (its progress bar on this stderr); its result through a file."""
    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec), "--worker-out", str(res),
               "--worker-label", label]
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        if rc != 0 or not res.is_file():
            if rc < 0 or rc in (130, 137, 143):
                raise KeyboardInterrupt(f"run {label} stopped (exit {rc})")
            return {"error": f"worker exited with {rc}; rerun with --in-process to see the traceback"}
        return json.loads(res.read_text())


# ---------------------------------------------------------------------- the sweep
def parse_floats(text: str, flag: str) -> list[float]:
    try:
        vals = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: give comma-separated numbers, e.g. 1e-3,2e-3") from None
    if not vals or any(not (v > 0 and math.isfinite(v)) for v in vals) or len(set(vals)) != len(vals):
        raise SystemExit(f"{flag} {text!r}: give distinct positive numbers")
    return vals


def best_runs(runs: dict, models) -> dict:
    """Per model: the finished run with the lowest validation bits/byte, and whether its lr is an end of the sweep
    (then the sweep should be widened that way)."""
    out = {}
    for m in models:
        done = [r for r in runs.values() if r.get("model") == m and r.get("val_bpb") is not None]
        if not done:
            continue
        b = min(done, key=lambda r: r["val_bpb"])
        lrs = sorted({r["lr"] for r in runs.values() if r.get("model") == m and "error" not in r})
        out[m] = {k: b[k] for k in ("lr", "val_bpb", "tokens_per_s", "steps", "tokens") if k in b}
        out[m]["lr_at_sweep_edge"] = len(lrs) > 1 and b["lr"] in (lrs[0], lrs[-1])
        out[m]["lrs_tried"] = lrs
    return out


def plot(runs: dict, path: Path, title: str) -> Path | None:
    try:
        from k3.train.plots import plt, save_figure
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    for m, color in zip(MODELS, ("tab:blue", "tab:orange")):
        pts = sorted((r["lr"], r["val_bpb"]) for r in runs.values() if r.get("model") == m and r.get("val_bpb"))
        if pts:
            ax.plot(*zip(*pts), "o-", color=color, label=m)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("validation bits/byte (end)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    return save_figure(fig, path)


def summarize(runs: dict, models) -> dict:
    best = best_runs(runs, models)
    out = {"best": best}
    if "k3" in best and "llama" in best:
        k, l = best["k3"], best["llama"]
        out["k3_minus_llama_bpb"] = round(k["val_bpb"] - l["val_bpb"], 4)
        if k.get("tokens_per_s") and l.get("tokens_per_s"):
            out["llama_over_k3_tokens_per_s"] = round(l["tokens_per_s"] / k["tokens_per_s"], 3)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="tiny models, a few steps, 2 lrs each: a smoke test")
    ap.add_argument("--minutes", type=float, default=None, help="wall-clock budget per run (default 5)")
    ap.add_argument("--models", default="k3,llama", help="comma-separated, of k3 and llama (default both)")
    ap.add_argument("--lrs-k3", default=None, help=f"k3's peak learning rates (default {DEFAULT_LRS['k3']})")
    ap.add_argument("--lrs-llama", default=None, help=f"the Llama's (default {DEFAULT_LRS['llama']})")
    ap.add_argument("--preset", default="mini", help="the k3 preset (default mini; --quick: tiny)")
    ap.add_argument("--llama-hidden", type=int, default=None, help="Llama width (default: the preset's d_model)")
    ap.add_argument("--llama-layers", type=int, default=None, help="Llama depth (default: the preset's n_layers)")
    ap.add_argument("--llama-heads", type=int, default=None, help="Llama heads (default: width / 64)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step, both models (default 8: the demo's)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128: the demo's)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="both models (default fp32)")
    ap.add_argument("--warmup-steps", type=int, default=10, help="(default 10: the demo's)")
    ap.add_argument("--eval-batches", type=int, default=None, help="validation batches (default 16: the demo's)")
    ap.add_argument("--max-steps", type=int, default=None, help="cap on steps per run (default 100000: the time "
                                                                "budget decides)")
    ap.add_argument("--no-doc-mask", action="store_true", help="train and evaluate both across document boundaries")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads per run (default: all cores)")
    ap.add_argument("--data", default=None, help="the demo's data dir (default runs/data; --quick: runs/data-quick)")
    ap.add_argument("--out", default=None, help="result JSON (default runs/bench/peers.json)")
    ap.add_argument("--resume", action="store_true", help="keep the finished runs of --out and run the rest")
    ap.add_argument("--in-process", action="store_true", help="run the points here, one after another")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--worker-label", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # one run, for the parent process
        write_result(args.worker_out, run_one(json.loads(args.worker), args.worker_label))
        return {}

    q = args.quick
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        raise SystemExit(f"--models {args.models!r}: choose from {', '.join(MODELS)}")
    lrs = {m: parse_floats(getattr(args, f"lrs_{m}") or (QUICK_LRS if q else DEFAULT_LRS)[m], f"--lrs-{m}")
           for m in models}
    preset = "tiny" if q and args.preset == "mini" else args.preset
    config = get_config(preset)
    seq_len = 32 if q and args.seq_len == 128 else args.seq_len
    minutes = args.minutes or (0.2 if q else 5.0)
    threads = args.threads or (1 if q else os.cpu_count() or 1)
    data = args.data or str(ROOT / "runs" / ("data-quick" if q else "data"))
    max_bytes = 300_000 if q else None
    out = Path(args.out or bench_out("peers", q))
    runs_dir = out.with_suffix("")

    from k3.data import prepare_data
    from k3.model.accounting import build_meta, count_params

    files = prepare_data(data, vocab_size=config.vocab_size, max_bytes=max_bytes, progress=sys.stderr.isatty(),
                         replace=False)
    k3_counts = count_params(build_meta(config))
    hidden = args.llama_hidden or config.d_model
    lcfg, l_params = llama_config(k3_counts["active"], config.vocab_size, hidden, args.llama_layers or config.n_layers,
                                  args.llama_heads or max(1, hidden // 64), max(seq_len, 128))
    rel = abs(l_params - k3_counts["active"]) / k3_counts["active"]
    if rel > ACTIVE_TOLERANCE:
        raise SystemExit(f"the Llama has {l_params:,} parameters, {rel:.2%} from k3's {k3_counts['active']:,} active "
                         f"ones (tolerance {ACTIVE_TOLERANCE:.1%}); pick another --llama-hidden/--llama-layers")
    settings = {"preset": preset, "minutes": minutes, "batch_size": args.batch_size, "seq_len": seq_len,
                "precision": args.precision, "warmup_steps": args.warmup_steps,
                "eval_batches": args.eval_batches or (2 if q else 16),
                "max_steps": args.max_steps or (8 if q else 100_000), "doc_mask": not args.no_doc_mask,
                "seed": args.seed, "threads": threads, "data": shown_path(data, ROOT), "max_bytes": max_bytes,
                "vocab_size": config.vocab_size, "decay_frac": 0.2, "schedule": "WSD fitted to the time budget",
                "optimizer": "adamw"}
    runs: dict[str, dict] = {}
    if args.resume and out.is_file():
        old = json.loads(out.read_text())
        differ = {k: (old.get("settings", {}).get(k), v) for k, v in settings.items()
                  if old.get("settings", {}).get(k) != v}
        if differ:
            raise SystemExit(f"--resume: {out} was run with other settings ({differ}: recorded, now); give the same "
                             "flags, or another --out")
        runs = {k: r for k, r in old.get("runs", {}).items() if "error" not in r}
    specs = []
    for m in models:
        for lr in lrs[m]:
            spec = {**settings, "model": m, "lr": lr, "data": data,
                    "llama_config": lcfg.to_dict() if m == "llama" else None}
            spec["metrics"] = str(runs_dir / f"{run_key(spec)}.jsonl")
            specs.append(spec)
    todo = [s for s in specs if run_key(s) not in runs]
    total_min = len(todo) * minutes
    print(f"peers: {len(todo)} run(s) of {minutes:g} min ({len(specs) - len(todo)} done), about {total_min:.0f} min; "
          f"k3 {preset} {k3_counts['active']:,} active / Llama {l_params:,} ({lcfg.hidden_size} x "
          f"{lcfg.num_hidden_layers}, MLP {lcfg.intermediate_size}); {threads} thread(s); writing {out}",
          file=sys.stderr)
    result: dict = {}
    t0 = time.perf_counter()

    def record() -> dict:
        res = {"benchmark": "peers", "quick": q, "settings": settings,
               "models": {"k3": {"preset": preset, "params": k3_counts["total"], "active_params": k3_counts["active"]},
                          "llama": {"config": {k: getattr(lcfg, k) for k in (
                              "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                              "intermediate_size", "vocab_size", "tie_word_embeddings", "rope_parameters")
                              if hasattr(lcfg, k)}, "params": l_params, "active_params": l_params,
                              "active_over_k3_active": round(l_params / k3_counts["active"], 5),
                              "tolerance": ACTIVE_TOLERANCE,
                              "trained_by": "k3.train.loop.Loop via Trainer's step function (benchmarks/peers.py)",
                              "doc_mask": "position ids restarting per document -> block-diagonal causal mask"}},
               "lrs": lrs, "runs": runs, **summarize(runs, MODELS),
               "bytes_per_token_val": files.val.manifest["bytes_per_token"],
               "wall_s": round(time.perf_counter() - t0, 1), "machine": machine(threads=threads),
               "command": "python benchmarks/peers.py " + " ".join(argv if argv is not None else sys.argv[1:])}
        write_result(out, res)
        return res

    result = record()
    for i, spec in enumerate(todo, 1):
        label = f"[{i}/{len(todo)}] {run_key(spec)}"
        r = run_one({**spec, "quiet": args.json and not sys.stderr.isatty()}, label) if args.in_process \
            else run_subprocess(spec, label)
        runs[run_key(spec)] = r
        result = record()
        what = r.get("error") or r.get("diverged") or \
            f"val {r['val_bpb']:.4f} bits/byte, {r['tokens_per_s']:,.0f} tokens/s, {r['steps']} steps"
        print(f"peers {label}: {what}", file=sys.stderr, flush=True)
    png = plot(runs, out.with_suffix(".png"), f"{preset} vs Llama, {minutes:g} min, batch {args.batch_size} x "
                                                f"{seq_len}, {args.precision}")
    if png is not None:
        result["plot"] = shown_path(png, ROOT)
        write_result(out, result)
    if args.json:
        print(json.dumps(result))
    else:
        for m, b in result["best"].items():
            edge = " (an end of the sweep: widen it)" if b["lr_at_sweep_edge"] else ""
            print(f"{m:<6} best lr {b['lr']:g}{edge}: {b['val_bpb']:.4f} bits/byte, {b['tokens_per_s']:,.0f} tokens/s")
        if "k3_minus_llama_bpb" in result:
            print(f"k3 - llama: {result['k3_minus_llama_bpb']:+.4f} bits/byte; llama / k3 tokens/s "
                  f"{result.get('llama_over_k3_tokens_per_s')}")
    return result


if __name__ == "__main__":
    main()
