"""Plots of RL runs: mean verified reward over GRPO steps, and held-out success per model and harness."""
from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from k3.train.metrics import read_metrics  # noqa: E402
from k3.train.plots import _ema, save_figure  # noqa: E402
from k3.fileio import loads_json


def reward_curve(path: str | os.PathLike) -> tuple[list[int], list[float]]:
    """(steps, mean verified reward of that step's fresh rollouts) from a GRPO metrics.jsonl."""
    recs = [r for r in read_metrics(path) if r.get("kind") == "train" and r.get("fresh_rollouts")
            and r.get("reward_mean") is not None]
    return [r["step"] for r in recs], [r["reward_mean"] for r in recs]


def _drawable(e) -> bool:
    """An entry of an eval report the success panel can draw: none or a success of None (no bar), or a success
    with its 95% interval."""
    if e is None or (isinstance(e, dict) and "success" in e and e["success"] is None):
        return True
    ci = e.get("ci95") if isinstance(e, dict) else None
    return (isinstance(e, dict) and isinstance(e.get("success"), (int, float)) and isinstance(ci, list)
            and len(ci) == 2 and all(isinstance(x, (int, float)) for x in ci))


def read_eval_report(path: str | os.PathLike) -> dict:
    """A `k3 rl eval` report (ROOT/eval.json), checked to hold what the success panel draws."""
    path = Path(path)
    fix = "`k3 rl eval` writes one (ROOT/eval.json, or its --out): pass that as --eval"
    try:
        report = loads_json(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON ({e}); {fix}") from None
    if not isinstance(report, dict) or not isinstance(report.get("models"), dict):
        raise ValueError(f"{path} is not a `k3 rl eval` report (no 'models'); {fix}")
    harnesses = report.get("harnesses")
    if not isinstance(harnesses, list) or not all(isinstance(h, str) for h in harnesses):
        raise ValueError(f"{path} is not a `k3 rl eval` report (no 'harnesses' list); {fix}")
    if not report["models"] or not harnesses:
        raise ValueError(f"{path} evaluates no model or no harness; {fix} and at least one --models and --harness")
    for m, entry in report["models"].items():
        if not isinstance(entry, dict) or not all(_drawable(entry.get(h)) for h in harnesses):
            raise ValueError(f"{path} is not a `k3 rl eval` report (model {m!r} lacks a success and ci95 per "
                             f"harness); {fix}")
    return report


def plot_rewards(runs: dict[str, str | os.PathLike], out: str | os.PathLike,
                 eval_path: str | os.PathLike | None = None, report: dict | None = None) -> Path:
    """Left: reward per step (raw, EMA) for each run. Right (with an eval report, read from `eval_path` or
    given as `report`): held-out success with 95% intervals per model, under each evaluated harness."""
    if report is None and eval_path:
        report = read_eval_report(eval_path)
    fig, axes = plt.subplots(1, 2 if report else 1, figsize=(12 if report else 7, 4), layout="constrained",
                             squeeze=False)
    ax = axes[0][0]
    for i, (name, path) in enumerate(runs.items()):
        if not Path(path).is_file():
            continue
        steps, rewards = reward_curve(path)
        color = f"C{i}"
        ax.plot(steps, rewards, color=color, alpha=0.3, lw=0.8)
        ax.plot(steps, _ema(rewards, 0.15), color=color, lw=1.8, label=f"{name} (EMA)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean verified reward of the step's rollouts")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    if report:
        ax = axes[0][1]
        models, harnesses = list(report["models"]), report["harnesses"]
        width = 0.8 / max(1, len(harnesses))
        for j, h in enumerate(harnesses):
            xs, ys, lo, hi = [], [], [], []
            for i, m in enumerate(models):
                e = report["models"][m].get(h)
                if not e or e["success"] is None:
                    continue
                xs.append(i + (j - (len(harnesses) - 1) / 2) * width)
                ys.append(e["success"])
                lo.append(max(0.0, e["success"] - e["ci95"][0]))
                hi.append(max(0.0, e["ci95"][1] - e["success"]))
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=f"{h} harness", color=f"C{j + 3}")
        ax.set_xticks(range(len(models)), models)
        ax.set_ylabel("held-out success (greedy)")
        ax.set_ylim(0, 1.25)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(loc="upper center", ncol=len(harnesses), fontsize="small")
    return save_figure(fig, Path(out))
