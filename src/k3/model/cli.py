"""`k3 params` and `k3 config`: what a configuration is, counted from the real modules."""
from __future__ import annotations

import argparse
import json

from k3.config import PRESETS, K3Config, K3ConfigError, get_config


def add_config_args(p: argparse.ArgumentParser, default: str = "mini") -> None:
    p.add_argument("--preset", default=default, choices=sorted(PRESETS), help=f"model preset (default {default})")
    p.add_argument("--config", metavar="FILE.json",
                   help="a config JSON: its fields override --preset's, the fields it leaves out come from --preset")
    p.add_argument("--set", metavar="FIELD=VALUE", action="append", default=[],
                   help="override one config field, e.g. --set attnres=full (repeatable)")


def config_from_args(args: argparse.Namespace) -> K3Config:
    if getattr(args, "config", None):
        try:
            with open(args.config, encoding="utf-8") as f:
                base = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise K3ConfigError(f"--config {args.config}: not valid JSON ({e}); give a JSON object of config fields, "
                                "as `k3 config --preset NAME` prints") from None
        if not isinstance(base, dict):
            raise K3ConfigError(f"--config {args.config}: holds a JSON {type(base).__name__}, not an object of config "
                                "fields; give one as `k3 config --preset NAME` prints")
        # a complete config (as `k3 config` or a checkpoint writes it, kda_norm_eps aside: from_dict fills that
        # in for configs saved before it existed) stands alone; a partial one is laid over --preset
        if not set(K3Config.__dataclass_fields__) - {"kda_norm_eps"} <= set(base):
            base = {**PRESETS[args.preset], **base}
    else:
        base = {**PRESETS[args.preset]}
        get_config(args.preset)  # validates the preset name
    fields = K3Config.__dataclass_fields__
    for item in getattr(args, "set", []) or []:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            raise K3ConfigError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # bare strings such as attnres=full
        if fields[key].type in ("str", str) and not isinstance(value, str):
            value = raw  # a string field takes the text as written: --set name=123 is the name "123"
        base[key] = value
    return K3Config.from_dict(base)


def _fmt(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:,.3f}{unit}"
    return str(n)


def cmd_params(args: argparse.Namespace) -> int:
    from k3.model.accounting import build_meta, count_params

    counts = count_params(build_meta(config_from_args(args)))
    if args.json:
        print(json.dumps(counts, indent=2))
        return 0
    print(f"{'component':<18}{'total':>16}{'active':>16}")
    for comp, v in counts["by_component"].items():
        print(f"{comp:<18}{v['total']:>16,}{v['active']:>16,}")
    print(f"{'all':<18}{counts['total']:>16,}{counts['active']:>16,}")
    print(f"total {_fmt(counts['total'])}, active {_fmt(counts['active'])}; "
          f"{counts['layers']['kda']} KDA + {counts['layers']['mla']} MLA layers, "
          f"{counts['active_experts']}/{counts['experts']} experts, latent {counts['latent_dim']}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    print(config_from_args(args).to_json())
    return 0


def register(sub) -> None:
    p = sub.add_parser("params", help="count parameters (total / active, by component) from the real modules")
    add_config_args(p, default="k3")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_params)
    p = sub.add_parser("config", help="print a validated config as JSON")
    add_config_args(p)
    p.set_defaults(func=cmd_config)
