"""GRPO: group-relative advantages, a clipped policy ratio, an optional KL to a reference, token masks.

Every sampled token of episode i gets its group's advantage A_i = (r_i - mean r) / (std r + eps) (population
std; `scale=False` drops it), and the per-token loss is

    l_t = -min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i) + beta KL_t,   rho = exp(log pi - log pi_old)

with KL_t the k3 estimator against the reference. Only tokens the policy sampled enter (`mask`); `agg="token"`
averages over all of them (DAPO), `agg="sequence"` per episode, then over episodes (GRPO). The settings are
checked by GRPOConfig. `grpo_loss_reference` is the same objective as plain loops; a test holds the two equal.
Sources: docs/rl.md ("GRPO").
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import torch
import torch.nn.functional as F

AGGREGATIONS = ("token", "sequence")


def group_advantages(rewards: Sequence[float], groups: Sequence, scale: bool = True, eps: float = 1e-6) -> list[float]:
    """One advantage per episode from the rewards of its group (same task, same harness)."""
    assert len(rewards) == len(groups), f"{len(rewards)} rewards but {len(groups)} group ids"
    members: dict = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    adv = [0.0] * len(rewards)
    for idx in members.values():
        r = [float(rewards[i]) for i in idx]
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))
        for i, x in zip(idx, r):
            adv[i] = (x - mean) / (std + eps) if scale else x - mean
    return adv


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V] of ids [B, T] -> log-prob of each next token [B, T-1] (position t predicts t+1)."""
    return F.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _check(eps_low: float, eps_high: float, beta: float, agg: str) -> None:
    """The settings come from a validated GRPOConfig (the boundary); here only the contract."""
    assert 0 < eps_low < 1 and eps_high > 0, f"clip range ({eps_low}, {eps_high})"
    assert beta >= 0 and agg in AGGREGATIONS, (beta, agg)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
              eps_low: float = 0.2, eps_high: float | None = None, ref_logp: torch.Tensor | None = None,
              beta: float = 0.0, agg: str = "token") -> tuple[torch.Tensor, dict]:
    """logp, old_logp, ref_logp, mask: [B, L] per target token (mask True where the policy sampled it);
    adv: [B]. -> (scalar loss, stats: clip fraction, mean ratio, mean KL, tokens)."""
    eps_high = eps_low if eps_high is None else eps_high
    _check(eps_low, eps_high, beta, agg)
    assert beta == 0 or ref_logp is not None, "beta > 0 needs ref_logp (the reference model's log-probs)"
    m = mask.to(logp.dtype)
    n = m.sum()
    assert float(n) > 0, "no sampled tokens to train on"  # GRPOTrainer forwards only episodes with some
    ratio = torch.exp(logp - old_logp)
    a = adv.to(logp.dtype)[:, None]
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_tok = -torch.minimum(ratio * a, clipped * a)
    kl = None
    if ref_logp is not None:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        if beta > 0:
            per_tok = per_tok + beta * kl
    if agg == "token":
        loss = (per_tok * m).sum() / n
    else:
        per_seq = m.sum(1)
        has = per_seq > 0
        loss = ((per_tok * m).sum(1)[has] / per_seq[has]).mean()
    with torch.no_grad():
        stats = {"clip_frac": float((((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).to(m.dtype) * m).sum() / n),
                 "ratio_mean": float((ratio * m).sum() / n), "tokens": int(n)}
        if kl is not None:
            stats["kl"] = float((kl * m).sum() / n)
    return loss, stats


def grpo_loss_reference(logp, old_logp, adv, mask, *, eps_low=0.2, eps_high=None, ref_logp=None, beta=0.0,
                        agg="token") -> torch.Tensor:
    """The same objective, one token at a time (slow, obviously written; for tests)."""
    eps_high = eps_low if eps_high is None else eps_high
    _check(eps_low, eps_high, beta, agg)
    seq_losses, total, count = [], 0.0, 0
    for i in range(logp.shape[0]):
        s, c = 0.0, 0
        for t in range(logp.shape[1]):
            if not bool(mask[i, t]):
                continue
            rho = torch.exp(logp[i, t] - old_logp[i, t])
            unclipped = rho * adv[i]
            clipped = torch.clamp(rho, 1 - eps_low, 1 + eps_high) * adv[i]
            term = -torch.min(unclipped, clipped)
            if beta > 0:
                d = ref_logp[i, t] - logp[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            s, c = s + term, c + 1
        total, count = total + s, count + c
        if c:
            seq_losses.append(s / c)
    if agg == "token":
        return total / count
    return sum(seq_losses) / len(seq_losses)
