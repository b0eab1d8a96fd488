"""Distributed training with FSDP2 + MoonEP (+ pipeline stages): the one loop in a distributed context.

Every rank builds the same model from the seed (as one process does); the context then applies expert
parallelism and FSDP2 from outside (with pp > 1 after keeping this rank's stage). A step is the single-process
step with three changes, so that the loss trajectory equals the single-process one:
  - data: rank r of dp takes rows [r*B/dp, (r+1)*B/dp) of each global micro-batch;
  - gradients: FSDP averages the non-expert gradients over dp, `sync_expert_grads` sums the experts' replica
    and shard-copy gradients and scales them by 1/dp; with pp > 1 the AttnRes parameters every stage holds get
    their gradients summed over the pipeline and a step runs GPipe over the `accum` micro-batches;
  - clipping: the global grad norm counts every element once (shards summed, replicas divided out).
Only AdamW: Muon orthogonalises whole matrices, and FSDP shards them.
"""
from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import torch

from k3.config import K3Config
from k3.parallel import checkpoint as pckpt
from k3.parallel import comm
from k3.parallel.expert import apply_expert_parallel, expert_modules, sync_expert_grads
from k3.parallel.fsdp import apply_fsdp, local_grad_sq
from k3.parallel.mesh import ParallelContext
from k3.parallel.pipeline import PipelineStage, check_tied_stages, prune_to_stage, run_gpipe, stage_shared_params
from k3.parallel.placement import Placement, contiguous_placement
from k3.train import checkpoint as ckpt
from k3.train.config import TrainConfig, check_schedule_fields
from k3.train.loop import check_data, holds_checkpoint
from k3.train.optim import build_optimizer
from k3.train.trainer import Trainer

log = logging.getLogger(__name__)

__all__ = ["parallelize", "DistributedContext", "ParallelTrainer", "global_grad_norm", "placements_from_loads"]


def parallelize(model, ctx: ParallelContext, placements: dict[int, Placement] | None = None, fsdp: bool = True):
    """MoonEP over ctx.ep_group (copies over edp), then FSDP2 over ctx.fsdp_mesh; in place."""
    edp = ctx.edp_group if ctx.dims.edp > 1 else None
    apply_expert_parallel(model, ctx.ep_group, edp, placements)
    if fsdp:
        apply_fsdp(model, ctx.fsdp_mesh)
    return model


