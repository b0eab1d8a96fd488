"""Error-compensating rounding of linear weights onto the MX grid: GPTQ (Frantar et al., arXiv 2210.17323).

GPTQ rounds the columns of W [out, in] one after another and, after each, moves the columns not yet rounded to
absorb its error, weighted by H = X^T X of the layer's calibration inputs (the paper's Algorithm 1, without its
lazy batching). For MX, each block of 32 columns takes its per-row power-of-two scale when the loop reaches the
block's first column, and later updates that push an element past the block's top saturate, so the result is
always on the grid (`fake_quantize_mx(q) == q`); with H = I it equals round-to-nearest bit for bit (both
tested). The update rule and the evidence: docs/quantization.md, "Error-compensating rounding".
"""
from __future__ import annotations

import collections
import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from k3.model.qat import QATLinear
from k3.ops.mx import MX_FORMATS, fake_quantize_mx, quantize_mx
from k3.ops.mx.fake import fake_quant
from k3.ops.mx.formats import _e2m1_magnitude, _e2m1_values

BLOCK = 32


def round_to_scale(w: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round w [rows] to the MX element grid of `fmt` at the given per-row power-of-two scale [rows]: nearest,
    ties to even, saturating at +-max_normal * scale. The element rounding is the quantizer's own
    (`_e2m1_magnitude` for E2M1, torch's float8_e4m3fn cast for E4M3); dividing by a power of two is exact. As
    the quantizer (and torchao), it divides by the scale clamped to 2^-126 and multiplies by the scale itself, which
    differ only for the scale code 0 (blocks below 2^-124)."""
    f = MX_FORMATS[fmt]
    y = (w.float() / scale.clamp_min(2.0 ** -126)).clamp_(-f.max_normal, f.max_normal)
    if f.name == "mxfp8":
        q = y.to(torch.float8_e4m3fn).float()
    else:
        q = torch.copysign(_e2m1_values(y.device)[_e2m1_magnitude(y.abs()).long()], y)
    return q * scale


def block_scales(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """The spec's scale of each row of w [rows, <= 32] (one block per row, zero-padded), as fp32 powers of two."""
    pad = BLOCK - w.shape[1]
    _, codes = quantize_mx(torch.nn.functional.pad(w.float(), (0, pad)) if pad else w.float(), fmt, BLOCK)
    return torch.ldexp(torch.ones(w.shape[0], dtype=torch.float32, device=w.device), codes[:, 0].int() - 127)


def gptq_mx(weight: torch.Tensor, hessian: torch.Tensor, fmt: str, damp: float = 0.01) -> torch.Tensor:
    """weight [out, in], hessian [in, in] (sum of x x^T over calibration inputs) -> the weight rounded onto the
    MX grid of `fmt` in blocks of 32 along `in`, column by column with GPTQ's error compensation. `damp` adds
    damp * mean(diag H) to the diagonal (the paper's 1 %) so that H is safely invertible; inputs that never
    fire (H_ii = 0) are given H_ii = 1 and their weights zeroed, as in the paper (they never reach the output).
    """
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"gptq_mx: weight must be [out, in] and hessian [in, in]; got {tuple(weight.shape)} "
                         f"and {tuple(hessian.shape)}")
    if weight.shape[1] % BLOCK:
        raise ValueError(f"gptq_mx: in = {weight.shape[1]} is not a multiple of {BLOCK}; MX blocks run along it")
    if fmt not in MX_FORMATS:
        raise ValueError(f"gptq_mx: format {fmt!r} is unknown; use one of {', '.join(MX_FORMATS)}")
    if not damp > 0:
        raise ValueError(f"gptq_mx: damp = {damp} must be > 0 (e.g. 0.01)")
    W = weight.detach().to(torch.float64).clone()
    H = hessian.detach().to(torch.float64).clone()
    n = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(damp * float(torch.diag(H).mean()))
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.empty_like(W)
    scale = None
    for i in range(n):
        if i % BLOCK == 0:
            scale = block_scales(W[:, i:i + BLOCK].float(), fmt)
        q = round_to_scale(W[:, i].float(), scale, fmt).to(W.dtype)
        Q[:, i] = q
        err = (W[:, i] - q) / U[i, i]
        W[:, i + 1:] -= err[:, None] * U[i, i + 1:][None, :]
    return Q.to(weight.dtype)


def output_error(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T): the summed squared change of the layer's output over the calibration inputs."""
    d = (weight - quantized).double()
    return float(((d @ hessian.double()) * d).sum())


@contextlib.contextmanager
def _input_hooks(modules: dict[str, nn.Module], hessians: dict[str, torch.Tensor]):
    """Add x^T x of every input each module sees (as the module consumes it: after its input fake quant)."""
    def hook(name, module):
        def fn(_, args):
            x = fake_quant(args[0].detach(), getattr(module, "act_format", None)).reshape(-1, args[0].shape[-1])
            x = x.double()
            hessians[name] += x.T @ x
        return fn

    handles = [m.register_forward_pre_hook(hook(name, m)) for name, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def gptq_roundable(module: nn.Module) -> bool:
    """A QATLinear with a weight format and an input width of whole MX blocks: what `gptq_linears_` and `GPTQLinear`
    can round (a head wrapped to quantize only its input has no weight grid)."""
    return isinstance(module, QATLinear) and module.weight_format is not None and module.in_features % BLOCK == 0


@torch.no_grad()
def gptq_linears_(model: nn.Module, batches, damp: float = 0.01, only=None) -> dict:
    """Round the weight of every QATLinear in `model` (the modules PTQ / QAT fake-quantize: the `linears` of
    config.qat, and the head where a caller wrapped it) onto its MX grid with GPTQ, in place, using the inputs
    those modules see on `batches` (an iterable of token tensors [B, T]). The model stays built with its qat
    config, so its forward still fake-quantizes; on the GPTQ weights that rounding changes nothing.

    Calibration runs once, through the model as it is (every layer already round-to-nearest quantized), not
    layer by layer. The routed experts keep round-to-nearest. Returns, per module, the output error
    tr((W - Q) H (W - Q)^T) of round-to-nearest and of GPTQ (GPTQ is greedy, so its error is usually, not
    provably, the smaller; equal with uncorrelated inputs) and the calibration token count. `only(name)`, if given, picks the modules to round."""
    picked = {n: m for n, m in model.named_modules() if isinstance(m, QATLinear) and (only is None or only(n))}
    if not picked:
        raise ValueError("gptq_linears_: the model has no QATLinear; build it with config.qat linears set "
                         "(e.g. qat={'linears': 'mxfp4'}) or wrap the layers to round in QATLinear")
    # fake_quant pads a width that is not a multiple of 32 for rounding; GPTQ leaves such a layer round-to-nearest
    modules = {n: m for n, m in picked.items() if gptq_roundable(m)}
    if not modules:
        raise ValueError(f"gptq_linears_: no QATLinear has in_features a multiple of {BLOCK} (widths "
                         f"{sorted({m.in_features for m in picked.values()})}); GPTQ rounds whole MX blocks only")
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for name, m in modules.items():
        if uses[id(m.weight)] > 1:
            raise ValueError(f"gptq_linears_: {name}.weight is shared with another parameter (tied embeddings?), "
                             "and rounding it in place would change that one too; untie it, or leave this layer "
                             "out with only=")
    device = next(model.parameters()).device
    hessians = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float64, device=m.weight.device)
                for n, m in modules.items()}
    was_training = model.training
    model.eval()
    tokens = 0
    try:
        with _input_hooks(modules, hessians):
            for x in batches:
                model(x.to(device))
                tokens += x.numel()
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("gptq_linears_: no calibration batches were given")
    report = {"calibration_tokens": tokens, "layers": {}}
    for name, m in modules.items():
        W, H = m.weight.detach(), hessians[name]
        Q = gptq_mx(W, H, m.weight_format, damp)
        rtn = fake_quantize_mx(W, m.weight_format, BLOCK)
        report["layers"][name] = {"rtn_error": output_error(W, rtn, H), "gptq_error": output_error(W, Q, H)}
        m.weight.copy_(Q)
    return report


