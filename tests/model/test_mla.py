"""GatedMLA: naive vs absorbed vs a loop reference, cached decode vs full forward, gate, QK-Clip logits."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from k3.config import get_config
from k3.model.cache import MLACache
from k3.model.mla import GatedMLA

# unequal head dims and ranks so a mixed-up K / V / C split cannot pass by accident
DIMS = dict(mla_heads=4, mla_qk_head_dim=16, mla_v_head_dim=24, mla_kv_lora_rank=20, mla_q_lora_rank=12,
            qk_rope_head_dim=6)
TOL = dict(atol=1e-5, rtol=1e-5)


def make(**overrides) -> GatedMLA:
    """A layer with O(1) logits: the 0.02 init makes attention near uniform and every tolerance vacuous."""
    m = GatedMLA(get_config("tiny", **{**DIMS, **overrides}))
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.Linear):
                mod.weight.normal_(0.0, 1.5 / math.sqrt(mod.in_features))
            elif isinstance(mod, nn.RMSNorm):
                mod.weight.uniform_(0.5, 1.5)
    return m.eval()


def reference(m: GatedMLA, x: torch.Tensor, gate: bool = True):
    """Token-by-token softmax attention over materialised k, v. Returns y and the logits [B, H, T, T] (-inf above the diagonal)."""
    B, T, _ = x.shape
    H, K, V, C, R = m.n_heads, m.qk_head_dim, m.v_head_dim, m.kv_lora_rank, m.rope_dim
    if m.q_lora_rank > 0:
        q = F.rms_norm(x @ m.wq_a.weight.T, (m.q_lora_rank,), m.q_norm.weight, m.q_norm.eps) @ m.wq_b.weight.T
    else:
        q = x @ m.wq.weight.T
    q = q.view(B, T, H, K + R)
    a = x @ m.wkv_a.weight.T
    c = F.rms_norm(a[..., :C], (C,), m.kv_norm.weight, m.kv_norm.eps)
    k_shared = a[..., C:]  # [B, T, R]: one unrotated key slice for every head
    kv = (c @ m.wkv_b.weight.T).view(B, T, H, K + V)
    k, v = kv[..., :K], kv[..., K:]
    logits = torch.full((B, H, T, T), float("-inf"))
    out = torch.zeros(B, T, H, V)
    for t in range(T):
        s = (torch.einsum("bhk,bshk->bhs", q[:, t, :, :K], k[:, : t + 1])
             + torch.einsum("bhr,bsr->bhs", q[:, t, :, K:], k_shared[:, : t + 1])) / math.sqrt(K + R)
        logits[:, :, t, : t + 1] = s
        out[:, t] = torch.einsum("bhs,bshv->bhv", s.softmax(-1), v[:, : t + 1])
    o = out.reshape(B, T, H * V)
    if gate:
        o = o * torch.sigmoid(x @ m.w_gate.weight.T)
    return o @ m.wo.weight.T, logits


@pytest.fixture(params=[(12, 6), (0, 6), (12, 0)], ids=["q_lora", "full_rank_q", "no_shared_key"])
def layer(request):
    q_lora, rope = request.param
    return make(mla_q_lora_rank=q_lora, qk_rope_head_dim=rope)


def test_naive_matches_loop_reference(layer):
    x = torch.randn(2, 9, 64)
    y = layer(x)
    ref, logits = reference(layer, x)
    assert y.shape == x.shape
    assert y.abs().mean() > 0.1  # tolerances below are meaningful at this scale
    assert logits[torch.isfinite(logits)].std() > 1.0  # attention is far from uniform
    torch.testing.assert_close(y, ref, **TOL)


def test_full_rank_q_has_wq_only():
    m = make(mla_q_lora_rank=0)
    assert hasattr(m, "wq") and not hasattr(m, "wq_a") and not hasattr(m, "wq_b")
    assert m.q_proj is m.wq
    m2 = make()
    assert m2.q_proj is m2.wq_b and not hasattr(m2, "wq")


def test_absorbed_equals_naive_prefill_and_decode(layer):
    x = torch.randn(2, 8, 64)
    torch.testing.assert_close(layer(x, absorb=True), layer(x, absorb=False), **TOL)
    # decode: one new token against a cache of 7
    prefix = MLACache()
    layer(x[:, :7], prefix)
    c1, c2 = MLACache(prefix.latent.clone()), MLACache(prefix.latent.clone())
    y_abs = layer(x[:, 7:], c1, absorb=True)
    y_naive = layer(x[:, 7:], c2, absorb=False)
    assert y_abs.abs().mean() > 0.1
    torch.testing.assert_close(y_abs, y_naive, **TOL)


@pytest.mark.parametrize("fmt,act", [("mxfp4", None), ("mxfp4", "mxfp8"), ("mxfp8", "mxfp8")])
def test_absorbed_equals_naive_with_qat_linears(fmt, act):
    """QAT on the linears: the absorbed decode reads wkv_b's weight directly, so it must fake-quantize it (and
    the cached latent, wkv_b's input) as the naive path's QATLinear does; it used the full-precision weight."""
    from k3.model.qat import QATLinear

    m = make(mla_kv_lora_rank=64)
    for name in ("wq_a", "wq_b", "wkv_a", "wkv_b", "w_gate", "wo"):
        setattr(m, name, QATLinear(getattr(m, name), fmt, act))
    x = torch.randn(2, 8, 64)
    torch.testing.assert_close(m(x, absorb=True), m(x, absorb=False), atol=1e-4, rtol=1e-4)
    prefix = MLACache()
    m(x[:, :7], prefix)
    y_abs = m(x[:, 7:], MLACache(prefix.latent.clone()), absorb=True)
    y_naive = m(x[:, 7:], MLACache(prefix.latent.clone()), absorb=False)
    torch.testing.assert_close(y_abs, y_naive, atol=1e-4, rtol=1e-4)


def test_absorbed_gradients_equal_naive():
    m = make().train()
    x = torch.randn(2, 6, 64)
    w = torch.randn(2, 6, 64)
    grads = []
    for absorb in (False, True):
        m.zero_grad()
        (m(x, absorb=absorb) * w).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-4, rtol=1e-4, msg=n)


def test_decode_uses_absorbed_path(layer, monkeypatch):
    x = torch.randn(1, 4, 64)
    cache = MLACache()
    layer(x[:, :3], cache)

    def boom(*a):
        raise AssertionError("naive path used at decode")

    monkeypatch.setattr(layer, "_naive", boom)
    layer(x[:, 3:], cache)  # T == 1 with a cache -> absorbed
    with pytest.raises(AssertionError, match="naive path used"):
        layer(x)  # no cache -> naive


def test_prefill_then_decode_equals_full(layer):
    x = torch.randn(2, 12, 64)
    full = layer(x)
    cache = MLACache()
    outs = [layer(x[:, :5], cache)]
    for t in range(5, 12):
        outs.append(layer(x[:, t : t + 1], cache))
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TOL)
    assert cache.length == 12


@pytest.mark.parametrize("absorb", [False, True])
def test_chunked_prefill_equals_full(layer, absorb):
    x = torch.randn(2, 11, 64)
    full = layer(x)
    cache = MLACache()
    y = torch.cat([layer(x[:, :4], cache, absorb=absorb), layer(x[:, 4:9], cache, absorb=absorb),
                   layer(x[:, 9:], cache, absorb=absorb)], dim=1)
    torch.testing.assert_close(y, full, **TOL)


def test_cache_holds_only_the_latent():
    m = make()
    B, T = 3, 7
    x = torch.randn(B, T, 64)
    cache = MLACache()
    m(x, cache)
    C, R = m.kv_lora_rank, m.rope_dim
    assert R > 0 and cache.latent.shape == (B, T, C + R)  # the latent and the shared key, nothing per head
    assert cache.nbytes() == B * T * (C + R) * 4
    a = m.wkv_a(x)
    torch.testing.assert_close(cache.latent, torch.cat([m.kv_norm(a[..., :C]), a[..., C:]], -1))

    # rows of different lengths merged into one batch: the padding mask is held too, and counted
    short = MLACache()
    m(x[:1, :4], short)
    merged = MLACache.merge([cache, short])
    assert merged.key_mask is not None and merged.key_mask.shape == (B + 1, T)
    assert merged.nbytes() == (B + 1) * T * (C + R) * 4 + (B + 1) * T * 1


def test_gate_scales_output():
    m = make()
    x = torch.randn(2, 6, 64)
    ungated, _ = reference(m, x, gate=False)
    gated = m(x)
    assert not torch.allclose(gated, ungated, atol=1e-3)
    with torch.no_grad():
        m.w_gate.weight.zero_()  # sigmoid(0) = 1/2 on every channel
    torch.testing.assert_close(m(x), 0.5 * ungated, **TOL)


def test_gate_is_elementwise_per_channel():
    m = make()
    x = torch.randn(1, 5, 64)
    V = m.v_head_dim
    with torch.no_grad():
        m.w_gate.weight.zero_()
        m.wo.weight.zero_()
        m.wo.weight[:, V : 2 * V] = torch.randn(64, V)  # only head 1 reaches the output
    y_half = m(x)
    with torch.no_grad():
        m.w_gate.weight[:V] = torch.randn(V, 64) * 10  # change head 0's gate only: output unchanged
    torch.testing.assert_close(m(x), y_half, **TOL)
    with torch.no_grad():
        m.w_gate.weight[V + 3] = torch.randn(64) * 10  # one channel of head 1: output changes
    assert not torch.allclose(m(x), y_half, atol=1e-3)


@pytest.mark.parametrize("absorb", [False, True])
def test_max_logits_brute_force(layer, absorb):
    x = torch.randn(2, 9, 64)
    _, logits = reference(layer, x)
    want = logits.amax(dim=(0, 2, 3))
    unmasked = reference_scores_unmasked(layer, x).amax(dim=(0, 2, 3))
    assert not torch.allclose(want, unmasked)  # so a missing causal mask would be caught
    layer.track_max_logits = True
    layer(x, absorb=absorb)
    assert layer.max_logits.shape == (layer.n_heads,) and not layer.max_logits.requires_grad
    torch.testing.assert_close(layer.max_logits, want, **TOL)
    # cached chunk: only its queries, against all visible keys
    cache = MLACache()
    layer(x[:, :4], cache)
    layer(x[:, 4:], cache, absorb=absorb)
    torch.testing.assert_close(layer.max_logits, logits[:, :, 4:].amax(dim=(0, 2, 3)), **TOL)


def reference_scores_unmasked(m, x):
    """All T x T scores, future keys included, to show that the causal mask changes the max."""
    B, T, _ = x.shape
    H, K, C, R = m.n_heads, m.qk_head_dim, m.kv_lora_rank, m.rope_dim
    q_in = m.q_norm(m.wq_a(x)) if m.q_lora_rank > 0 else x
    q = m.q_proj(q_in).view(B, T, H, K + R)
    a = m.wkv_a(x)
    k = m.wkv_b(m.kv_norm(a[..., :C])).view(B, T, H, -1)[..., :K]
    k = torch.cat([k, a[..., None, C:].expand(B, T, H, R)], -1)
    return torch.einsum("bthk,bshk->bhts", q, k) / math.sqrt(K + R)


def test_qk_clip_rescales_only_offending_heads(layer):
    x = torch.randn(2, 9, 64)
    layer.track_max_logits = True
    with torch.no_grad():
        layer(x)
    before = layer.max_logits.clone()
    tau = float(before.median())  # clips about half the heads
    K, V, H, C = layer.qk_head_dim, layer.v_head_dim, layer.n_heads, layer.kv_lora_rank
    v_rows = layer.wkv_b.weight.view(H, K + V, -1)[:, K:].clone()
    shared_key_rows = layer.wkv_a.weight[C:].clone()
    gamma = layer.qk_clip_(tau)
    with torch.no_grad():
        layer(x)
    clipped = before > tau
    assert clipped.any() and (~clipped).any()
    torch.testing.assert_close(gamma, torch.where(clipped, tau / before, torch.ones_like(before)))
    torch.testing.assert_close(layer.max_logits, torch.minimum(before, torch.tensor(tau)), **TOL)
    torch.testing.assert_close(layer.wkv_b.weight.view(H, K + V, -1)[:, K:], v_rows, atol=0, rtol=0)
    torch.testing.assert_close(layer.wkv_a.weight[C:], shared_key_rows, atol=0, rtol=0)  # shared by every head


def test_qk_clip_without_tracking_raises():
    with pytest.raises(AssertionError, match="track_max_logits"):  # k3.train.optim turns tracking on first
        make().qk_clip_(100.0)


@pytest.mark.parametrize("absorb", [False, True])
def test_causality(layer, absorb):
    x = torch.randn(2, 10, 64)
    y = layer(x, absorb=absorb)
    x2 = x.clone()
    x2[:, 6] += torch.randn(2, 64)
    y2 = layer(x2, absorb=absorb)
    torch.testing.assert_close(y2[:, :6], y[:, :6], atol=0, rtol=0)
    assert (y2[:, 6:] - y[:, 6:]).abs().amax(-1).min() > 1e-4  # the change reaches every later position


def _mla_model():
    from k3.model.transformer import K3Model

    return K3Model(get_config("tiny", layer_pattern="MMMM", **DIMS)).eval()


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(5, dtype=torch.long), r"integer tensor \[B, T\]"), (torch.zeros(1, 2, 5, dtype=torch.long), r"\[B, T\]"),
    (torch.zeros(1, 5), "integer tensor"), (torch.zeros(1, 0, dtype=torch.long), r"\[B, T\] with B, T >= 1"),
])
def test_bad_input_raises(bad, match):
    """The layer trusts its caller; K3Model.forward names the bad input."""
    with pytest.raises(ValueError, match=match):
        _mla_model()(bad)


def test_cache_batch_mismatch_raises():
    m = _mla_model()
    cache = m.new_cache()
    m(torch.zeros(2, 3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"cache slot 0 \(MLACache.latent\) is \(2, 3, 26\).*a batch of 3"):
        m(torch.zeros(3, 1, dtype=torch.long), cache)


def test_full_preset_builds_on_meta():
    cfg = get_config("k3")
    with torch.device("meta"):
        m = GatedMLA(cfg)
    d, H, K, V, R = cfg.d_model, cfg.mla_heads, cfg.mla_qk_head_dim, cfg.mla_v_head_dim, cfg.qk_rope_head_dim
    qr, C = cfg.mla_q_lora_rank, cfg.mla_kv_lora_rank
    assert (H, qr, C, K, R, V) == (96, 1536, 512, 128, 64, 128) and cfg.mla_cache_dim == 576
    want = d * qr + qr + qr * H * (K + R) + d * (C + R) + C + C * H * (K + V) + d * H * V + H * V * d
    assert sum(p.numel() for p in m.parameters()) == want
