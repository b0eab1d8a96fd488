"""Quantization-aware training: what `config.qat` fake-quantizes, and the linear layer that does it.

`config.qat` says what is fake-quantized, and the model reads it at construction:
    expert_weights  routed-expert weights w1, w3, w2, in blocks of 32 along the reduction (input) dim
    activations     the inputs of the expert GEMMs: x before w1/w3 and silu(x w1) * (x w3) before w2 (and,
                    with `linears`, the inputs of those linears too)
    linears         the weights of every other nn.Linear inside the layers (token mixers, shared experts,
                    dense MLP, latent projections); not the output head, not the router
Each value is "mxfp4", "mxfp8" or "none"/None. Post-training quantization is therefore just: build the model
with a qat config and load full-precision weights into it.

The fake quantization itself (MX quantize-dequantize forward, straight-through backward) is the op
`k3.ops.mx.fake.fake_quant`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config, K3ConfigError
from k3.ops.mx.fake import fake_quant

QAT_KEYS = ("expert_weights", "activations", "linears")
DEFAULT_QAT = {"expert_weights": "mxfp4", "activations": "mxfp8"}


def qat_format(config: K3Config, key: str) -> str | None:
    """The MX format config.qat gives `key` ('mxfp4' / 'mxfp8'), or None when that part stays full precision."""
    if key not in QAT_KEYS:
        raise K3ConfigError(f"qat key {key!r} is unknown; use one of {QAT_KEYS}")
    v = (config.qat or {}).get(key)
    return None if v in (None, "none") else v


def parse_qat(spec: str | None, base: dict | None = None) -> dict:
    """`k3 train --qat [SPEC]`: SPEC is empty (K3's setting: expert weights mxfp4, activations mxfp8) or
    comma-separated KEY=FORMAT items applied on top of it, e.g. 'linears=mxfp4' or 'activations=none'.
    `base`: qat items the config already holds (from --set or --config), kept unless SPEC names them."""
    qat = {**DEFAULT_QAT, **(base or {})}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in QAT_KEYS or value not in ("mxfp4", "mxfp8", "none"):
            raise ValueError(f"--qat {spec!r}: {item!r} is not KEY=FORMAT with KEY one of {', '.join(QAT_KEYS)} "
                             "and FORMAT one of mxfp4, mxfp8, none (e.g. --qat linears=mxfp4)")
        qat[key] = value
    return qat


class QATLinear(nn.Linear):
    """An nn.Linear whose weight [out, in] is fake-quantized along `in` (the reduction dim) on every forward,
    and whose input x [..., in] is fake-quantized along its last dim when `act_format` is set.

    Holds the original module's parameters, so state_dict names and values are those of the nn.Linear it
    replaced. Modules that read `.weight` directly (e.g. MLA's absorbed decode) see the full-precision weight.
    """

    def __init__(self, linear: nn.Linear, weight_format: str, act_format: str | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.weight_format, self.act_format = weight_format, act_format

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(fake_quant(x, self.act_format), fake_quant(self.weight, self.weight_format, dim=1), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight_format={self.weight_format}, act_format={self.act_format}"


def apply_linear_qat(model: nn.Module, config: K3Config) -> int:
    """config.qat.linears set: swap every nn.Linear under `model.layers` for a QATLinear sharing its parameters
    (weights in the `linears` format, inputs in the `activations` format); returns the count.

    The head stays full precision (as the embedding does), and so does the router, whose weight is not a
    Linear: routing compares close scores and costs E * d per token, too little to be worth quantizing.
    """
    fmt, act = qat_format(config, "linears"), qat_format(config, "activations")
    if fmt is None:
        return 0
    n = 0
    for parent in list(model.layers.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, QATLinear(child, fmt, act))
                n += 1
    return n
