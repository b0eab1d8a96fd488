"""Router math, balancing, grouped experts vs the per-token reference, LatentMoE shapes and counts."""
import pytest
import torch

from k3.config import get_config
from k3.model.moe import (
    MoE, Router, RoutedExperts, GatedMLP, _column_quantile, grouped_glu, histogram_column_quantile,
)


def _scaled(module: torch.nn.Module, std: float = 0.2) -> torch.nn.Module:
    """Re-init with a larger std so outputs are O(1) and 1e-5 tolerances mean something."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=std)
    return module


def _skewed_router(balancing: str, **over) -> Router:
    """16 experts, top-2, and a router whose first 3 experts win for almost every token of _skewed_batch."""
    cfg = get_config("tiny", n_experts=16, n_active_experts=2, balancing=balancing, **over)
    r = Router(cfg, 64)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        r.weight.normal_(std=0.02, generator=g)
        r.weight[:3] += 0.3 * _MU / _MU.norm()
    return r


_MU = torch.randn(64, generator=torch.Generator().manual_seed(2))


def _skewed_batch(seed: int, n: int = 2048) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed)) + _MU


def _close(a: torch.Tensor, b: torch.Tensor, what: str = "", tol: float = 1e-5) -> None:
    """max |a - b| <= tol * max(1, max |b|): fp32 sums taken in another order differ relative to the scale."""
    err, scale = (a - b).abs().max().item(), max(1.0, b.abs().max().item())
    assert err <= tol * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def _imbalance(load: torch.Tensor) -> float:
    load = load.float()
    return (load.max() / load.mean()).item()


# ------------------------------------------------------------------------------------------ compute paths
@pytest.mark.parametrize("moe", ["latent", "standard"])
@pytest.mark.parametrize("impl,backend", [("loop", None), ("grouped", "grouped_mm"), ("grouped", "bmm"),
                                          ("grouped", "slices"), ("grouped", "auto")])
def test_fast_paths_match_naive_fwd_bwd(moe, impl, backend):
    if backend == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not in this torch")
    cfg = get_config("tiny", moe=moe)
    m = _scaled(MoE(cfg))
    x = torch.randn(2, 12, cfg.d_model)

    def run(impl, backend):
        m.zero_grad()
        m.impl = impl
        if backend:
            m.experts.backend = backend
        xx = x.clone().requires_grad_()
        y = m(xx)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(0)))
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        return y.detach(), xx.grad, grads

    y0, gx0, g0 = run("naive", None)
    y1, gx1, g1 = run(impl, backend)
    assert y0.abs().mean() > 1e-2  # the comparison is not between zeros
    _close(y1, y0, "y")
    _close(gx1, gx0, "dx")
    for n in g0:
        _close(g1[n], g0[n], n)


@pytest.mark.parametrize("backend", ["grouped_mm", "bmm", "slices"])
def test_grouped_glu_handles_empty_experts(backend):
    if backend == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not in this torch")
    E, d, f = 5, 8, 16
    counts = torch.tensor([3, 0, 4, 0, 1])
    x = torch.randn(int(counts.sum()), d)
    ws = [torch.randn(E, d, f), torch.randn(E, d, f), torch.randn(E, f, d)]
    w1, w3, w2 = (w.clone().requires_grad_() for w in ws)
    y = grouped_glu(x, counts, w1, w3, w2, backend)
    r1, r3, r2 = (w.clone().requires_grad_() for w in ws)
    ref, start = [], 0
    for e, c in enumerate(counts.tolist()):
        xe = x[start:start + c]
        ref.append((torch.nn.functional.silu(xe @ r1[e]) * (xe @ r3[e])) @ r2[e])
        start += c
    ref = torch.cat(ref)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    dy = torch.randn(y.shape)
    y.backward(dy)
    ref.backward(dy)
    for w, r in ((w1, r1), (w3, r3), (w2, r2)):
        torch.testing.assert_close(w.grad, r.grad, atol=1e-5, rtol=1e-5)
        assert w.grad[counts == 0].abs().max() == 0  # experts without tokens get an exact zero gradient


# ------------------------------------------------------------------------------------------ router math
def test_bias_steers_selection_not_weights():
    cfg = get_config("tiny", routed_scale=2.5)
    r = _scaled(Router(cfg, cfg.d_model), 0.1)
    x = torch.randn(3, 10, cfg.d_model)
    w0, e0 = r(x)
    r.bias[5] = 10.0  # expert 5 now wins every token's selection
    w1, e1 = r(x)
    assert (e1 == 5).any(-1).all() and not (e0 == 5).any(-1).all()
    s = r.scores(x).reshape(-1, cfg.n_experts)
    g = s.gather(-1, e1)  # the weights are the *unbiased* scores of the chosen experts, normalised
    torch.testing.assert_close(w1, 2.5 * g / g.sum(-1, keepdim=True))
    torch.testing.assert_close(w1.sum(-1), torch.full((30,), 2.5))
    torch.testing.assert_close(w0.sum(-1), torch.full((30,), 2.5))
    # selection = top-k of s + b
    assert torch.equal(e1.sort(-1).values, (s + r.bias).topk(cfg.n_active_experts, -1).indices.sort(-1).values)
    assert torch.equal(r.last_load, torch.bincount(e1.flatten(), minlength=cfg.n_experts))


def test_aux_loss_matches_brute_force():
    cfg = get_config("tiny", balancing="aux_loss", aux_loss_coef=0.01)
    r = _scaled(Router(cfg, cfg.d_model), 0.1)
    x = torch.randn(3, 7, cfg.d_model)
    _, experts = r(x)
    E, k, T = cfg.n_experts, cfg.n_active_experts, 7
    s = r.scores(x)
    experts = experts.view(3, T, k)
    total = 0.0
    for b in range(3):
        for i in range(E):
            f_i = E / (k * T) * sum(int(i in experts[b, t].tolist()) for t in range(T))
            P_i = sum((s[b, t, i] / s[b, t].sum()).item() for t in range(T)) / T
            total += f_i * P_i
    assert r.aux_loss is not None and r.aux_loss.requires_grad
    assert abs(r.aux_loss.item() - 0.01 * total / 3) < 1e-6
    r.eval()
    r(x)
    assert r.aux_loss is None  # only a training-time loss
    r2 = Router(get_config("tiny", balancing="bias"), cfg.d_model)
    r2(x)
    assert r2.aux_loss is None


def test_bias_update_moves_against_load():
    r = _skewed_router("bias", bias_update_rate=0.01)
    loads = torch.zeros(16)
    for seed in range(2):  # accumulates over the forwards since the last update
        r(_skewed_batch(seed, 512))
        loads += r.last_load
    r.update_balancing()
    expected = -0.01 * torch.sign(loads - loads.mean())
    torch.testing.assert_close(r.bias, expected)
    assert (r.bias[:3] < 0).all() and (r.bias[loads < loads.mean()] > 0).all()
    r.update_balancing()  # nothing accumulated since: no change
    torch.testing.assert_close(r.bias, expected)
    r.eval()
    r(_skewed_batch(5, 512))
    r.update_balancing()  # evaluation forwards do not count
    torch.testing.assert_close(r.bias, expected)


def test_quantile_balancing_fixes_a_skewed_router():
    runs = {}
    for mode in ("none", "bias", "quantile", "quantile-exact"):
        r = _skewed_router(mode.split("-")[0], **({"quantile_estimator": "exact"} if "exact" in mode else {}))
        hist = []
        for step in range(8):
            r(_skewed_batch(100 + step))
            hist.append(_imbalance(r.last_load))
            r.update_balancing()
        runs[mode] = hist
    assert runs["none"][0] > 3 and min(runs["none"]) > 3  # the router is skewed and stays so alone
    assert min(runs["bias"]) > 3  # gamma = 1e-3 needs many steps; QB has no step size to tune
    assert max(runs["quantile"][-3:]) < 1.5, runs["quantile"]  # the release's histogram estimator
    assert max(runs["quantile-exact"][-3:]) < 1.5, runs["quantile-exact"]


def test_quantile_update_is_a_fixed_point_of_balance():
    # On one batch, one update must leave each expert chosen by k/n of the tokens *given the old
    # thresholds alpha*: c_j splits column j at q = k*M/n. Margins tie at exactly 0 (each token's (k+1)-th
    # expert), so: at most q strictly above, at least q at or above.
    r = _skewed_router("quantile", quantile_estimator="exact")
    x = _skewed_batch(7)
    r(x)
    u = torch.cat(r._margins)
    c = _column_quantile(u, 2 / 16, r._margin_bound(), r.quantile_bins)
    q = 2048 * 2 // 16
    assert ((u > c).sum(0) <= q).all() and ((u >= c).sum(0) >= q).all()
    assert ((u > c).sum(0) == q).sum() >= 12  # without a tie, exactly q
    assert c[:3].min() >= 0 and c[3:].max() < 0  # overloaded experts go down, the rest up


def test_quantile_biases_do_not_drift_and_routing_ignores_the_centring():
    """Balanced random routing: without centring, every quantile update moved every bias down by about half a
    column's smallest chosen margin (-16 after 2000 steps); a shared shift changes no top-k, so the biases are
    kept at mean 0 and the routing is the uncentred update's."""
    cfg = get_config("tiny", n_experts=8, n_active_experts=2, balancing="quantile", quantile_estimator="exact")
    r = Router(cfg, 64)
    g = torch.Generator().manual_seed(3)
    uncentred = r.bias.clone()
    for step in range(60):
        x = torch.randn(512, 64, generator=g)
        _, chosen = r(x)
        with torch.no_grad():  # the same tokens under the uncentred biases pick the same experts
            s = r.scores(x)
            assert torch.equal((s + uncentred).topk(2, dim=-1).indices.sort(-1).values, chosen.sort(-1).values)
            u = torch.cat(r._margins)
            uncentred -= _column_quantile(u, 2 / 8, r._margin_bound(), r.quantile_bins)
        r.update_balancing()
        assert abs(float(r.bias.mean())) < 1e-6
    assert float(uncentred.mean()) < -0.02  # the drift the centring removes
    assert float(r.bias.abs().max()) < 0.5


