"""PNG plots of a run's metrics.jsonl (matplotlib, Agg backend): loss, expert load, AttnRes weights.

Each plot is drawn from the records alone, so `plot_all(run_dir)` can redraw a finished or running run.
Files are written atomically (render to a temporary name, then rename).
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from k3.fileio import atomic_open  # noqa: E402
from k3.train.metrics import read_metrics  # noqa: E402

log = logging.getLogger(__name__)


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Write `fig` to `path` atomically (format from the suffix, PNG by default) and close it."""
    path = Path(path)
    try:
        with atomic_open(path, "wb") as f:
            fig.savefig(f, dpi=110, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return path


def _ema(xs: list[float], alpha: float = 0.1) -> list[float]:
    out, m = [], None
    for x in xs:
        m = x if m is None else (1 - alpha) * m + alpha * x
        out.append(m)
    return out


def plot_loss(records: list[dict], path: str | os.PathLike, baseline: float | None = None,
              baseline_label: str = "unigram") -> Path:
    """Train loss per step (raw and smoothed) and validation loss at each evaluation."""
    train = [r for r in records if r.get("kind") == "train" and r.get("loss") is not None]
    val = [r for r in records if r.get("kind") == "val" and r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    if train:
        steps = [r["step"] for r in train]
        loss = [r["loss"] for r in train]
        ax.plot(steps, loss, color="tab:blue", alpha=0.3, lw=0.8, label="train")
        ax.plot(steps, _ema(loss), color="tab:blue", lw=1.5, label="train (EMA)")
    if val:
        style = "o-" if len(val) > 2 else "o"  # two points (start, end) joined would suggest a curve
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], style, color="tab:orange", label="validation")
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", lw=1, label=baseline_label)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    if train or val or baseline is not None:
        ax.legend()
    else:  # a run stopped before its first step (a spent time budget) has nothing to draw yet
        ax.text(0.5, 0.5, "no training or validation records yet", ha="center", va="center", transform=ax.transAxes)
    return save_figure(fig, path)


def plot_experts(records: list[dict], path: str | os.PathLike, max_layers: int = 8) -> Path:
    """Heatmap per MoE layer: each expert's share of routed tokens over steps, relative to a uniform share
    (1 = balanced, log2 colour scale)."""
    train = [r for r in records if r.get("kind") == "train" and r.get("expert_load")]
    if not train:
        fig, ax = plt.subplots(figsize=(5, 2))
        ax.text(0.5, 0.5, "no expert-load records (no MoE layers?)", ha="center", va="center")
        ax.axis("off")
        return save_figure(fig, path)
    total_layers = len(train[-1]["expert_load"])
    n_layers = min(total_layers, max_layers)
    cols = min(n_layers, 4)
    rows = math.ceil(n_layers / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False, layout="constrained")
    steps = [r["step"] for r in train]
    im = None
    for i in range(rows * cols):
        ax = axes[i // cols][i % cols]
        if i >= n_layers:
            ax.axis("off")
            continue
        share = np.array([r["expert_load"][i] for r in train], dtype=float).T  # [E, steps]
        rel = np.log2(np.clip(share * share.shape[0], 1 / 16, 16))
        im = ax.imshow(rel, aspect="auto", origin="lower", cmap="RdBu_r", vmin=-2, vmax=2,
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, share.shape[0] - 0.5), interpolation="nearest")
        ax.set_title(f"MoE layer {i}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("expert", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.8, label="log2(load / uniform)")
    fig.suptitle("expert load over training" + (f" (the first {n_layers} of {total_layers} MoE layers)"
                                                 if n_layers < total_layers else ""))
    return save_figure(fig, path)


def plot_attnres(records: list[dict], path: str | os.PathLike) -> Path:
    """Left: the latest mean AttnRes weight of each source, per sublayer. Right: weight entropy over steps."""
    train = [r for r in records if r.get("kind") == "train" and r.get("attnres_weights")]
    if not train:
        fig, ax = plt.subplots(figsize=(5, 2))
        ax.text(0.5, 0.5, "no AttnRes records (attnres = none?)", ha="center", va="center")
        ax.axis("off")
        return save_figure(fig, path)
    weights = train[-1]["attnres_weights"]
    n_src = max(len(w) for w in weights if w)
    grid = np.full((len(weights), n_src), np.nan)
    for j, w in enumerate(weights):
        if w:
            grid[j, :len(w)] = w
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 0.28 * len(weights) + 2.5), layout="constrained")
    im = a0.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    a0.set_xlabel("source (0 = embedding, then completed blocks, last = the current block's partial sum, if any)")
    a0.set_ylabel("sublayer (even: token mixer, odd: channel mixer; last: final)")
    a0.set_yticks(range(len(weights)))
    a0.set_xticks(range(n_src))
    a0.set_title(f"AttnRes source weights at step {train[-1]['step']}")
    fig.colorbar(im, ax=a0, label="mean weight")
    ent = np.array([[e if e is not None else np.nan for e in r.get("attnres_entropy", [])] for r in train])
    if ent.size:
        im1 = a1.imshow(ent.T, aspect="auto", origin="upper", cmap="magma", interpolation="nearest",
                        extent=(train[0]["step"] - 0.5, train[-1]["step"] + 0.5, ent.shape[1] - 0.5, -0.5))
        a1.set_xlabel("step")
        a1.set_ylabel("sublayer")
        a1.set_title("weight entropy (nats)")
        fig.colorbar(im1, ax=a1)
    return save_figure(fig, path)


def plot_all(run_dir: str | os.PathLike, baseline: float | None = None) -> dict[str, Path]:
    """Redraw loss.png, experts.png and attnres.png from run_dir/metrics.jsonl."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    return {
        "loss": plot_loss(records, run_dir / "loss.png", baseline),
        "experts": plot_experts(records, run_dir / "experts.png"),
        "attnres": plot_attnres(records, run_dir / "attnres.png"),
    }
