"""`k3 params` and `k3 config`: what a configuration is, counted from the real modules."""
from __future__ import annotations

import argparse
import json

from k3.config import PRESETS, K3Config, K3ConfigError, get_config, is_complete_config, read_config_file
from k3.fileio import loads_json


def add_config_args(p: argparse.ArgumentParser, default: str = "mini") -> None:
    p.add_argument("--preset", default=default, choices=sorted(PRESETS), help=f"model preset (default {default})")
    p.add_argument("--config", metavar="FILE.json",
                   help="a config JSON: its fields override --preset's, the fields it leaves out come from --preset")
    p.add_argument("--set", metavar="FIELD=VALUE", action="append", default=[],
                   help="override one config field, e.g. --set attnres=full (repeatable)")


def config_from_args(args: argparse.Namespace) -> K3Config:
    if getattr(args, "config", None):
        base = read_config_file(args.config)
        if not is_complete_config(base):  # a partial config is laid over --preset
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
            value = loads_json(raw)
        except json.JSONDecodeError:
            value = raw  # bare strings such as attnres=full
        if fields[key].type in ("str", str) and not isinstance(value, str):
            value = raw  # a string field takes the text as written: --set name=123 is the name "123"
        base[key] = value
    return K3Config.from_dict(base)


def cmd_params(args: argparse.Namespace) -> int:
    from k3.model.accounting import build_meta, count_params, format_count

    cfg = config_from_args(args)
    counts = count_params(build_meta(cfg))
    if args.json:
        print(json.dumps(counts, indent=2))
        return 0
    rows = [(comp, v["total"], v["active"]) for comp, v in counts["by_component"].items()]
    rows.append(("all", counts["total"], counts["active"]))
    # wide enough for the longest name and number, with at least one space between columns
    c = max(18, max(len(r[0]) for r in rows) + 2)
    w = max(16, max(len(f"{n:,}") for r in rows for n in r[1:]) + 2)
    print(f"{'component':<{c}}{'total':>{w}}{'active':>{w}}")
    for comp, total, active in rows:
        print(f"{comp:<{c}}{total:>{w},}{active:>{w},}")
    print(f"total {format_count(counts['total'])}, active {format_count(counts['active'])}; "
          f"{counts['layers']['kda']} KDA + {counts['layers']['mla']} MLA layers, " + (
              f"{counts['active_experts']}/{counts['experts']} experts, latent {counts['latent_dim']}"
              if cfg.n_dense_layers < cfg.n_layers else "no MoE layer (every layer dense)"))
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
