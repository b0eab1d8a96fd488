"""MoonEP in k3: routed experts sharded over EP ranks, tokens moved by all-to-all of the *latent* vectors.

`apply_expert_parallel` swaps each `MoE.experts` (a `RoutedExperts`, forward(z [N, l], weights [N, k], experts
[N, k]) -> [N, l]) for an `ExpertParallel` with the same contract that holds only this rank's slots of the stacked
weights. The router, the shared expert, W_down and W_up stay local, so a token-slot crosses the network as
l = moe_latent_dim numbers each way. Forward: route to slots (the placement), all-to-all of the counts, dispatch,
one grouped GLU, combine; backward runs the all-to-alls in reverse, and `sync_expert_grads` then sums the
gradients of replicas and shard copies. The steps in full: docs/distributed.md ("MoonEP in k3").
"""
from __future__ import annotations

import torch
from torch import nn

from k3.model.moe import MoE, RoutedExperts, grouped_glu
from k3.parallel import comm
from k3.parallel.placement import Placement, contiguous_placement

__all__ = ["ExpertParallel", "apply_expert_parallel", "expert_modules", "sync_expert_grads", "gather_experts"]


class ExpertParallel(nn.Module):
    """This rank's slots of a RoutedExperts: w1, w3 [S, dim, ffn], w2 [S, ffn, dim]; same forward contract."""

    def __init__(self, experts: RoutedExperts, placement: Placement, group=None, edp_group=None):
        super().__init__()
        R = comm.world_size(group)
        assert placement.n_ranks == R, f"placement is for {placement.n_ranks} EP ranks but the EP group has {R}"
        assert placement.n_experts == experts.n_experts, \
            f"placement is for {placement.n_experts} experts but the layer has {experts.n_experts}"
        self.n_experts, self.dim, self.ffn = experts.n_experts, experts.dim, experts.ffn
        # edp_group None: this shard has no copies on other ranks (group None would mean the whole world)
        self.placement, self.group, self.edp_group = placement, group, edp_group
        self.ep_rank = comm.rank(group)
        self.local = placement.local_experts(self.ep_rank)
        idx = torch.tensor(self.local)
        with torch.no_grad():
            self.w1 = nn.Parameter(experts.w1.detach()[idx].clone())
            self.w3 = nn.Parameter(experts.w3.detach()[idx].clone())
            self.w2 = nn.Parameter(experts.w2.detach()[idx].clone())
        self.impl = "grouped"  # MoE.impl sets this; EP always runs the grouped path
        self.backend = experts.backend
        # QAT: the same fake-quant as RoutedExperts (per expert along the reduction dim, so per slot too)
        self.weight_format = getattr(experts, "weight_format", None)
        self.act_format = getattr(experts, "act_format", None)
        self.glu = experts.glu
        self.last_recv_rows = 0  # token-slots this rank computed in the last forward
        self.last_recv_counts: torch.Tensor | None = None  # [S] per local slot

    # RoutedExperts' QAT hooks, shared rather than copied: they read only w1/w3/w2 and the two formats
    expert_weights = RoutedExperts.expert_weights
    quant_act = RoutedExperts.quant_act

    def extra_repr(self) -> str:
        return (f"experts={self.n_experts}, local slots={self.local}, ep_rank={self.ep_rank}/{self.placement.n_ranks}, "
                f"dim={self.dim}, ffn={self.ffn}")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        # the MoE layer's call, after K3Model.forward checked its input
        assert x.dim() == 2 and x.shape[-1] == self.dim and experts.shape == weights.shape \
            and experts.shape[0] == x.shape[0]
        R, S = self.placement.n_ranks, self.placement.slots_per_rank
        N, k = experts.shape
        slot = self.placement.route(experts.reshape(-1), self.ep_rank)  # [N*k] global slot
        order = torch.argsort(slot, stable=True)  # by destination rank, then its local slot
        send = torch.bincount(slot, minlength=R * S).view(R, S)
        recv = torch.empty_like(send)
        comm.all_to_all_single(recv, send, None, None, group=self.group, tag="ep_counts")
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        # under QAT the payload is fake-quantized before it leaves (where an MXFP8 dispatch would quantize)
        z = comm.all_to_all_rows(self.quant_act(x)[order // k], out_splits, in_splits, self.group, tag="ep_dispatch")
        # received rows come grouped by sender, then slot; the grouped matmul wants them by slot
        slot_of_row = torch.arange(R * S, device=x.device).remainder(S).repeat_interleave(recv.flatten())
        by_slot = torch.argsort(slot_of_row, stable=True)
        counts = recv.sum(0)
        self.last_recv_rows, self.last_recv_counts = int(counts.sum()), counts.detach()
        h = grouped_glu(z[by_slot], counts, *self.expert_weights(), self.backend, act=self.quant_act, glu=self.glu)
        if z.requires_grad and not h.requires_grad:
            # no rows arrived: keep the graph through both all-to-alls, whose backwards are collectives
            # that every rank of the group must enter, even with nothing to send
            h = h + 0.0 * z.sum()
        h = h[torch.argsort(by_slot)]
        y = comm.all_to_all_rows(h, in_splits, out_splits, self.group, tag="ep_combine")
        y = y[torch.argsort(order)].view(N, k, self.dim)
        return torch.bmm(weights.to(x.dtype).unsqueeze(1), y).squeeze(1)


def expert_modules(model: nn.Module) -> list[ExpertParallel]:
    return [m for m in model.modules() if isinstance(m, ExpertParallel)]


def apply_expert_parallel(model: nn.Module, group=None, edp_group=None,
                          placements: dict[int, Placement] | None = None) -> list[ExpertParallel]:
    """Replace every MoE's RoutedExperts by an ExpertParallel over `group` (in place).

    placements: {MoE index (0 = first MoE layer): Placement}; the rest get contiguous shards (which need
    n_experts divisible by the EP size; otherwise pass a balanced placement with redundant slots).
    """
    R = comm.world_size(group)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    placements = placements or {}
    out = []
    for i, moe in enumerate(moes):
        assert not isinstance(moe.experts, ExpertParallel), "expert parallelism is already applied to this model"
        p = placements.get(i) or contiguous_placement(moe.experts.n_experts, R)
        moe.experts = ExpertParallel(moe.experts, p, group, edp_group)
        out.append(moe.experts)
    return out


@torch.no_grad()
def sync_expert_grads(model: nn.Module, scale: float = 1.0) -> None:
    """After backward: every replica of an expert gets the sum of all replicas' gradients (EP group), copies
    of a shard get the sum over the edp group, then everything is multiplied by `scale` (e.g. 1 / dp for a
    loss that is the mean of per-rank means). Missing gradients become zeros, so that the optimizer steps
    every expert as the single-process run does."""
    for m in expert_modules(model):
        params = (m.w1, m.w3, m.w2)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        reps = m.placement.replicas()
        shared = [e for e in range(m.n_experts) if len(reps[e]) > 1]
        if shared:
            row = {e: i for i, e in enumerate(shared)}
            local = [(s, row[e]) for s, e in enumerate(m.local) if e in row]
            for p in params:
                buf = p.new_zeros(len(shared), *p.shape[1:])
                if local:
                    s_idx = torch.tensor([s for s, _ in local], device=p.device)
                    r_idx = torch.tensor([r for _, r in local], device=p.device)
                    buf.index_add_(0, r_idx, p.grad[s_idx])
                comm.all_reduce(buf, group=m.group, tag="ep_replica_grad")
                if local:
                    p.grad[s_idx] = buf[r_idx]
        if m.edp_group is not None and comm.world_size(m.edp_group) > 1:
            for p in params:
                comm.all_reduce(p.grad, group=m.edp_group, tag="edp_grad")
        if scale != 1.0:
            for p in params:
                p.grad.mul_(scale)


@torch.no_grad()
def gather_experts(m: ExpertParallel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All logical experts' weights (w1, w3, w2) [E, ...] on every EP rank, from each expert's first replica."""
    R, S = m.placement.n_ranks, m.placement.slots_per_rank
    first = torch.tensor([r[0] for r in m.placement.replicas()])
    out = []
    for p in (m.w1, m.w3, m.w2):
        full = p.new_empty(R * S, *p.shape[1:])
        comm.all_gather_single(full, p.detach().contiguous(), group=m.group, tag="ep_gather")
        out.append(full[first])
    return tuple(out)
