"""PTQ vs QAT: does training through the MX fake quant recover the loss that quantizing afterwards costs?

    python benchmarks/qat.py [--json] [--quick] [--preset mini] [--steps N] [--settings k3,harsh,harshest]

Same data, seed, schedule and token budget for every run, on the tokenized standard-library corpus
(runs/data, made here if missing):
  fp32   train in full precision -> validation loss
  PTQ    the fp32 weights loaded into a model built with the qat config (nothing retrained) -> val loss
  QAT    train from scratch with the qat config (fake quant + straight-through estimator) -> val loss
  fp32'  the fp32 run again with seed + 1: the seed-to-seed spread that any QAT-vs-fp32 comparison carries
recovery = (PTQ - QAT) / (PTQ - fp32): the fraction of the PTQ degradation that QAT wins back (target >= 0.8);
it means something only where PTQ - fp32 is well above the seed spread.
Settings: 'k3' = routed-expert weights MXFP4 + their input activations MXFP8 (K3's); 'harsh' = that plus every
other linear layer (weights MXFP4, inputs MXFP8); 'harshest' = all of those with MXFP4 activations (W4A4).
The default model is `mini-s`, a mini-shaped model scaled down so that each run takes minutes on a shared
2-core CPU; `--preset mini` runs the real mini (about 4x slower per step). Validation uses the whole split.
Writes runs/bench/qat.json atomically.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from k3.config import PRESETS, K3Config, get_config
from k3.data import DEFAULT_VOCAB_SIZE, prepare_data
from k3.fileio import atomic_write_json
from k3.model.transformer import K3Model
from k3.train.trainer import TrainConfig, Trainer, evaluate

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "bench" / "qat.json"
SETTINGS = {
    "k3": {"expert_weights": "mxfp4", "activations": "mxfp8"},
    "harsh": {"expert_weights": "mxfp4", "activations": "mxfp8", "linears": "mxfp4"},
    "harshest": {"expert_weights": "mxfp4", "activations": "mxfp4", "linears": "mxfp4"},
}
# mini's structure (KDA + MLA, block AttnRes, LatentMoE with a shared expert, 8192-token vocab), smaller widths
MINI_S = dict(name="mini-s", d_model=128, n_layers=4, kda_heads=2, kda_head_dim=64, kda_gate_rank=32, mla_heads=2,
              mla_q_lora_rank=64, mla_kv_lora_rank=64, mla_qk_head_dim=64, mla_v_head_dim=64, attnres_sources=3,
              dense_ffn=384, moe_latent_dim=64, n_experts=32, n_active_experts=4, expert_ffn=128, shared_ffn=256)


def base_config(preset: str, quick: bool = False):
    if quick:  # the tokenized corpus is shared: keep its 8192-token vocabulary
        return get_config("tiny", vocab_size=DEFAULT_VOCAB_SIZE)
    if preset == "mini-s":
        return K3Config.from_dict({**PRESETS["mini"], **MINI_S})
    return get_config(preset)


def train_run(config, files, args, label: str, seed: int | None = None) -> tuple[torch.nn.Module, dict]:
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                     warmup_steps=args.warmup_steps, seed=args.seed if seed is None else seed, measure_mfu=False,
                     record_attnres=False)
    trainer = Trainer(config, tc, files.train, None)  # no periodic eval: one full-split eval below
    t0 = time.perf_counter()
    result = trainer.fit()
    train_s = time.perf_counter() - t0
    rec = {"train_loss_last10": sum(result.losses[-10:]) / len(result.losses[-10:]), "tokens": result.tokens,
           "train_s": round(train_s, 1), "tokens_per_s": round(result.tokens / train_s, 1)}
    rec.update(val(trainer.model, files, args))
    print(f"{label}: {json.dumps(rec)}", file=sys.stderr, flush=True)
    return trainer.model, rec


def val(model, files, args) -> dict:
    t0 = time.perf_counter()
    loss = evaluate(model, files.val, args.eval_batches, args.batch_size, args.seq_len)
    return {"val_loss": loss, "eval_s": round(time.perf_counter() - t0, 1)}


def ptq(fp32_model, qat: dict, files, args) -> dict:
    """PTQ exactly as defined: build the model with the qat config, load the fp32-trained weights, evaluate."""
    model = K3Model(fp32_model.config.replace(qat=qat))
    model.load_state_dict(fp32_model.state_dict())
    return val(model, files, args)


def compare(fp32: dict, ptq_rec: dict, qat_rec: dict, spread: float | None) -> dict:
    degradation = ptq_rec["val_loss"] - fp32["val_loss"]
    gap = qat_rec["val_loss"] - fp32["val_loss"]
    return {"ptq_degradation": degradation, "qat_gap": gap,
            "recovery": (ptq_rec["val_loss"] - qat_rec["val_loss"]) / degradation if degradation > 0 else None,
            "ptq_degradation_over_seed_spread": degradation / spread if spread else None}


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": sys.version.split()[0],
            "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="tiny model, a few steps: a smoke test of the script")
    ap.add_argument("--preset", default="mini-s", help="mini-s (default), mini, or any preset")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per training run (default 200)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-batches", type=int, default=None, help="validation batches (default: the whole split)")
    ap.add_argument("--settings", default="k3,harsh,harshest", help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--no-seed-spread", action="store_true", help="skip the second fp32 run (seed + 1)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: the machine is shared)")
    ap.add_argument("--data", default=str(ROOT / "runs" / "data"))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.batch_size, args.seq_len = args.steps or 4, 2, 32
        args.eval_batches = args.eval_batches or 2
    args.steps = args.steps or 200
    config = base_config(args.preset, args.quick)
    # runs/data holds the default vocabulary; another vocabulary gets its own directory, never a rebuild of it
    data = args.data if config.vocab_size == DEFAULT_VOCAB_SIZE else f"{args.data}-v{config.vocab_size}"
    files = prepare_data(data, vocab_size=config.vocab_size)
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    if not names or set(names) - set(SETTINGS):
        raise SystemExit(f"--settings {args.settings!r}: use a comma-separated subset of {', '.join(SETTINGS)}")
    t_start = time.perf_counter()
    machine_before = machine()
    runs = {}
    fp32_model, runs["fp32"] = train_run(config, files, args, "fp32")
    spread = None
    if not args.no_seed_spread:
        _, runs["fp32_seed+1"] = train_run(config, files, args, "fp32_seed+1", seed=args.seed + 1)
        spread = abs(runs["fp32_seed+1"]["val_loss"] - runs["fp32"]["val_loss"])
    results = {}
    for name in names:
        qat = SETTINGS[name]
        runs[f"ptq_{name}"] = ptq(fp32_model, qat, files, args)
        print(f"ptq_{name}: {json.dumps(runs[f'ptq_{name}'])}", file=sys.stderr, flush=True)
        _, runs[f"qat_{name}"] = train_run(config.replace(qat=qat), files, args, f"qat_{name}")
        results[name] = {"qat": qat, **compare(runs["fp32"], runs[f"ptq_{name}"], runs[f"qat_{name}"], spread)}
    val_windows = (files.val.n_tokens - 1) // args.seq_len
    result = {
        "benchmark": "qat",
        "quick": args.quick,
        "model": config.name,
        "config": config.to_dict(),
        "params": sum(p.numel() for p in fp32_model.parameters()),
        "budget": {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                   "tokens": args.steps * args.batch_size * args.seq_len, "lr": args.lr,
                   "warmup_steps": args.warmup_steps, "seed": args.seed, "optimizer": "adamw"},
        "val_tokens": (args.eval_batches * args.batch_size if args.eval_batches else val_windows) * args.seq_len,
        "runs": runs,
        "settings": results,
        "seed_spread": spread,
        "definitions": {"recovery": "(PTQ val loss - QAT val loss) / (PTQ val loss - fp32 val loss)",
                        "ptq_degradation": "PTQ val loss - fp32 val loss, nats/token",
                        "qat_gap": "QAT val loss - fp32 val loss, nats/token",
                        "seed_spread": "|fp32 val loss (seed + 1) - fp32 val loss (seed)|: training noise"},
        "command": "python benchmarks/qat.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "total_s": round(time.perf_counter() - t_start, 1),
        "machine": machine_before,
        "loadavg_1m_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    atomic_write_json(Path(args.out), result)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{config.name}, {result['budget']['tokens']:,} training tokens per run, "
              f"{result['val_tokens']:,} validation tokens")
        print(f"fp32 val loss {runs['fp32']['val_loss']:.4f}" + (f", seed-to-seed spread {spread:.4f}" if spread
                                                                  is not None else ""))
        for name, r in results.items():
            rec = "n/a" if r["recovery"] is None else f"{r['recovery']:.2f}"
            print(f"{name}: PTQ {runs[f'ptq_{name}']['val_loss']:.4f} (+{r['ptq_degradation']:.4f}), "
                  f"QAT {runs[f'qat_{name}']['val_loss']:.4f} (+{r['qat_gap']:.4f}), recovery {rec}")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