def test_histogram_quantile_matches_exact():
    u = torch.randn(4000, 6) * 0.3 + torch.linspace(-0.5, 0.5, 6)
    bound, bins = 2.0, 1024
    exact = _column_quantile(u, 0.125, bound, bins)
    hist = histogram_column_quantile(u, 0.125, bound, bins)
    assert (hist - exact).abs().max() <= 2 * bound / bins
    # the all-reduce path: two "ranks" holding halves of the rows, whose [E, bins] counts are summed as
    # dist.all_reduce(SUM) would, give exactly the one-process histogram answer
    rank1 = {}

    def record(t):
        rank1["hist"] = t.clone()
        return t

    histogram_column_quantile(u[2000:], 0.125, bound, bins, all_reduce=record)
    rank0 = histogram_column_quantile(u[:2000], 0.125, bound, bins, all_reduce=lambda t: t + rank1["hist"])
    torch.testing.assert_close(rank0, hist)


# ------------------------------------------------------------------------------------------ MoE module
def _expected_params(cfg):
    d, l, E, f = cfg.d_model, cfg.latent_dim, cfg.n_experts, cfg.expert_ffn
    n = E * d + 3 * E * l * f + 3 * d * cfg.n_shared_experts * cfg.shared_ffn
    latent_norm = l if cfg.latent_moe_use_norm else 0
    return n + (2 * d * l + latent_norm if cfg.moe == "latent" else 0)


