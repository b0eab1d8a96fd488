"""GPTQ rounding onto the MX grid (k3.quant.gptq): against round-to-nearest, an explicit-inverse reference,
the grid itself, and on a model."""
import pytest
import torch

from k3.config import get_config
from k3.model.transformer import K3Model
from k3.ops.mx import fake_quantize_mx
from k3.model.qat import QATLinear
from k3.ops.mx.fake import fake_quant
from k3.quant.gptq import GPTQLinear, block_scales, gptq_linears_, gptq_mx, output_error, round_to_scale


def _correlated_hessian(n: int, rank: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, rank, generator=g) @ torch.randn(rank, n, generator=g) + 0.1 * torch.randn(2048, n,
                                                                                                     generator=g)
    return (x.T @ x).double()


def _weight(out: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(out, n, generator=torch.Generator().manual_seed(seed)) * 0.05


def _gptq_by_explicit_inverses(W, H, fmt, damp=0.01):
    """The same greedy algorithm written the long way (Optimal Brain Quantization's update): after rounding
    column i, the columns not yet rounded, F = [i+1, n), move by -(w_i - q_i) / [H_G^-1]_00 * [H_G^-1]_0,1:
    with G = [i, n) and H_G^-1 the inverse of H restricted to G, recomputed from scratch at every step."""
    W = W.double().clone()
    H = H.double().clone()
    H.diagonal().add_(damp * float(torch.diag(H).mean()))
    n = W.shape[1]
    Q = torch.empty_like(W)
    for i in range(n):
        if i % 32 == 0:
            scale = block_scales(W[:, i:i + 32].float(), fmt)
        q = round_to_scale(W[:, i].float(), scale, fmt).double()
        Q[:, i] = q
        inv = torch.linalg.inv(H[i:, i:])
        W[:, i:] -= ((W[:, i] - q) / inv[0, 0])[:, None] * inv[0][None, :]
    return Q.float()


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_uncorrelated_inputs_give_round_to_nearest_bitwise(fmt):
    """With H = I, U is diagonal and no column is moved: GPTQ is round-to-nearest, bit for bit."""
    W = _weight(48, 96) * torch.logspace(-3, 1, 96)  # blocks of very different magnitudes
    assert torch.equal(gptq_mx(W, torch.eye(96), fmt), fake_quantize_mx(W, fmt))
    # blocks so small that their scale code is 0 (the quantizer divides by 2^-126 there, as torchao does, and
    # multiplies by 2^-127: such a block is not even a fixed point of the quantizer itself)
    tiny = _weight(8, 64) * torch.tensor([1e-39] * 32 + [1e-36] * 32)
    assert torch.equal(gptq_mx(tiny, torch.eye(64), fmt), fake_quantize_mx(tiny, fmt))


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_matches_the_explicit_inverse_reference(fmt):
    W, H = _weight(40, 64), _correlated_hessian(64)
    Q = gptq_mx(W, H, fmt)
    ref = _gptq_by_explicit_inverses(W, H, fmt)
    # the same greedy decisions: a flip at a rounding tie would show as a whole grid step
    assert (Q != ref).float().mean() < 1e-3
    assert torch.allclose(Q, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_result_is_on_the_grid_and_lowers_the_output_error(fmt):
    W, H = _weight(64, 128), _correlated_hessian(128)
    W[3, 5] = 0.9  # one large element: its block's scale is set by it, and compensation pushes others around
    Q = gptq_mx(W, H, fmt)
    assert torch.equal(fake_quantize_mx(Q, fmt), Q)  # exactly representable: the export stores it losslessly
    rtn = fake_quantize_mx(W, fmt)
    assert output_error(W, Q, H) < 0.5 * output_error(W, rtn, H)


def test_saturation_keeps_compensated_values_on_the_grid():
    """Two nearly identical inputs: column 0 (the block's top, 0.0149 = 7.63 x 2^-9) saturates down to
    6 x 2^-9, and the update pushes the error onto column 1 (0.0115 = 5.9 x 2^-9) past the top of the
    scale fixed at the block's start; it must saturate there, not leave the grid."""
    g = torch.Generator().manual_seed(0)
    W = torch.full((4, 32), 0.002)
    W[:, 0], W[:, 1] = 0.0149, 0.0115
    x = torch.randn(512, 32, generator=g)
    x[:, 1] = x[:, 0] + 1e-3 * torch.randn(512, generator=g)
    H = (x.T @ x).double()
    Q = gptq_mx(W, H, "mxfp4")
    assert torch.equal(fake_quantize_mx(Q, "mxfp4"), Q)
    assert torch.all(Q[:, 0] == 6 * 2.0 ** -9) and torch.all(Q[:, 1] == 6 * 2.0 ** -9)  # both at the top
    # column 1 as the update after column 0 leaves it (the reference's step, with the same damping): past the top
    Hd = H.clone()
    Hd.diagonal().add_(0.01 * float(torch.diag(H).mean()))
    inv = torch.linalg.inv(Hd)
    moved = W[:, 1].double() - (W[:, 0].double() - Q[:, 0].double()) / inv[0, 0] * inv[0, 1]
    assert torch.all(moved > 7 * 2.0 ** -9)


def test_round_to_scale_is_the_formats_rounding():
    scale = torch.full((6,), 0.25)
    # w / scale = 0, 0.24, 0.76, 1.25 (a tie between codes 2 and 3: the even one, 1.0), 5.6, 20 (saturates at 6)
    w = torch.tensor([0.0, 0.06, 0.19, 0.3125, 1.4, 5.0])
    assert round_to_scale(w, scale, "mxfp4").tolist() == [0.0, 0.0, 0.25, 0.25, 1.5, 1.5]
    assert torch.equal(block_scales(torch.tensor([[0.5, -3.0], [0.0, 0.01]]), "mxfp4"),
                       torch.tensor([0.5, 2.0 ** -9]))  # 2^(floor(log2 amax) - 2)


def test_bad_input_is_refused():
    W = _weight(8, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        gptq_mx(W[:, :40], torch.eye(40), "mxfp4")
    with pytest.raises(ValueError, match=r"\[in, in\]"):
        gptq_mx(W, torch.eye(32), "mxfp4")
    with pytest.raises(ValueError, match="unknown"):
        gptq_mx(W, torch.eye(64), "int4")
    with pytest.raises(ValueError, match="damp"):
        gptq_mx(W, torch.eye(64), "mxfp4", damp=0.0)


def test_dead_inputs_get_zero_weights():
    W, H = _weight(8, 64), _correlated_hessian(64)
    H[7, :] = 0
    H[:, 7] = 0
    Q = gptq_mx(W, H, "mxfp4")
    assert torch.all(Q[:, 7] == 0) and torch.equal(fake_quantize_mx(Q, "mxfp4"), Q)


def test_gptq_linears_rounds_every_qat_linear_in_place():
    config = get_config("tiny", qat={"expert_weights": "mxfp4", "activations": "mxfp8", "linears": "mxfp4"})
    torch.manual_seed(0)
    model = K3Model(config)
    batches = [torch.randint(0, config.vocab_size, (2, 32)) for _ in range(3)]
    before = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, QATLinear)}
    probe_name = "layers.0.mixer.q_proj" if "layers.0.mixer.q_proj" in before else sorted(before)[0]
    probe, seen = model.get_submodule(probe_name), []
    handle = probe.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach().clone()))
    rep = gptq_linears_(model, batches)
    handle.remove()
    assert all(not m._forward_pre_hooks for m in model.modules())  # its calibration hooks are gone
    # the layer's H is of its inputs as it multiplies them: after the MXFP8 input fake quant
    xq = torch.cat([fake_quant(x, probe.act_format).reshape(-1, probe.in_features) for x in seen]).double()
    assert torch.equal(probe.weight.detach(), gptq_mx(before[probe_name], xq.T @ xq, probe.weight_format))
    assert rep["calibration_tokens"] == 3 * 2 * 32 and set(rep["layers"]) <= set(before)
    assert len(rep["layers"]) >= len(before) - 2  # only widths that are not multiples of 32 stay RTN
    for name, m in model.named_modules():
        if name in rep["layers"]:
            assert torch.equal(fake_quantize_mx(m.weight.detach(), m.weight_format), m.weight.detach())
            assert not torch.equal(m.weight.detach(), before[name])
    assert sum(r["gptq_error"] for r in rep["layers"].values()) < sum(r["rtn_error"] for r in rep["layers"].values())
    with pytest.raises(ValueError, match="no calibration"):
        gptq_linears_(model, [])
    with pytest.raises(ValueError, match="no QATLinear"):
        gptq_linears_(K3Model(get_config("tiny")), batches)


