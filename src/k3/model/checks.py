"""Input checks shared by the layers: a bad input fails with a ValueError that names what was expected."""
from __future__ import annotations

import torch

from k3.ops.amp import autocast_on


def check_tensor(who: str, x, want: str) -> None:
    """x must be a tensor at all (a list or an array fails here, before any shape check reads x.dim())."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{who} expects a float tensor x of shape {want}, got a {type(x).__name__}; "
                         "pass a torch.Tensor")


def check_dtype(who: str, x: torch.Tensor, want: str, like: torch.Tensor | None = None) -> None:
    """x must be a float tensor and, when `like` (a weight) is given, in like's dtype unless autocast is on
    for x's device (then the layer's matmuls cast for themselves). `want` describes the expected shape."""
    if not x.is_floating_point():
        raise ValueError(f"{who} expects a float tensor x of shape {want}, got dtype {x.dtype}; cast it with .float()")
    if like is not None and x.dtype != like.dtype and not autocast_on(x.device.type):
        raise ValueError(f"{who} expects x of shape {want} in the layer's dtype {like.dtype}, got {x.dtype}; "
                         "cast x or the layer (e.g. layer.to(x.dtype)), or run under torch.autocast")
