"""Attention Residuals for a decode step: the same mix as `naive.attnres_mix`, in a few kernels.

At one token per row a mix is a handful of [B, D] vectors, and the two-phase form (blockwise.py) spends ~37 small
kernels on each; here the sources' normalised keys are computed once, when a source is made, and every later
sublayer's mix is one stack, one mat-vec for the logits, a softmax and a weighted sum (docs/serving.md, decode).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.amp import as_dtype, no_autocast
from k3.ops.attnres.naive import compute_dtype

__all__ = ["decode_key", "decode_mix"]


def decode_key(source: torch.Tensor, eps: float) -> torch.Tensor:
    """source [B, T, D] -> its key RMSNorm(source) without weight, [B, T, D] in the compute dtype (fp32 / fp64)."""
    with no_autocast(source.device.type):
        return F.rms_norm(as_dtype(source, compute_dtype(source)), (source.shape[-1],), eps=eps)


def decode_mix(keys: list[torch.Tensor], sources: list[torch.Tensor], query: torch.Tensor,
               norm_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """keys[i] = decode_key(sources[i]); sources: S tensors [B, T, D]; query, norm_weight [D] ->
    h [B, T, D] (sources' dtype) and the weights over sources [B, T, S], as `naive.attnres_mix` returns them."""
    k = torch.stack(keys)  # [S, B, T, D]
    with no_autocast(k.device.type):  # the softmax in the keys' precision, as naive.attnres_mix keeps it
        # (a mix is ~10 tiny kernels: the casts that would change nothing are skipped, not dispatched)
        q = as_dtype(query, k.dtype)
        if norm_weight is not None:
            q = q * norm_weight.to(k.dtype)
        w = torch.matmul(k, q).softmax(dim=0)  # [S, B, T]
        h = (w.unsqueeze(-1) * as_dtype(torch.stack(sources), w.dtype)).sum(0)
    return as_dtype(h, sources[0].dtype), w.permute(1, 2, 0)
