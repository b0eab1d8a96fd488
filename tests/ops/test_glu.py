"""The fast SiTU-GLU against its written formula: values, gradients, dtypes, extremes."""
import pytest
import torch

from k3.ops.glu import situ_glu, situ_glu_ref


@pytest.mark.parametrize("beta,lbeta", [(4.0, 25.0), (1.0, 3.0)])
def test_values_and_grads_match_the_reference_fp64(beta, lbeta):
    g0 = torch.randn(64, 48, dtype=torch.float64) * 6
    u0 = torch.randn(64, 48, dtype=torch.float64) * 40
    dh = torch.randn(64, 48, dtype=torch.float64)
    outs = []
    for fn in (situ_glu, situ_glu_ref):
        g, u = g0.clone().requires_grad_(), u0.clone().requires_grad_()
        h = fn(g, u, beta, lbeta)
        h.backward(dh)
        outs.append((h.detach(), g.grad, u.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradcheck():
    g = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    u = (torch.randn(5, 7, dtype=torch.float64) * 30).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b, 4.0, 25.0), (g, u))


def test_small_gradient_free_calls_take_the_composed_form(monkeypatch):
    import k3.ops.glu as glu

    calls = []
    monkeypatch.setattr(glu._SiTUGLU, "apply", lambda *a: calls.append(1) or glu.situ_glu_ref(*a))
    with torch.no_grad():
        situ_glu(torch.randn(8, 256), torch.randn(8, 256))
        assert not calls
        situ_glu(torch.randn(128, 256), torch.randn(128, 256))
        assert calls
    situ_glu(torch.randn(8, 256, requires_grad=True), torch.randn(8, 256))
    assert len(calls) == 2


def test_fp32_close_to_the_reference_including_tiny_and_huge_inputs():
    g = torch.cat([torch.randn(20000) * 5, torch.tensor([0.0, 1e-8, -1e-6, 1e4, -1e4, 80.0, -80.0])])
    u = torch.cat([torch.randn(20000) * 40, torch.tensor([1e-7, 0.0, 3.0, 1e5, -1e5, 0.5, -0.5])])
    want = situ_glu_ref(g.double(), u.double()).float()
    got = situ_glu(g, u)
    ref32 = situ_glu_ref(g, u)
    # the sigmoid identity costs about one ulp of 1 in tanh: absolute error ~1e-7 x beta x lbeta at most
    assert (got - want).abs().max() < 4.0 * 25.0 * 1e-6
    assert (ref32 - want).abs().max() < 4.0 * 25.0 * 1e-6
    assert torch.isfinite(got).all() and got.abs().max() <= 4.0 * 25.0


def test_bf16_and_autocast_stay_within_bf16_tolerance():
    g, u = torch.randn(256, 128) * 3, torch.randn(256, 128) * 20
    want = situ_glu_ref(g, u)
    got = situ_glu(g.bfloat16(), u.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def test_one_gradient_only_and_broadcasting_fall_back():
    g = torch.randn(8, 16, requires_grad=True)
    u = torch.randn(8, 16)
    situ_glu(g, u).sum().backward()
    g2 = g.detach().clone().requires_grad_()
    situ_glu_ref(g2, u).sum().backward()
    torch.testing.assert_close(g.grad, g2.grad)
    row = torch.randn(16)
    torch.testing.assert_close(situ_glu(g.detach(), row), situ_glu_ref(g.detach(), row))
