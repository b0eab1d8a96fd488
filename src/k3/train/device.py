"""Which device a run uses, the autocast it trains under there, and (CPU) how its memory is allocated."""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time

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


def autocast(device: torch.device | str, precision: str = "fp32", *, training: bool = True):
    """The autocast a forward runs under. Training: bf16 on CUDA always (as before), on a CPU only with precision
    "bf16". Inference (`training=False`: k3 sample, k3 serve): bf16 where `precision` is bf16, on any device;
    otherwise none, so fp32 weights run in fp32. "auto" must be resolved first (k3.train.precision)."""
    device = torch.device(device)
    if device.type == "cuda" and training:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision != "fp32":
        raise ValueError(f"precision {precision!r}: resolve 'auto' before running (k3.train.precision)")
    return contextlib.nullcontext()


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_CPU_ALLOC_MMAP_BYTES = 32 << 20  # glibc's largest allowed mmap threshold on 64-bit
_CPU_ALLOC_TRIM_BYTES = 1 << 30
_cpu_alloc_tuned: bool | None = None


def tune_cpu_allocator() -> bool:
    """Keep freed activation buffers in the process heap (glibc only; once per process). True if applied.

    PyTorch's CPU tensors come from malloc, and glibc serves blocks over its dynamic mmap threshold (128 KiB, rising
    to at most 32 MiB) with fresh mmaps and gives them back on free, so every new activation of a CPU training
    step pays its page faults again: a 4 MB elementwise output cost ~0.6 ms where the arithmetic took 0.1 ms.
    Raising the mmap threshold to 32 MiB and the trim threshold to 1 GiB reuses freed memory instead: with the
    fused SiTU, `mini`'s step ran 1.34x faster, 1.06x from this alone (docs/training.md, "The CPU step"). The
    cost is up to 1 GiB of freed heap held by the process. This is what glibc's MALLOC_MMAP_THRESHOLD_ /
    MALLOC_TRIM_THRESHOLD_ set from the environment, applied from Python; K3_CPU_MALLOPT=0 turns it off, and it is
    skipped where those variables are already set or libc is not glibc."""
    global _cpu_alloc_tuned
    if _cpu_alloc_tuned is not None:
        return _cpu_alloc_tuned
    _cpu_alloc_tuned = False
    if os.environ.get("K3_CPU_MALLOPT", "1") == "0" or sys.platform != "linux" \
            or any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
            return False
        _cpu_alloc_tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, _CPU_ALLOC_MMAP_BYTES)) \
            and bool(libc.mallopt(_M_TRIM_THRESHOLD, _CPU_ALLOC_TRIM_BYTES))
    except OSError:  # not glibc (musl, macOS): its allocator, as it is
        pass
    return _cpu_alloc_tuned


def busy_cores(sample_s: float = 0.5) -> float | None:
    """Cores other processes keep busy now, from /proc/stat's idle time over `sample_s` (None off Linux). Not the
    1-minute load average: it lags, so a job that just ended (a test run before the demo) still counts in it, and
    the demo would train on one core of two idle ones."""
    def read():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + (v[4] if len(v) > 4 else 0), sum(v)  # idle + iowait, all

    try:
        idle0, all0 = read()
        time.sleep(sample_s)
        idle1, all1 = read()
    except (OSError, ValueError, IndexError):
        return None
    if all1 <= all0:
        return None
    return (1 - (idle1 - idle0) / (all1 - all0)) * (os.cpu_count() or 1)


def busy_now() -> tuple[float | None, str]:
    """(cores busy now, how that was measured): `busy_cores`, else the 1-minute load average, else (None, "")."""
    busy = busy_cores()
    if busy is not None:
        return busy, f"{busy:.1f} busy now (0.5 s sample)"
    if hasattr(os, "getloadavg"):
        load = os.getloadavg()[0]
        return load, f"load average {load:.1f}"
    return None, ""
