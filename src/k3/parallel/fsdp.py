"""FSDP2 (`fully_shard`) for the non-expert parameters, composed with expert parallelism.

Each sublayer (pre-norm + token mixer, pre-norm + channel mixer) is one FSDP unit (all-gathered before
its forward, resharded after), the root
unit holds the embedding, AttnRes queries, final norm and head. Expert weights are `ignored_params`:
EP already shards them, and their gradients are synchronised by `sync_expert_grads`, not by FSDP.
FSDP's all-gather and reduce-scatter go through k3.parallel.comm, so they are counted in bytes.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from k3.parallel import comm
from k3.parallel.expert import expert_modules

__all__ = ["apply_fsdp", "CountingAllGather", "CountingReduceScatter"]


class CountingAllGather(DefaultAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return comm.all_gather_single(output_tensor, input_tensor, group=group, tag="fsdp_all_gather",
                                      async_op=async_op)


class CountingReduceScatter(DefaultReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return comm.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, tag="fsdp_reduce_scatter",
                                          async_op=async_op)


def apply_fsdp(model: nn.Module, mesh, reshard_after_forward: bool = True) -> nn.Module:
    """fully_shard each sublayer of every `model.layers[i]` and then the root, over `mesh`, leaving expert weights alone."""
    # FSDP2 warns when a unit returns a view (MoE returns y.view(B, T, d)): an in-place op on it would skip
    # the pre-backward hook. AttnRes consumes sublayer outputs out of place (push adds or appends), which
    # the gradient tests against the single-process model confirm, so the warning is noise here.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    ignored = {p for m in expert_modules(model) for p in m.parameters()}
    units = []
    for block in model.layers:
        # K3Model calls a block's norms and mixers directly, never block(...), so the units are the two
        # sublayers (norm + token mixer, norm + channel mixer); fully_shard hooks their forwards
        for group in ([block.attn_norm, block.mixer], [block.ffn_norm, block.ffn]):
            own = {p for m in group for p in m.parameters()}
            fully_shard(group, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored & own)
            units.append(group[0])  # the modules of a group share one FSDP state
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    units.append(model)
    for u in units:
        u.set_custom_all_gather(CountingAllGather())
        u.set_custom_reduce_scatter(CountingReduceScatter())
    return model


def local_grad_sq(p: torch.nn.Parameter) -> torch.Tensor:
    """Sum of squares of this rank's piece of p.grad (a DTensor's local shard, or the plain tensor)."""
    g = p.grad
    dtype = torch.promote_types(p.dtype, torch.float32)  # fp32 at least; an fp64 run stays fp64
    if g is None:
        return torch.zeros((), dtype=dtype, device=p.device)
    g = g.to_local() if hasattr(g, "to_local") else g
    return g.to(dtype).pow(2).sum()
