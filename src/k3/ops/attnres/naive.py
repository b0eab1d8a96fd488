"""Attention Residuals, reference form: every source materialised, one softmax over depth.

    h = sum_i softmax_i(w^T (g * RMSNorm(v_i))) v_i          (Attention Residuals, arXiv 2603.15031, Eq. 2-4)

`v_i` are the sources (token embedding, earlier sublayer outputs or block sums), `w` the sublayer's
pseudo-query and `g` the optional learned weight of the key RMSNorm. There is no 1/sqrt(d) scale (the
paper's Fig. 2 pseudocode has none). Logits, softmax and the weighted sum run in fp32 (fp64 for fp64
inputs); `h` comes back in the sources' dtype. Every token is mixed on its own, so T = 1 (decode) needs nothing special.
"""
from __future__ import annotations

import torch

from k3.ops.amp import no_autocast

__all__ = ["attnres_logits", "attnres_mix", "check_query", "check_sources", "compute_dtype", "rms_normalize"]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 (tests can then check the algebra exactly)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_sources(sources: torch.Tensor, name: str = "sources", allow_empty: bool = False) -> None:
    if not isinstance(sources, torch.Tensor) or sources.dim() != 4:
        got = tuple(sources.shape) if isinstance(sources, torch.Tensor) else type(sources).__name__
        raise ValueError(f"{name} must have shape [S, B, T, D] (S stacked depth sources), got {got}")
    if sources.shape[0] == 0 and not allow_empty:
        raise ValueError(f"{name} must hold at least one source ([S, B, T, D] with S >= 1), got S = 0")
    if not sources.is_floating_point():
        raise ValueError(f"{name} must be a float tensor [S, B, T, D], got dtype {sources.dtype}; cast it with .float()")


def check_query(query: torch.Tensor, d: int, name: str = "query", leading: tuple[int, ...] = ()) -> None:
    want = (*leading, d)
    if query is not None and tuple(query.shape) != want:
        dims = "".join(f"{n}, " for n in leading)
        raise ValueError(f"{name} must have shape [{dims}D] = {list(want)}, got {list(query.shape)}")
    if query is not None and not query.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got dtype {query.dtype}; cast it with .float()")


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> x / rms(x) over D, in compute_dtype(x) (no learned weight; apply it separately)."""
    x = x.to(compute_dtype(x))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def attnres_logits(sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    """sources [S, B, T, D], query [D], norm_weight [D] or None -> logits [S, B, T] (fp32)."""
    keys = rms_normalize(sources, eps)
    if norm_weight is not None:
        keys = keys * norm_weight.to(keys.dtype)
    return torch.einsum("sbtd,d->sbt", keys, query.to(keys.dtype))


def attnres_mix(sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """One AttnRes operation over all sources at once.

    sources [S, B, T, D]; query [D] (the pseudo-query w); norm_weight [D] or None (key RMSNorm weight g).
    Returns h [B, T, D] (sources' dtype) and the softmax weights over sources [B, T, S] (compute dtype).
    """
    check_sources(sources)
    d = sources.shape[-1]
    check_query(query, d, "query")
    check_query(norm_weight, d, "norm_weight")
    with no_autocast(sources.device.type):  # the softmax in the sources' precision, not autocast's bf16
        weights = attnres_logits(sources, query, norm_weight, eps).softmax(dim=0)  # [S, B, T]
        h = torch.einsum("sbt,sbtd->btd", weights, sources.to(weights.dtype))
    return h.to(sources.dtype), weights.permute(1, 2, 0)
