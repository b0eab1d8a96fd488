"""Fake quant with a straight-through estimator, and QAT switched on by config.qat at model construction."""
import pytest
import torch
import torch.nn.functional as F

from k3.config import K3ConfigError, get_config
from k3.model.moe import MoE, RoutedExperts
from k3.model.transformer import K3Model
from k3.ops.mx import dequantize_mx, quantize_mx
from k3.model.qat import QATLinear, parse_qat, qat_format
from k3.ops.mx.fake import fake_quant

K3_QAT = {"expert_weights": "mxfp4", "activations": "mxfp8"}


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_forward_is_dequantize_of_quantize_bitwise(fmt):
    x = torch.randn(6, 4, 96) * 3
    assert torch.equal(_bits(fake_quant(x, fmt)), _bits(dequantize_mx(*quantize_mx(x, fmt), fmt)))
    # along another dim: blocks run along dim 1
    w = torch.randn(3, 64, 40)
    ref = dequantize_mx(*quantize_mx(w.transpose(1, 2), fmt), fmt).transpose(1, 2)
    assert torch.equal(_bits(fake_quant(w, fmt, dim=1)), _bits(ref))
    assert not torch.equal(fake_quant(w, fmt, dim=1), fake_quant(w, fmt, dim=-1))  # the dim matters


def test_padding_for_dims_not_divisible_by_32():
    x = torch.randn(5, 40)
    padded = F.pad(x, (0, 24))
    ref = dequantize_mx(*quantize_mx(padded, "mxfp4"), "mxfp4")[:, :40]
    assert torch.equal(fake_quant(x, "mxfp4"), ref)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_gradient_is_the_identitys(fmt):
    x = (torch.randn(4, 64) * 2).requires_grad_()
    g = torch.randn(4, 64)
    fake_quant(x, fmt).backward(g)
    assert torch.equal(x.grad, g)
    w = torch.randn(2, 64, 8, requires_grad=True)
    fake_quant(w, fmt, dim=1).backward(torch.ones(2, 64, 8))
    assert torch.equal(w.grad, torch.ones(2, 64, 8))
    assert fake_quant(x, None) is x


def test_bad_inputs():
    with pytest.raises(ValueError, match="float32"):
        fake_quant(torch.arange(64), "mxfp4")
    with pytest.raises(ValueError, match="unsupported MX format"):
        fake_quant(torch.randn(64), "int4")
    with pytest.raises(ValueError, match="KEY=FORMAT"):
        parse_qat("linears=int8")
    with pytest.raises(K3ConfigError, match="qat"):
        get_config("tiny", qat={"weights": "mxfp4"})


def test_parse_qat():
    assert parse_qat("") == K3_QAT
    assert parse_qat("linears=mxfp4") == {**K3_QAT, "linears": "mxfp4"}
    assert parse_qat("activations=none, expert_weights=mxfp8") == {"expert_weights": "mxfp8", "activations": "none"}
    cfg = get_config("tiny", qat=parse_qat("activations=none"))
    assert qat_format(cfg, "activations") is None and qat_format(cfg, "expert_weights") == "mxfp4"
    # `k3 train --qat` keeps qat items the config already holds (--set qat=... or --config): they were dropped
    import argparse

    from k3.train.cli import _with_qat
    held = get_config("tiny", qat={"linears": "mxfp4"})
    assert _with_qat(held, argparse.Namespace(qat="")).qat == {**K3_QAT, "linears": "mxfp4"}
    assert _with_qat(held, argparse.Namespace(qat="linears=none")).qat == {**K3_QAT, "linears": "none"}


def test_config_switches_qat_on_at_construction():
    m = K3Model(get_config("tiny", qat=K3_QAT))
    e = m.moe_layers()[0].experts
    assert (e.weight_format, e.act_format) == ("mxfp4", "mxfp8")
    assert not any(isinstance(x, QATLinear) for x in m.modules())
    plain = K3Model(get_config("tiny"))
    assert plain.moe_layers()[0].experts.weight_format is None
    assert list(m.state_dict()) == list(plain.state_dict())  # PTQ: fp32 weights load as they are

    harsh = K3Model(get_config("tiny", qat={"linears": "mxfp4"}))
    qlin = [n for n, x in harsh.named_modules() if isinstance(x, QATLinear)]
    lin = [n for n, x in plain.named_modules() if type(x) is torch.nn.Linear and n.startswith("layers.")]
    assert qlin == lin and len(qlin) > 20 and type(harsh.head) is torch.nn.Linear
    assert list(harsh.state_dict()) == list(plain.state_dict())


