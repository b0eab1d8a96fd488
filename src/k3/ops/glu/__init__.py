"""The gated linear units of k3's MLPs and experts: h = act(gate) * up, in two forms.

    silu  SwiGLU (Shazeer, arXiv 2002.05202):  silu(g) * u
    situ  K3's SiTU-GLU:  beta * tanh(g / beta) * sigmoid(g) * lbeta * tanh(u / lbeta)

SiTU soft-caps both branches: |gate branch| < beta and |up branch| < lbeta, so no single token's hidden unit can
grow without bound (K3 ships beta 4, lbeta 25). For |g| << beta and |u| << lbeta it is SwiGLU up to
O(g^3 / beta^2): tanh(g/beta) * beta = g - g^3 / (3 beta^2) + ..., so a model starts out as it would with SwiGLU.

`situ_glu` is the fast form (one autograd node, tanh through expm1); `situ_glu_ref` is the formula as written,
its reference (tests/ops/test_glu.py compares values and gradients).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["ACTS", "silu_glu", "situ_glu", "situ_glu_ref", "glu_for"]

ACTS = ("situ", "silu")
SMALL = 1 << 14  # values up to which a gradient-free situ_glu runs the composed form (fewer, tiny kernels)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., F] -> silu(gate) * up."""
    return F.silu(gate) * up


def situ_glu_ref(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """gate, up [..., F] -> beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta): the reference."""
    return (beta * torch.tanh(gate / beta) * torch.sigmoid(gate)) * (linear_beta * torch.tanh(up / linear_beta))


def _tanh_scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """tanh(x / scale) as sign(x) (1 - e) / (1 + e), e = exp(-2|x| / scale), from expm1: torch's CPU tanh runs ~5x
    slower than exp (1M fp32 values: 2.7 ms). expm1 keeps tanh's relative precision near 0 (2 sigmoid(2z) - 1, tried
    first, is off by up to one ulp of 1 there: a relative error of 1e-4 at z ~ 1e-3)."""
    e = x.abs().mul_(-2.0 / scale).expm1_()  # in (-1, 0]
    return e.div_(e + 2.0).neg_().copysign_(x)


class _SiTUGLU(torch.autograd.Function):
    """situ_glu's one autograd node: the forward keeps sigmoid(g), tanh(g/beta), tanh(u/lbeta) and the backward
    is written out, where the composed formula records ~8 nodes and their saved tensors."""

    @staticmethod
    def forward(ctx, gate, up, beta, linear_beta):
        ctx.dtype = gate.dtype
        # in fp32 at least: bf16 keeps too few bits for the expm1 form and the written-out backward
        gate, up = (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t for t in (gate, up))
        sg = torch.sigmoid(gate)
        tg = _tanh_scaled(gate, beta)
        tu = _tanh_scaled(up, linear_beta)
        ctx.save_for_backward(sg, tg, tu)
        ctx.betas = (beta, linear_beta)
        return (tg * sg).mul_(beta * linear_beta).mul_(tu).to(ctx.dtype)

    @staticmethod
    def backward(ctx, dh):
        sg, tg, tu = ctx.saved_tensors
        beta, linear_beta = ctx.betas
        dh = dh.to(sg.dtype)
        d_gate = d_up = None
        # two buffers, updated in place: each new [N, F] tensor costs more than the arithmetic on a CPU
        if ctx.needs_input_grad[0]:
            # d/dg [beta tanh(g/beta) sigmoid(g)] = (1 - tanh^2) sigmoid + beta tanh sigmoid (1 - sigmoid)
            d_gate = torch.mul(tg, tg).neg_().add_(1.0).mul_(sg)
            d_gate.add_(torch.rsub(sg, 1.0).mul_(sg).mul_(tg), alpha=beta)
            d_gate = d_gate.mul_(tu).mul_(dh).mul_(linear_beta).to(ctx.dtype)
        if ctx.needs_input_grad[1]:  # dh * beta tanh(g/beta) sigmoid(g) * (1 - tanh^2(u/lbeta))
            d_up = torch.mul(tu, tu).neg_().add_(1.0).mul_(tg).mul_(sg).mul_(dh).mul_(beta).to(ctx.dtype)
        return d_gate, d_up, None, None


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """gate, up [..., F] -> beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta) (`situ_glu_ref`),
    as one autograd node, 1.4x faster than the reference forward + backward on a CPU (docs/moe.md)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:  # broadcasting or mixed: the composed form handles them
        return situ_glu_ref(gate, up, beta, linear_beta)
    if gate.numel() <= SMALL and not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
        return situ_glu_ref(gate, up, beta, linear_beta)  # a decode step's few rows: fewer calls is what counts
    return _SiTUGLU.apply(gate, up, float(beta), float(linear_beta))


def glu_for(config):
    """The GLU `config.hidden_act` names, as a picklable callable (gate, up) -> hidden."""
    if config.hidden_act == "silu":
        return silu_glu
    return functools.partial(situ_glu, beta=float(config.situ_beta), linear_beta=float(config.situ_linear_beta))