@pytest.mark.parametrize("moe", ["latent", "standard"])
def test_shapes_and_parameter_counts(moe):
    cfg = get_config("tiny", moe=moe)
    m = MoE(cfg)
    assert m.dispatch_dim == (cfg.moe_latent_dim if moe == "latent" else cfg.d_model)
    assert m.experts.w1.shape == (cfg.n_experts, m.dispatch_dim, cfg.expert_ffn)
    assert m.experts.w2.shape == (cfg.n_experts, cfg.expert_ffn, m.dispatch_dim)
    assert sum(p.numel() for p in m.parameters()) == _expected_params(cfg)
    assert hasattr(m, "w_down") == (moe == "latent")
    y = m(torch.randn(2, 5, cfg.d_model))
    assert y.shape == (2, 5, cfg.d_model)


def test_full_size_counts_on_meta():
    cfg = get_config("k3")
    with torch.device("meta"):
        m = MoE(cfg)
    assert sum(p.numel() for p in m.parameters()) == _expected_params(cfg)
    assert m.dispatch_dim == 3584 and m.router.bias.shape == (896,)
    assert "bias" not in dict(m.router.named_parameters())  # a buffer: no optimizer ever sees it


def test_shared_expert_on_every_token():
    cfg = get_config("tiny")
    m = _scaled(MoE(cfg))
    x = torch.randn(2, 9, cfg.d_model)
    with torch.no_grad():
        m.experts.w2.zero_()  # routed path off: what is left is the shared expert, on every token
        y = m(x)
    torch.testing.assert_close(y, m.shared(x))
    assert (y.abs().sum(-1) > 0).all()
    m0 = MoE(get_config("tiny", n_shared_experts=0))
    assert m0.shared is None
    with torch.no_grad():
        m0.experts.w2.zero_()
        assert m0(x).abs().max() == 0


