import math

import pytest

from k3.ablate.stats import CONTRADICTED, INCONCLUSIVE, SUPPORTED, mean_std, paired_ci, t_cdf, t_critical, verdict


@pytest.mark.parametrize("x", [-30.0, -2.0, -0.3, 0.0, 0.7, 5.0, 100.0])
def test_t_cdf_matches_the_cauchy_closed_form_at_one_degree_of_freedom(x):
    assert t_cdf(x, 1) == pytest.approx(0.5 + math.atan(x) / math.pi, abs=1e-7)


@pytest.mark.parametrize("df, want", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423)])
def test_t_critical_matches_tables(df, want):
    assert t_critical(df) == pytest.approx(want, abs=2e-3)


def test_t_critical_tends_to_the_normal_quantile():
    assert t_critical(100_000) == pytest.approx(1.95996, abs=1e-3)


def test_mean_std():
    assert mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    m, s = mean_std([4.0])
    assert m == 4.0 and s is None


def test_paired_ci_uses_per_seed_differences():
    a = {0: 3.0, 1: 3.1, 2: 3.2}
    b = {0: 3.5, 1: 3.6, 2: 3.7}  # a huge seed effect, a constant difference of -0.5
    ci = paired_ci(a, b)
    assert ci["n"] == 3 and ci["mean"] == pytest.approx(-0.5)
    assert ci["lo"] == pytest.approx(-0.5) and ci["hi"] == pytest.approx(-0.5)
    assert verdict("lower", ci) == SUPPORTED
    assert verdict("higher", ci) == CONTRADICTED


def test_verdicts_need_the_interval_to_exclude_the_threshold():
    noisy = paired_ci({0: 1.0, 1: 2.0, 2: 1.4}, {0: 1.5, 1: 1.5, 2: 1.5})
    assert noisy["lo"] < 0 < noisy["hi"]
    assert verdict("lower", noisy) == INCONCLUSIVE
    worse = paired_ci({0: 2.0, 1: 2.1, 2: 2.05}, {0: 1.0, 1: 1.0, 2: 1.0})
    assert verdict("lower", worse) == CONTRADICTED
    one = paired_ci({0: 1.0}, {0: 2.0})
    assert verdict("lower", one) == INCONCLUSIVE  # one seed: no interval, no verdict


def test_within_margin():
    ci = paired_ci({0: 1.01, 1: 1.02, 2: 1.015}, {0: 1.0, 1: 1.0, 2: 1.0})  # a worse than b by ~0.015
    assert verdict("within", ci, margin=0.1) == SUPPORTED
    assert verdict("within", ci, margin=0.001) == CONTRADICTED
    assert verdict("within", ci, margin=None) == INCONCLUSIVE
    with pytest.raises(AssertionError, match="lower, higher or within"):  # the suites' claims name their kind
        verdict("sideways", ci)


def test_known_measurement_noise_floors_the_interval():
    a, b = {0: 0.60, 1: 0.70}, {0: 0.50, 1: 0.60}  # two identical differences: zero sample variance
    assert verdict("higher", paired_ci(a, b)) == SUPPORTED
    noisy = paired_ci(a, b, noise_var={0: 0.01, 1: 0.01})
    assert noisy["lo"] < 0 < noisy["hi"] and verdict("higher", noisy) == INCONCLUSIVE
