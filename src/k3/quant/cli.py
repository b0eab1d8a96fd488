"""`k3 quant-bytes`: checkpoint bytes by component and precision. (`k3 export` is k3.io.cli's.)"""
from __future__ import annotations

import argparse
import json

from k3.model.cli import add_config_args, config_from_args


def cmd_quant_bytes(args: argparse.Namespace) -> int:
    from k3.quant.sizes import bytes_table, checkpoint_bytes

    result = checkpoint_bytes(config_from_args(args), args.routed_format)
    print(json.dumps(result, indent=2) if args.json else bytes_table(result))
    return 0


def register(sub) -> None:
    p = sub.add_parser("quant-bytes", help="checkpoint bytes by component: fp32, bf16, MX-packed routed experts",
                       description="Bytes of every stored tensor, by component, computed from the real modules "
                                   "(the full preset is built on the meta device).")
    add_config_args(p, default="k3")
    p.add_argument("--routed-format", choices=("mxfp4", "mxfp8"), default="mxfp4")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_quant_bytes)
