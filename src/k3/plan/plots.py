"""Each wall against context length (1k .. 1M tokens), for K3 and its what-ifs, as one PNG (matplotlib, Agg)."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from k3.fileio import atomic_open  # noqa: E402
from k3.plan.hardware import load_hardware  # noqa: E402
from k3.plan.walls import Layout, Options, plan  # noqa: E402
from k3.plan.whatif import apply_what_if, headline  # noqa: E402

log = logging.getLogger(__name__)

CONTEXTS = tuple(1024 * 2 ** i for i in range(11))  # 1k .. 1M


def wall_curves(config, hardware, layout: Layout, options: Options, names=(), contexts=CONTEXTS, progress=False) -> dict:
    """{variant: {metric: [value per context]}} for the base config and each what-if (serving)."""
    variants = [("k3" if config.name == "k3" else config.name, config, options)]
    variants += [(n, *apply_what_if(n, config, options)) for n in names]
    contexts = [c for c in contexts if c <= config.max_context]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(variants) * len(contexts), desc="plan curves", unit="plan")
    out: dict = {"contexts": contexts}
    for label, cfg, opt in variants:
        rows = []
        for c in contexts:
            try:
                rows.append(headline(plan(cfg, hardware, layout, dataclasses.replace(opt, mode="serve", context=c))))
            except ValueError as e:
                log.warning("%s at context %d: %s", label, c, e)
                rows.append(None)
            if bar is not None:
                bar.update(1)
        out[label] = {k: [r[k] if r else float("nan") for r in rows]
                      for k in ("memory_gb", "bytes_read_per_token", "comm_s_per_decode_step", "decode_ms_per_token", "ttft_s")}
    if bar is not None:
        bar.close()
    return out


def plot_walls(path, config, hardware, layout: Layout, options: Options, names=(), progress=False) -> Path:
    hw = load_hardware(hardware)
    curves = wall_curves(config, hw, layout, options, names, progress=progress)
    xs = curves["contexts"]
    panels = [("memory_gb", "memory per GPU (GB)", 1.0),
              ("bytes_read_per_token", "HBM bytes read per decoded token (GB)", 1e-9),
              ("comm_s_per_decode_step", "communication per decode step (ms)", 1e3),
              ("decode_ms_per_token", "decode latency bound (ms / token)", 1.0),
              ("ttft_s", "time to first token bound (s)", 1.0)]
    fig, grid = plt.subplots(2, 3, figsize=(13, 7.2))
    axes = grid.flat
    base = list(curves)[1]
    for ax, (key, title, scale) in zip(axes, panels):
        for label, series in curves.items():
            if label == "contexts":
                continue
            main = label == base
            ax.plot(xs, [v * scale for v in series[key]], marker=".", label=label, color="k" if main else None,
                    linewidth=2.4 if main else 1.2, zorder=3 if main else 2)
        if key == "memory_gb":
            ax.axhline(hw.memory_gb * options.mem_util, color="k", linestyle="--", linewidth=0.8,
                       label=f"{options.mem_util:.0%} of {hw.memory_gb:g} GB")
        ax.set_xscale("log", base=2)
        values = [v for label, series in curves.items() if label != "contexts" for v in series[key] if v == v]
        if values and min(values) > 0:
            ax.set_yscale("log")
        ax.set_xticks([1024, 8192, 65536, 524288, 1048576], ["1k", "8k", "64k", "512k", "1M"])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("context (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    legend = axes[len(panels)]
    legend.axis("off")
    handles, labels = axes[0].get_legend_handles_labels()
    legend.legend(handles, labels, loc="center", fontsize=10, title="variant (--what-if)")
    fig.suptitle(f"{config.name} on {layout.gpus} x {hw.name} (tp={layout.tp} ep={layout.ep} pp={layout.pp} "
                 f"dp={layout.dp}), serving batch {options.batch}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_open(path, "wb") as f:
            fig.savefig(f, dpi=100, format="png")
    finally:
        plt.close(fig)
    return path
