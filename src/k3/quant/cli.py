"""`k3 export` (packed MX checkpoints, HF transformers directories) and `k3 quant-bytes` (checkpoint bytes by
component and precision)."""
from __future__ import annotations

import argparse
import json

from pathlib import Path

from k3.model.cli import add_config_args, config_from_args

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
    from k3.quant.export import EXPORT_KEY, export_mx
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


def cmd_quant_bytes(args: argparse.Namespace) -> int:
    from k3.quant.sizes import bytes_table, checkpoint_bytes

    result = checkpoint_bytes(config_from_args(args), args.routed_format)
    print(json.dumps(result, indent=2) if args.json else bytes_table(result))
    return 0


def register(sub) -> None:
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

    p = sub.add_parser("quant-bytes", help="checkpoint bytes by component: fp32, bf16, MX-packed routed experts",
                       description="Bytes of every stored tensor, by component, computed from the real modules "
                                   "(the full preset is built on the meta device).")
    add_config_args(p, default="k3")
    p.add_argument("--routed-format", choices=("mxfp4", "mxfp8"), default="mxfp4")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_quant_bytes)
