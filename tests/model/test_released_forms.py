"""The released K3 forms against references written apart from the modules: transformers' Kimi-Linear MLA (the
shared key slice), SiTU-GLU's formula, the Stable LatentMoE order, and Block AttnRes as the release's loop
runs it (a running partial sum, snapshots every attn_res_block_size layers)."""
import math

import pytest
import torch
import torch.nn.functional as F

from k3.config import get_config
from k3.model.mla import GatedMLA
from k3.model.moe import MoE
from k3.model.transformer import K3Model
from k3.ops.glu import situ_glu


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------------------------------------- MLA
@pytest.mark.parametrize("q_lora", [0, 12])
def test_mla_with_shared_key_matches_transformers_kimi_linear_attention(q_lora):
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention, KimiLinearConfig

    d, H, K, R, V, C = 64, 3, 16, 8, 12, 20
    hf_cfg = KimiLinearConfig(hidden_size=d, num_attention_heads=H, num_key_value_heads=H, qk_nope_head_dim=K,
                              qk_rope_head_dim=R, v_head_dim=V, kv_lora_rank=C, q_lora_rank=q_lora or None,
                              num_hidden_layers=2, vocab_size=64, rms_norm_eps=1e-6)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = KimiLinearAttention(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]) if p.dim() == 2 else 1 + 0.3 * torch.randn_like(p))
    cfg = get_config("tiny", d_model=d, mla_heads=H, mla_qk_head_dim=K, qk_rope_head_dim=R, mla_v_head_dim=V,
                     mla_kv_lora_rank=C, mla_q_lora_rank=q_lora, mla_use_output_gate=False)
    m = GatedMLA(cfg).eval()
    names = {"wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj",
             **({"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj"} if q_lora else {"wq": "q_proj"})}
    with torch.no_grad():
        for ours, theirs in names.items():
            getattr(m, ours).weight.copy_(getattr(hf, theirs).weight)
    assert math.isclose(hf.scaling, m.softmax_scale) and math.isclose(m.softmax_scale, (K + R) ** -0.5)
    x = torch.randn(2, 7, d)
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    want, _ = hf(x, attention_mask=mask)
    assert rel_err(m(x), want) < 1e-5
    assert rel_err(m(x, absorb=True), want) < 1e-5


# ---------------------------------------------------------------------------------------------- SiTU
def test_situ_glu_is_its_written_formula():
    g, u = torch.randn(1000, dtype=torch.float64) * 8, torch.randn(1000, dtype=torch.float64) * 60
    beta, lbeta = 4.0, 25.0
    want = [beta * math.tanh(a / beta) / (1 + math.exp(-a)) * lbeta * math.tanh(b / lbeta)
            for a, b in zip(g.tolist(), u.tolist())]
    torch.testing.assert_close(situ_glu(g, u, beta, lbeta), torch.tensor(want, dtype=torch.float64))
    # soft caps: the gate branch stays under beta, the up branch under lbeta, whatever the input
    big = torch.tensor([1e4])
    assert situ_glu(big, torch.ones(1)).item() < beta * 1.0 + 1e-6
    assert abs(situ_glu(big, big).item()) <= beta * lbeta + 1e-6


@pytest.mark.parametrize("impl", ["naive", "loop", "grouped"])
def test_moe_under_situ_and_latent_norm_is_the_released_order(impl):
    """route on the full width -> W_down -> experts (SiTU) -> weighted sum -> RMSNorm -> W_up, + shared(x) on x."""
    torch.manual_seed(0)
    cfg = get_config("tiny")
    assert cfg.hidden_act == "situ" and cfg.latent_moe_use_norm
    m = MoE(cfg).eval()
    m.impl = impl
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(2, 5, cfg.d_model)
    h = x.reshape(-1, cfg.d_model)
    s = torch.sigmoid(h @ m.router.weight.T)
    top = (s + m.router.bias).topk(cfg.n_active_experts, -1).indices
    g = s.gather(-1, top)
    g = g / g.sum(-1, keepdim=True) * cfg.routed_scale
    z = h @ m.w_down.weight.T
    e = m.experts
    rows = []
    for n in range(h.shape[0]):
        rows.append(sum(g[n, j] * (situ_glu(z[n] @ e.w1[i], z[n] @ e.w3[i], 4.0, 25.0) @ e.w2[i])
                        for j, i in enumerate(top[n].tolist())))
    y = F.rms_norm(torch.stack(rows), (cfg.moe_latent_dim,), m.latent_norm.weight, cfg.norm_eps) @ m.w_up.weight.T
    sh = m.shared
    y = y + situ_glu(h @ sh.w1.weight.T, h @ sh.w3.weight.T, 4.0, 25.0) @ sh.w2.weight.T
    assert rel_err(m(x).reshape(-1, cfg.d_model), y) < 1e-5


