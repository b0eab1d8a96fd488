"""KimiDeltaAttention layer: cache continuity, a reference built from fla's pieces, gradients, errors."""
import pytest
import torch
import torch.nn.functional as F

from k3.config import get_config
from k3.model.cache import KDACache
from k3.model.kda import KimiDeltaAttention
from k3.model.transformer import K3Model

import fla.ops.kda.naive as fla_naive  # noqa: E402  (the reference; a dev dependency)
import fla.ops.kda.gate as fla_gate  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny ops: with 2 threads on a shared 2-core box each parallel region can stall ~12 ms (seen here:
    the same test took 0.2 s on 1 thread and 5 s on 2). Correctness does not depend on the thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel_err(a, ref):
    return ((a - ref).abs().max() / ref.abs().max()).item()


FORMS = {"k3": {}, "kimi-linear": dict(gate_lower_bound=None, use_full_rank_gate=False),
         "k3-earlier": dict(gate_lower_bound=None, use_full_rank_gate=False, kda_gate_bias=True)}


@pytest.fixture(params=list(FORMS))
def layer(request):
    torch.manual_seed(0)
    cfg = get_config("tiny", kda_heads=2, kda_head_dim=16, kda_gate_rank=8, d_model=32, **FORMS[request.param])
    m = KimiDeltaAttention(cfg, layer_idx=0)
    with torch.no_grad():                                   # livelier than the 0.02 init, so errors show
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def reference_forward(m: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """Written separately from the layer: per-projection convs, fla's gate and fla's naive recurrence."""
    B, T, _ = x.shape
    H, K, W = m.n_heads, m.head_dim, m.conv_size
    outs = []
    for i, proj in enumerate((m.q_proj, m.k_proj, m.v_proj)):
        w = m.conv_weight[i * H * K:(i + 1) * H * K]
        y = F.conv1d(F.pad(proj(x).transpose(1, 2), (W - 1, 0)), w, groups=H * K)
        outs.append(F.silu(y).transpose(1, 2).reshape(B, T, H, K))
    q, k, v = outs
    q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    f = m.alpha_up(m.alpha_down(x)).view(B, T, H, K)
    if m.config.gate_lower_bound is None:
        g = fla_gate.naive_kda_gate(f, m.A_log, m.dt_bias)
    else:
        g = fla_gate.naive_kda_lowerbound_gate(f, m.A_log, m.dt_bias, lower_bound=m.config.gate_lower_bound)
    beta = m.beta_proj(x).sigmoid()
    o, _ = fla_naive.naive_recurrent_kda(q, k, v, g, beta)
    gate = m.g_proj(x) if m.config.use_full_rank_gate else m.gate_up(m.gate_down(x))
    o = F.rms_norm(o, (K,), m.norm_weight, eps=m.eps) * gate.view(B, T, H, K).sigmoid()
    return m.o_proj(o.reshape(B, T, H * K))


@pytest.mark.parametrize("T", [5, 70])                      # recurrent and chunk dispatch
def test_matches_reference(layer, T):
    x = torch.randn(2, T, 32)
    assert rel_err(layer(x), reference_forward(layer, x)) < 1e-5


def test_prefill_then_decode_equals_full_forward(layer):
    x = torch.randn(2, 45, 32)
    full = layer(x)
    cache = KDACache()
    steps = [layer(x[:, :37], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(37, 45)]
    assert rel_err(torch.cat(steps, dim=1), full) < 1e-5
    assert cache.state.shape == (2, 2, 16, 16) and cache.state.dtype == torch.float32
    assert cache.conv_state.shape == (2, 3 * 2 * 16, layer.conv_size - 1)


@pytest.mark.parametrize("split", [2, 20, 64])              # inside the conv window, short, chunk boundary
def test_split_prefill_equals_full_forward(layer, split):
    x = torch.randn(1, 90, 32)
    cache = KDACache()
    parts = torch.cat([layer(x[:, :split], cache=cache), layer(x[:, split:], cache=cache)], dim=1)
    assert rel_err(parts, layer(x)) < 1e-5


def test_cache_slot_is_filled_in_place(layer):
    cache = KDACache()
    layer(torch.randn(1, 3, 32), cache=cache)
    first = cache.state
    layer(torch.randn(1, 1, 32), cache=cache)
    assert cache.state is not first and not torch.equal(cache.state, first)


def test_gradients_reach_every_parameter(layer):
    x = torch.randn(2, 70, 32, requires_grad=True)
    layer(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_bad_inputs_are_named_where_they_enter_the_model(layer):
    """The layer trusts its caller: K3Model.forward names a bad input or a cache of another batch."""
    m = K3Model(get_config("tiny", layer_pattern="KKKK")).eval()
    for bad in (torch.zeros(4, dtype=torch.long), torch.zeros(1, 1, 4, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"integer tensor \[B, T\]"):
            m(bad)
    for bad in (torch.zeros(1, 4), [[0] * 4]):  # float ids, or not a tensor
        with pytest.raises(ValueError, match="integer tensor"):
            m(bad)
    for bad in (torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long)):  # empty
        with pytest.raises(ValueError, match=r"\[B, T\] with B, T >= 1"):
            m(bad)
    cache = m.new_cache()
    m(torch.zeros(2, 4, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"cache slot 0 \(KDACache.conv_state\).*a batch of 1"):
        m(torch.zeros(1, 1, dtype=torch.long), cache)                      # batch changed mid-stream
    with pytest.raises(RuntimeError, match="dtype"):                       # an fp64 x in an fp32 layer: torch's error
        layer(torch.randn(1, 4, 32, dtype=torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # under autocast the matmuls cast for themselves
        assert layer(torch.randn(1, 20, 32).bfloat16()).shape == (1, 20, 32)


def test_bounded_gate_lies_in_its_bounds_and_matches_fla():
    torch.manual_seed(0)
    m = KimiDeltaAttention(get_config("tiny", gate_lower_bound=-3.0))
    x = 30 * torch.randn(2, 9, m.config.d_model)  # saturating inputs: the gate must stay inside (-3, 0]
    g = m.forget_gate(x)
    assert g.min() >= -3.0 and g.max() <= 0.0 and g.dtype == torch.float32
    f = m.alpha_up(m.alpha_down(x)).view(2, 9, m.n_heads, m.head_dim)
    ref = fla_gate.naive_kda_lowerbound_gate(f, m.A_log, m.dt_bias, lower_bound=-3.0)
    assert torch.equal(g, ref) or rel_err(g, ref) < 1e-6
    unbounded = KimiDeltaAttention(get_config("tiny", gate_lower_bound=None))
    assert unbounded.forget_gate(x).min() < -3.0  # Kimi-Linear's softplus gate has no floor


def test_init_and_meta_construction():
    cfg = get_config("tiny", gate_lower_bound=None, use_full_rank_gate=False)
    m = KimiDeltaAttention(cfg)
    A = m.A_log.exp()
    assert ((A >= 1) & (A <= 16)).all() and torch.equal(m.dt_bias, torch.zeros_like(m.dt_bias))
    assert abs(m.q_proj.weight.std().item() - cfg.init_std) < 0.2 * cfg.init_std
    bounded = KimiDeltaAttention(get_config("tiny"))  # fla / glm5_next's init: A_log 0, dt = softplus(dt_bias)
    dt = torch.nn.functional.softplus(bounded.dt_bias)
    assert torch.equal(bounded.A_log, torch.zeros_like(bounded.A_log)) and dt.min() >= 1e-3 * 0.99 and dt.max() <= 0.1 * 1.01
    k3 = get_config("k3")
    with torch.device("meta"):
        big = KimiDeltaAttention(k3)
    H, K, d, r, W = k3.kda_heads, k3.kda_head_dim, k3.d_model, k3.kda_gate_rank, k3.kda_conv_size
    qkv, conv, gates = 3 * d * H * K, 3 * H * K * W, (d * r + r * H * K) + d * H * K   # f_a, f_b; full-rank g_proj
    A_log, dt_bias, beta, norm, out = H, H * K, d * H, K, H * K * d
    expected = qkv + conv + gates + A_log + dt_bias + beta + norm + out
    assert sum(p.numel() for p in big.parameters()) == expected
