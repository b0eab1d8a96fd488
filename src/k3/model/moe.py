"""Channel mixing: gated MLPs (SiTU-GLU or SwiGLU, k3.ops.glu), the sigmoid top-k router with load balancing,
routed experts, (Latent)MoE.

- Router (DeepSeek-V3): the top-k experts are chosen on sigmoid scores plus a bias b that steers selection only;
  the gating weights are the unbiased scores of the chosen experts, normalised and scaled by `routed_scale`.
  Balancing 'aux_loss', 'bias' or 'quantile' (Quantile Balancing, as K3 ships it); 'bias' and 'quantile'
  accumulate statistics until `update_balancing()`, called once per optimizer step.
- LatentMoE: routed experts work in a latent width l < d behind a shared W_down and W_up (K3's "Stable" form
  normalises the combined latent); the router and the shared expert read the full-width token.
- Routed experts are stacked weights w1/w3 [E, dim, ffn], w2 [E, ffn, dim]; `RoutedExperts.impl` picks 'naive'
  (the reference), 'loop' or 'grouped' (`grouped_glu`). Under `config.qat` every path fake-quantizes alike.
Formulas, sources and measurements: docs/moe.md; QAT: docs/quantization.md.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.ops.amp import as_dtype, at_least_fp32, autocast_on, no_autocast
from k3.ops.glu import glu_for, silu_glu
from k3.model import packing
from k3.model.qat import qat_format
from k3.ops.mx.fake import fake_quant

IMPLS = ("naive", "loop", "grouped")
GROUPED_BACKENDS = ("auto", "grouped_mm", "bmm", "slices")


class GatedMLP(nn.Module):
    """x [..., d_in] -> [..., d_in]:  w2(glu(w1 x, w3 x)), w1 gate, w3 up [d_ff, d_in], w2 down [d_in, d_ff];
    glu (k3.ops.glu) is SwiGLU's silu(g) * u unless given (K3: SiTU)."""

    def __init__(self, d_in: int, d_ff: int, init_std: float = 0.02, glu=silu_glu):
        super().__init__()
        self.glu = glu
        self.w1 = nn.Linear(d_in, d_ff, bias=False)
        self.w3 = nn.Linear(d_in, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_in, bias=False)
        if self.w1.weight.device.type != "meta":
            for w in (self.w1.weight, self.w3.weight, self.w2.weight):
                nn.init.normal_(w, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = packing.packed_linear(self, "w13", (self.w1, self.w3), x)  # one product without gradients
        return self.w2(self.glu(gate, up))


# ---------------------------------------------------------------------------------------------- router
class Router(nn.Module):
    """x [B, T, dim] (or [N, dim], one sequence) -> (weights [N, k], experts [N, k]), N = B*T tokens.

    State: `weight` [E, dim] (learned), `bias` [E] (buffer, never a gradient; moved by `update_balancing`),
    `last_load` [E] (token-slots per expert in the last forward), `aux_loss` (scalar tensor, or None).
    """

    def __init__(self, config: K3Config, dim: int):
        super().__init__()
        self.dim = dim
        self.n_experts, self.top_k = config.n_experts, config.n_active_experts
        self.routed_scale = config.routed_scale
        self.balancing = config.balancing
        self.bias_update_rate = config.bias_update_rate
        self.aux_loss_coef = config.aux_loss_coef
        self.weight = nn.Parameter(torch.empty(self.n_experts, dim))
        self.register_buffer("bias", torch.zeros(self.n_experts))  # persistent: inference routes with it
        self.register_buffer("_load_acc", torch.zeros(self.n_experts), persistent=False)
        self._margins: list[torch.Tensor] = []  # quantile balancing: margin rows since the last update
        self.aux_loss: torch.Tensor | None = None
        self.last_load: torch.Tensor | None = None
        self.quantile_estimator, self.quantile_bins = config.quantile_estimator, config.quantile_bins
        if self.balancing == "quantile" and self.quantile_estimator == "histogram":
            # counts of r_ij per expert and bin since the last update, and the range they are binned over: the
            # release's [min b - 1, max b + 1] of the current bias (r = alpha - s always lies inside it)
            self.register_buffer("_qb_hist", torch.zeros(self.n_experts, self.quantile_bins), persistent=False)
            self.register_buffer("qb_bounds", torch.tensor([-1.0, 1.0]))
        # Public switch: False makes training forwards route without accumulating balancing statistics
        # (the recompute pass of activation checkpointing must not count its tokens twice).
        self.collect_stats = True
        # Set by `balancing_token_mask`: [B, T] bool, False at padding, which must not steer the balance.
        self.token_mask: torch.Tensor | None = None
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=config.init_std)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> sigmoid affinities [..., E] in fp32 (fp64 in an fp64 model; the top-k decision compares
        close values), also under autocast, which would otherwise run the fp32 matmul in bf16 again."""
        with no_autocast(x.device.type):
            return torch.sigmoid(F.linear(at_least_fp32(x), at_least_fp32(self.weight)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.scores(x).reshape(-1, self.n_experts)  # [N, E]
        bias = self.bias if self.bias.dtype == torch.float32 else self.bias.float()
        biased = s.detach() + bias
        experts = biased.topk(self.top_k, dim=-1).indices  # selection on s + b ...
        g = s.gather(-1, experts)  # ... weights from the unbiased s
        weights = g / (g.sum(-1, keepdim=True) + 1e-20)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale

        keep = self._kept_tokens(x)  # None: every token counts
        counted = experts if keep is None else experts[keep]
        load = torch.bincount(counted.reshape(-1), minlength=self.n_experts)
        self.last_load = load.detach()
        self.aux_loss = None
        if self.balancing == "aux_loss" and self.training:
            seqs = x.shape[0] if x.dim() == 3 else 1
            self.aux_loss = self._sequence_balance_loss(s.view(seqs, -1, self.n_experts), experts.view(seqs, -1, self.top_k),
                                                        None if keep is None else keep.view(seqs, -1))
        # evaluation forwards (eval mode, or no grad on a model left in train mode) do not steer the balance
        if self.training and self.collect_stats and torch.is_grad_enabled():
            self._accumulate(biased if keep is None else biased[keep], load)
        return weights, experts

    def _kept_tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """The flat [N] mask of tokens that count in the balancing statistics, from `token_mask`."""
        if self.token_mask is None:
            return None
        assert tuple(self.token_mask.shape) == tuple(x.shape[:-1]), (
            f"balancing_token_mask got a mask of shape {tuple(self.token_mask.shape)}, but the router sees tokens of "
            f"shape {tuple(x.shape[:-1])}; pass the [B, T] mask of the batch forwarded")
        return self.token_mask.reshape(-1).to(device=x.device, dtype=torch.bool)

    def _sequence_balance_loss(self, s: torch.Tensor, experts: torch.Tensor,
                               keep: torch.Tensor | None = None) -> torch.Tensor:
        """DeepSeek-V3 eq. 17-20, averaged over sequences: alpha * sum_i f_i P_i with
        f_i = E / (k T) * #{t: i in topk(t)} and P_i = mean_t s_{i,t} / sum_j s_{j,t}. With `keep` [B, T], T and
        the sums run over the kept tokens of each sequence, and sequences with none are left out."""
        B, T, E = s.shape
        chosen = torch.zeros(B, T, E, device=s.device).scatter_(-1, experts, 1.0)
        if keep is None:
            f = chosen.sum(1) * (E / (self.top_k * T))  # [B, E], no gradient (a count)
            P = (s / s.sum(-1, keepdim=True)).mean(1)  # [B, E]
            return self.aux_loss_coef * (f * P).sum(-1).mean()
        w = keep.to(s.dtype).unsqueeze(-1)  # [B, T, 1]
        n = w.sum(1)  # [B, 1] kept tokens per sequence
        f = (chosen * w).sum(1) * E / (self.top_k * n.clamp_min(1))
        P = (s / s.sum(-1, keepdim=True) * w).sum(1) / n.clamp_min(1)
        per_seq = (f * P).sum(-1)
        has = n.squeeze(-1) > 0
        return self.aux_loss_coef * (per_seq[has].mean() if bool(has.any()) else per_seq.sum() * 0.0)

    # ------------------------------------------------------------------ balancing
    @torch.no_grad()
    def _accumulate(self, biased: torch.Tensor, load: torch.Tensor) -> None:
        if self.balancing == "bias":
            self._load_acc += load.to(self._load_acc.dtype)
        elif self.balancing == "quantile" and self.top_k < self.n_experts:
            # alpha_i: the token's (k+1)-th biased score. margin > 0 exactly for the k chosen experts.
            alpha = biased.topk(self.top_k + 1, dim=-1).values[:, -1:]
            if self.quantile_estimator == "histogram":
                r = alpha - (biased - self.bias.float())  # alpha_i - s_ij: expert j is chosen iff r_ij < b_j
                lo, hi = self.qb_bounds.float().unbind()  # tensors: no host sync per forward on an accelerator
                idx = ((r - lo) * (self.quantile_bins / (hi - lo))).floor().clamp_(0, self.quantile_bins - 1).long()
                self._qb_hist.scatter_add_(1, idx.t(), torch.ones_like(idx.t(), dtype=self._qb_hist.dtype))
            else:
                self._margins.append(biased - alpha)

    @torch.no_grad()
    def update_balancing(self) -> None:
        """Apply the bias update from the statistics accumulated since the last call; once per optimizer step."""
        if self.balancing == "bias" and self._load_acc.sum() > 0:
            load = _all_reduce_sum(self._load_acc.clone())
            self.bias -= self.bias_update_rate * torch.sign(load - load.mean()).to(self.bias.dtype)
        elif self.balancing == "quantile" and self.quantile_estimator == "histogram":
            hist = _all_reduce_sum(self._qb_hist.clone())
            if hist.sum() > 0:
                lo, hi = (float(v) for v in self.qb_bounds)
                b = histogram_lower_quantile(hist, self.top_k / self.n_experts, lo, hi)
                self.bias.copy_((b - b.mean()).to(self.bias.dtype))
                self.qb_bounds.copy_(torch.stack([self.bias.min() - 1, self.bias.max() + 1]).to(self.qb_bounds.dtype))
            self._qb_hist.zero_()
        elif self.balancing == "quantile" and self._margins:
            margins = torch.cat(self._margins)
            # c_j: the margin that exactly k/n of all tokens exceed in column j; shifting b_j by -c_j leaves
            # about k/n of the tokens above their threshold for expert j (Su's beta_j, with b = -beta).
            c = _column_quantile(margins, self.top_k / self.n_experts, self._margin_bound(), self.quantile_bins)
            self.bias -= c.to(self.bias.dtype)
            # a shift shared by every expert changes no token's top-k, so the mean is pinned to 0: in balance each
            # c_j is a small positive number (the (q+1)-th margin of a column is a token's (k+1)-th expert, at
            # exactly 0, so the midpoint sits above it), and without this every bias drifted down without bound
            self.bias -= self.bias.mean()
        self._load_acc.zero_()
        self._margins = []

    def _margin_bound(self) -> float:
        # sigmoid scores lie in (0, 1), so every biased score lies in [min b, 1 + max b] and |margin| <= R.
        return 1.0 + float(self.bias.max() - self.bias.min())


@contextlib.contextmanager
def _routers_set(module: nn.Module, name: str, value):
    """Inside the block, attribute `name` of every Router under `module` is `value`; restored after."""
    routers = [m for m in module.modules() if isinstance(m, Router)]
    before = [getattr(r, name) for r in routers]
    for r in routers:
        setattr(r, name, value)
    try:
        yield
    finally:
        for r, b in zip(routers, before):
            setattr(r, name, b)


def balancing_stats_paused(module: nn.Module):
    """Inside the block, every Router under `module` routes without accumulating balancing statistics."""
    return _routers_set(module, "collect_stats", False)


def balancing_token_mask(module: nn.Module, mask: torch.Tensor):
    """Inside the block, every Router under `module` counts only the tokens where `mask` ([B, T] bool, the batch
    being forwarded) is True in its balancing statistics: the bias and quantile updates, the aux loss and
    `last_load`. Routing itself is unchanged. Right-padded batches (SFT, GRPO, distillation) pass
    `ids != PAD`, so a column of identical padding tokens does not push its experts' biases down."""
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 2, \
        f"balancing_token_mask wants a [B, T] bool tensor, got {getattr(mask, 'shape', mask)!r} " \
        f"{getattr(mask, 'dtype', type(mask).__name__)}"
    return _routers_set(module, "token_mask", mask)


