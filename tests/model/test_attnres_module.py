"""AttnRes module: the protocol, the paper's source sets (Eq. 6), impl equivalence, decode, metrics, errors."""
import dataclasses
import math

import pytest
import torch

from k3.config import K3Config
from k3.model import attnres as attnres_module
from k3.model.attnres import AttnRes, AttnResState
from k3.ops.attnres import attnres_mix

D = 16


def make_config(n_layers=5, sources=4, mode="block"):
    # n_layers 5, 3 blocks -> block_size ceil(5/3) = 2 layers: blocks of 2, 2 and 1 layers (short last block)
    return K3Config(d_model=D, n_layers=n_layers, attnres_sources=sources, attnres=mode, moe_latent_dim=8)


def make_sublayers(n, seed=1):
    """Token-wise stand-ins for the mixers: y = tanh(h W_j), so every h feeds the later sources."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(D, D, generator=gen) / math.sqrt(D)).requires_grad_() for _ in range(n)]


def randomise(module, seed=2):
    """As after some training: queries away from zero, key-norm weights away from one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q, g in zip(module.pseudo_query, module.key_norm):
            q.copy_(torch.randn(D, generator=gen))
            g.copy_(1 + 0.3 * torch.randn(D, generator=gen))


def run(module, emb, weights):
    """The transformer loop of the model, with sublayer j replaced by y_j = tanh(h_j W_j)."""
    state = module.start(emb)
    hs, ys = [], []
    for i in range(module.n_layers):
        for j in (2 * i, 2 * i + 1):
            h = module.mix(state, j)
            y = torch.tanh(h @ weights[j])
            module.push(state, j, y)
            hs.append(h)
            ys.append(y)
    return hs, ys, module.final(state)


def pair(config, seed=2):
    a = AttnRes(config, impl="blockwise")
    if config.attnres != "none":
        randomise(a, seed)
    b = AttnRes(config, impl="naive")
    b.load_state_dict(a.state_dict())
    return a, b


# ---------------------------------------------------------------------- semantics
def test_none_is_exactly_the_plain_residual_stream():
    module = AttnRes(make_config(mode="none"))
    assert list(module.parameters()) == []
    emb, weights = torch.randn(2, 3, D), make_sublayers(10)
    hs, ys, final = run(module, emb, weights)
    x = emb
    for j in range(10):
        assert torch.equal(hs[j], x), j
        x = x + torch.tanh(x @ weights[j])
    assert torch.equal(final, x)


@pytest.mark.parametrize("impl", ["blockwise", "naive"])
@pytest.mark.parametrize("n_layers,sources", [(5, 4), (4, 2), (3, 4), (6, 4)])
def test_block_mode_uses_the_source_sets_of_eq6(impl, n_layers, sources):
    """Reference built from the paper directly: block n's first sublayer sees [b_0 .. b_{n-1}], later
    sublayers also b_n^{i-1}; the final mix sees [b_0, b_1, .., b_N]. Queries and norms are random."""
    config = make_config(n_layers, sources)
    module = AttnRes(config, impl=impl)
    randomise(module)
    P = 2 * config.attnres_block_size
    emb, weights = torch.randn(2, 3, D), make_sublayers(2 * n_layers)
    hs, _, final = run(module, emb, weights)

    q, g = list(module.pseudo_query), list(module.key_norm)
    outs = []
    for j in range(2 * n_layers):
        n, i = divmod(j, P)
        blocks = [sum(outs[k * P:(k + 1) * P]) for k in range(n)]
        sources_j = [emb] + blocks + ([sum(outs[n * P:j])] if i else [])
        assert len(sources_j) == module.n_sources(j)
        h_ref, _ = attnres_mix(torch.stack(sources_j), q[j], g[j], config.norm_eps)
        torch.testing.assert_close(hs[j], h_ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"sublayer {j}: {m}")
        outs.append(torch.tanh(h_ref @ weights[j]))
    all_blocks = [sum(outs[k:k + P]) for k in range(0, 2 * n_layers, P)]
    h_ref, _ = attnres_mix(torch.stack([emb] + all_blocks), q[-1], g[-1], config.norm_eps)
    torch.testing.assert_close(final, h_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["blockwise", "naive"])
