"""Fake quantization with a straight-through estimator: what QAT (`config.qat`, k3.model.qat) computes.

Forward returns dequantize(quantize(x)) exactly (`fake_quantize_mx`); backward passes the gradient unchanged,
d fq(x) / dx := I (Bengio et al., arXiv 1308.3432). MX has no fixed clipping range to mask: each block's scale
follows its own max, so only elements between the largest normal and the next power of two (6X..8X for E2M1)
saturate, and the block's largest element is often one of them; zeroing its gradient would freeze exactly the
weights that set the scale, so nothing is masked.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.mx.formats import fake_quantize_mx

BLOCK = 32  # MX block size (OCP MX v1.0), along the reduction dim


class _MXFakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: str) -> torch.Tensor:
        return fake_quantize_mx(x, fmt, BLOCK)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None  # straight through: the identity's gradient


def fake_quant(x: torch.Tensor, fmt: str | None, dim: int = -1) -> torch.Tensor:
    """x [..., n, ...] -> same shape and dtype, MX-quantized and dequantized in blocks of 32 along `dim`.

    Gradient: straight through. A `dim` whose size is not a multiple of 32 is padded with zeros for the
    rounding (a zero never changes a block's scale) and sliced back. fmt None returns x.
    """
    if fmt is None:
        return x
    moved = dim not in (-1, x.dim() - 1)
    y = x.transpose(dim, -1) if moved else x
    n = y.shape[-1]
    pad = -n % BLOCK
    if pad:
        y = F.pad(y, (0, pad))
    y = _MXFakeQuant.apply(y, fmt)
    if pad:
        y = y[..., :n]
    return y.transpose(dim, -1) if moved else y
