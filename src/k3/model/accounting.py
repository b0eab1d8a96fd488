"""Exact parameter accounting, read from the real modules (the full preset is built on the meta device).

Every parameter is attributed to one component by where it lives in the module tree; "active" counts
what one token touches: everything except the routed experts, plus top-k / n_experts of them.
"""
from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model.moe import MoE, Router, SwiGLU
from k3.model.transformer import K3Model

COMPONENTS = (
    "embedding", "head", "kda", "mla", "attnres", "norms", "dense_mlp",
    "moe_router", "moe_latent_proj", "moe_shared", "moe_routed",
)


def build_meta(config: K3Config) -> K3Model:
    """The model on the meta device: shapes and counts without memory."""
    with torch.device("meta"):
        return K3Model(config)


def _moe_component(moe: MoE, name: str) -> str:
    """name is a parameter name relative to the MoE module."""
    child_name = name.split(".")[0]
    child = getattr(moe, child_name)
    if isinstance(child, Router):
        return "moe_router"
    if child is getattr(moe, "experts", None):
        return "moe_routed"
    if isinstance(child, (SwiGLU, nn.ModuleList)):
        return "moe_shared"
    if isinstance(child, nn.Linear):
        return "moe_latent_proj"
    raise ValueError(f"cannot attribute MoE parameter {name!r} to a component")


def component_of(model: K3Model, name: str) -> str:
    top = name.split(".")[0]
    if top == "embed":
        return "embedding"
    if top == "head":
        return "head"
    if top == "attnres":
        return "attnres"
    if top == "norm":
        return "norms"
    if top == "layers":
        _, idx, part, *rest = name.split(".")
        block = model.layers[int(idx)]
        if part in ("attn_norm", "ffn_norm"):
            return "norms"
        if part == "mixer":
            return "kda" if block.kind == "K" else "mla"
        if part == "ffn":
            return _moe_component(block.ffn, ".".join(rest)) if isinstance(block.ffn, MoE) else "dense_mlp"
    raise ValueError(f"cannot attribute parameter {name!r} to a component")


def count_params(model: K3Model) -> dict:
    """Totals and a per-component breakdown, each with total and active counts."""
    cfg = model.config
    by = {c: {"total": 0, "active": 0} for c in COMPONENTS}
    active_frac = cfg.n_active_experts / cfg.n_experts
    for name, p in model.named_parameters():  # tied weights are yielded once
        comp = component_of(model, name)
        n = p.numel()
        by[comp]["total"] += n
        by[comp]["active"] += round(n * active_frac) if comp == "moe_routed" else n
    return {
        "total": sum(v["total"] for v in by.values()),
        "active": sum(v["active"] for v in by.values()),
        "d_model": cfg.d_model,
        "latent_dim": cfg.latent_dim,
        "layers": {"total": cfg.n_layers, "kda": cfg.n_kda_layers, "mla": cfg.n_mla_layers},
        "attnres_sources": cfg.attnres_sources if cfg.attnres == "block" else None,
        "attnres": cfg.attnres,
        "experts": cfg.n_experts,
        "active_experts": cfg.n_active_experts,
        "shared_experts": cfg.n_shared_experts,
        "vocab_size": cfg.vocab_size,
        "max_context": cfg.max_context,
        "by_component": {k: v for k, v in by.items() if v["total"]},
    }
