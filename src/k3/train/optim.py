"""Optimizers: AdamW (torch's), Muon (ours) for matrix weights, and MuonClip's QK-Clip for Gated MLA.

Muon replaces each matrix's momentum update by its orthogonal polar factor (five quintic Newton-Schulz steps)
scaled by 0.2 * sqrt(max(m, n)), so it shares AdamW's learning rate and weight decay (Moonlight, arXiv
2502.16982). It gets every `nn.Linear` weight but the head, and the routed experts' 3-D stacks, one matrix per
expert; AdamW gets the rest (`split_params`). QK-Clip (Kimi K2, arXiv 2507.20534) rescales, after each step, the
query and key rows of every MLA head whose max logit in the step exceeded tau, so it lands at tau. Sources,
the parameter split in full and the cost on CPU: docs/training.md ("Optimizers").
"""
from __future__ import annotations

import logging
import math
from typing import Iterable

import torch
from torch import nn

log = logging.getLogger(__name__)

NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """G [..., m, n] -> approximately U Vᵀ for G = U S Vᵀ (batched over leading dims).

    The quintic iteration pushes singular values into roughly [0.7, 1.2] rather than exactly 1, which is
    what Muon needs and is cheaper than converging. Runs in bf16 on CUDA, fp32 elsewhere.
    """
    assert G.dim() >= 2, f"newton_schulz needs a matrix [..., m, n], got shape {tuple(G.shape)}"
    a, b, c = NS_COEFFS
    X = G.to(torch.bfloat16 if G.is_cuda else torch.float32)
    tall = G.size(-2) > G.size(-1)
    if tall:  # iterate on the wide orientation so X Xᵀ is the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


class Muon(torch.optim.Optimizer):
    """Muon for 2-D weights and 3-D stacks of them (orthogonalised per slice over the last two dims).

    p <- p * (1 - lr * wd) - lr * 0.2 * sqrt(max(m, n)) * NS(momentum update)
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.1, ns_steps: int = 5, rms_scale: float = 0.2):
        if lr < 0 or not 0.0 <= momentum < 1.0 or weight_decay < 0 or ns_steps < 1:
            raise ValueError(f"Muon: invalid hyperparameters lr={lr} momentum={momentum} "
                             f"weight_decay={weight_decay} ns_steps={ns_steps}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps, rms_scale=rms_scale)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() not in (2, 3):
                    raise ValueError(f"Muon handles 2-D weights and 3-D expert stacks, got a parameter of "
                                     f"shape {tuple(p.shape)}; give it to AdamW (see split_params)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.mul_(mu).add_(g)
                u = g.add(buf, alpha=mu) if group["nesterov"] else buf
                o = newton_schulz(u, group["ns_steps"])
                scale = group["rms_scale"] * math.sqrt(max(p.size(-2), p.size(-1)))
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.add_(o, alpha=-lr * scale)
        return loss


class OptimizerList:
    """Several optimizers stepped as one (torchtitan's OptimizersContainer idea): Muon + AdamW.

    `param_groups` is the concatenation of the members' groups, so an LR schedule sees one optimizer.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = {k: v for k, v in optimizers.items() if v is not None}

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {k: opt.state_dict() for k, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.optimizers):
            raise ValueError(f"optimizer state has parts {sorted(state)} but this optimizer has "
                             f"{sorted(self.optimizers)}; was the checkpoint made with another --optimizer?")
        for k, opt in self.optimizers.items():
            built = [{f: g.get(f) for f in ("fused", "foreach")} for g in opt.param_groups]
            opt.load_state_dict(state[k])
            for g, b in zip(opt.param_groups, built):  # how this process runs the step is its own choice,
                g.update(b)                            # not the saving process's (fused or not: same update)


def split_params(model: nn.Module, adamw_modules: Iterable[str] = ("embed", "head")) -> tuple[list, list, list]:
    """-> (muon, adamw_decay, adamw_no_decay) lists of (name, param): Muon for Linear weights and 3-D stacks of
    real matrices; AdamW without weight decay for 1-D parameters and those marked `_no_weight_decay`.

    `adamw_modules` names top-level children that always go to AdamW (embedding, output head).
    """
    excluded = {id(p) for n in adamw_modules if hasattr(model, n) for p in getattr(model, n).parameters()}
    muon, decay, no_decay, seen = [], [], [], set()
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{pname}" if mod_name else pname
            is_conv = isinstance(mod, nn.modules.conv._ConvNd) or "conv" in pname
            if getattr(p, "_no_weight_decay", False):
                no_decay.append((name, p))
            elif id(p) in excluded:
                (decay if p.dim() >= 2 else no_decay).append((name, p))
            elif isinstance(mod, nn.Linear) and pname == "weight":
                muon.append((name, p))
            elif p.dim() == 3 and min(p.shape[-2:]) > 1 and not is_conv:  # a stack of real matrices
                muon.append((name, p))
            elif p.dim() >= 2 and not isinstance(mod, (nn.Embedding,)) and mod_name.split(".")[0] != "attnres":
                decay.append((name, p))
            else:
                no_decay.append((name, p))
    return muon, decay, no_decay


def _adamw(groups: list[dict], **kw) -> torch.optim.AdamW:
    """torch's AdamW, fused (one kernel over all tensors; its step time: docs/benchmarks.md, "Train") where every
    parameter is a plain CPU or CUDA float tensor; the per-tensor form otherwise (DTensor parameters under FSDP).
    Same update up to float rounding (tests/train/test_train_optim.py)."""
    params = [p for g in groups for p in g["params"]]
    fused = all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") and p.is_floating_point()
                for p in params)
    return torch.optim.AdamW(groups, fused=fused or None, **kw)


