"""Aggregate cached runs into tables, verdicts and plots: results.json, results.md, plots/*.png.

Per variant: mean +- std over seeds of each metric. Per claim: the paired per-seed difference of the
claim's metric with its 95% Student-t interval and a verdict (k3.ablate.stats). Nothing here is tuned to
an outcome: the verdict rule is fixed before the numbers exist.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from k3.ablate.runner import Plan
from k3.ablate.stats import mean_std, paired_ci, verdict
from k3.ablate.suites import PROBE, PROBE_CLAIMS, Claim
from k3.fileio import atomic_write_json, atomic_write_text

METRICS = ("val_loss", "val_bpb", "load_max_mean", "load_max_mean_val", "active_params", "moe_payload", "seconds")


def _by_variant(plan: Plan, results: dict, group: str) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for e in plan.entries:
        if e.group == group and e.spec.key in results:
            out.setdefault(e.variant, {})[e.seed] = results[e.spec.key]
    return out


def _probe_metrics(res: dict, nq: int | None) -> dict:
    """Accuracy per length, its means at / below and beyond the training length, and the binomial
    variance of each (n queries per length, lengths independent)."""
    acc = {int(L): a for L, a in res["accuracy"].items()}
    out = {f"acc@{L}": a for L, a in acc.items()}
    for name, sel in (("acc_in", lambda L: L <= res["train_len"]), ("acc_long", lambda L: L > res["train_len"])):
        xs = [a for L, a in acc.items() if sel(L)]
        out[name] = sum(xs) / len(xs) if xs else None
        if xs and nq:
            out[name + "_var"] = sum(a * (1 - a) / nq for a in xs) / len(xs) ** 2
    return out


def _judge(claim: Claim, runs: dict[str, dict[int, dict]]) -> dict:
    def metric(label):
        return {s: r.get(claim.metric) for s, r in runs.get(label, {}).items()}

    noise = None
    if claim.metric + "_var" in next(iter(runs.get(claim.a, {}).values()), {}):
        va = {s: r.get(claim.metric + "_var", 0.0) for s, r in runs[claim.a].items()}
        vb = {s: r.get(claim.metric + "_var", 0.0) for s, r in runs.get(claim.b, {}).items()}
        noise = {s: va[s] + vb[s] for s in set(va) & set(vb)}
    ci = paired_ci(metric(claim.a), metric(claim.b), noise_var=noise)
    margin = gain = None
    if claim.kind == "within":
        gain = paired_ci(metric(claim.margin_ref), metric(claim.b))  # how much b gains over the reference
        margin = claim.margin_frac * gain["mean"] if gain["n"] >= 2 and gain["lo"] > 0 else None
    out = {"id": claim.id, "text": claim.text, "source": claim.source, "a": claim.a, "b": claim.b,
           "metric": claim.metric, "kind": claim.kind, "n": ci["n"], "diff_mean": ci["mean"],
           "ci95": [ci["lo"], ci["hi"]], "verdict": verdict(claim.kind, ci, margin)}
    if claim.kind == "within":
        out.update(margin=margin, margin_frac=claim.margin_frac, margin_ref=claim.margin_ref, gain_mean=gain["mean"],
                   gain_ci95=[gain["lo"], gain["hi"]])
    return out


def aggregate(plan: Plan, results: dict) -> dict:
    """The summary written to results.json."""
    out: dict = {"groups": {}}
    for g in plan.groups:
        entry = {"title": g.title, "baseline": g.baseline, "varies": list(g.varies)}
        if g.name in plan.skipped:
            out["groups"][g.name] = {**entry, "skipped": plan.skipped[g.name]}
            continue
        runs = _by_variant(plan, results, g.name)
        variants = {}
        for v in g.variants:
            seeds = runs.get(v.label, {})
            row = {"overrides": v.overrides, "ptq_of": v.ptq_of, "seeds": sorted(seeds),
                   "keys": {s: r["key"] for s, r in sorted(seeds.items())}}
            for m in METRICS:
                if m == "load_max_mean" and v.ptq_of:
                    continue  # PTQ trains nothing: it has a validation load only (older results hold that here)
                finite = {s: r[m] for s, r in sorted(seeds.items())
                          if isinstance(r.get(m), (int, float)) and math.isfinite(r[m])}
                if finite:
                    row[m] = dict(zip(("mean", "std"), mean_std(list(finite.values()))))
                    row[m]["values"] = list(finite.values())
                    row[m]["seeds"] = list(finite)  # the seeds of `values` (a non-finite one is left out)
            if v.label != g.baseline:
                ci = paired_ci({s: r.get("val_loss") for s, r in seeds.items()},
                               {s: r.get("val_loss") for s, r in runs.get(g.baseline, {}).items()})
                row["val_loss_vs_baseline"] = {"mean": ci["mean"], "ci95": [ci["lo"], ci["hi"]], "n": ci["n"]}
            curves = [r["train_loss"] for r in seeds.values() if r.get("train_loss")]
            row["train_loss_mean_curve"] = _mean_curve(curves)
            variants[v.label] = row
        out["groups"][g.name] = {**entry, "variants": variants, "claims": [_judge(c, runs) for c in g.claims]}
    if any(e.group == PROBE for e in plan.entries):
        data = next(e.spec.data for e in plan.entries if e.group == PROBE)
        nq = data["eval_batches"] * data["eval_batch_size"] * data["task"]["n_keys"]  # queries per length
        runs = {label: {s: {**r, **_probe_metrics(r, nq)} for s, r in by_seed.items()}
                for label, by_seed in _by_variant(plan, results, PROBE).items()}
        variants = {}
        for label, by_seed in runs.items():
            row = {"seeds": sorted(by_seed), "pattern": next(iter(_pattern(plan, label)), None)}
            keys = sorted({k for r in by_seed.values() for k in r if k.startswith("acc@") or k in ("acc_in", "acc_long")},
                          key=lambda k: (not k.startswith("acc@"), int(k[4:]) if k.startswith("acc@") else 0, k))
            for k in keys:
                row[k] = dict(zip(("mean", "std"), mean_std([r[k] for r in by_seed.values() if r.get(k) is not None])))
            row["train_len"] = next(iter(by_seed.values()))["train_len"]
            row["seconds"] = dict(zip(("mean", "std"), mean_std([r["seconds"] for r in by_seed.values()])))
            variants[label] = row
        out["probe"] = {"variants": variants, "claims": [_judge(c, runs) for c in PROBE_CLAIMS]}
        out["probe_task"] = {**data["task"], "queries_per_length": nq}
    return out


def _pattern(plan: Plan, label: str):
    for e in plan.entries:
        if e.group == PROBE and e.variant == label:
            yield e.spec.config["layer_pattern"]


def _mean_curve(curves: list[list[float]]) -> list[float]:
    if not curves:
        return []
    n = min(len(c) for c in curves)
    return [sum(c[i] for c in curves) / len(curves) for i in range(n)]


# ---------------------------------------------------------------------------------------------- markdown
def _pm(stat: dict | None, fmt: str = "{:.4f}") -> str:
    if not stat or stat.get("mean") is None or (isinstance(stat["mean"], float) and math.isnan(stat["mean"])):
        return "–"
    s = fmt.format(stat["mean"])
    return s + (f" ± {fmt.format(stat['std'])}" if stat.get("std") is not None else " (1 seed)")


def format_ci(mean: float, ci: list[float], fmt: str = "{:+.4f}") -> str:
    if mean is None or math.isnan(mean):
        return "–"
    if not all(math.isfinite(x) for x in ci):
        return f"{fmt.format(mean)} (CI needs ≥ 2 seeds)"
    return f"{fmt.format(mean)} [{fmt.format(ci[0])}, {fmt.format(ci[1])}]"


def markdown(summary: dict, header: str = "") -> str:
    lines = [header] if header else []
    if summary.get("failed"):
        lines += [f"**{len(summary['failed'])} run(s) failed** and count as missing seeds below (rerun the same "
                  "command to retry them):", ""] + [f"- {f['run']}: {f['error']}" for f in summary["failed"]] + [""]
    for name, g in summary["groups"].items():
        lines += [f"### {name}: {g['title']}", ""]
        if "skipped" in g:
            lines += [f"**Skipped**: {g['skipped']}.", ""]
            continue
        lines += ["| variant | seeds | val loss (nats/token) | val bits/byte | Δ loss vs "
                  f"{g['baseline']} [95% CI] | max/mean expert load (train) | (val) | active params | "
                  "routed values/token/layer | s/run |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for label, r in g["variants"].items():
            d = r.get("val_loss_vs_baseline")
            lines.append(
                f"| {label}{' (baseline)' if label == g['baseline'] else ''} | {len(r['seeds'])} | "
                f"{_pm(r.get('val_loss'))} | {_pm(r.get('val_bpb'))} | "
                f"{format_ci(d['mean'], d['ci95']) if d else '–'} | {_pm(r.get('load_max_mean'), '{:.2f}')} | "
                f"{_pm(r.get('load_max_mean_val'), '{:.2f}')} | "
                f"{_pm(r.get('active_params'), '{:,.0f}').split(' ±')[0]} | "
                f"{_pm(r.get('moe_payload'), '{:,.0f}').split(' ±')[0]} | {_pm(r.get('seconds'), '{:.0f}')} |")
        lines += ["", *_claims_md(g["claims"]), ""]
    if "probe" in summary:
        p = summary["probe"]
        variants = p["variants"]
        first = next(iter(variants.values()), None)
        if first:
            lengths = sorted(int(k[4:]) for k in first if k.startswith("acc@"))
            tl = first["train_len"]
            lines += ["### probe: needle retrieval accuracy vs context length", "",
                      "| model | pattern | seeds | " + " | ".join(f"L={L}{'*' if L > tl else ''}" for L in lengths)
                      + " | s/run |", "|---|---|---|" + "---|" * (len(lengths) + 1)]
            for label, r in variants.items():
                lines.append(f"| {label} | {r['pattern']} | {len(r['seeds'])} | "
                             + " | ".join(_pm(r.get(f"acc@{L}"), "{:.3f}") for L in lengths)
                             + f" | {_pm(r.get('seconds'), '{:.0f}')} |")
            lines += ["", f"Chance is 1/{_n_values(summary)}; trained at length {tl}; * = longer than training.", ""]
        lines += [*_claims_md(p["claims"]), ""]
    return "\n".join(lines) + "\n"


def _n_values(summary: dict) -> str:
    return str(summary.get("probe_task", {}).get("n_values", "n_values"))


def _claims_md(claims: list[dict]) -> list[str]:
    out = ["| claim | comparison (metric) | mean difference a − b [95% CI] | verdict |", "|---|---|---|---|"]
    for c in claims:
        extra = ""
        if c["kind"] == "within":
            extra = (f"; margin = {c.get('margin_frac', 0.5):g} × gain of {c['b']} over {c['margin_ref']} = "
                     + (f"{c['margin']:.4f}" if c.get("margin") is not None else "n/a (gain not significant)"))
        fmt = "{:+.4f}" if "acc" not in c["metric"] else "{:+.3f}"
        out.append(f"| {c['text']} ({c['source']}) | {c['a']} − {c['b']} ({c['metric']}, {c['kind']}{extra}) | "
                   f"{format_ci(c['diff_mean'], c['ci95'], fmt)} | **{c['verdict']}** |")
    return out


# ---------------------------------------------------------------------------------------------- plots
def plot_all(summary: dict, out_dir: str | os.PathLike) -> list[Path]:
    from k3.train.plots import _ema, save_figure  # imported first: it selects the Agg backend

    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    paths = []
    for name, g in summary["groups"].items():
        if "skipped" in g:
            continue
        metrics = [m for m in ("val_loss", "load_max_mean") if any(m in r for r in g["variants"].values())]
        fig, axes = plt.subplots(1, len(metrics) + 1, figsize=(5 * (len(metrics) + 1), 3.6), layout="constrained",
                                 squeeze=False)  # every run failed: no metric, one Axes
        axes = list(axes[0])
        labels = list(g["variants"])
        for ax, m in zip(axes, metrics):
            for i, label in enumerate(labels):
                r = g["variants"][label].get(m)
                if not r:
                    continue
                ax.bar(i, r["mean"], yerr=r["std"] or 0, color="tab:orange" if label == g["baseline"] else "tab:blue",
                       alpha=0.6, capsize=4)
                ax.plot([i] * len(r["values"]), r["values"], "k.", ms=5)
            vals = [x for lb in labels for x in g["variants"][lb].get(m, {}).get("values", [])]
            if vals:
                lo, hi = min(vals), max(vals)
                pad = 0.5 * (hi - lo) + 1e-3 * abs(hi)
                ax.set_ylim(lo - pad, hi + pad)
            ax.set_xticks(range(len(labels)), labels, rotation=15)
            ax.set_ylabel({"val_loss": "val loss (nats/token)", "load_max_mean": "max/mean expert load"}[m])
        ax = axes[-1]
        for label in labels:
            c = g["variants"][label].get("train_loss_mean_curve")
            if c:
                ax.plot(range(1, len(c) + 1), _ema(c), label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss, mean over seeds (EMA)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:  # every run of the group failed
            ax.text(0.5, 0.5, "no run finished", ha="center", va="center", transform=ax.transAxes)
        fig.suptitle(g["title"], fontsize=10)
        paths.append(save_figure(fig, out_dir / f"{name}.png"))
    if "probe" in summary and summary["probe"]["variants"]:
        fig, ax = plt.subplots(figsize=(6, 3.8), layout="constrained")
        tl = None
        for label, r in summary["probe"]["variants"].items():
            Ls = sorted(int(k[4:]) for k in r if k.startswith("acc@"))
            ax.errorbar(Ls, [r[f"acc@{L}"]["mean"] for L in Ls], yerr=[r[f"acc@{L}"]["std"] or 0 for L in Ls],
                        marker="o", capsize=3, label=f"{label} ({r['pattern']})")
            tl = r["train_len"]
        if tl:
            ax.axvline(tl, color="gray", ls="--", lw=1, label="training length")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle retrieval accuracy")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out_dir / "probe.png"))
    return paths


def json_safe(obj):
    """`obj` with every non-finite float (a CI from fewer than 2 seeds is ±inf, a mean of no seeds nan) as None:
    JSON has no Infinity or NaN, and strict readers reject Python's spelling of them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_report(summary: dict, out_dir: str | os.PathLike, header: str = "") -> dict:
    out_dir = Path(out_dir)
    atomic_write_json(out_dir / "results.json", json_safe(summary))
    md = markdown(summary, header)
    atomic_write_text(out_dir / "results.md", md)
    plots = plot_all(summary, out_dir / "plots")
    for stale in (out_dir / "plots").glob("*.png"):  # an earlier run's groups that this run did not have
        if stale not in plots:
            stale.unlink()
    return {"json": out_dir / "results.json", "markdown": out_dir / "results.md", "plots": plots}
