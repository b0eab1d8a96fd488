"""Training metrics: one JSON line per step, expert load, AttnRes entropy, FLOPs per token and MFU.

Records in metrics.jsonl carry `"kind": "train"` (every step) or `"kind": "val"` (every evaluation); a writer
flushes every line, so a crash loses at most the one being written. The MFU peak is measured on this machine (a
matmul in the training dtype, cached per process), not a datasheet number; FLOPs per token are the planner's
count (k3.model.accounting). The record fields and the FLOP formula: docs/training.md ("Metrics"); the unigram
baseline (`unigram_loss`): its "The demo".
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import torch

from k3.fileio import atomic_write_text, loads_json

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- JSONL
class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most the line being written.

    `resume_step`: drop records after that step (they belong to the part of a run that a resume repeats).
    """

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            keep = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in keep))
        elif resume_step is None and self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh file
        self._f = open(self.path, "a")

    def log(self, record: dict) -> None:
        self._f.write(json.dumps(record, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All complete records of a metrics.jsonl (a torn last line from a crash is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(loads_json(line))
            except json.JSONDecodeError:
                log.warning("%s: skipping a malformed line", path)
    return out


# ---------------------------------------------------------------------- FLOPs and MFU
_PEAK: dict[tuple, float] = {}


def measured_peak_flops(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        n: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of an n x n matmul on `device` (best of `repeats` after one warm-up); cached per process."""
    device = torch.device(device)
    key = (device.type, device.index, dtype, n)
    if key in _PEAK:
        return _PEAK[key]
    g = torch.Generator(device=device).manual_seed(0)  # its own: drawing from the global one would move a
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)  # resumed run's restored RNG state
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    best = float("inf")
    for i in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        if i:  # the first run is the warm-up
            best = min(best, time.perf_counter() - t0)
    _PEAK[key] = 2 * n ** 3 / best
    log.debug("measured peak %.1f GFLOP/s on %s %s", _PEAK[key] / 1e9, device, dtype)
    return _PEAK[key]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def flops_per_token(model: torch.nn.Module, seq_len: int) -> dict:
    """Training FLOPs per token of a K3Model at sequence length `seq_len`: k3.model.accounting.flops_per_token,
    the one count the planner uses too (keys total, params, mla, kda, attnres, active_params)."""
    from k3.model.accounting import flops_per_token as count

    return count(model, seq_len)


# ---------------------------------------------------------------------- model probes
def expert_load_stats(model: torch.nn.Module) -> dict:
    """Per MoE layer: max/mean of `router.last_load` (token counts per expert) and each expert's share."""
    ratios, shares = [], []
    layers = model.moe_layers() if hasattr(model, "moe_layers") else []
    for m in layers:
        load = getattr(m.router, "last_load", None)
        if load is None:
            continue
        load = load.detach().float().cpu()
        mean = float(load.mean())
        ratios.append(float(load.max()) / mean if mean > 0 else float("nan"))
        total = float(load.sum())
        shares.append([round(float(x) / total, 5) if total > 0 else 0.0 for x in load])
    if not ratios:
        return {}
    return {"expert_load_max_mean": [round(r, 4) for r in ratios],
            "expert_load_max_mean_overall": round(sum(ratios) / len(ratios), 4),
            "expert_load": shares}


def attnres_stats(model: torch.nn.Module) -> dict:
    ar = getattr(model, "attnres", None)
    if ar is None or not getattr(ar, "record_weights", False) or not getattr(ar, "last_weights", None):
        return {}
    ent = ar.entropy()
    n = max(ar.last_weights) + 1
    return {"attnres_entropy": [round(ent[j], 5) if j in ent else None for j in range(n)],
            "attnres_weights": [[round(float(x), 5) for x in ar.last_weights[j]] if j in ar.last_weights else None
                                for j in range(n)]}


def bits_per_byte(loss_nats: float, bytes_per_token: float) -> float:
    """Cross-entropy in nats per token -> bits per byte of the underlying text."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token = {bytes_per_token} must be positive")
    return loss_nats / math.log(2) / bytes_per_token


def unigram_loss(train_tokens, vocab_size: int, targets) -> float:
    """Cross-entropy (nats / token) of a unigram model fitted to `train_tokens` (add-one smoothed),
    evaluated on `targets` (an iterable of id tensors/arrays, e.g. the validation batches' targets)."""
    import numpy as np

    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size] + 1.0
    logp = np.log(counts / counts.sum())
    total, n = 0.0, 0
    for y in targets:
        y = np.asarray(y.cpu() if isinstance(y, torch.Tensor) else y, dtype=np.int64).reshape(-1)
        total -= float(logp[y].sum())
        n += y.size
    if n == 0:
        raise ValueError("unigram_loss: no target tokens")
    return total / n