def _dist_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if _dist_world() > 1:
        import torch.distributed as dist

        dist.all_reduce(t)
    return t


def _column_quantile(u: torch.Tensor, frac: float, bound: float, bins: int) -> torch.Tensor:
    """u [M, E] -> c [E]: per column, the value that a fraction `frac` of the (global) rows exceed.

    One process: exact, the midpoint between the q-th and (q+1)-th largest value, q = round(frac * M).
    Data parallel: rows live on different ranks, so each rank histograms its rows on fixed edges over
    [-bound, bound] (the same on every rank, since b is replicated), one all-reduce sums the [E, bins]
    counts, and the crossing bin is interpolated linearly. The result lies in the bin that holds the q-th
    largest value; with few rows it can differ from the exact midpoint by up to half the gap between the q-th
    and (q+1)-th values (docs/moe.md measures it).
    """
    if _dist_world() > 1:
        return histogram_column_quantile(u, frac, bound, bins, all_reduce=_all_reduce_sum)
    M = u.shape[0]
    if M < 2:
        return u.new_zeros(u.shape[1])
    q = min(max(round(frac * M), 1), M - 1)
    top = u.topk(q + 1, dim=0).values  # [q + 1, E], descending
    return 0.5 * (top[q - 1] + top[q])


def histogram_lower_quantile(hist: torch.Tensor, frac: float, lo: float, hi: float) -> torch.Tensor:
    """hist [E, bins]: counts of values binned evenly over [lo, hi] -> [E], per row the value below which a fraction
    `frac` of its counts lie: the first bin whose cumulative count reaches max(ceil(frac * n), 1), entered by
    linear interpolation within it (Megatron-LM's quantile balancing update, PR #6637)."""
    E, bins = hist.shape
    n = hist.sum(1)
    target = frac * n
    rank = torch.clamp(torch.ceil(target), min=1)
    cum = hist.cumsum(1)
    i = (cum < rank[:, None]).sum(1).clamp(max=bins - 1)  # the first bin whose cumulative count reaches rank
    before = cum.gather(1, i[:, None])[:, 0] - hist.gather(1, i[:, None])[:, 0]
    in_bin = hist.gather(1, i[:, None])[:, 0]
    t = ((target - before) / in_bin.clamp(min=1)).clamp(0, 1)
    return lo + (i.to(hist.dtype) + t) * ((hi - lo) / bins)


