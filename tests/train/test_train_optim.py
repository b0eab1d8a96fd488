import math

import pytest
import torch
from torch import nn

from k3.train.optim import Muon, OptimizerList, build_optimizer, newton_schulz, split_params
from k3.train.schedule import WSDSchedule


# ---------------------------------------------------------------------- schedule
def test_wsd_shape():
    s = WSDSchedule(total_steps=100, warmup_steps=10, decay_steps=20, min_ratio=0.1)
    f = [s.factor(i) for i in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(b > a for a, b in zip(f[:10], f[1:10]))  # warmup rises
    assert all(x == 1.0 for x in f[10:80])  # stable
    assert all(b < a for a, b in zip(f[80:], f[81:]))  # decay falls
    assert f[99] == pytest.approx(0.1)
    for shape in ("cosine", "sqrt"):
        g = WSDSchedule(100, 10, 20, 0.0, shape)
        assert g.factor(99) == pytest.approx(0.0, abs=1e-12) and g.factor(79) == 1.0


def test_wsd_fractions_and_errors():
    s = WSDSchedule.from_fractions(1000, warmup_frac=0.05, decay_frac=0.2)
    assert (s.warmup_steps, s.decay_steps) == (50, 200)
    assert WSDSchedule.from_fractions(1).factor(0) > 0
    with pytest.raises(ValueError, match="exceeds total_steps"):
        WSDSchedule(10, 6, 6)
    with pytest.raises(ValueError, match="shape"):
        WSDSchedule(10, 1, 1, shape="step")


def test_schedule_apply_uses_peak_lr():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=0.5)
    s = WSDSchedule(10, 2, 0)
    s.apply(opt, 0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)
    s.apply(opt, 5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


# ---------------------------------------------------------------------- Muon
def test_newton_schulz_orthogonalises():
    torch.manual_seed(1)
    # a Gaussian matrix and an ill-conditioned one (singular values spread over two orders of magnitude)
    U, _ = torch.linalg.qr(torch.randn(96, 48))
    V, _ = torch.linalg.qr(torch.randn(48, 48))
    G = U @ torch.diag(torch.logspace(-2, 0, 48)) @ V.T
    for g in (torch.randn(96, 48), G, G.T):  # tall and wide
        assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 3
        X = newton_schulz(g)
        sv = torch.linalg.svdvals(X)
        # the quintic iteration lands singular values in roughly [0.68, 1.2], not exactly 1
        assert sv.min() > 0.6 and sv.max() < 1.3, sv
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        polar = u @ vh
        cos = (X * polar).sum() / (X.norm() * polar.norm())
        assert cos > 0.95


def test_newton_schulz_batched_matches_per_slice():
    G = torch.randn(3, 16, 24)
    X = newton_schulz(G)
    for e in range(3):
        torch.testing.assert_close(X[e], newton_schulz(G[e]), rtol=1e-5, atol=1e-6)


def test_muon_update_rms_matches_adamw_scale():
    # with RMS matching, one Muon step moves a matrix by ~0.2 * lr in RMS, whatever its shape
    for shape in ((64, 256), (256, 64), (4, 32, 48)):
        p = nn.Parameter(torch.zeros(shape))
        opt = Muon([p], lr=0.01, weight_decay=0.0, nesterov=False)
        p.grad = torch.randn(shape)
        opt.step()
        rms = p.detach().pow(2).mean().sqrt().item()
        assert 0.15 * 0.01 < rms < 0.25 * 0.01, (shape, rms)


def test_muon_expert_slices_are_independent():
    p = nn.Parameter(torch.zeros(2, 8, 16))
    opt = Muon([p], lr=0.1, weight_decay=0.0)
    g = torch.randn(2, 8, 16)
    g[1] *= 1000.0  # a huge gradient on expert 1 must not shrink expert 0's update
    p.grad = g
    opt.step()
    r0, r1 = p[0].pow(2).mean().sqrt(), p[1].pow(2).mean().sqrt()
    assert r0.item() == pytest.approx(r1.item(), rel=0.2)


def test_muon_rejects_vectors():
    with pytest.raises(ValueError, match="AdamW"):
        Muon([nn.Parameter(torch.zeros(4))])


def test_muon_trains_toy_problem():
    torch.manual_seed(0)
    X = torch.randn(256, 32)
    W_true = torch.randn(32, 16)
    Y = torch.tanh(X @ W_true)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))
    opt = build_optimizer(model, "muon", lr=0.02, weight_decay=0.0)
    assert set(opt.optimizers) == {"muon", "adamw"}
    first = None
    for _ in range(150):
        loss = (model(X) - Y).pow(2).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1 * first, (first, loss.item())


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.RMSNorm(8)
        self.conv = nn.Conv1d(8, 8, 3, groups=8)
        self.experts = nn.Parameter(torch.randn(4, 8, 8))
        self.conv_weight = nn.Parameter(torch.randn(8, 1, 4))  # a raw depthwise filter, like KDA's
        self.table = nn.Parameter(torch.randn(3, 8))
        self.A_log = nn.Parameter(torch.zeros(2, 2))
        self.A_log._no_weight_decay = True
        self.head = nn.Linear(8, 10, bias=False)


