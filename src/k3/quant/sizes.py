"""Checkpoint bytes by component and precision, read from the real modules (the full preset on the meta device).

Every tensor a checkpoint stores (parameters and persistent buffers, tied weights once) is attributed to a
component by `k3.model.accounting.component_of`. Routed-expert bytes in MX come from `packed_shapes`, the
function the exporter itself uses to lay out codes and scales, so this table and `k3 export` cannot drift.
"""
from __future__ import annotations

import torch

from k3.config import K3Config
from k3.model.accounting import COMPONENTS, build_meta, component_of
from k3.quant.export import EXPERT_WEIGHTS, packed_shapes

_DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def _stored_tensors(model) -> dict[str, torch.Tensor]:
    seen, out = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _mx_bytes(shape, fmt: str) -> int:
    codes, scales = packed_shapes(tuple(shape), fmt)
    return int(torch.Size(codes).numel() + torch.Size(scales).numel())  # both uint8


def checkpoint_bytes(config: K3Config, routed_format: str = "mxfp4") -> dict:
    """{component: {params, fp32, bf16, mx_rest_bf16, mx_rest_fp32}} plus 'total'; bytes of model weights only.

    fp32 / bf16: every tensor at that width. mx_rest_*: routed experts packed in `routed_format` (codes +
    E8M0 scales) and everything else at bf16 / fp32 (`k3 export` writes the rest as trained, fp32 on CPU).
    """
    model = build_meta(config)
    rows = {c: {"params": 0, "fp32": 0, "bf16": 0, "mx_rest_bf16": 0, "mx_rest_fp32": 0} for c in COMPONENTS}
    for name, t in _stored_tensors(model).items():
        comp = component_of(model, name)
        n = t.numel()
        r = rows[comp]
        r["params"] += n
        r["fp32"] += 4 * n
        r["bf16"] += 2 * n
        if comp == "moe_routed" and name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS:
            mx = _mx_bytes(t.shape, routed_format)
            r["mx_rest_bf16"] += mx
            r["mx_rest_fp32"] += mx
        else:
            r["mx_rest_bf16"] += 2 * n
            r["mx_rest_fp32"] += 4 * n
    rows = {c: r for c, r in rows.items() if r["params"]}
    rows["total"] = {k: sum(r[k] for r in rows.values()) for k in ("params", "fp32", "bf16", "mx_rest_bf16",
                                                                      "mx_rest_fp32")}
    return {"config": config.name, "routed_format": routed_format, "by_component": rows}


def bytes_table(result: dict) -> str:
    """Markdown table of `checkpoint_bytes` in GB (1e9 bytes), with bits per parameter of the MX column."""
    f = result["routed_format"].upper()
    lines = [f"| component | values | fp32 GB | bf16 GB | {f} routed + bf16 rest, GB | bits/param |",
             "|---|---:|---:|---:|---:|---:|"]
    for comp, r in result["by_component"].items():
        bits = 8 * r["mx_rest_bf16"] / r["params"]
        name = f"**{comp}**" if comp == "total" else comp
        lines.append(f"| {name} | {r['params']:,} | {r['fp32'] / 1e9:,.2f} | {r['bf16'] / 1e9:,.2f} | "
                     f"{r['mx_rest_bf16'] / 1e9:,.2f} | {bits:.2f} |")
    return "\n".join(lines)
