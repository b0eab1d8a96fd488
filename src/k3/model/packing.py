"""Inference packing: linears that read the same input, run as one product over their stacked weights.

A CPU decode step is bound by reading weights, and one [sum of rows, d] product reads them faster than several
narrow ones (a 128 x 256 fp32 matrix at 4.9 GB/s, 128 x 512 at 7.7, 256 x 2048 at 15 on the dev machine;
docs/serving.md, decode) and costs one call instead of several.

The stacked copies are made only inside `scope(session)`, which the serving engine opens around its steps with a
session of its own (`new_session()`), and are kept on the owning modules, outside their state dicts, for that session.
A copy is rebuilt when the session changes or a weight's storage or version counter does; it cannot see an in-place
write that leaves the version counter alone, which torch's fused AdamW does (its step bumps no version), so code
that changes the weights while a session lives starts a new one (`Engine.refresh_weights`). Outside a scope (training,
evaluation, `K3Model.generate`), where gradients are wanted, where a linear is not a plain one (QAT's fake-quantized
linears), or where a copy would exceed `PACK_MAX_BYTES`, the linears run apart.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
from typing import Sequence

import torch
from torch import nn

PACK_MAX_BYTES = 64 << 20  # per pack: mini's largest is 16 MB (a layer's routed w1 + w3); K3's would be GBs

_SESSION: contextvars.ContextVar[int | None] = contextvars.ContextVar("k3_packing_session", default=None)
_SESSIONS = itertools.count(1)


def new_session() -> int:
    """A session id no earlier session had: packs made under another are rebuilt under it."""
    return next(_SESSIONS)


@contextlib.contextmanager
def scope(session: int):
    """Within it, linears may run from packed copies made for `session` (module doc)."""
    token = _SESSION.set(session)
    try:
        yield
    finally:
        _SESSION.reset(token)


def cached_pack(owner: nn.Module, name: str, ws: Sequence[torch.Tensor], build) -> object | None:
    """build(ws) cached on `owner` under `name` for the open session until any of `ws` changes; None outside a
    scope or where gradients are wanted."""
    session = _SESSION.get()
    if session is None or (torch.is_grad_enabled() and any(w.requires_grad for w in ws)):
        return None
    packs = owner.__dict__.setdefault("_inference_packs", {})
    key = (session,) + tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws)
    hit = packs.get(name)
    if hit is None or hit[0] != key:
        packs.pop(name, None)  # the stale copy goes before the new one is made
        hit = (key, build([w.detach() for w in ws]))
        packs[name] = hit
    return hit[1]


def packed_weight(owner: nn.Module, name: str, linears: Sequence[nn.Module]) -> torch.Tensor | None:
    """The weights of `linears` (plain bias-free nn.Linear reading one input) stacked by output rows,
    [sum of out_features, in_features], or None where they must run apart (module doc)."""
    if _SESSION.get() is None:  # training and evaluation: no per-call checks on their path
        return None
    if any(type(m) is not nn.Linear or m.bias is not None for m in linears):
        return None
    ws = [m.weight for m in linears]
    if sum(w.numel() * w.element_size() for w in ws) > PACK_MAX_BYTES:
        return None
    return cached_pack(owner, name, ws, torch.cat)


def packed_linear(owner: nn.Module, name: str, linears: Sequence[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """[m(x) for m in linears], as one product when `packed_weight` allows (the outputs are then views of it)."""
    w = packed_weight(owner, name, linears)
    if w is None:
        return [m(x) for m in linears]
    return list(torch.nn.functional.linear(x, w).split([m.out_features for m in linears], dim=-1))
