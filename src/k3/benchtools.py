"""What every script in `benchmarks/` shares: the machine record, paired timing, writing the result.

A speed claim is a ratio of two paths timed side by side in one process: `paired` alternates them
(a b, b a, a b, ...) so that a slow phase of a shared machine hits both, and reports the median ratio.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from k3.fileio import atomic_write_json


def positive_int(text: str) -> int:
    """argparse type for counts (repeats, steps, threads): an integer >= 1, else a one-line usage error."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return value


def loadavg() -> float | None:
    """The 1-minute load average (None where the OS has none): how busy the machine was."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine(**extra) -> dict:
    """The machine a figure was measured on; `extra` adds the benchmark's own fields."""
    rec = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "loadavg_1m": loadavg(),
    }
    rec.update(extra)
    return rec


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes (on CUDA, call torch.cuda.synchronize inside fn)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def paired(fn_a: Callable[[], object], fn_b: Callable[[], object], repeats: int, warmup: int = 1) -> dict:
    """Time a and b alternately, `repeats` times each after `warmup` rounds.

    ratio = t_b / t_a per repeat (> 1: a is faster); the order flips every repeat.
    """
    assert repeats >= 1, f"repeats must be >= 1, got {repeats}"  # the scripts' --repeats is a positive_int
    for _ in range(warmup):
        fn_a()
        fn_b()
    ta, tb = [], []
    for r in range(repeats):
        if r % 2:
            tb.append(timed(fn_b))
            ta.append(timed(fn_a))
        else:
            ta.append(timed(fn_a))
            tb.append(timed(fn_b))
    ratios = [b / a for a, b in zip(ta, tb)]
    return {"a_median_s": statistics.median(ta), "b_median_s": statistics.median(tb),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def matmul_peak(repeats: int = 5, n: int = 2048, dtype: torch.dtype = torch.float32) -> dict:
    """The measured n x n matmul rate on this CPU (GFLOP/s, median and best of `repeats`; fp32 unless `dtype`)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    ts = [timed(lambda: a @ b) for _ in range(repeats)]
    return {"n": n, "median_gflops": 2 * n**3 / statistics.median(ts) / 1e9, "best_gflops": 2 * n**3 / min(ts) / 1e9,
            "repeats": repeats}


BENCH_DIR = Path(__file__).resolve().parents[2] / "runs" / "bench"


def shown_path(path: str | os.PathLike, root: str | os.PathLike) -> str:
    """A path as results record it: relative to `root` (the repository) when inside it, so no machine paths reach
    the JSON."""
    p, root = Path(path).resolve(), Path(root).resolve()
    return str(p.relative_to(root)) if p.is_relative_to(root) else str(p)


def bench_out(name: str, quick: bool = False) -> Path:
    """Where benchmark `name` writes its JSON: runs/bench/NAME.json, or runs/bench/quick/ for --quick smoke
    runs, so that a smoke run never replaces the figure docs/benchmarks.md is built from."""
    return (BENCH_DIR / "quick" if quick else BENCH_DIR) / f"{name}.json"


def write_result(out: str | os.PathLike, result: dict, as_json: bool = False) -> Path:
    """Write the benchmark's JSON atomically to `out` (print it on stdout when --json was given)."""
    atomic_write_json(Path(out), result)
    if as_json:
        print(json.dumps(result))
    return Path(out)


class RandomTokens:
    """A dataset of uniform random token ids for throughput runs (speed does not depend on the text):
    get_batch(step, B, T, seed) -> (inputs, targets), a pure function of (seed, step)."""

    def __init__(self, vocab_size: int, n_tokens: int = 1 << 20):
        self.vocab_size, self.n_tokens = vocab_size, n_tokens

    def __len__(self) -> int:
        return self.n_tokens

    def get_batch(self, step, batch_size, seq_len, seed=0):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        w = torch.randint(0, self.vocab_size, (batch_size, seq_len + 1), generator=g)
        return w[:, :-1], w[:, 1:]
