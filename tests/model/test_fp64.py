"""An fp64 model computes in fp64 throughout: gradients pass gradcheck, cached decode equals the full forward to
fp64 rounding. (Steps kept at fp32 at least for bf16 must not cut fp64 down to fp32.)"""
import torch

from k3.config import get_config
from k3.model.kda import KimiDeltaAttention
from k3.model.moe import MoE
from k3.model.transformer import K3Model

SMALL = dict(d_model=8, kda_heads=2, kda_head_dim=4, kda_gate_rank=4, mla_heads=2, mla_q_lora_rank=4,
             mla_kv_lora_rank=4, mla_qk_head_dim=4, mla_v_head_dim=4, moe_latent_dim=4, n_experts=4,
             n_active_experts=2, expert_ffn=4, shared_ffn=4, dense_ffn=8)


def _scaled(mod):
    torch.manual_seed(0)
    mod = mod.double()
    with torch.no_grad():
        for p in mod.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5)
    return mod


def test_kda_layer_and_moe_pass_gradcheck_in_fp64():
    cfg = get_config("tiny", **SMALL)
    x = torch.randn(1, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    for mod in (KimiDeltaAttention(cfg), MoE(cfg)):
        mod = _scaled(mod)
        assert torch.autograd.gradcheck(mod, (x,), atol=1e-6, rtol=1e-4), type(mod).__name__


def test_fp64_cached_decode_equals_the_full_forward_to_fp64_rounding():
    model = K3Model(get_config("tiny", layer_pattern="MKMM", n_layers=4)).double().eval()
    ids = torch.randint(20, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :16], cache)] + [model(ids[:, t:t + 1], cache) for t in range(16, 24)]
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-10