def test_gptq_linear_trains_through_gptq_rounding():
    torch.manual_seed(0)
    base = QATLinear(torch.nn.Linear(64, 48), "mxfp4", "mxfp8")
    layer = GPTQLinear(base)
    assert layer.weight is base.weight and list(layer.state_dict()) == list(base.state_dict())
    x = torch.randn(3, 16, 64) @ torch.randn(64, 64) * 0.3  # correlated inputs
    layer.eval()
    assert torch.equal(layer(x), base(x))  # no training input seen yet: round to nearest, as QATLinear
    layer.train()
    y = layer(x)
    xq = fake_quant(x, "mxfp8").reshape(-1, 64).double()
    H = xq.T @ xq
    assert torch.allclose(layer.hessian, H) and layer.seen == 48
    Q = gptq_mx(base.weight.detach(), H, "mxfp4")
    assert torch.equal(y, torch.nn.functional.linear(fake_quant(x, "mxfp8"), Q, base.bias))
    assert not torch.equal(Q, fake_quantize_mx(base.weight.detach(), "mxfp4"))
    g = torch.randn_like(y)
    y.backward(g)  # straight through: the gradient of a linear layer at the rounded weight
    assert torch.allclose(base.weight.grad, g.reshape(-1, 48).T @ fake_quant(x, "mxfp8").reshape(-1, 64), atol=1e-5)
    layer.eval()
    first = layer(x)
    assert torch.equal(layer(x), first) and layer.seen == 48  # eval neither gathers inputs nor changes
    with torch.no_grad():
        base.weight.mul_(1.5)
    assert not torch.equal(layer(x), first)  # the cached rounding follows an in-place weight update
    with pytest.raises(TypeError, match="QATLinear"):
        GPTQLinear(torch.nn.Linear(64, 8))
    with pytest.raises(ValueError, match="multiple of 32"):
        GPTQLinear(QATLinear(torch.nn.Linear(40, 8), "mxfp4"))