def placements_from_loads(loads, ep: int, redundant_per_rank: int) -> dict[int, Placement]:
    """EPLB-style placements, one per MoE layer, from observed loads [n_moe_layers][E] (a checkpoint's
    `expert_loads`); redundant_per_rank extra slots on each EP rank hold replicas of the hottest experts."""
    from k3.parallel.placement import balanced_placement

    out = {}
    for i, layer in enumerate(loads):
        E = len(layer)
        assert E % ep == 0 or redundant_per_rank, f"n_experts = {E} is not divisible by ep = {ep}; add redundant slots"
        out[i] = balanced_placement(torch.tensor(layer, dtype=torch.float64), ep, -(-E // ep) + redundant_per_rank)
    return out


def global_grad_norm(model, ctx: ParallelContext) -> torch.Tensor:
    """The L2 norm of the whole (logical) gradient, equal on every rank (of the dp group; of the world when
    pp > 1, where the stage-shared AttnRes parameters, identical on every stage, count once)."""
    expert_params = {id(p) for m in expert_modules(model) for p in m.parameters()}
    replicate = ctx.dims.dp // ctx.dims.fsdp_size  # copies of each FSDP shard (HSDP)
    shared = {id(p) for _, p in stage_shared_params(model)} if ctx.dims.pp > 1 else set()
    # fp32 at least, fp64 in an fp64 run (as clip_grad_norm_ in the single-process Trainer)
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in model.parameters()) else torch.float32
    sq = torch.zeros((), dtype=dtype, device=ctx.device)
    for p in model.parameters():
        if id(p) not in expert_params and p.requires_grad:
            sq = sq + local_grad_sq(p) / (replicate * (ctx.dims.pp if id(p) in shared else 1))
    for m in expert_modules(model):
        copies = m.placement.n_replicas()[torch.tensor(m.local)].to(ctx.device, dtype) * ctx.dims.edp  # [S]
        for p in m.parameters():
            if p.grad is not None:
                sq = sq + (p.grad.to(dtype).pow(2).flatten(1).sum(1) / copies).sum()
    comm.all_reduce(sq, group=ctx.dp_group if ctx.dims.pp == 1 else None, tag="grad_norm")
    return sq.sqrt()


@torch.no_grad()
def sync_stage_shared_grads(model, ctx: ParallelContext) -> None:
    """Sum the gradients of the parameters every stage holds (AttnRes) over the pipeline: each stage's covers
    only its own sublayers. One all-reduce of the concatenated local shards over ctx.pp_group (the ranks with
    this dp index, which hold the same FSDP shards); missing gradients count as zeros."""
    params = [p for _, p in stage_shared_params(model)]
    if not params:
        return
    local = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        local.append(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
    flat = torch.cat([g.reshape(-1) for g in local])
    comm.all_reduce(flat, group=ctx.pp_group, tag="pp_shared_grad")
    for g, part in zip(local, flat.split([g.numel() for g in local])):
        g.copy_(part.view_as(g))


@contextlib.contextmanager
def router_balancing_over(group):
    """Inside the block, the routers' balancing statistics (k3.model.moe sums them over the default group,
    which with pp > 1 holds other stages' layers) are summed over `group` instead, through k3.parallel.comm."""
    from k3.model import moe

    saved = moe._dist_world, moe._all_reduce_sum

    def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, group=group, tag="router_balancing")
        return t

    moe._dist_world, moe._all_reduce_sum = (lambda: comm.world_size(group)), all_reduce_sum
    try:
        yield
    finally:
        moe._dist_world, moe._all_reduce_sum = saved


@torch.no_grad()
def clip_grads_(model, total_norm: torch.Tensor, max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_'s rule with a precomputed global norm."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            g.mul_(coef.to(g.dtype))


def check_parallel_settings(config: K3Config, tc: TrainConfig, dims, train_data=None) -> None:
    """What a distributed run refuses (ValueError naming the flag): checked by every rank, and once by the launcher
    before torchrun starts so that the user sees one line instead of one per rank and torchrun's traceback."""
    if dims.pp > config.n_layers:
        raise ValueError(f"--pp {dims.pp} stages cannot split {config.n_layers} layers; use --pp <= {config.n_layers}")
    check_tied_stages(config, dims.pp)
    if tc.seq_len > config.max_context:
        raise ValueError(f"--seq-len {tc.seq_len} exceeds the model's max_context = {config.max_context}; use "
                         f"--seq-len <= {config.max_context}")
    if tc.optimizer != "adamw":
        raise ValueError(f"--optimizer {tc.optimizer} with FSDP: Muon orthogonalises whole matrices and FSDP shards "
                         "them; use --optimizer adamw for distributed runs")
    if tc.batch_size % dims.dp:
        raise ValueError(f"--batch-size {tc.batch_size} does not split over {dims.dp} data-parallel ranks; use a "
                         f"multiple of {dims.dp}")
    if tc.activation_checkpointing or tc.compile:
        raise ValueError("--activation-checkpointing and --compile are not wired into distributed runs yet; drop them")
    if tc.max_minutes is not None:
        raise ValueError("--max-minutes is not wired into distributed runs yet (every rank would have to agree on "
                         "the stop); give --steps")
    if train_data is not None:
        from k3.train.batches import check_dataset

        check_dataset(train_data, "training", config, tc.batch_size, tc.seq_len, tc.seed,
                      min_tokens=tc.batch_size * tc.seq_len + 1)


def check_resume_meta(meta: dict, config: K3Config, tc: TrainConfig, data_info: dict | None) -> None:
    """What a distributed checkpoint (its meta) must share with the run that resumes it: the model config, the
    batch shape, accumulation and seed, and the data. Checked by the ranks and, once, by the launcher."""
    have, want = meta.get("config") or {}, config.to_dict()
    if have != want:
        diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
        raise ValueError(f"{meta['path']}: the checkpoint's model config differs from this run's in {diff}; "
                         "resume with the same --preset/--set")
    for k in ("batch_size", "seq_len", "accum", "seed"):
        if meta["train"][k] != getattr(tc, k):
            raise ValueError(f"{meta['path']}: {k} is {meta['train'][k]!r} in the checkpoint but "
                             f"{getattr(tc, k)!r} now; resume with the same {k}")
    check_schedule_fields(meta["train"], tc, str(meta["path"]))
    check_data(meta.get("data") or {}, data_info or {}, str(meta["path"]))


class DistributedContext:
    """The loop's parallel context over a ParallelContext (mesh, groups): rank r of dp trains on its rows of each
    global batch; experts are placed by MoonEP (`placements`: {MoE layer index over the whole model: Placement}),
    the rest sharded by FSDP2; with pp > 1 each rank keeps its pipeline stage. Rank 0 writes metrics, every rank
    writes its shards of the (DCP) checkpoints."""

    def __init__(self, ctx: ParallelContext, placements: dict[int, Placement] | None = None):
        self.mesh, self.dims, self.device = ctx, ctx.dims, ctx.device
        self.world, self.rank, self.dp = ctx.dims.world, ctx.rank, ctx.dims.dp
        self.placements = dict(placements or {})
        self.pipelined = ctx.dims.pp > 1
        self.stage = None

    def check(self, config: K3Config, tc: TrainConfig) -> None:
        check_parallel_settings(config, tc, self.dims)

    def prepare(self, model):
        config, ctx = model.config, self.mesh
        moe_ids = [i for i in range(config.n_layers) if config.is_moe_layer(i)]  # layer of each MoE index
        if self.pipelined:
            held = prune_to_stage(model, ctx.pp_rank, self.dims.pp)
            self._moe_index = [g for g, i in enumerate(moe_ids) if i in held]  # this stage's MoE layers
        else:
            self._moe_index = list(range(len(moe_ids)))
        self._n_moe, self._n_experts = len(moe_ids), config.n_experts
        local = {k: self.placements[g] for k, g in enumerate(self._moe_index) if g in self.placements}
        parallelize(model, ctx, local)
        if self.pipelined:
            self.stage = PipelineStage(model, ctx.pp_rank, self.dims.pp, ranks=ctx.pp_ranks, group=ctx.pp_group)
        # token-slots per expert seen since the last save, per MoE layer: EPLB's input at the next restart
        self._loads = [torch.zeros(config.n_experts, dtype=torch.float64) for _ in model.moe_layers()]
        return model

    def optimizer(self, model, tc: TrainConfig):
        opt = build_optimizer(model, "adamw", lr=tc.lr, weight_decay=tc.weight_decay, betas=tc.betas)
        for o in opt.optimizers.values():
            for g in o.param_groups:
                g["foreach"] = False  # one group mixes FSDP DTensors and plain expert tensors
        return opt

    def rows(self, batch_size: int) -> slice:
        b = batch_size // self.dp
        return slice(self.mesh.dp_rank * b, (self.mesh.dp_rank + 1) * b)

    def observe_loads(self, model) -> None:
        for acc, moe in zip(self._loads, model.moe_layers()):
            if moe.router.last_load is not None:
                acc += moe.router.last_load.to(acc)

    def pipeline_step(self, model, batches: list) -> float:
        """GPipe over the micro-batches; the global mean loss (from the last stage, on every rank)."""
        docs = [d for _, _, d in batches]
        losses = run_gpipe(self.stage, [x for x, _, _ in batches], [y for _, y, _ in batches],
                           on_forward=lambda m: self.observe_loads(model),
                           micro_docs=None if any(d is None for d in docs) else docs)
        # the last stage's losses (each mean CE / accum) reach every rank, rank 0 (first stage) included
        loss_sum = torch.tensor(sum(losses), dtype=torch.float64, device=self.device)
        comm.all_reduce(loss_sum, tag="loss")
        return float(loss_sum) / self.dp

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Summed over the data-parallel ranks (the loss of each rank's rows)."""
        comm.all_reduce(t, group=self.mesh.dp_group, tag="loss")
        return t

    def any(self, flag: bool) -> bool:
        """Whether any rank says so (a 4-byte all-reduce, MAX): every rank gets the same answer after the same step,
        so on a stop request they all save that step together and stop."""
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        comm.all_reduce(t, op=torch.distributed.ReduceOp.MAX, tag="stop_request")
        return bool(t.item())

    def barrier(self) -> None:
        comm.barrier()

    def clip_grads(self, model, params, max_norm: float) -> torch.Tensor:
        sync_expert_grads(model, 1.0 / self.dp)
        if self.pipelined:
            sync_stage_shared_grads(model, self.mesh)
        norm = global_grad_norm(model, self.mesh)
        if math.isfinite(float(norm)):  # a non-finite step is refused by the loop before the update
            clip_grads_(model, norm, max_norm)
        return norm

    def balancing(self):
        # with pp > 1 the world holds other stages' layers: balance over this stage's dp group
        return router_balancing_over(self.mesh.dp_group) if self.pipelined else contextlib.nullcontext()

    # ------------------------------------------------------------------ checkpoints
    def latest(self, ckpt_dir: Path) -> Path | None:
        return pckpt.latest(ckpt_dir)

    def holds_any(self, ckpt_dir: Path) -> bool:
        return holds_checkpoint(ckpt_dir)

    def save(self, loop) -> Path:
        # every MoE layer of the whole model: this stage fills its rows, the sum over the world adds the dp
        # ranks' token-slots and the other stages' rows
        loads = torch.zeros(self._n_moe, self._n_experts, dtype=torch.float64, device=self.device)
        for g, acc in zip(self._moe_index, self._loads):
            loads[g] = acc.to(loads.device)
        comm.all_reduce(loads, group=self.mesh.dp_group if not self.pipelined else None, tag="expert_loads")
        loads = loads.cpu()
        for acc in self._loads:
            acc.zero_()
        # placements of every MoE layer, as apply_expert_parallel made them (rank 0 holds only its stage's)
        placements = [self.placements.get(g) or contiguous_placement(self._n_experts, self.dims.ep)
                      for g in range(self._n_moe)]
        meta = {"config": loop.config.to_dict(), "train": loop.tc.to_dict(), "tokens": loop.tokens,
                "expert_loads": loads.tolist(),
                "dims": {"world": self.world, "ep": self.dims.ep, "fsdp": self.dims.fsdp_size, "pp": self.dims.pp},
                "placements": [p.to_dict() for p in placements], "data": loop.data_info}
        return pckpt.save(loop.ckpt_dir, loop.step, loop.model, loop.optimizer, self.mesh, meta, loop.tc.keep_last)

    def load(self, loop, path: Path) -> dict:
        if pckpt.latest(path) is None and ckpt.latest_checkpoint(path) is not None:
            raise ValueError(f"{path} holds a single-process checkpoint, not a distributed one; resume it without "
                             "--nproc (or start a new distributed run with another --out)")
        meta = pckpt.read_meta(path)  # checked before any collective load: a mismatch is a clear error, not DCP's
        check_resume_meta(meta, loop.config, loop.tc, loop.data_info)
        return pckpt.load(path, loop.model, loop.optimizer, self.mesh)


def ParallelTrainer(config: K3Config, tc: TrainConfig, train_data, ctx: ParallelContext, out_dir=None,
                    placements: dict[int, Placement] | None = None, overwrite: bool = False,
                    data_info: dict | None = None) -> Trainer:
    """The pretraining Trainer over a ParallelContext (the one loop in a distributed context)."""
    return Trainer(config, tc, train_data, None, out_dir, data_info=data_info, overwrite=overwrite,
                   ctx=DistributedContext(ctx, placements))
