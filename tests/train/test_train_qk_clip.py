import math

import pytest
import torch
from torch import nn

from k3.config import get_config
from k3.model.mla import GatedMLA
from k3.train.optim import QKClip, mla_layers


class Holder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.mla = GatedMLA(cfg)


@pytest.mark.parametrize("q_lora", [32, 0])
def test_qk_clip_rescales_exactly_the_head_rows_and_caps_at_tau(q_lora):
    torch.manual_seed(0)
    cfg = get_config("tiny", mla_heads=4, mla_q_lora_rank=q_lora)
    H, K, V, R = cfg.mla_heads, cfg.mla_qk_head_dim, cfg.mla_v_head_dim, cfg.qk_rope_head_dim
    Q = K + R  # query rows per head: K against the head's own keys, then R against the shared key slice
    assert R > 0
    model = Holder(cfg)
    mla = model.mla
    with torch.no_grad():  # blow up heads 0 and 2 (queries and keys), leave 1 and 3 small
        for h, f in ((0, 80.0), (2, 60.0)):
            mla.q_proj.weight[h * Q:h * Q + K] *= f
            mla.wkv_b.weight[h * (K + V):h * (K + V) + K] *= f
    clip = QKClip(model, tau=100.0)
    assert mla_layers(model) == [mla] and mla.track_max_logits
    x1, x2 = torch.randn(2, 12, cfg.d_model) * 4, torch.randn(1, 12, cfg.d_model) * 4
    mla(x1)
    clip.observe()
    s1 = mla.max_logits.clone()
    mla(x2)
    clip.observe()
    s = torch.maximum(s1, mla.max_logits)  # the step's max over both micro-batches
    assert s[0] > 100 and s[2] > 100 and s[1] < 100 and s[3] < 100

    q_before, kv_before = mla.q_proj.weight.detach().clone(), mla.wkv_b.weight.detach().clone()
    out = clip.apply()
    assert out["clipped_heads"] == 2 and out["max_logit"] == pytest.approx(float(s.max()))
    gamma = torch.clamp(100.0 / s, max=1.0)
    q_expect, kv_expect = q_before.clone(), kv_before.clone()
    for h in range(H):
        r = math.sqrt(float(gamma[h]))
        q_expect[h * Q:h * Q + K] *= r
        q_expect[h * Q + K:(h + 1) * Q] *= float(gamma[h])  # the shared key is not scaled: its query takes all
        kv_expect[h * (K + V):h * (K + V) + K] *= r  # key rows only; value rows untouched
    torch.testing.assert_close(mla.q_proj.weight, q_expect, rtol=1e-6, atol=0)
    torch.testing.assert_close(mla.wkv_b.weight, kv_expect, rtol=1e-6, atol=0)
    for h in (1, 3):  # heads under tau: bit-for-bit unchanged
        assert torch.equal(mla.q_proj.weight[h * Q:(h + 1) * Q], q_before[h * Q:(h + 1) * Q])
    for h in range(H):
        assert torch.equal(mla.wkv_b.weight[h * (K + V) + K:(h + 1) * (K + V)],
                           kv_before[h * (K + V) + K:(h + 1) * (K + V)])

    # logits are bilinear in q and k, so the clipped heads' max logit is now exactly tau
    mla(torch.cat([x1, x2]))
    after = mla.max_logits
    assert after[0].item() == pytest.approx(100.0, rel=1e-4) and after[2].item() == pytest.approx(100.0, rel=1e-4)
    torch.testing.assert_close(after[[1, 3]], s[[1, 3]], rtol=1e-5, atol=1e-5)


def test_qk_clip_tau_is_checked_by_the_train_config():
    # the loop's config is where a tau comes in (0 disables QK-Clip, so no QKClip is built with it)
    from k3.train.config import TrainConfig

    with pytest.raises(ValueError, match="qk_clip_tau"):
        TrainConfig(optimizer="muon", qk_clip_tau=-1.0).validate()