def test_expert_weights_quantized_along_reduction_dim():
    e = RoutedExperts(4, 64, 96, weight_format="mxfp4")
    w1, w3, w2 = e.expert_weights()
    assert torch.equal(w1, fake_quant(e.w1, "mxfp4", dim=1))
    assert torch.equal(w2, dequantize_mx(*quantize_mx(e.w2.detach().transpose(1, 2), "mxfp4"), "mxfp4").transpose(1, 2))
    # each 32-block of w1[e, :, j] (a column: the reduction dim) shares one power-of-two scale
    col = w1[0, :32, 5]
    ratios = col[col != 0] / col[col != 0].abs().min()
    assert torch.all(ratios.abs() <= 12)  # E2M1 magnitudes 0.5..6 under one scale


def test_ptq_changes_outputs_and_qat_linear_matches_functional():
    torch.manual_seed(0)
    plain = K3Model(get_config("tiny"))
    q = K3Model(get_config("tiny", qat={**K3_QAT, "linears": "mxfp4"}))
    q.load_state_dict(plain.state_dict())
    x = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        a, b = plain(x), q(x)
    rel = ((a - b).norm() / a.norm()).item()
    assert 1e-3 < rel < 1  # quantized, still the same function (4-bit linears at random init: coarse)
    lin = q.layers[0].mixer.q_proj
    h = torch.randn(3, lin.in_features)
    assert isinstance(lin, QATLinear) and lin.act_format == "mxfp8"  # linears take the activations format
    assert torch.equal(lin(h), F.linear(fake_quant(h, "mxfp8"), fake_quant(lin.weight, "mxfp4", dim=1)))
    w_only = K3Model(get_config("tiny", qat={"linears": "mxfp4"})).layers[0].mixer.q_proj
    w_only.weight = lin.weight
    assert torch.equal(w_only(h), F.linear(h, fake_quant(lin.weight, "mxfp4", dim=1)))


def _scaled(module, std=0.2):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=std)
    return module


@pytest.mark.parametrize("moe", ["latent", "standard"])
@pytest.mark.parametrize("impl,backend", [("loop", None), ("grouped", "slices"), ("grouped", "bmm"),
                                          ("grouped", "grouped_mm")])
def test_qat_paths_match_naive_fwd_bwd(moe, impl, backend):
    """Per-row activation blocks and per-column weight blocks: every path sees the same quantized operands."""
    if backend == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not in this torch")
    cfg = get_config("tiny", moe=moe, qat=K3_QAT)
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
        return y.detach(), xx.grad, {n: p.grad.clone() for n, p in m.named_parameters()}

    y0, gx0, g0 = run("naive", None)
    y1, gx1, g1 = run(impl, backend)
    unq = MoE(get_config("tiny", moe=moe))
    unq.load_state_dict(m.state_dict())
    unq.impl = "naive"
    assert (unq(x) - y0).abs().max() > 1e-3  # quantization is really on
    assert torch.equal(y1, y0)  # same quantized operands, and here the same sums
    for a, b in [(gx1, gx0)] + [(g1[n], g0[n]) for n in g0]:
        assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("impl,backend", [("naive", "auto"), ("loop", "auto"), ("grouped", "slices"),
                                          ("grouped", "bmm")])
def test_routed_experts_take_an_empty_batch_under_qat(impl, backend):
    """An expert-parallel rank can receive no rows: fake quant of the empty activations must not fail."""
    ex = RoutedExperts(4, 32, 64, weight_format="mxfp4", act_format="mxfp8")
    ex.impl, ex.backend = impl, backend
    y = ex(torch.zeros(0, 32), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert y.shape == (0, 32)
