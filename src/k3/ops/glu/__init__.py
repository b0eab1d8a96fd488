"""The gated linear units of k3's MLPs and experts: h = act(gate) * up, in two forms.

    silu  SwiGLU (Shazeer, arXiv 2002.05202):  silu(g) * u
    situ  K3's SiTU-GLU:  beta * tanh(g / beta) * sigmoid(g) * lbeta * tanh(u / lbeta)

SiTU soft-caps both branches: |gate branch| < beta and |up branch| < lbeta, so no single token's hidden unit can
grow without bound (K3 ships beta 4, lbeta 25). For |g| << beta and |u| << lbeta it is SwiGLU up to
O(g^3 / beta^2): tanh(g/beta) * beta = g - g^3 / (3 beta^2) + ..., so a model starts out as it would with SwiGLU.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["ACTS", "silu_glu", "situ_glu", "glu_for"]

ACTS = ("situ", "silu")


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., F] -> silu(gate) * up."""
    return F.silu(gate) * up


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """gate, up [..., F] -> beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta)."""
    return (beta * torch.tanh(gate / beta) * torch.sigmoid(gate)) * (linear_beta * torch.tanh(up / linear_beta))


def glu_for(config):
    """The GLU `config.hidden_act` names, as a picklable callable (gate, up) -> hidden."""
    if config.hidden_act == "silu":
        return silu_glu
    return functools.partial(situ_glu, beta=float(config.situ_beta), linear_beta=float(config.situ_linear_beta))