def histogram_column_quantile(u: torch.Tensor, frac: float, bound: float, bins: int, all_reduce=None) -> torch.Tensor:
    """Histogram estimate of `_column_quantile` (the distributed path); `all_reduce(t)` sums t over ranks."""
    M, E = u.shape
    width = 2.0 * bound / bins
    b = ((u.float() + bound) / width).floor().clamp_(0, bins - 1).long()  # [M, E] bin of each margin
    hist = torch.zeros(E, bins + 1, device=u.device)  # last column: this rank's row count
    hist[:, :bins].scatter_add_(1, b.t(), torch.ones_like(b.t(), dtype=hist.dtype))
    hist[:, bins] = M
    if all_reduce is not None:
        hist = all_reduce(hist)
    counts, total = hist[:, :bins], hist[0, bins]
    q = frac * total
    above = counts.flip(1).cumsum(1).flip(1)  # above[j, i]: rows with margin in bin i or higher
    # the highest bin i whose "at or above" count reaches q holds the quantile
    i = ((above >= q).float() * torch.arange(bins, device=u.device)).argmax(1)  # highest bin reaching q
    above_next = F.pad(above, (0, 1)).gather(1, (i + 1)[:, None])[:, 0]
    in_bin = counts.gather(1, i[:, None])[:, 0]
    # within bin i, spread its values evenly; the (q - above_next) largest of them lie above the answer
    t = ((q - above_next) / in_bin.clamp(min=1)).clamp(0, 1)
    return -bound + (i.float() + 1 - t) * width


