"""Inference packing: linears that read the same input, run as one product over their stacked weights.

A CPU decode step is bound by reading weights, and one [sum of rows, d] product reads them faster than several
narrow ones (a 128 x 256 fp32 matrix at 4.9 GB/s, 128 x 512 at 7.7, 256 x 2048 at 15 on the dev machine;
docs/serving.md, decode) and costs one call instead of several. The stacked copy is made on first use, kept on the
owning module outside its state dict, and rebuilt when any weight changes (an optimizer step or a load bumps the
tensor's version); where gradients are wanted, a linear is not a plain one (QAT's fake-quantized linears), or the
copy would exceed `PACK_MAX_BYTES`, the linears run apart as before.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

PACK_MAX_BYTES = 64 << 20  # per pack: mini's largest is 16 MB (a layer's routed w1 + w3); K3's would be GBs


def weights_key(ws: Sequence[torch.Tensor]) -> tuple:
    """What identifies the values of `ws`: storage, in-place version, dtype and device of each."""
    return tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws)


def cached_pack(owner: nn.Module, name: str, ws: Sequence[torch.Tensor], build) -> object:
    """build(ws) cached on `owner` under `name` until any of `ws` changes."""
    packs = owner.__dict__.setdefault("_inference_packs", {})
    key = weights_key(ws)
    hit = packs.get(name)
    if hit is None or hit[0] != key:
        hit = (key, build([w.detach() for w in ws]))
        packs[name] = hit
    return hit[1]


def packed_weight(owner: nn.Module, name: str, linears: Sequence[nn.Module]) -> torch.Tensor | None:
    """The weights of `linears` (plain bias-free nn.Linear reading one input) stacked by output rows,
    [sum of out_features, in_features], or None where they must run apart (module doc)."""
    if any(type(m) is not nn.Linear or m.bias is not None for m in linears):
        return None
    ws = [m.weight for m in linears]
    if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
        return None
    if sum(w.numel() * w.element_size() for w in ws) > PACK_MAX_BYTES:
        return None
    return cached_pack(owner, name, ws, torch.cat)


def packed_linear(owner: nn.Module, name: str, linears: Sequence[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """[m(x) for m in linears], as one product when `packed_weight` allows (the outputs are then views of it)."""
    w = packed_weight(owner, name, linears)
    if w is None:
        return [m(x) for m in linears]
    return list(torch.nn.functional.linear(x, w).split([m.out_features for m in linears], dim=-1))