def test_split_params_rule():
    muon, decay, no_decay = split_params(_Toy())
    names = lambda xs: sorted(n for n, _ in xs)  # noqa: E731
    assert names(muon) == ["experts", "proj.weight"]
    assert names(decay) == ["conv.weight", "conv_weight", "embed.weight", "head.weight", "table"]
    assert names(no_decay) == ["A_log", "conv.bias", "norm.weight", "proj.bias"]


def test_build_optimizer_covers_every_param_once():
    m = _Toy()
    for name in ("adamw", "muon"):
        opt = build_optimizer(m, name)
        ids = [id(p) for g in opt.param_groups for p in g["params"]]
        assert len(ids) == len(set(ids)) == len(list(m.parameters()))
    with pytest.raises(ValueError, match="adamw or muon"):
        build_optimizer(m, "sgd")


def test_optimizer_list_state_dict_mismatch():
    opt = build_optimizer(_Toy(), "muon")
    with pytest.raises(ValueError, match="--optimizer"):
        opt.load_state_dict({"adamw": {}})
    assert isinstance(opt, OptimizerList)
    assert not math.isnan(sum(g["lr"] for g in opt.param_groups))


def test_fused_adamw_takes_the_per_tensor_steps():
    from k3.config import get_config
    from k3.model.transformer import K3Model

    # float64: in float32, AdamW's normalised step turns rounding noise in near-zero gradients into
    # differences of ~1e-6 (a small fraction of the lr 1e-2 step) between any two summation orders
    torch.manual_seed(0)
    a = K3Model(get_config("tiny")).double()
    b = K3Model(get_config("tiny")).double()
    b.load_state_dict(a.state_dict())
    fused = build_optimizer(a, "adamw", lr=1e-2)
    assert fused.optimizers["adamw"].defaults["fused"]
    plain = build_optimizer(b, "adamw", lr=1e-2)
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in plain.optimizers["adamw"].param_groups]
    plain.optimizers["adamw"] = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    assert not plain.optimizers["adamw"].param_groups[0]["fused"]  # the per-tensor form
    ids = torch.randint(0, a.config.vocab_size, (2, 12))
    for _ in range(3):
        for m, opt in ((a, fused), (b, plain)):
            opt.zero_grad()
            m(ids[:, :-1]).logsumexp(-1).mean().backward()
            opt.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=n)


def test_a_resumed_optimizer_keeps_its_own_kernel_choice():
    """Loading a state saved by the per-tensor AdamW (older checkpoints) must not switch the fused kernel off."""
    from k3.config import get_config
    from k3.model.transformer import K3Model

    m = K3Model(get_config("tiny"))
    opt = build_optimizer(m, "adamw")
    saved = opt.state_dict()
    for g in saved["adamw"]["param_groups"]:
        g["fused"], g["foreach"] = None, None  # as torch's default AdamW saves it
    opt.load_state_dict(saved)
    assert all(g["fused"] for g in opt.optimizers["adamw"].param_groups)
