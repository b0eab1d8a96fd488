"""`k3 eval`, `k3 sample` and `k3 export`: the commands that read any checkpoint k3.load reads."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from k3.cli_checks import seed as seed_type
from k3.train.cli import _bytes_per_token, check_sampling, generate_text, load_data_dir


PRECISION_HELP = ("fp32, bf16 (autocast over the fp32 weights), or auto (default): bf16 on CUDA, and on a CPU only "
                  "where a probe on this host, cached per host, measures it faster")


def resolve_precision_flag(args: argparse.Namespace, device, quiet: bool = False) -> str:
    """--precision, with "auto" settled (k3.train.precision); says on stderr what was chosen and why."""
    from k3.train.precision import resolve_precision

    precision, reason = resolve_precision(args.precision, device)
    if not quiet:
        print(f"precision {precision}: {reason}", file=sys.stderr)
    return precision


# ---------------------------------------------------------------------- k3 eval
def cmd_eval(args: argparse.Namespace) -> int:
    from k3.train.metrics import bits_per_byte
    from k3.io import load_with_manifest
    from k3.train.batches import eval_batch_count, evaluate
    from k3.train.device import resolve_device

    for flag, value in (("--max-batches", args.max_batches), ("--batch-size", args.batch_size),
                        ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")
    device = resolve_device(args.device)
    model, manifest = load_with_manifest(args.ckpt, device=device)
    data_dir = args.data or manifest.get("data", {}).get("data_dir")
    if not data_dir:
        raise ValueError("the checkpoint does not name its data; pass --data DIR")
    if not args.data and not Path(data_dir).exists():
        raise ValueError(f"the data the checkpoint was trained on ({data_dir}) is gone; pass --data DIR, a directory "
                         "tokenized with the same tokenizer")
    files = load_data_dir(data_dir)
    trained = (manifest.get("data") or {}).get("tokenizer_hash")
    if trained and files.tokenizer.fingerprint != trained:
        raise ValueError(f"--data {data_dir} was tokenized with another tokenizer than the model's training data "
                         f"(vocabulary {files.tokenizer.vocab_size}); its token ids would mean other text to the "
                         "model: pass --data of the data the model was trained on")
    seq_len = args.seq_len or manifest.get("data", {}).get("seq_len") or 256
    from k3.train.batches import check_dataset

    if seq_len > model.config.max_context:
        raise ValueError(f"--seq-len {seq_len} is longer than the model's max_context = {model.config.max_context}; "
                         f"give --seq-len {model.config.max_context} or less")
    check_dataset(files.val, "validation", model.config, 1, seq_len, 0)
    precision = resolve_precision_flag(args, device, quiet=args.quiet or args.json)
    t0 = time.perf_counter()
    from tqdm.auto import tqdm

    total = eval_batch_count(files.val, args.batch_size, seq_len, args.max_batches)
    with tqdm(total=total, unit="batch", desc="eval", disable=args.quiet, file=sys.stderr, dynamic_ncols=True) as bar:
        loss = evaluate(model, files.val, args.max_batches, args.batch_size, seq_len, device=device,
                        progress=bar.update, precision=precision)
    out = {"checkpoint": manifest["path"], "step": manifest["step"], "split": "val", "seq_len": seq_len,
           "precision": precision,
           "val_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "seconds": round(time.perf_counter() - t0, 2)}
    bpt = _bytes_per_token(files.val)
    if bpt:
        out["bytes_per_token"] = bpt
        out["bits_per_byte"] = bits_per_byte(loss, bpt)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        step = f"step {out['step']}" if out["step"] is not None else "released weights"
        print(f"{out['checkpoint']} ({step}), val split, seq_len {seq_len}")
        print(f"loss {loss:.4f} nats/token, perplexity {out['perplexity']:.2f}"
              + (f", {out['bits_per_byte']:.4f} bits/byte ({bpt:.2f} bytes/token)" if bpt else ""))
    return 0


# ---------------------------------------------------------------------- k3 sample
def cmd_sample(args: argparse.Namespace) -> int:
    from k3.io import load_with_manifest
    from k3.io.trained import checkpoint_tokenizer
    from k3.train.device import resolve_device
    from k3.train.device import autocast

    check_sampling(args.temperature, args.top_p, args.max_new_tokens)
    if args.num_samples < 1:
        raise ValueError(f"--num-samples {args.num_samples} must be >= 1")
    device = resolve_device(args.device)
    model, manifest = load_with_manifest(args.ckpt, device=device)
    tokenizer = checkpoint_tokenizer(manifest, model.config.vocab_size, args.tokenizer)
    precision = resolve_precision_flag(args, device)
    for i in range(args.num_samples):
        with autocast(device, precision, training=False):
            text = generate_text(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_p,
                                 args.seed + i, skip_special=not args.keep_special)
        if args.num_samples > 1:
            print(f"--- sample {i + 1}")
        print(text)
    return 0


# ---------------------------------------------------------------------- k3 export
FORMATS = ("mx", "hf", "kimi")


def cmd_export_hf(args: argparse.Namespace) -> int:
    from k3.io.hf import export_hf

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise ValueError(f"{out} exists and is not empty; pass --overwrite to replace it or choose another --out")
    path = export_hf(args.ckpt, out, tokenizer_path=args.tokenizer)
    print(f"exported {args.ckpt} -> {path} (HF transformers: config.json, model.safetensors, tokenizer files)")
    print(f"load it: import k3.io.hf; AutoModelForCausalLM.from_pretrained({str(path)!r})")
    return 0


def cmd_export_kimi(args: argparse.Namespace) -> int:
    import torch

    from k3.io.export import export_kimi

    if args.activations != "keep" or args.tokenizer is not None:
        raise ValueError("--activations and --tokenizer do not apply to --format kimi (the released layout packs only "
                         "the routed-expert weights; the tokenizer is the source's)")
    dtype = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    path, info = export_kimi(args.ckpt, args.out, model_type=args.model_type, dtype=dtype, overwrite=args.overwrite)
    experts = "compressed-tensors MXFP4" if info["mxfp4_experts"] else "full precision"
    print(f"exported {args.ckpt} -> {path} ({info['model_type']}; routed experts {experts}; "
          f"{', '.join(info['shards'])}; tokenizer: {info['tokenizer'] or 'none known'})")
    if info["model_type"] == "kimi_linear":
        print(f"load it: transformers.KimiLinearForCausalLM.from_pretrained({str(path)!r}), or k3.load({str(path)!r})")
    else:
        print(f"load it: k3.load({str(path)!r}); k3 eval / sample / serve --ckpt {path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from k3.io.export import export_mx
    from k3.quant.export import EXPORT_KEY
    from k3.train.checkpoint import read_manifest

    if args.format not in FORMATS:
        raise ValueError(f"--format {args.format!r} is not supported; use one of {', '.join(FORMATS)}")
    if args.format == "kimi":
        return cmd_export_kimi(args)
    if args.model_type is not None or args.dtype is not None:
        raise ValueError("--model-type and --dtype apply to --format kimi only")
    if args.format == "hf":
        if args.activations != "keep":
            raise ValueError("--activations applies to --format mx only (the HF export keeps the checkpoint's "
                             "config)")
        return cmd_export_hf(args)
    if args.tokenizer is not None:
        raise ValueError("--tokenizer applies to --format hf only")
    path = export_mx(args.ckpt, args.out, activations=args.activations, overwrite=args.overwrite)
    info = read_manifest(path, verify=False)["extra"][EXPORT_KEY]
    print(f"exported {info['source']['checkpoint']} (step {info['source']['step']}) -> {path}")
    print(f"routed experts: {info['routed_expert_params']:,} parameters in {info['routed_expert_bytes']:,} bytes "
          f"of {info['expert_weights']} codes + E8M0 scales = {info['routed_bits_per_param']:.3f} bits/param; "
          f"other tensors {', '.join(info['other_tensors'])}")
    print(f"use it like a checkpoint: k3 eval --ckpt {args.out}   |   k3 sample --ckpt {args.out}")
    return 0


# ---------------------------------------------------------------------- registration
def register(sub) -> None:
    p = sub.add_parser("eval", help="validation loss, perplexity and bits per byte of a checkpoint")
    p.add_argument("--ckpt", default="runs/train/checkpoint",
                   help="checkpoint dir or root (default runs/train/checkpoint)")
    p.add_argument("--data", default=None, help="tokenized data dir (default: the one the checkpoint was trained on)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None, help="default: the training seq_len")
    p.add_argument("--max-batches", type=int, default=None, help="cap on validation batches (default: the whole split)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto", help=PRECISION_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("sample", help="generate text from a checkpoint")
    p.add_argument("--ckpt", default="runs/train/checkpoint", help="checkpoint dir or root")
    p.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=seed_type, default=0)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--keep-special", action="store_true",
                   help="print the special tokens the model writes (<|end|>, <|tool_call|>, ...); by default they "
                        "are left out, as the server's completions do")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one the checkpoint names)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto", help=PRECISION_HELP)
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("export", help="export a checkpoint: packed MX routed experts (--format mx), an HF "
                                      "transformers directory (--format hf) or the released Kimi layout "
                                      "(--format kimi)",
                       description="--format mx: pack a training checkpoint's routed-expert weights as MX codes + "
                                   "E8M0 scales (MXFP4: two codes per byte); every other tensor is copied as stored. "
                                   "The result loads with `k3 eval --ckpt OUT` / `k3 sample --ckpt OUT` and runs the "
                                   "experts from the packed weights (docs/quantization.md). --format hf: write "
                                   "config.json, model.safetensors and the tokenizer for AutoModelForCausalLM "
                                   "(docs/serving.md). --format kimi: the released layout of Kimi-Linear (kimi_linear) "
                                   "or Kimi K3 (kimi_k3), routed experts as compressed-tensors MXFP4 when the model "
                                   "packs them; any checkpoint k3 reads is a source (docs/checkpoints.md).")
    p.add_argument("ckpt", help="training checkpoint: a step directory or a root holding `latest` (--format kimi: "
                                "also an export or a released folder)")
    p.add_argument("--out", required=True, help="output directory (becomes a checkpoint root)")
    p.add_argument("--format", default="mx", help=f"export format: {', '.join(FORMATS)} (default mx)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json to ship with --format hf (default: the one the checkpoint's manifest names)")
    p.add_argument("--activations", choices=("keep", "mxfp8", "mxfp4", "none"), default="keep",
                   help="qat.activations of the exported model (default: keep the checkpoint's; a full-precision "
                        "checkpoint exported with mxfp8 runs K3's PTQ setting)")
    p.add_argument("--model-type", choices=("kimi_linear", "kimi_k3"), default=None,
                   help="--format kimi: the layout (default: kimi_linear for a model without K3's additions, else "
                        "kimi_k3)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="--format kimi: the dtype of the unquantized tensors (default: as the source stores them; "
                        "the release ships bf16)")
    p.add_argument("--overwrite", action="store_true", help="replace an export already in --out")
    p.set_defaults(func=cmd_export)
