"""Mean +- std over seeds, paired differences with a Student-t confidence interval, and verdicts.

Seed s of every variant sees the same batches in the same order (the data order is a function of the
seed), so variants are compared on paired per-seed differences: d_s = m(a, s) - m(b, s), CI = mean(d) +-
t_{0.975, n-1} * sd(d) / sqrt(n). A verdict is 'supported' or 'contradicted' only when the CI excludes the
claim's threshold; otherwise, and always with fewer than two seeds, it is 'inconclusive'.
"""
from __future__ import annotations

import functools
import math
import statistics

SUPPORTED, CONTRADICTED, INCONCLUSIVE = "supported", "contradicted", "inconclusive"


def mean_std(xs: list[float]) -> tuple[float, float | None]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return float("nan"), None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def _t_pdf(x: float, df: int) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(x * x / df))


def t_cdf(x: float, df: int) -> float:
    """P(T <= x) for Student's t by Simpson integration of the density from 0 (symmetric)."""
    assert df >= 1, f"degrees of freedom must be >= 1, got {df}"
    if x == 0:
        return 0.5
    a, n = abs(x), 256
    # substitute x = tan(u): the tails of small df decay slowly, the tangent maps them onto a finite range
    hi = math.atan(a)
    h = hi / n
    f = lambda u: _t_pdf(math.tan(u), df) / math.cos(u) ** 2  # noqa: E731
    s = f(0) + f(hi) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))
    area = s * h / 3
    return 0.5 + area if x > 0 else 0.5 - area


@functools.lru_cache(maxsize=None)
def t_critical(df: int, confidence: float = 0.95) -> float:
    """Two-sided critical value: P(|T| <= t) = confidence (bisection on t_cdf)."""
    target = 0.5 + confidence / 2
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < target:
        hi *= 2
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < target else (lo, mid)
    return 0.5 * (lo + hi)


def paired_ci(a: dict[int, float], b: dict[int, float], confidence: float = 0.95,
              noise_var: dict[int, float] | None = None) -> dict:
    """a, b: seed -> metric. Mean difference a - b over the shared seeds and its two-sided CI.

    noise_var: seed -> known measurement variance of that seed's difference (e.g. binomial noise of an
    accuracy on a finite evaluation set). The spread used is max(sample variance, mean noise variance):
    two seeds whose differences happen to coincide must not yield a zero-width interval."""
    seeds = sorted(s for s in set(a) & set(b)
                   if a[s] is not None and b[s] is not None and math.isfinite(a[s]) and math.isfinite(b[s]))
    d = [a[s] - b[s] for s in seeds]
    out = {"n": len(d), "seeds": seeds, "diffs": d}
    if not d:
        return {**out, "mean": float("nan"), "lo": float("nan"), "hi": float("nan")}
    m = statistics.fmean(d)
    if len(d) < 2:
        return {**out, "mean": m, "lo": float("-inf"), "hi": float("inf")}
    var = statistics.variance(d)
    if noise_var:
        var = max(var, statistics.fmean(noise_var.get(s, 0.0) for s in seeds))
    half = t_critical(len(d) - 1, confidence) * math.sqrt(var / len(d))
    return {**out, "mean": m, "lo": m - half, "hi": m + half}


def verdict(kind: str, ci: dict, margin: float | None = None) -> str:
    """'lower': a < b; 'higher': a > b; 'within': a - b < margin (margin > 0 measured elsewhere)."""
    # kinds are written in the suites (k3.ablate.suites), not given by a user
    assert kind in ("lower", "higher", "within"), f"claim kind {kind!r} is unknown; use lower, higher or within"
    if ci["n"] < 2 or math.isnan(ci["mean"]):
        return INCONCLUSIVE
    if kind == "lower":
        threshold = 0.0
    elif kind == "higher":
        return SUPPORTED if ci["lo"] > 0 else CONTRADICTED if ci["hi"] < 0 else INCONCLUSIVE
    else:
        if margin is None or not margin > 0:
            return INCONCLUSIVE  # no measured gain to keep a share of
        threshold = margin
    return SUPPORTED if ci["hi"] < threshold else CONTRADICTED if ci["lo"] > threshold else INCONCLUSIVE
