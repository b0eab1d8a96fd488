"""Which device a run uses, and the autocast it trains under there."""
from __future__ import annotations

import contextlib

import torch


def resolve_device(name: str) -> torch.device:
    """--device auto | cpu | cuda[:N] -> a torch.device this machine has (ValueError naming the flag otherwise)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {name!r} is not a device; use auto, cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine (this torch build "
                         f"{'has no CUDA' if torch.version.cuda is None else 'sees no GPU'}); use --device cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return dev


def autocast(device: torch.device, precision: str = "fp32"):
    """The autocast a forward runs under: bf16 on CUDA always (as before), on a CPU only with precision "bf16"
    ("auto" must be resolved first: k3.train.precision)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if precision != "fp32":
        raise ValueError(f"precision {precision!r}: resolve 'auto' before training (k3.train.precision)")
    return contextlib.nullcontext()
