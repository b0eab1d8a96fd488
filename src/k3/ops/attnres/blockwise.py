"""Attention Residuals, two-phase form (Attention Residuals, arXiv 2603.15031, Sec. 4.2 and Algorithm 1).

The pseudo-queries are parameters, not functions of the hidden state, so every query of a block is known
before the block runs, and the sources completed before the block (embedding, earlier blocks) do not
change while it runs:

- Phase 1, once per block: all Q queries of the block against the S completed sources in one batched
  product, kept as online-softmax statistics per query: running max m, normaliser l = sum exp(logit - m)
  and unnormalised accumulator acc = sum exp(logit - m) v.
- Phase 2, once per sublayer: the sources that grew inside the block (Block AttnRes: the one partial sum;
  Full AttnRes: the outputs so far in this group) are scored with that sublayer's query alone and merged
  into its phase-1 statistics by the online-softmax rule; h = acc / l. The block's first sublayer has no
  such source and reads the phase-1 result directly (Algorithm 1, line 8).

The key RMSNorm weight g folds into the query, w^T (g * k^) = (w * g)^T k^, so phase 1 normalises each
source once and shares it across queries. Statistics are fp32 (fp64 for fp64 inputs). Equal to `naive.attnres_mix` up to
rounding, forward and backward (autograd runs through both phases).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from k3.ops.amp import no_autocast
from k3.ops.attnres.naive import check_query, check_sources, rms_normalize

__all__ = ["Phase1Stats", "Phase2Out", "blockwise_mix", "merged_weights", "phase1", "phase2"]


class Phase1Stats(NamedTuple):
    """Online-softmax statistics of Q queries over S completed sources (all in the compute dtype).

    m: [Q, B, T] max logit; l: [Q, B, T] sum exp(logit - m); acc: [Q, B, T, D] sum exp(logit - m) v;
    logits: [Q, S, B, T] (no D; kept so the mixing weights can be reported).
    """

    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor
    logits: torch.Tensor

    def select(self, i: int) -> "Phase1Stats":
        """The statistics of query i alone: m [B, T], l [B, T], acc [B, T, D], logits [S, B, T]."""
        return Phase1Stats(self.m[i], self.l[i], self.acc[i], self.logits[i])


class Phase2Out(NamedTuple):
    """h: [B, T, D] the mix; m, l: [B, T] merged statistics; logits: [K, B, T] of the phase-2 sources."""

    h: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor
    logits: torch.Tensor | None


def _effective_queries(queries: torch.Tensor, norm_weights: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    q = queries.to(dtype)
    return q if norm_weights is None else q * norm_weights.to(dtype)


def phase1(sources: torch.Tensor, queries: torch.Tensor, norm_weights: torch.Tensor | None = None,
           eps: float = 1e-6) -> Phase1Stats:
    """All queries of a block against the completed sources, in one batched computation.

    sources [S, B, T, D] (S >= 1); queries [Q, D]; norm_weights [Q, D] or None -> Phase1Stats.
    """
    check_sources(sources)
    d = sources.shape[-1]
    if queries.dim() != 2:
        raise ValueError(f"queries must have shape [Q, D] with D = {d}, got {list(queries.shape)}")
    check_query(queries, d, "queries", leading=(queries.shape[0],))
    check_query(norm_weights, d, "norm_weights", leading=(queries.shape[0],))
    with no_autocast(sources.device.type):  # the softmax statistics stay in the sources' precision (fp32)
        keys = rms_normalize(sources, eps)  # [S, B, T, D], shared by every query of the block
        logits = torch.einsum("qd,sbtd->qsbt", _effective_queries(queries, norm_weights, keys.dtype), keys)
        m = logits.amax(dim=1)  # [Q, B, T]
        p = torch.exp(logits - m.unsqueeze(1))
        l = p.sum(dim=1)
        acc = torch.einsum("qsbt,sbtd->qbtd", p, sources.to(p.dtype))
    return Phase1Stats(m, l, acc, logits)


def phase2(stats: Phase1Stats, query: torch.Tensor, norm_weight: torch.Tensor | None = None,
           extra: torch.Tensor | None = None, eps: float = 1e-6) -> Phase2Out:
    """Merge one sublayer's phase-1 statistics with the sources that grew inside the block.

    stats: `phase1(...).select(i)` (m [B, T], l [B, T], acc [B, T, D]); query [D]; norm_weight [D] or None;
    extra [K, B, T, D] or None (K = 0 or None: the block's first sublayer). Returns Phase2Out; h is in the
    statistics' dtype (cast it back to the sources' dtype).
    """
    m1, l1, acc1 = stats.m, stats.l, stats.acc
    if acc1.dim() != 3:
        raise ValueError(f"stats must be one query's statistics (acc [B, T, D]), got acc {list(acc1.shape)}; "
                         "pass phase1(...).select(i)")
    d = acc1.shape[-1]
    check_query(query, d, "query")
    check_query(norm_weight, d, "norm_weight")
    if extra is None or extra.shape[0] == 0:
        return Phase2Out(acc1 / l1.unsqueeze(-1), m1, l1, None)
    check_sources(extra, "extra")
    if tuple(extra.shape[1:]) != tuple(acc1.shape):
        raise ValueError(f"extra must have shape [K, B, T, D] = [K, {', '.join(map(str, acc1.shape))}], "
                         f"got {list(extra.shape)}")
    with no_autocast(extra.device.type):
        keys = rms_normalize(extra, eps).to(acc1.dtype)
        logits2 = torch.einsum("kbtd,d->kbt", keys, _effective_queries(query, norm_weight, keys.dtype))
        m = torch.maximum(m1, logits2.amax(dim=0))
        scale1 = torch.exp(m1 - m)
        p2 = torch.exp(logits2 - m)
        l = scale1 * l1 + p2.sum(dim=0)
        acc = scale1.unsqueeze(-1) * acc1 + torch.einsum("kbt,kbtd->btd", p2, extra.to(p2.dtype))
    return Phase2Out(acc / l.unsqueeze(-1), m, l, logits2)


def merged_weights(logits1: torch.Tensor, logits2: torch.Tensor | None, m: torch.Tensor,
                   l: torch.Tensor) -> torch.Tensor:
    """Softmax weights over all sources from the two phases: logits1 [S, B, T], logits2 [K, B, T] or None,
    merged m, l [B, T] -> weights [B, T, S + K] (phase-1 sources first)."""
    logits = logits1 if logits2 is None else torch.cat([logits1, logits2], dim=0)
    return (torch.exp(logits - m) / l).permute(1, 2, 0)


def blockwise_mix(sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor | None = None,
                  extra: torch.Tensor | None = None, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """One AttnRes operation through both phases (a block of one query).

    sources [S, B, T, D] completed; extra [K, B, T, D] or None -> h [B, T, D] (sources' dtype),
    weights [B, T, S + K]. Same result as naive.attnres_mix(cat([sources, extra]), query, norm_weight).
    """
    check_sources(sources)
    check_query(query, sources.shape[-1], "query")
    stats = phase1(sources, query.unsqueeze(0), None if norm_weight is None else norm_weight.unsqueeze(0), eps)
    one = stats.select(0)
    out = phase2(one, query, norm_weight, extra, eps)
    return out.h.to(sources.dtype), merged_weights(one.logits, out.logits, out.m, out.l)