def test_full_mode_has_one_source_per_sublayer(impl):
    config = make_config(5, 4, mode="full")
    module = AttnRes(config, impl=impl)
    randomise(module)
    emb, weights = torch.randn(2, 3, D), make_sublayers(10)
    hs, _, final = run(module, emb, weights)
    q, g = list(module.pseudo_query), list(module.key_norm)
    outs = []
    for j in range(10):
        h_ref, _ = attnres_mix(torch.stack([emb] + outs), q[j], g[j], config.norm_eps)
        torch.testing.assert_close(hs[j], h_ref, atol=1e-5, rtol=1e-5)
        outs.append(torch.tanh(h_ref @ weights[j]))
    h_ref, _ = attnres_mix(torch.stack([emb] + outs), q[10], g[10], config.norm_eps)
    torch.testing.assert_close(final, h_ref, atol=1e-5, rtol=1e-5)


def test_source_counts_follow_the_paper():
    block = AttnRes(make_config(5, 4))  # 4 sublayers per block: blocks {0..3}, {4..7}, {8, 9}
    assert [block.n_sources(j) for j in range(11)] == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4]
    full = AttnRes(make_config(5, 4, mode="full"))
    assert [full.n_sources(j) for j in range(11)] == list(range(1, 12))
    assert block.n_blocks == 3 and block.block_size == 2


def test_first_sublayer_of_a_block_sees_no_empty_partial_sum():
    """Zero queries: sublayer 4 (first of block 2) is the mean of [emb, b_1], not of [emb, b_1, 0]."""
    module = AttnRes(make_config(5, 4))
    emb, weights = torch.randn(2, 3, D), make_sublayers(10)
    hs, ys, _ = run(module, emb, weights)
    b1 = ys[0] + ys[1] + ys[2] + ys[3]
    torch.testing.assert_close(hs[4], (emb + b1) / 2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hs[5], (emb + b1 + ys[4]) / 3, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hs[0], emb)


def test_full_and_block_agree_only_on_the_first_two_sublayers():
    """Both see [emb] and then [emb, y_0]; from sublayer 2 on, block sums y_0 + y_1 into one source."""
    block, full = AttnRes(make_config(5, 4)), AttnRes(make_config(5, 4, mode="full"))
    randomise(block)
    full.load_state_dict(block.state_dict())
    emb, weights = torch.randn(2, 3, D), make_sublayers(10)
    hs_b, _, _ = run(block, emb, weights)
    hs_f, _, _ = run(full, emb, weights)
    torch.testing.assert_close(hs_b[0], hs_f[0])
    torch.testing.assert_close(hs_b[1], hs_f[1])
    assert (hs_b[2] - hs_f[2]).abs().max() > 1e-3


# ---------------------------------------------------------------------- blockwise == naive
def assert_scaled_close(a, b, tol, what):
    """max |a - b| <= tol * max(1, max |b|): fp32 gradients here reach ~10 after 14 sublayers."""
    err, scale = (a - b).abs().max().item(), max(1.0, b.abs().max().item())
    assert err <= tol * scale, f"{what}: max abs diff {err:.3g} > {tol} * {scale:.3g}"