# ---------------------------------------------------------------------------------------------- experts
def grouped_glu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                backend: str = "auto", act=None, glu=silu_glu) -> torch.Tensor:
    """x [S, dim] sorted by expert, counts [E] (sum S) -> [S, dim]; rows of expert e use w1[e], w3[e], w2[e].

    backends: 'grouped_mm' (torch._grouped_mm, one call per weight), 'bmm' (pad each expert to the largest
    count, batched matmul), 'slices' (a loop over experts on contiguous slices). 'auto' picks per device.
    `act`, if given, maps the hidden h [..., ffn] before w2 row by row (QAT's activation fake-quant); `glu`
    is the gated unit (gate, up) -> h (k3.ops.glu).
    """
    act = act or (lambda h: h)
    if backend == "auto":
        backend = _grouped_backend(x, counts, w1, w2)
    if backend == "grouped_mm":
        if not _rows_aligned(x, w1, w2):
            raise ValueError(f"grouped backend 'grouped_mm' needs every width (dim {x.shape[-1]}, ffn "
                             f"{w1.shape[-1]}) to be a multiple of {16 // x.element_size()} in {x.dtype} (torch."
                             "_grouped_mm takes rows of a multiple of 16 bytes); use backend 'slices' or 'auto'")
        # torch._grouped_mm wants one dtype; under autocast x arrives in bf16 while the weights are fp32
        w1, w3, w2 = (w.to(x.dtype) for w in (w1, w3, w2))
        offs = counts.cumsum(0).to(torch.int32)
        h = glu(torch._grouped_mm(x, w1, offs=offs), torch._grouped_mm(x, w3, offs=offs))
        return torch._grouped_mm(act(h), w2, offs=offs)
    if backend == "bmm":
        E, C = counts.shape[0], int(counts.max()) if x.shape[0] else 0
        expert = torch.repeat_interleave(torch.arange(E, device=x.device), counts)
        pos = torch.arange(x.shape[0], device=x.device) - (counts.cumsum(0) - counts)[expert]
        xp = x.new_zeros(E, C, x.shape[1]).index_put((expert, pos), x)  # [E, C, dim], zero rows pad
        h = glu(torch.bmm(xp, w1), torch.bmm(xp, w3))
        return torch.bmm(act(h), w2)[expert, pos]
    if backend == "slices":
        # unbind, not w[e]: the backward of each w[e] select allocates and zero-fills a whole [E, ...]
        # gradient (3 * E of them a layer, most of a CPU training step at 64 experts); unbind's backward
        # stacks the E expert gradients once
        outs, w1s, w3s, w2s = [], w1.unbind(0), w3.unbind(0), w2.unbind(0)
        for e, xe in enumerate(torch.split(x, counts.tolist())):
            if xe.shape[0]:
                outs.append(act(glu(xe @ w1s[e], xe @ w3s[e])) @ w2s[e])
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])
    raise ValueError(f"grouped backend {backend!r} is unknown; use one of {GROUPED_BACKENDS}")


