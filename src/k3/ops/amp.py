"""Autocast helpers shared by the ops and the layers.

The KDA kernels fix their own precision (fp32 at least, the state always fp32): under torch.autocast their
matmuls would otherwise run in bf16, which changes the state's dtype, and with out= buffers fails outright.
"""
from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["as_dtype", "at_least_fp32", "autocast_on", "no_autocast", "without_autocast"]

_WIDE = (torch.float32, torch.float64)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)`, except that a tensor already in `dtype` comes back itself without a dispatcher call: a decode
    step is a few dozen tiny kernels a layer, where a no-op cast costs as much as one of them."""
    return t if t.dtype == dtype else t.to(dtype)


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` in fp32, or kept in fp64: what `.float()` means for numerically sensitive steps, without turning an
    fp64 model (exact references, gradcheck) into an fp32 one. Already wide, `t` itself comes back without a
    dispatcher call (a decode step makes ~100 of these)."""
    if t.dtype in _WIDE:
        return t
    return t.to(torch.promote_types(t.dtype, torch.float32))


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for this device type; False where autocast does not exist (meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def no_autocast(device_type: str):
    """A context that turns autocast off for this device type (nothing to turn off on meta)."""
    return torch.autocast(device_type, enabled=False) if autocast_on(device_type) else contextlib.nullcontext()


def without_autocast(fn):
    """Decorator: run `fn(q, ...)` with autocast off for q's device."""
    @functools.wraps(fn)
    def run(q: torch.Tensor, *args, **kwargs):
        with no_autocast(q.device.type):
            return fn(q, *args, **kwargs)

    return run