def test_latent_norm_makes_the_routed_path_scale_free():
    """With the norm before W_up, the routed scale cannot change the output (why K3 ships routed_scaling_factor
    1.0); without it, it scales the routed path."""
    torch.manual_seed(0)
    x = torch.randn(1, 6, 64)
    outs = {}
    for norm in (True, False):
        for scale in (1.0, 3.0):
            torch.manual_seed(1)
            m = MoE(get_config("tiny", latent_moe_use_norm=norm, routed_scale=scale)).eval()
            with torch.no_grad():  # trained-size weights: at the 0.02 init the norm's eps outweighs the tiny latent
                for p in m.parameters():
                    p.normal_(0, 0.5)
            outs[norm, scale] = m(x)
    torch.testing.assert_close(outs[True, 1.0], outs[True, 3.0], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(outs[False, 1.0], outs[False, 3.0], atol=1e-4)


# ---------------------------------------------------------------------------------------------- AttnRes
def _mix(sources, proj_w, norm_w, eps):
    """The release's mix: v = stacked sources, k = v / rms(v), scores = k . (norm.w * proj.w), softmax over
    sources, weighted sum of the un-normalised v."""
    v = torch.stack(sources)  # [S, B, T, D]
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    w = (k * (norm_w * proj_w)).sum(-1).softmax(0)
    return (w[..., None] * v).sum(0)


def released_loop_logits(model: K3Model, ids: torch.Tensor) -> torch.Tensor:
    """K3's decoder loop as the released modeling code runs it, over the model's own modules: a running partial
    sum, snapshotted (then reset) at every layer i with i % attn_res_block_size == 0 (the embedding at i = 0)."""
    cfg, ar = model.config, model.attnres
    eps, bs = cfg.norm_eps, cfg.attnres_block_size
    q, g = ar.pseudo_query, ar.key_norm
    prefix, snaps = model.embed(ids), []
    for i, block in enumerate(model.layers):
        h = _mix(snaps + [prefix], q[2 * i], g[2 * i], eps) if snaps else prefix
        if i % bs == 0:
            snaps.append(prefix)
            prefix = torch.zeros_like(prefix)
        prefix = prefix + block.mixer(block.attn_norm(h))
        h = _mix(snaps + [prefix], q[2 * i + 1], g[2 * i + 1], eps)
        prefix = prefix + block.ffn(block.ffn_norm(h))
    out = _mix(snaps + [prefix], q[2 * cfg.n_layers], g[2 * cfg.n_layers], eps)
    return model.head(model.norm(out))


@pytest.mark.parametrize("n_layers,block", [(4, 2), (7, 3), (5, 5)])
def test_block_attnres_is_the_released_loop(n_layers, block):
    torch.manual_seed(0)
    sources = math.ceil(n_layers / block) + 1
    cfg = get_config("tiny", n_layers=n_layers, attn_res_block_size=block, attnres_sources=sources)
    model = K3Model(cfg).double().eval()  # fp64: the two orders of summation then agree to rounding
    with torch.no_grad():  # non-uniform mixes: zero pseudo-queries would hide a wrong source set
        for p in list(model.attnres.pseudo_query) + list(model.attnres.key_norm):
            p.normal_(0, 1.0)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        assert rel_err(model(ids), released_loop_logits(model, ids)) < 1e-10