def test_shared_experts_fuse_into_one_swiglu():
    cfg = get_config("tiny", n_shared_experts=2, shared_ffn=16)
    m = MoE(cfg)
    assert isinstance(m.shared, GatedMLP) and m.shared.w1.weight.shape == (32, cfg.d_model)


def test_errors_name_the_expected_shape():
    """The layers trust their caller: K3Model.forward names a bad input; the knobs a user sets are checked."""
    from k3.model.transformer import K3Model

    cfg = get_config("tiny")
    model = K3Model(cfg)
    for bad, match in ((torch.zeros(4, dtype=torch.long), r"integer tensor \[B, T\]"), (torch.zeros(1, 4), "integer tensor"),
                       ([[0] * 4], "integer tensor"), (torch.tensor([[0, cfg.vocab_size]]), "outside the vocabulary")):
        with pytest.raises(ValueError, match=match):  # ids outside the vocabulary would route nothing sensible
            model(bad)
    m = MoE(cfg)
    with pytest.raises(ValueError, match="impl"):
        m.impl = "fast"
    with pytest.raises(RuntimeError, match="dtype"):  # fp64 tokens in fp32 layers: torch's own error
        m(torch.randn(1, 4, cfg.d_model, dtype=torch.float64))
    ex = RoutedExperts(4, 8, 16)
    ids, w = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    ex.impl = "fast"
    with pytest.raises(ValueError, match=r"RoutedExperts.impl = 'fast' is unknown"):
        ex(torch.randn(3, 8), w, ids)
    ex.impl = "grouped"
    ffn = GatedMLP(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ffn(torch.randn(3, 8).bfloat16()).shape == (3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # under autocast, bf16 tokens meet fp32 weights legitimately
        assert ex(torch.randn(3, 8).bfloat16(), w, ids).shape == (3, 8)
    with pytest.raises(ValueError, match="backend"):
        grouped_glu(torch.randn(2, 8), torch.tensor([1, 1, 0, 0]), ex.w1, ex.w3, ex.w2, "cuda_magic")


@pytest.mark.parametrize("impl,backend", [("naive", None), ("loop", None), ("grouped", "slices"), ("grouped", "bmm")])
def test_no_tokens_give_zero_gradients_not_none(impl, backend):
    """N = 0 (a rank whose batch routes nothing here): the output stays in the graph, so backward runs and every
    expert weight gets a zero gradient (some paths returned a fresh tensor and backward raised)."""
    ex = RoutedExperts(4, 8, 16)
    ex.impl = impl
    if backend:
        ex.backend = backend
    x = torch.randn(0, 8, requires_grad=True)
    y = ex(x, torch.ones(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert y.shape == (0, 8)
    y.sum().backward()
    assert all(w.grad is not None and not w.grad.any() for w in (ex.w1, ex.w3, ex.w2))


def test_grouped_mm_takes_bf16_tokens_with_fp32_weights():
    """Under autocast the tokens reach the experts in bf16 while the weights stay fp32 parameters:
    the grouped_mm backend casts the weights (as autocast would) instead of failing on mixed dtypes."""
    from k3.model.moe import grouped_glu

    torch.manual_seed(0)
    x = torch.randn(10, 16).bfloat16()
    w1, w3, w2 = torch.randn(3, 16, 8), torch.randn(3, 16, 8), torch.randn(3, 8, 16)
    counts = torch.tensor([3, 0, 7])
    got = grouped_glu(x, counts, w1, w3, w2, "grouped_mm")
    want = grouped_glu(x, counts, w1.bfloat16(), w3.bfloat16(), w2.bfloat16(), "slices")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def test_router_scores_stay_fp32_under_autocast():
    """Autocast would run the router's fp32 matmul in bf16 again (on CUDA, and on CPU as here): the scores, and
    so the top-k choice between close experts, must not depend on it."""
    torch.manual_seed(0)
    r = Router(get_config("tiny"), 64)
    x = torch.randn(256, 64)
    plain = r.scores(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = r.scores(x.bfloat16())
        assert torch.nn.functional.linear(x, r.weight).dtype == torch.bfloat16  # autocast is really on here
    assert auto.dtype == torch.float32
    assert torch.equal(auto, r.scores(x.bfloat16().float()))
    assert not torch.equal(plain, auto)  # the inputs were bf16; only they differ, not the matmul's precision


def test_no_grad_forwards_do_not_steer_the_balance():
    # a model left in train mode and run under no_grad (a rollout, a probe) is not a training step
    cfg = get_config("tiny", balancing="bias")
    m = MoE(cfg).train()
    x = torch.randn(2, 16, cfg.d_model)
    with torch.no_grad():
        m(x)
    m.router.update_balancing()
    assert torch.count_nonzero(m.router.bias) == 0
    m(x).sum().backward()  # a training forward does
    m.router.update_balancing()
    assert torch.count_nonzero(m.router.bias) > 0


@pytest.mark.parametrize("balancing", ["bias", "quantile", "aux_loss"])
def test_padding_under_balancing_token_mask_does_not_steer_the_balance(balancing):
    """Two sequences of 5 and 9 real tokens, right-padded to 12 with one repeated padding vector (as a padding
    token embeds): under `balancing_token_mask` the router's statistics are those of the real tokens alone."""
    from k3.model.moe import balancing_token_mask

    torch.manual_seed(0)
    cfg = get_config("tiny", balancing=balancing, aux_loss_coef=0.01)
    r = _scaled(Router(cfg, cfg.d_model), 0.1)
    lengths, T = (5, 9), 12
    real = [torch.randn(n, cfg.d_model) for n in lengths]
    pad = torch.randn(cfg.d_model)
    x = torch.stack([torch.cat([s, pad.expand(T - len(s), -1)]) for s in real])
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]

    def stats(run):
        r.bias.zero_()
        if hasattr(r, "qb_bounds"):  # the histogram's range follows the bias
            r.qb_bounds.copy_(torch.tensor([-1.0, 1.0]))
        run()
        out = (r.last_load.clone(), None if r.aux_loss is None else r.aux_loss.detach().clone())
        r.update_balancing()
        return (*out, r.bias.clone())

    with torch.enable_grad():
        def padded():
            with balancing_token_mask(r, mask):
                r(x)
        want_loads, want_aux, want_bias = [], [], None

        def separately():  # each real sequence alone: the statistics padding must not change
            for s in real:
                r(s[None])
                want_loads.append(r.last_load.clone())
                if r.aux_loss is not None:
                    want_aux.append(r.aux_loss.detach().clone())
        load, aux, bias = stats(padded)
        _, _, want_bias = stats(separately)
        unmasked_load, _, unmasked_bias = stats(lambda: r(x))
    assert torch.equal(load, sum(want_loads))
    assert not torch.equal(unmasked_load, load)  # the padding rows would have counted
    if balancing == "aux_loss":
        torch.testing.assert_close(aux, torch.stack(want_aux).mean())
    else:
        torch.testing.assert_close(bias, want_bias)
        assert not torch.equal(unmasked_bias, bias) or balancing == "bias"
    with pytest.raises(AssertionError, match="shape"):  # the training loops pass the batch's own mask
        with balancing_token_mask(r, mask[:, :5]):
            r(x)


def test_cpu_backend_follows_the_rows_per_expert():
    """CPU fp32: torch._grouped_mm while the experts get few rows each (the per-expert loop's overhead shows there),
    the slices loop once their matmuls dominate; the threshold scales with the threads. CUDA keeps grouped_mm for
    bf16 only; torch.compile and CPU autocast get the slices (no _grouped_mm rule there for what they pass), and so
    do widths that are not a multiple of 16 bytes, which torch._grouped_mm refuses."""
    from k3.model.moe import CPU_GROUPED_MM_ROWS_PER_THREAD, _grouped_backend

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not in this torch")
    counts = torch.ones(64, dtype=torch.long)
    w1, w2 = torch.zeros(64, 4, 8), torch.zeros(64, 8, 4)
    threads = torch.get_num_threads()
    limit = CPU_GROUPED_MM_ROWS_PER_THREAD * threads * 64
    assert _grouped_backend(torch.zeros(limit, 4), counts, w1, w2) == "grouped_mm"
    assert _grouped_backend(torch.zeros(limit + 1, 4), counts, w1, w2) == "slices"
    assert _grouped_backend(torch.zeros(limit, 4, dtype=torch.float64), counts, w1, w2) == "slices"
    torch.set_num_threads(threads + 1)
    try:
        assert _grouped_backend(torch.zeros(limit + 1, 4), counts, w1, w2) == "grouped_mm"
    finally:
        torch.set_num_threads(threads)
    assert _grouped_backend(torch.zeros(1, 4, device="meta"), counts, w1, w2) == "slices"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _grouped_backend(torch.zeros(limit, 4), counts, w1, w2) == "slices"
    for x, a, b in ((torch.zeros(limit, 3), torch.zeros(64, 3, 8), torch.zeros(64, 8, 3)),  # dim 3
                    (torch.zeros(limit, 4), torch.zeros(64, 4, 6), w2)):                  # ffn 6
        assert _grouped_backend(x, counts, a, b) == "slices"


@pytest.mark.parametrize("dim,ffn", [(30, 32), (32, 30), (5, 7)])
def test_experts_of_widths_grouped_mm_refuses_run_on_the_slices(dim, ffn):
    """A width that is not a multiple of 4 fp32 values: torch._grouped_mm refuses such rows, so 'auto' takes the
    slices (a model with expert_ffn 30, or the ablation's FLOP-matched standard MoE at width 43, crashed at small
    steps); asking for grouped_mm by name says what to change."""
    from k3.model.moe import grouped_glu

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, dim, generator=g, requires_grad=True)
    w1, w3 = (torch.randn(4, dim, ffn, generator=g, requires_grad=True) for _ in range(2))
    w2 = torch.randn(4, ffn, dim, generator=g, requires_grad=True)
    auto = grouped_glu(x, counts, w1, w3, w2)
    auto.square().sum().backward()
    assert torch.equal(auto, grouped_glu(x, counts, w1, w3, w2, backend="slices"))
    assert x.grad is not None and torch.isfinite(w1.grad).all()
    if hasattr(torch, "_grouped_mm"):
        with pytest.raises(ValueError, match="multiple of 4.*'slices'"):
            grouped_glu(x, counts, w1, w3, w2, backend="grouped_mm")


def test_cpu_autocast_runs_the_experts_from_fp32_inputs():
    """Under CPU bf16 autocast an fp32 x reaching the experts (a direct caller) is cast by autocast; 'auto' takes the
    slices there (torch._grouped_mm's backward failed with an unrelated stride message)."""
    from k3.model.moe import grouped_glu

    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 4, 1])
    x = torch.randn(8, 16, generator=g, requires_grad=True)
    w1, w3 = (torch.randn(4, 16, 32, generator=g, requires_grad=True) for _ in range(2))
    w2 = torch.randn(4, 32, 16, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_glu(x, counts, w1, w3, w2)
    out.float().sum().backward()
    want = grouped_glu(x, counts, w1, w3, w2, backend="slices")
    assert out.shape == (8, 16) and ((out.float() - want).norm() / want.norm()).item() < 0.02  # bf16 rounding
    assert x.grad is not None and torch.isfinite(w2.grad).all()


def test_cpu_autocast_keeps_the_routed_experts_fp32():
    """Under CPU bf16 autocast the routed experts run in fp32 (the per-step weight casts cost more than bf16 saves
    at these sizes): the output and gradients equal the fp32 path's on the same (bf16-rounded) input, bit for bit."""
    g = torch.Generator().manual_seed(2)
    ex = RoutedExperts(4, 16, 32)
    x = torch.randn(6, 16, generator=g).bfloat16()
    w = torch.rand(6, 2, generator=g)
    ids = torch.randint(0, 4, (6, 2), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ex(x, w, ids)
    got.sum().backward()
    grads = [p.grad.clone() for p in (ex.w1, ex.w3, ex.w2)]
    ex.zero_grad()
    want = ex(x.float(), w, ids)
    want.sum().backward()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, (ex.w1, ex.w3, ex.w2)))
