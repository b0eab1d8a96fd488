"""What-ifs: undo one K3 choice at a time and see which wall moves.

Each what-if maps (config, options) to a changed pair; the planner then recomputes everything from the
changed model, so a what-if is as exact as the plan itself.
"""
from __future__ import annotations

import dataclasses

from k3.config import K3Config
from k3.plan.walls import Layout, Options, plan

WHAT_IFS = {
    "no-latentmoe": "standard MoE: the same experts and top-k, dispatched at full width d_model",
    "full-attention": "every layer Gated MLA (no KDA)",
    "all-kda": "every layer KDA (no MLA)",
    "full-attnres": "Full Attention Residuals: every sublayer output is a source",
    "no-attnres": "plain residual stream instead of Attention Residuals",
    "bf16-experts": "routed experts stored in BF16 instead of MXFP4",
}


def apply_what_if(name: str, config: K3Config, options: Options) -> tuple[K3Config, Options]:
    if name == "no-latentmoe":
        return config.replace(moe="standard", name=f"{config.name}+{name}"), options
    if name == "full-attention":
        return config.replace(layer_pattern="M" * config.n_layers, name=f"{config.name}+{name}"), options
    if name == "all-kda":
        return config.replace(layer_pattern="K" * config.n_layers, name=f"{config.name}+{name}"), options
    if name == "full-attnres":
        return config.replace(attnres="full", name=f"{config.name}+{name}"), options
    if name == "no-attnres":
        return config.replace(attnres="none", name=f"{config.name}+{name}"), options
    if name == "bf16-experts":
        return config, dataclasses.replace(options, expert_precision="bf16")
    raise ValueError(f"unknown what-if {name!r}; choose from {', '.join(WHAT_IFS)}")


def parse_what_ifs(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WHAT_IFS]
    if unknown or not names:
        raise ValueError(f"--what-if {text!r}: unknown {unknown or 'empty list'}; choose from {', '.join(WHAT_IFS)}")
    return names


def headline(r: dict) -> dict:
    """The few numbers per wall that a what-if table compares (per GPU of the worst stage)."""
    mem = r["memory"]
    comm = r["communication"]
    out = {"memory_gb": mem["total"] / 1e9, "weights_gb": mem["weights"] / 1e9, "fits": r["fits"],
           "a2a_bytes_per_token_per_layer": comm["a2a_bytes_per_token_per_moe_layer"],
           "pp_bytes_per_microbatch": comm["pp_bytes_per_microbatch"],
           "flops_per_token_forward": r["compute"]["flops_per_token_forward"]}
    if r["mode"] == "serve":
        out.update({"cache_gb_per_sequence": mem["cache_per_sequence"] / 1e9,
                    "bytes_read_per_token": r["bandwidth"]["bytes_read_per_token"],
                    "comm_s_per_decode_step": comm["total_s"],
                    "decode_ms_per_token": r["latency"]["decode_per_token_bound_s"] * 1e3,
                    "tokens_per_s": r["latency"]["tokens_per_s_bound"],
                    "ttft_s": r["latency"]["ttft_bound_s"]})
    else:
        out.update({"activations_gb_checkpointing": mem["activations_checkpointing"] / 1e9,
                    "comm_s_per_step": comm["total_s"], "step_time_s": r["latency"]["step_time_bound_s"]})
    return out


def what_ifs(config: K3Config, hardware, layout: Layout, options: Options, names: list[str]) -> dict:
    """{'base': headline, name: {'headline': ..., 'ratio': value / base per number} or {'error': why}}."""
    base = headline(plan(config, hardware, layout, options))
    out: dict = {"base": base}
    for name in names:
        cfg, opt = apply_what_if(name, config, options)
        try:
            h = headline(plan(cfg, hardware, layout, opt))
        except ValueError as e:
            out[name] = {"error": str(e)}
            continue
        ratio = {k: (h[k] / base[k] if isinstance(base[k], (int, float)) and not isinstance(base[k], bool) and base[k]
                     else None) for k in h}
        out[name] = {"description": WHAT_IFS[name], "headline": h, "ratio": ratio}
    return out