class GPTQLinear(QATLinear):
    """QAT through GPTQ rounding: a QATLinear whose forward uses its weight rounded by `gptq_mx` instead of to
    nearest, with H = the sum of x x^T over every input it has seen in training so far (this batch included),
    and a straight-through gradient to the full-precision weight. Training thus fits the weights to the
    rounding they will be exported with. In eval mode it uses the rounding from the H gathered in training
    (cached between weight updates); before any training input it rounds to nearest.

    Built from a QATLinear, sharing its parameters (state_dict names and values unchanged). H lives in a
    non-persistent buffer, so a resumed run starts it afresh (the benchmark that uses this never resumes
    within its QAT phase).
    """

    def __init__(self, linear: QATLinear, damp: float = 0.01):
        if not isinstance(linear, QATLinear):
            raise TypeError(f"GPTQLinear is built from a QATLinear (it needs its formats); got {type(linear)}")
        if linear.in_features % BLOCK:
            raise ValueError(f"GPTQLinear: in_features = {linear.in_features} is not a multiple of {BLOCK}")
        super().__init__(linear, linear.weight_format, linear.act_format)
        self.damp = damp
        self.register_buffer("hessian", torch.zeros(self.in_features, self.in_features, dtype=torch.float64,
                                                    device=self.weight.device), persistent=False)
        self.seen = 0
        self._cache: tuple | None = None

    def rounded_weight(self) -> torch.Tensor:
        """The weight as this layer uses it: GPTQ-rounded with the H so far (round-to-nearest before any).
        Cached in eval mode only, keyed on everything that can change it; a mode switch drops the cache (an
        optimizer that writes the weight without bumping its version, e.g. fused AdamW, steps in train mode)."""
        w = self.weight.detach()
        key = (w._version, w.data_ptr(), w.dtype, w.device, self.seen, self.hessian._version)
        if self.training or self._cache is None or self._cache[0] != key:
            q = gptq_mx(w, self.hessian, self.weight_format, self.damp) if self.seen else \
                fake_quantize_mx(w, self.weight_format, BLOCK)
            self._cache = None if self.training else (key, q)
            return q
        return self._cache[1]

    def train(self, mode: bool = True):
        self._cache = None
        return super().train(mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = fake_quant(x, self.act_format)
        if self.training:
            with torch.no_grad():
                xf = x.detach().reshape(-1, x.shape[-1]).double()
                self.hessian += xf.T @ xf
                self.seen += xf.shape[0]
        # exactly the rounded weight forward (w - w.detach() is 0), the identity backward: straight through
        w = self.rounded_weight() + (self.weight - self.weight.detach())
        return F.linear(x, w, self.bias)