@pytest.mark.parametrize("dtype,tol,grad_tol", [(torch.float32, 1e-5, 5e-5), (torch.float64, 1e-10, 1e-10)])
@pytest.mark.parametrize("mode", ["block", "full"])
@pytest.mark.parametrize("n_layers,sources", [(5, 4), (4, 2), (3, 4), (7, 3)])
def test_blockwise_equals_naive_forward_and_backward(mode, n_layers, sources, dtype, tol, grad_tol):
    """Outputs: fp32 to 1e-5 of each tensor's scale; fp64 to 1e-10, which shows the two forms are the same
    algebra and the fp32 differences are rounding accumulated over the depth of the chain. fp32 gradients
    go through that chain forward and back: on some CPUs they differ by up to 1.5e-5 of their scale after
    14 sublayers (the kernels' summation order varies with the instruction set), so they get 5e-5; in fp64
    they match to 1e-10 like the outputs."""
    a, b = pair(make_config(n_layers, sources, mode))
    a.to(dtype)
    b.to(dtype)
    emb = torch.randn(2, 4, D, dtype=dtype)
    results = []
    for module in (a, b):
        e = emb.clone().requires_grad_()
        weights = [w.detach().to(dtype).requires_grad_() for w in make_sublayers(2 * n_layers)]
        hs, _, final = run(module, e, weights)
        loss = (final * torch.linspace(-1, 1, D, dtype=dtype)).sum() + sum((h ** 2).mean() for h in hs)
        leaves = [e, *weights, *module.parameters()]
        results.append((torch.stack(hs + [final]).detach(), torch.autograd.grad(loss, leaves)))
    (out_a, grads_a), (out_b, grads_b) = results
    assert out_a.dtype == dtype
    assert_scaled_close(out_a, out_b, tol, "outputs")
    for k, (ga, gb) in enumerate(zip(grads_a, grads_b)):
        assert_scaled_close(ga, gb, grad_tol, f"grad of leaf {k}")


def test_blockwise_runs_phase1_once_per_block(monkeypatch):
    calls = []
    real = attnres_module.phase1

    def counting(sources, queries, *args, **kwargs):
        calls.append((sources.shape[0], queries.shape[0]))
        return real(sources, queries, *args, **kwargs)

    monkeypatch.setattr(attnres_module, "phase1", counting)
    module = AttnRes(make_config(5, 4))
    run(module, torch.randn(1, 2, D), make_sublayers(10))
    # (completed sources, queries): block 1 sees [emb], block 2 [emb, b1], block 3 (one layer) [emb, b1, b2]
    assert calls == [(1, 4), (2, 4), (3, 2)]


# ---------------------------------------------------------------------- init, decode, metrics
@pytest.mark.parametrize("mode", ["block", "full"])
@pytest.mark.parametrize("impl", ["blockwise", "naive"])
def test_zero_init_queries_give_a_uniform_mix(mode, impl):
    module = AttnRes(make_config(5, 4, mode), impl=impl)
    assert all(torch.equal(q, torch.zeros(D)) for q in module.pseudo_query)
    assert all(torch.equal(g, torch.ones(D)) for g in module.key_norm)
    module.record_weights = True
    run(module, torch.randn(2, 3, D), make_sublayers(10))
    entropy = module.entropy()
    assert sorted(module.last_weights) == list(range(11)) == sorted(entropy)
    for j, w in module.last_weights.items():
        n = module.n_sources(j)
        torch.testing.assert_close(w, torch.full((n,), 1 / n), atol=1e-6, rtol=0)
        assert entropy[j] == pytest.approx(math.log(n), abs=1e-5)


@pytest.mark.parametrize("mode", ["block", "full", "none"])
def test_single_token_decode_matches_the_whole_sequence(mode):
    """AttnRes mixes over depth per token: running tokens one at a time (T = 1) changes nothing."""
    module, _ = pair(make_config(5, 4, mode))
    emb, weights = torch.randn(2, 4, D), make_sublayers(10)
    hs, _, final = run(module, emb, weights)
    for t in range(4):
        hs_t, _, final_t = run(module, emb[:, t:t + 1], weights)
        assert final_t.shape == (2, 1, D)
        torch.testing.assert_close(final_t, final[:, t:t + 1], atol=1e-5, rtol=1e-5)
        for j in range(10):
            torch.testing.assert_close(hs_t[j], hs[j][:, t:t + 1], atol=1e-5, rtol=1e-5)