def build_optimizer(model: nn.Module, name: str = "adamw", lr: float = 1e-3, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95,
                    adamw_lr: float | None = None) -> OptimizerList:
    """`adamw`: AdamW on everything (no decay on 1-D params). `muon`: Muon on matrices, AdamW on the rest.

    With Muon's RMS matching, both use the same peak `lr` unless `adamw_lr` says otherwise.
    """
    muon, decay, no_decay = split_params(model)
    adamw_lr = lr if adamw_lr is None else adamw_lr
    if name == "adamw":
        decay = muon + decay
        groups = [{"params": [p for _, p in decay], "weight_decay": weight_decay, "lr": adamw_lr, "kind": "decay"},
                  {"params": [p for _, p in no_decay], "weight_decay": 0.0, "lr": adamw_lr, "kind": "no_decay"}]
        return OptimizerList({"adamw": _adamw([g for g in groups if g["params"]], lr=adamw_lr, betas=betas,
                                              eps=eps)})
    if name == "muon":
        log.debug("muon: %d tensors (%d params); adamw: %d tensors", len(muon),
                  sum(p.numel() for _, p in muon), len(decay) + len(no_decay))
        groups = [{"params": [p for _, p in decay], "weight_decay": weight_decay, "lr": adamw_lr, "kind": "decay"},
                  {"params": [p for _, p in no_decay], "weight_decay": 0.0, "lr": adamw_lr, "kind": "no_decay"}]
        adamw_groups = [g for g in groups if g["params"]]
        return OptimizerList({
            "muon": Muon([{"params": [p for _, p in muon], "kind": "muon"}], lr=lr, momentum=momentum,
                         weight_decay=weight_decay) if muon else None,
            "adamw": _adamw(adamw_groups, lr=adamw_lr, betas=betas, eps=eps) if adamw_groups else None,
        })
    raise ValueError(f"unknown optimizer {name!r}; choose adamw or muon")


# ---------------------------------------------------------------------- QK-Clip (MuonClip)
def mla_layers(model: nn.Module) -> list[nn.Module]:
    """Modules that support QK-Clip: anything with `track_max_logits`, `max_logits` and `qk_clip_`."""
    return [m for m in model.modules() if hasattr(m, "track_max_logits") and hasattr(m, "qk_clip_")]


class QKClip:
    """MuonClip's QK-Clip across a model's MLA layers, with the max logit taken over a whole optimizer step.

    `observe()` after each micro-batch forward keeps the running per-head max of every layer's `max_logits`;
    `apply()` after the optimizer step hands that max to each layer's `qk_clip_(tau)` (which knows its own
    row layout) and resets. Returns the largest logit seen, for metrics.
    """

    def __init__(self, model: nn.Module, tau: float = 100.0):
        assert tau > 0, f"QK-Clip tau = {tau} must be positive (TrainConfig: qk_clip_tau = 0 disables it)"
        self.tau = tau
        self.layers = mla_layers(model)
        for m in self.layers:
            m.track_max_logits = True
        self._max: list[torch.Tensor | None] = [None] * len(self.layers)

    def observe(self) -> None:
        for i, m in enumerate(self.layers):
            if m.max_logits is not None:
                s = m.max_logits.detach().float()
                self._max[i] = s if self._max[i] is None else torch.maximum(self._max[i], s)

    @torch.no_grad()
    def apply(self) -> dict:
        """-> {"max_logit": float, "clipped_heads": int} over all MLA layers for this step."""
        top, clipped = float("-inf"), 0
        for i, m in enumerate(self.layers):
            s = self._max[i]
            if s is None:
                continue
            top = max(top, float(s.max()))
            m.max_logits = s.to(m.max_logits.dtype if m.max_logits is not None else s.dtype)
            gamma = m.qk_clip_(self.tau)
            clipped += int((gamma < 1).sum())
            self._max[i] = None
        return {"max_logit": top if self.layers else None, "clipped_heads": clipped}
