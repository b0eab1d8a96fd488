"""The 9-cell evaluation: scores per (domain, effort) cell, reasoning length per effort, gap plots.

Every model answers the same held-out problems (`domains.eval_problems`) greedily under each cell's
thinking budget; the domain checkers score the answers. A teacher is scored on its own cell; a student
or baseline on every cell. `table` lines them up (teacher, student, baselines) with the mean reasoning
tokens per effort level, which a student must keep ordered low < medium < high.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Sequence

import torch

from k3.distill.domains import CELLS, DOMAIN_NAMES, Domain, Problem, cell_name
from k3.distill.effort import EFFORTS, build_prompt
from k3.distill.rollout import sample

log = logging.getLogger(__name__)


def long_answers(problems: dict[tuple[str, str], Sequence[Problem]], tokenizer, max_answer_tokens: int) -> str | None:
    """A warning when some reference answers need more than `max_answer_tokens` tokens (those problems cannot be
    answered in full, so every model scores lower on them; a small vocabulary makes answers long), else None."""
    seen = {p.answer for ps in problems.values() for p in ps}
    lengths = {a: len(tokenizer.encode(a, allow_special=False)) for a in seen}
    over = [n for n in lengths.values() if n > max_answer_tokens]
    if not over:
        return None
    return (f"{len(over)} of {len(lengths)} distinct reference answers need more than --max-answer-tokens "
            f"{max_answer_tokens} tokens (up to {max(over)}): those problems cannot be answered in full; raise "
            f"--max-answer-tokens to {max(over)} or use a larger vocabulary")


def evaluate_cells(models: torch.nn.Module | dict[tuple[str, str], torch.nn.Module],
                   problems: dict[tuple[str, str], Sequence[Problem]], domains: dict[str, Domain], tokenizer,
                   budgets: dict[str, int], max_answer_tokens: int = 40, batch_size: int = 96,
                   progress=None, teachers=None) -> dict[str, dict]:
    """Greedy answers of `models` (one model, or one per cell) to `problems` -> {cell: {score, n,
    reasoning_tokens, forced_close, closed}}, score = fraction correct. With `teachers` (a TeacherMatrix),
    also `reverse_kl`: KL(model || the cell's teacher) per completion token of the model's own answers."""
    rows = []
    for cell, ps in problems.items():
        m = models[cell] if isinstance(models, dict) else models
        rows.extend((cell, p, m) for p in ps)
    by_model: dict[int, list[int]] = {}
    for i, (_, _, m) in enumerate(rows):
        by_model.setdefault(id(m), []).append(i)
    answers, reasoning, forced, closed = [""] * len(rows), [0] * len(rows), [False] * len(rows), [False] * len(rows)
    kl = [float("nan")] * len(rows)
    for idx in by_model.values():
        model = rows[idx[0]][2]
        for k in range(0, len(idx), batch_size):
            chunk = idx[k:k + batch_size]
            prompts = [build_prompt(rows[i][1].text, rows[i][0][1], tokenizer) for i in chunk]
            ro = sample(model, prompts, [budgets[rows[i][0][1]] for i in chunk], max_answer_tokens, temperature=0.0)
            for j, (i, a) in enumerate(zip(chunk, ro.answers(tokenizer))):
                answers[i], reasoning[i] = a, ro.reasoning_tokens[j]
                forced[i], closed[i] = ro.forced_close[j], ro.closed[j]
            if teachers is not None:
                for i, v in zip(chunk, _token_kl(model, teachers, ro, [rows[i][0] for i in chunk])):
                    kl[i] = v
            if progress is not None:
                progress(len(chunk))
    correct = [0.0] * len(rows)
    for d in DOMAIN_NAMES:
        sel = [i for i, (c, _, _) in enumerate(rows) if c[0] == d]
        if sel:
            for i, s in zip(sel, domains[d].check([rows[i][1] for i in sel], [answers[i] for i in sel])):
                correct[i] = s
    out = {}
    for cell in problems:
        sel = [i for i, (c, _, _) in enumerate(rows) if c == cell]
        n = len(sel)
        out[cell_name(*cell)] = {
            "score": sum(correct[i] for i in sel) / n if n else float("nan"), "n": n,
            "reasoning_tokens": sum(reasoning[i] for i in sel) / n if n else float("nan"),
            "forced_close": sum(forced[i] for i in sel) / n if n else float("nan"),
            "closed": sum(closed[i] for i in sel) / n if n else float("nan"),
        }
        if teachers is not None:
            out[cell_name(*cell)]["reverse_kl"] = sum(kl[i] for i in sel) / n if n else float("nan")
    return out


@torch.no_grad()
def _token_kl(model, teachers, ro, cells) -> list[float]:
    """Per row: mean KL(p_model || p_teacher of its cell) over its completion tokens."""
    from k3.distill.mopd import reverse_kl

    was_training = model.training
    model.eval()
    try:
        per_pos = reverse_kl(model(ro.ids)[:, :-1], teachers.logits(ro.ids, cells)[:, :-1])
    finally:
        model.train(was_training)
    mask = ro.completion_mask[:, 1:]
    return ((per_pos * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()


def effort_lengths(result: dict[str, dict]) -> dict[str, float]:
    """Mean reasoning tokens per effort level over the domains present (weighted by problems)."""
    out = {}
    for e in EFFORTS:
        cells = [v for k, v in result.items() if k.endswith("/" + e)]
        n = sum(v["n"] for v in cells)
        if n:
            out[e] = sum(v["reasoning_tokens"] * v["n"] for v in cells) / n
    return out


def ordered(lengths: dict[str, float]) -> bool | None:
    """low < medium < high (strictly), over the levels present; None with fewer than two (nothing to order)."""
    vals = [lengths[e] for e in EFFORTS if e in lengths]
    return all(a < b for a, b in zip(vals, vals[1:])) if len(vals) > 1 else None


def table(teacher: dict[str, dict], models: dict[str, dict[str, dict]]) -> dict:
    """The report: per cell the teacher's and each model's score, per model the reasoning tokens per effort."""
    names = [cell_name(*c) for c in CELLS]
    cells = [c for c in names if c in teacher or any(c in r for r in models.values())]
    rows = []
    for c in cells:
        row = {"cell": c, "teacher": teacher.get(c, {}).get("score")}
        for name, res in models.items():
            row[name] = res.get(c, {}).get("score")
        rows.append(row)
    mean = {"cell": "mean", "teacher": _mean([r["teacher"] for r in rows])}
    for name in models:
        mean[name] = _mean([r[name] for r in rows])
    lengths = {"teacher": effort_lengths(teacher), **{n: effort_lengths(r) for n, r in models.items()}}
    report = {"cells": rows, "mean": mean, "reasoning_tokens": lengths,
              "effort_ordered": {n: ordered(v) for n, v in lengths.items()}}
    kl_models = [n for n, r in models.items() if any("reverse_kl" in v for v in r.values())]
    if kl_models:
        report["reverse_kl"] = [{"cell": c, **{n: models[n].get(c, {}).get("reverse_kl") for n in kl_models}}
                                for c in cells]
        report["reverse_kl"].append({"cell": "mean", **{n: _mean([r[n] for r in report["reverse_kl"]])
                                                        for n in kl_models}})
    return report


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def markdown(report: dict) -> str:
    names = [k for k in report["cells"][0] if k != "cell"] if report["cells"] else []
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines = ["| cell | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in report["cells"] + [report["mean"]]:
        lines.append(f"| {r['cell']} | " + " | ".join(f(r.get(n)) for n in names) + " |")
    lines += ["", "| model | " + " | ".join(f"reasoning tokens ({e})" for e in EFFORTS) + " | low < medium < high |",
              "|---|" + "---:|" * len(EFFORTS) + "---|"]
    for n, lengths in report["reasoning_tokens"].items():
        lines.append(f"| {n} | " + " | ".join(f"{lengths[e]:.1f}" if e in lengths else "-" for e in EFFORTS)
                     + f" | {({True: 'yes', False: 'no'}).get(report['effort_ordered'][n], '-')} |")
    if report.get("reverse_kl"):
        kn = [k for k in report["reverse_kl"][0] if k != "cell"]
        lines += ["", "| reverse KL to the cell's teacher (nats/token) | " + " | ".join(kn) + " |",
                  "|---|" + "---:|" * len(kn)]
        for r in report["reverse_kl"]:
            lines.append(f"| {r['cell']} | " + " | ".join(f(r.get(n)) for n in kn) + " |")
    return "\n".join(lines) + "\n"


def plot_gaps(records: list[dict], path: str | os.PathLike, title: str = "MOPD student vs teacher, per cell") -> Path:
    """Per cell over training: the held-out student-minus-teacher score (from `eval` records, which carry
    `gap`) and, when the run logged it, the reverse KL to the cell's teacher on the student's own samples
    (from `train` records, smoothed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from k3.train.plots import _ema, save_figure

    evals = [r for r in records if r.get("kind") == "eval" and r.get("gap")]
    if not evals:
        raise ValueError("the run has no evaluation records with teacher gaps; train with --eval-n > 0")
    train = [r for r in records if r.get("kind") == "train" and r.get("reverse_kl_by_cell")]
    fig, axes = plt.subplots(1, 2 if train else 1, figsize=(12 if train else 7.5, 4.5), layout="constrained",
                             squeeze=False)
    colors = {"arith": "tab:blue", "pyfunc": "tab:green", "text": "tab:red"}
    styles = {"low": ":", "medium": "--", "high": "-"}
    for c in [cell_name(*c) for c in CELLS]:
        d, e = c.split("/")
        pts = [(r["step"], r["gap"][c]) for r in evals if c in r["gap"]]
        if pts:
            axes[0, 0].plot([p[0] for p in pts], [p[1] for p in pts], styles[e], color=colors[d], marker="o", ms=3,
                            label=c)
        pts = [(r["step"], r["reverse_kl_by_cell"][c]) for r in train if c in r["reverse_kl_by_cell"]]
        if pts:
            axes[0, 1].plot([p[0] for p in pts], _ema([p[1] for p in pts], 0.1), styles[e], color=colors[d], label=c)
    ax = axes[0, 0]
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out score: student - teacher")
    ax.set_title(title)
    ax.legend(ncol=3, fontsize=8)
    if train:
        ax = axes[0, 1]
        ax.set_xlabel("step")
        ax.set_ylabel("reverse KL to the cell's teacher (nats/token, EMA)")
        ax.set_title("on the student's own samples")
        ax.set_ylim(bottom=0)
    return save_figure(fig, Path(path))