def test_recorded_weights_and_entropy_after_training_like_change():
    a, b = pair(make_config(5, 4))
    emb, weights = torch.randn(2, 3, D), make_sublayers(10)
    run(a, emb, weights)
    assert a.last_weights == {} and a.entropy() == {}  # recording is off by default
    for m in (a, b):
        m.record_weights = True
        run(m, emb, weights)
    for j in range(11):
        wa, wb = a.last_weights[j], b.last_weights[j]
        assert wa.shape == (a.n_sources(j),) and not wa.requires_grad
        torch.testing.assert_close(wa.sum(), torch.tensor(1.0))
        torch.testing.assert_close(wa, wb, atol=1e-5, rtol=1e-5)
        assert 0.0 <= a.entropy()[j] <= math.log(a.n_sources(j)) + 1e-6
        assert a.entropy()[j] == pytest.approx(b.entropy()[j], abs=1e-5)
    # random queries are no longer uniform somewhere
    assert any(a.entropy()[j] < math.log(a.n_sources(j)) - 1e-3 for j in range(1, 11))


def test_parameters_one_query_and_one_key_norm_per_operation():
    config = make_config(5, 4)
    module = AttnRes(config)
    assert sum(p.numel() for p in module.parameters()) == 2 * (2 * 5 + 1) * D
    assert all(p.dim() == 1 for p in module.parameters())
    randomise(module)
    module.reset_parameters()
    assert all(torch.equal(q, torch.zeros(D)) for q in module.pseudo_query)
    assert all(torch.equal(g, torch.ones(D)) for g in module.key_norm)


def test_state_is_a_small_dataclass():
    module = AttnRes(make_config())
    state = module.start(torch.randn(1, 2, D))
    assert isinstance(state, AttnResState) and dataclasses.is_dataclass(state)


# ---------------------------------------------------------------------- errors
def test_bad_input_raises_value_error_naming_the_shape():
    """Inputs are named where they enter the model (K3Model.forward); inside, AttnRes asserts its protocol."""
    from k3.config import get_config
    from k3.model.accounting import pipeline_sources
    from k3.model.transformer import K3Model

    model = K3Model(get_config("tiny"))
    with pytest.raises(ValueError, match=r"integer tensor \[B, T\]"):  # AttnRes.start would see [2, 3, 4, D]
        model(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"integer tensor \[B, T\]"):  # or a float embedding of floats
        model(torch.zeros(2, 3))
    module = AttnRes(make_config())
    state = module.start(torch.randn(2, 3, D))
    with pytest.raises(AssertionError, match=r"out of order"):
        module.mix(state, 1)
    module.mix(state, 0)
    with pytest.raises(AssertionError, match=r"sublayer 0\) expects y in the stream's dtype torch.float32, got torch.int64"):
        module.push(state, 0, torch.zeros(2, 3, D, dtype=torch.long))
    with pytest.raises(AssertionError, match=r"\[B, T, D\] = \[2, 3, 16\], got \[2, 3, 8\]"):
        module.push(state, 0, torch.randn(2, 3, 8))
    with pytest.raises(AssertionError, match=r"sublayer 0\) expects y in the stream's dtype torch.float32, got torch.float64"):
        module.push(state, 0, torch.randn(2, 3, D, dtype=torch.float64))  # it passed, and final() came out fp64
    module.push(state, 0, torch.randn(2, 3, D))
    with pytest.raises(AssertionError, match=r"out of order"):
        module.push(state, 0, torch.randn(2, 3, D))
    with pytest.raises(AssertionError, match=r"after 1 of 10"):
        module.final(state)
    with pytest.raises(AssertionError, match=r"AttnResState"):
        module.mix(None, 0)
    with pytest.raises(AssertionError, match=r"impl"):
        AttnRes(make_config(), impl="fast")
    with pytest.raises(ValueError, match=r"before layer 1 \.\. 4, got 5"):  # n_sources of a sublayer past the end
        pipeline_sources(make_config(), 5)