def test_gptq_linear_forward_weight_is_exactly_the_rounding():
    """A wider layer with correlated inputs, where GPTQ moves weights far: the weight the forward multiplies is
    the GPTQ result bit for bit (not w + (q - w), which rounds twice), in train and in eval mode."""
    g = torch.Generator().manual_seed(0)
    base = QATLinear(torch.nn.Linear(128, 384), "mxfp4", "mxfp8")
    layer = GPTQLinear(base)
    x = torch.randn(4, 64, 128, generator=g) @ torch.randn(128, 128, generator=g) * 0.3
    xq = fake_quant(x, "mxfp8")
    y = layer(x)
    Q = gptq_mx(base.weight.detach(), layer.hessian, "mxfp4")
    assert torch.equal(fake_quantize_mx(Q, "mxfp4"), Q)
    assert torch.equal(y, torch.nn.functional.linear(xq, Q, base.bias))
    layer.eval()
    assert torch.equal(layer(x), y)


def test_gptq_linear_eval_cache_follows_every_weight_update():
    """Writes that do not bump the weight's version (fused AdamW, .data) happen in train mode or are followed by
    a mode switch: either way the eval rounding is recomputed."""
    torch.manual_seed(0)
    layer = GPTQLinear(QATLinear(torch.nn.Linear(64, 32), "mxfp4", "mxfp8"))
    x = torch.randn(2, 16, 64) @ torch.randn(64, 64) * 0.3
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    for _ in range(2):
        layer.train()
        layer(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        layer.eval()
        fresh = torch.nn.functional.linear(fake_quant(x, "mxfp8"),
                                           gptq_mx(layer.weight.detach(), layer.hessian, "mxfp4"), layer.bias)
        assert torch.equal(layer(x), fresh)
    layer.weight.data.mul_(1.5)
    layer.train(False)
    assert not torch.equal(layer(x), fresh)


def test_gptq_linears_refuses_shared_weights_and_unroundable_widths():
    a, b = QATLinear(torch.nn.Linear(32, 32), "mxfp4"), QATLinear(torch.nn.Linear(32, 32), "mxfp4")
    b.weight = a.weight  # tied: rounding one in place would silently change the other
    with pytest.raises(ValueError, match="shared"):
        gptq_linears_(torch.nn.Sequential(a, b), [torch.randn(2, 32)])
    with pytest.raises(ValueError, match=r"multiple of 32 \(widths \[40\]\)"):
        gptq_linears_(torch.nn.Sequential(QATLinear(torch.nn.Linear(40, 8), "mxfp4")), [torch.randn(2, 40)])