CPU_GROUPED_MM_ROWS_PER_THREAD = 64  # CPU: torch._grouped_mm while the mean rows per expert <= this x threads


def _rows_aligned(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch._grouped_mm refuses operands whose rows are not a multiple of 16 bytes (torch 2.13): every width
    the experts' matmuls read or write, in x's dtype (the weights are cast to it)."""
    return all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], w1.shape[-1], w2.shape[-1]))


def _grouped_backend(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> str:
    """The one place that picks the grouped kernel for a device / dtype (timings: docs/benchmarks.md, MoE).

    CUDA: torch._grouped_mm for bf16, one kernel per weight instead of one launch per expert. CPU: a loop
    over the contiguous slices once the experts' matmuls are large enough to dominate; padded bmm lost to the
    slices everywhere (padding and the scatter into [E, C, dim] cost more than batching saves). With few rows
    per expert the loop's per-expert overhead shows, and torch._grouped_mm (CPU fp32, forward and backward) is
    faster. Hence grouped_mm up to 64 rows per expert per thread (`CPU_GROUPED_MM_ROWS_PER_THREAD`), except under
    torch.compile, whose fake-tensor rule for torch._grouped_mm (torch 2.13) accepts bf16 only, and under CPU
    autocast (it casts an fp32 x to bf16 there, for which the CPU kernel has no rule). Widths that are not a
    multiple of 16 bytes (`_rows_aligned`) take the slices on any device.
    """
    if not hasattr(torch, "_grouped_mm") or not _rows_aligned(x, w1, w2):
        return "slices"
    if x.device.type == "cuda":
        return "grouped_mm" if x.dtype == torch.bfloat16 else "slices"
    few_rows = x.shape[0] <= CPU_GROUPED_MM_ROWS_PER_THREAD * torch.get_num_threads() * counts.numel()
    if (x.device.type == "cpu" and x.dtype == torch.float32 and few_rows and not torch.compiler.is_compiling()
            and not torch.is_autocast_enabled("cpu")):
        return "grouped_mm"
    return "slices"


_EXPERTS_ON_META = contextvars.ContextVar("k3_routed_experts_on_meta", default=False)


@contextlib.contextmanager
def routed_experts_on_meta():
    """Within it, RoutedExperts put their stacked weights on the meta device (no memory, no init): for a model
    whose routed experts are replaced right away (the packed MX model), the rest of it built as usual."""
    token = _EXPERTS_ON_META.set(True)
    try:
        yield
    finally:
        _EXPERTS_ON_META.reset(token)


class RoutedExperts(nn.Module):
    """E gated-MLP experts dim -> ffn -> dim (`glu`: k3.ops.glu, SwiGLU unless given) as stacked weights;
    forward(x [N, dim], weights [N, k], experts [N, k])
    -> sum_j weights[:, j] * expert_{experts[:, j]}(x)  [N, dim].

    QAT: `weight_format` fake-quantizes w1, w3, w2 along their reduction dim (dim, dim, ffn); `act_format`
    fake-quantizes x and the hidden h along their last dim. Every impl goes through `expert_weights()` and
    `quant_act()`, so a subclass that stores the weights differently (k3.quant.export) overrides just those.
    """

    def __init__(self, n_experts: int, dim: int, ffn: int, init_std: float = 0.02,
                 weight_format: str | None = None, act_format: str | None = None, glu=silu_glu):
        super().__init__()
        self.n_experts, self.dim, self.ffn = n_experts, dim, ffn
        self.glu = glu
        self.weight_format, self.act_format = weight_format, act_format
        device = "meta" if _EXPERTS_ON_META.get() else None  # see routed_experts_on_meta
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, ffn, device=device))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, ffn, device=device))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, ffn, dim, device=device))  # down
        self.impl = "grouped"
        self.backend = "auto"
        if self.w1.device.type != "meta":
            for w in (self.w1, self.w3, self.w2):
                nn.init.normal_(w, std=init_std)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and autocast_on("cpu"):
            # CPU autocast: the experts stay fp32. Their matmuls are small (mini: ~128 rows per expert), where bf16
            # gains 1.2-1.5x, but casting the stacked weights each step and their gradients back cost more than
            # that in a full step (docs/training.md, "bf16 on a CPU")
            with no_autocast("cpu"):
                return self.forward(at_least_fp32(x), weights, experts)
        w = self.expert_weights()
        weights = weights.to(x.dtype)
        x = self.quant_act(x)
        if x.shape[0] == 0:  # no tokens: an empty output that stays in the graph (zero gradients, not none)
            return x.new_zeros(0, self.dim) + 0 * (x.sum() + weights.sum() + sum(t.sum() for t in w))
        if self.impl == "naive":
            return self._naive(x, weights, experts, *w)
        if self.impl == "loop":
            return self._loop(x, weights, experts, *w)
        if self.impl == "grouped":
            return self._grouped(x, weights, experts, *w)
        raise ValueError(f"RoutedExperts.impl = {self.impl!r} is unknown; use one of {IMPLS}")

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1 [E, dim, ffn], w3 [E, dim, ffn], w2 [E, ffn, dim]) as the GEMMs use them."""
        return tuple(fake_quant(w, self.weight_format, dim=1) for w in (self.w1, self.w3, self.w2))

    def quant_act(self, a: torch.Tensor) -> torch.Tensor:
        """a [..., n] entering an expert GEMM (n is its reduction dim) -> fake-quantized under QAT."""
        return fake_quant(a, self.act_format)

    def _naive(self, x, weights, experts, w1, w3, w2):
        """Reference: every token, every chosen slot, one expert at a time."""
        rows = []
        for n in range(x.shape[0]):
            y = x.new_zeros(self.dim)
            for j in range(experts.shape[1]):
                e = int(experts[n, j])
                h = self.quant_act(self.glu(x[n] @ w1[e], x[n] @ w3[e]))
                y = y + weights[n, j] * (h @ w2[e])
            rows.append(y)
        return torch.stack(rows) if rows else x.new_zeros(0, self.dim)

    def _loop(self, x, weights, experts, w1, w3, w2):
        """Per expert: find its tokens, gather, run, scatter-add back (the common eager MoE pattern). The
        weights are unbound into per-expert views once: indexing w[e] in the loop would make backward
        allocate and zero a gradient the size of the whole stacked weight for every expert."""
        y = x.new_zeros(x.shape)
        w1s, w3s, w2s = w1.unbind(0), w3.unbind(0), w2.unbind(0)
        for e in range(self.n_experts):
            tok, slot = torch.where(experts == e)
            if tok.numel() == 0:
                continue
            xe = x[tok]
            out = self.quant_act(self.glu(xe @ w1s[e], xe @ w3s[e])) @ w2s[e]
            y.index_add_(0, tok, out * weights[tok, slot, None])
        return y

    def _grouped(self, x, weights, experts, w1, w3, w2):
        """Sort the N*k token-slots by expert once, run all experts as grouped matmuls, unsort, combine."""
        N, k = experts.shape
        if self.backend == "auto" and _few_slots(x, experts, w1):
            return self._few_tokens(x, weights, experts, w1, w3, w2)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)
        out_sorted = grouped_glu(x[order // k], counts, w1, w3, w2, self.backend, act=self.quant_act, glu=self.glu)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        out = out_sorted[inverse].view(N, k, self.dim)
        return torch.bmm(weights.unsqueeze(1), out).squeeze(1)

    def _few_tokens(self, x, weights, experts, w1, w3, w2):
        """`_grouped` for a decode step (`_few_slots`): only the chosen experts run, each on its rows, and the glu
        once over all rows. torch._grouped_mm's CPU kernel visits all E experts, the empty ones too: at batch 1
        (8 of 64 chosen) that was most of a decode step's MoE time (docs/serving.md, decode). Gate and up run as
        one product per expert when `_decode_pack` has them side by side."""
        N, k = experts.shape
        ids = experts.reshape(-1).tolist()
        if N == 1:  # k distinct experts, each run is one slot, in slot order, and every run reads x
            runs = [(e, j, j + 1) for j, e in enumerate(ids)]
            rows = [x] * k
        else:
            order = sorted(range(N * k), key=ids.__getitem__)  # token-slots grouped by expert (stable)
            runs, a = [], 0
            for b in range(1, N * k + 1):
                if b == N * k or ids[order[b]] != ids[order[a]]:
                    runs.append((ids[order[a]], a, b))
                    a = b
            order_t = torch.tensor(order, device=x.device)
            rows = x.index_select(0, order_t // k).split([b - a for _, a, b in runs])  # in expert order
        pack = self._decode_pack(w1, w3, w2)
        if pack is not None:
            w13s, w2s = pack
            gu = torch.cat([r @ w13s[e] for r, (e, _, _) in zip(rows, runs)])
            gate, up = gu.split(self.ffn, dim=-1)
        else:
            w2s = w2
            gate = torch.cat([r @ w1[e] for r, (e, _, _) in zip(rows, runs)])
            up = torch.cat([r @ w3[e] for r, (e, _, _) in zip(rows, runs)])
        h = self.quant_act(self.glu(gate, up))
        hs = h.split([b - a for _, a, b in runs])  # each run's rows, in one call
        out_sorted = torch.cat([r @ w2s[e] for r, (e, _, _) in zip(hs, runs)])
        if N == 1:  # the token's k outputs, weighted
            return weights @ out_sorted
        out = torch.empty_like(out_sorted).index_copy_(0, order_t, out_sorted).view(N, k, self.dim)
        return torch.bmm(weights.unsqueeze(1), out).squeeze(1)

    def _decode_pack(self, w1, w3, w2):
        """For `_few_tokens`: (per expert [dim, 2 ffn] gate and up side by side, per expert w2 views), or None.
        One contiguous 2x-wide product per expert reads its weights faster than two narrow ones. The rules are
        k3.model.packing's (a serving session's copy of w1 and w3, up to `PACK_MAX_BYTES`), for the plain stored
        weights only, not QAT's fake-quantized ones nor a subclass's own storage."""
        stored = tuple(getattr(self, n, None) for n in ("w1", "w3", "w2"))  # a subclass may store none
        if not (w1 is stored[0] and w3 is stored[1] and w2 is stored[2]) \
                or 2 * w1.numel() * w1.element_size() > packing.PACK_MAX_BYTES:
            return None
        return packing.cached_pack(self, "gate_up", (w1, w3, w2),
                                   lambda ws: (torch.cat(ws[:2], dim=-1).unbind(0), ws[2].unbind(0)))


DECODE_MAX_SLOTS = 64  # token-slots (tokens x top-k) up to which a gradient-free CPU call runs `_few_tokens`


def _few_slots(x: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor) -> bool:
    """A decode step's routed experts: on the CPU, no gradient, at most `DECODE_MAX_SLOTS` token-slots (batch 8 at
    top-8), where most of the E experts get no row."""
    return (x.device.type == "cpu" and experts.numel() <= DECODE_MAX_SLOTS
            and not (torch.is_grad_enabled() and (x.requires_grad or w1.requires_grad)))


# ---------------------------------------------------------------------------------------------- MoE
class MoE(nn.Module):
    """x [B, T, d_model] -> y [B, T, d_model]: shared expert(s) on every token plus top-k routed experts.

    moe='latent': y = shared(x) + W_up( norm( sum_j g_j E_j( W_down x ) ) ), experts in latent_dim; the RMSNorm
                  only with latent_moe_use_norm (K3's routed_expert_norm);
    moe='standard': y = shared(x) + sum_j g_j E_j(x), experts in d_model.
    `dispatch_dim` is the width of each routed token payload (what an all-to-all would move).
    """

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.d_model = config.d_model
        self.latent = config.moe == "latent"
        self.dispatch_dim = config.latent_dim
        d, l, std = config.d_model, config.latent_dim, config.init_std
        self.router = Router(config, d)  # full-width x: the routing decision costs E*d, not worth compressing
        if self.latent:
            self.w_down = nn.Linear(d, l, bias=False)
            self.w_up = nn.Linear(l, d, bias=False)
            if self.w_down.weight.device.type != "meta":
                nn.init.normal_(self.w_down.weight, std=std)
                nn.init.normal_(self.w_up.weight, std=std)
        self.latent_norm = (nn.RMSNorm(l, eps=config.norm_eps)
                            if self.latent and config.latent_moe_use_norm else None)
        glu = glu_for(config)
        self.experts = RoutedExperts(config.n_experts, l, config.expert_ffn, std,
                                     qat_format(config, "expert_weights"), qat_format(config, "activations"), glu)
        # n shared experts of width f, summed, are one gated MLP of width n*f (as DeepSeek-V3 builds them)
        self.shared = (GatedMLP(d, config.n_shared_experts * config.shared_ffn, std, glu)
                       if config.n_shared_experts > 0 else None)

    @property
    def impl(self) -> str:
        return self.experts.impl

    @impl.setter
    def impl(self, value: str) -> None:
        if value not in IMPLS:
            raise ValueError(f"MoE impl {value!r} is unknown; use one of {IMPLS}")
        self.experts.impl = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        weights, experts = self.router(x)
        h = x.reshape(B * T, d)
        z = self.w_down(h) if self.latent else h  # [N, dispatch_dim]: the payload routed to experts
        y = self.experts(z, weights, experts)
        if self.latent_norm is not None:  # in fp32, as the release's RMSNorm computes it
            n = self.latent_norm
            y = as_dtype(F.rms_norm(at_least_fp32(y), n.normalized_shape, at_least_fp32(n.weight), n.eps), y.dtype)
        if self.latent:
            y = self.w_up(y)
        if self.shared is not None:
            y = y + self.shared(h)
        return y.view(B, T, d)
