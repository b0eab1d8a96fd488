"""`k3 export` (packed MX checkpoints) and `k3 quant-bytes` (checkpoint bytes by component and precision)."""
from __future__ import annotations

import argparse
import json

from k3.model.cli import add_config_args, config_from_args


def cmd_export(args: argparse.Namespace) -> int:
    from k3.quant.export import EXPORT_KEY, export_mx
    from k3.train.checkpoint import read_manifest

    if args.format != "mx":
        raise ValueError(f"--format {args.format!r} is not supported; use --format mx")
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
    p = sub.add_parser("export", help="write a checkpoint with packed MX routed experts (k3 export --format mx)",
                       description="Pack a training checkpoint's routed-expert weights as MX codes + E8M0 scales "
                                   "(MXFP4: two codes per byte); every other tensor is copied as stored. The "
                                   "result loads with `k3 eval --ckpt OUT` / `k3 sample --ckpt OUT` and runs the "
                                   "experts from the packed weights. See docs/quantization.md.")
    p.add_argument("ckpt", help="training checkpoint: a step directory or a root holding `latest`")
    p.add_argument("--out", required=True, help="output directory (becomes a checkpoint root)")
    p.add_argument("--format", default="mx", help="export format; only 'mx' (default)")
    p.add_argument("--activations", choices=("keep", "mxfp8", "mxfp4", "none"), default="keep",
                   help="qat.activations of the exported model (default: keep the checkpoint's; a full-precision "
                        "checkpoint exported with mxfp8 runs K3's PTQ setting)")
    p.add_argument("--overwrite", action="store_true", help="replace an export already in --out")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("quant-bytes", help="checkpoint bytes by component: fp32, bf16, MX-packed routed experts",
                       description="Bytes of every stored tensor, by component, computed from the real modules "
                                   "(the full preset is built on the meta device).")
    add_config_args(p, default="k3")
    p.add_argument("--routed-format", choices=("mxfp4", "mxfp8"), default="mxfp4")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_quant_bytes)
