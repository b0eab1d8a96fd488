"""Data-parallel training with FSDP2 + MoonEP: the trainer's step, with the batch split over ranks.

Every rank builds the same model from the seed (as the single-process Trainer does), then
`parallelize` applies expert parallelism and FSDP2 from outside. A step is the single-process step with
three changes, so that the loss trajectory equals the single-process one:
  - data: rank r of dp takes rows [r*B/dp, (r+1)*B/dp) of the global micro-batch `get_batch(step*accum +
    micro, B, T, seed)`, so the ranks together see exactly the single-process batch;
  - gradients: the loss is each rank's mean, FSDP averages the non-expert gradients over dp, and
    `sync_expert_grads` sums replica / shard-copy gradients of the experts and scales them by 1/dp;
  - clipping: the global grad norm counts every element once (shards summed, replicas divided out).
The router's balancing all-reduce (in k3.model.moe) sums expert loads over the world, which is the dp
group when pp = 1. Only AdamW: Muon orthogonalises whole matrices, and FSDP shards them.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from k3.config import K3Config
from k3.parallel import checkpoint as pckpt
from k3.parallel import comm
from k3.parallel.expert import apply_expert_parallel, expert_modules, sync_expert_grads
from k3.parallel.fsdp import apply_fsdp, local_grad_sq
from k3.parallel.mesh import ParallelContext
from k3.parallel.placement import Placement
from k3.train.optim import build_optimizer
from k3.train.trainer import TrainConfig, TrainResult, split_batch

log = logging.getLogger(__name__)

__all__ = ["parallelize", "ParallelTrainer", "global_grad_norm", "placements_from_loads"]


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
        if E % ep and redundant_per_rank == 0:
            raise ValueError(f"n_experts = {E} is not divisible by ep = {ep}; add redundant slots (--ep-redundant)")
        out[i] = balanced_placement(torch.tensor(layer, dtype=torch.float64), ep, -(-E // ep) + redundant_per_rank)
    return out


def global_grad_norm(model, ctx: ParallelContext) -> torch.Tensor:
    """The L2 norm of the whole (logical) gradient, equal on every rank of the dp group."""
    expert_params = {id(p) for m in expert_modules(model) for p in m.parameters()}
    replicate = ctx.dims.dp // ctx.dims.fsdp_size  # copies of each FSDP shard (HSDP)
    sq = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for p in model.parameters():
        if id(p) not in expert_params and p.requires_grad:
            sq = sq + local_grad_sq(p) / replicate
    for m in expert_modules(model):
        copies = m.placement.n_replicas()[torch.tensor(m.local)].float() * ctx.dims.edp  # [S]
        for p in m.parameters():
            if p.grad is not None:
                sq = sq + (p.grad.float().pow(2).flatten(1).sum(1) / copies).sum()
    comm.all_reduce(sq, group=ctx.dp_group, tag="grad_norm")
    return sq.sqrt()


@torch.no_grad()
def clip_grads_(model, total_norm: torch.Tensor, max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_'s rule with a precomputed global norm."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            g.mul_(coef.to(g.dtype))


class ParallelTrainer:
    """Train a K3Model over a ParallelContext (pp = 1); rank 0 writes metrics, all ranks write checkpoints."""

    def __init__(self, config: K3Config, tc: TrainConfig, train_data, ctx: ParallelContext,
                 out_dir=None, placements: dict[int, Placement] | None = None, overwrite: bool = False):
        from k3.model.transformer import K3Model

        self.config, self.tc, self.ctx = config.validate(), tc.validate(), ctx
        dims = ctx.dims
        if dims.pp != 1:
            raise ValueError(f"pp = {dims.pp}: pipeline training is not implemented (k3.parallel.pipeline runs "
                             "stage forward/backward and measures stage traffic); use --pp 1")
        if tc.optimizer != "adamw":
            raise ValueError(f"optimizer {tc.optimizer!r} with FSDP: Muon orthogonalises whole matrices and FSDP "
                             "shards them; use --optimizer adamw for distributed runs")
        if tc.batch_size % dims.dp:
            raise ValueError(f"batch_size = {tc.batch_size} does not split over {dims.dp} data-parallel ranks; "
                             f"use a multiple of {dims.dp}")
        if tc.activation_checkpointing or tc.compile:
            raise ValueError("activation checkpointing and compile are not wired into distributed runs yet")
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.overwrite = overwrite
        self.train_data = train_data
        torch.manual_seed(tc.seed)  # the same init as the single-process Trainer, on every rank
        self.model = K3Model(config).to(ctx.device)
        parallelize(self.model, ctx, placements)
        self.optimizer = build_optimizer(self.model, "adamw", lr=tc.lr, weight_decay=tc.weight_decay, betas=tc.betas)
        for opt in self.optimizer.optimizers.values():
            for g in opt.param_groups:
                g["foreach"] = False  # one group mixes FSDP DTensors and plain expert tensors
        self._peak_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.schedule = tc.schedule()
        self.step, self.tokens = 0, 0
        # token-slots per expert seen since the last save, per MoE layer: EPLB's input at the next restart
        self._loads = [torch.zeros(config.n_experts, dtype=torch.float64) for _ in self.model.moe_layers()]

    @property
    def ckpt_dir(self) -> Path | None:
        return None if self.out_dir is None else self.out_dir / "checkpoint"

    def rows(self) -> slice:
        b = self.tc.batch_size // self.ctx.dims.dp
        return slice(self.ctx.dp_rank * b, (self.ctx.dp_rank + 1) * b)

    def train_step(self) -> dict:
        tc, model, ctx = self.tc, self.model, self.ctx
        model.train()
        t0 = time.perf_counter()
        lr_factor = self.schedule.apply(self.optimizer, self.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=ctx.device)
        rows = self.rows()
        for micro in range(tc.accum):
            x, y = split_batch(self.train_data.get_batch(self.step * tc.accum + micro, tc.batch_size, tc.seq_len,
                                                         tc.seed))
            x, y = x[rows].to(ctx.device), y[rows].to(ctx.device)
            logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            total = loss + model.aux_loss()
            (total / tc.accum).backward()
            loss_sum += loss.detach()
            for acc, moe in zip(self._loads, model.moe_layers()):
                if moe.router.last_load is not None:
                    acc += moe.router.last_load.to(acc)
        sync_expert_grads(model, 1.0 / ctx.dims.dp)
        norm = global_grad_norm(model, ctx)
        clip_grads_(model, norm, tc.grad_clip if tc.grad_clip > 0 else math.inf)
        self.optimizer.step()
        model.update_balancing()
        comm.all_reduce(loss_sum, group=ctx.dp_group, tag="loss")
        loss = float(loss_sum) / ctx.dims.dp / tc.accum
        if not math.isfinite(loss):
            raise ValueError(f"training diverged: loss is {loss} at step {self.step + 1}; lower --lr or check the data")
        n_tok = tc.accum * tc.batch_size * tc.seq_len
        self.step += 1
        self.tokens += n_tok
        dt = time.perf_counter() - t0
        return {"kind": "train", "step": self.step, "loss": loss, "lr": self._peak_lrs[0] * lr_factor,
                "grad_norm": float(norm), "tokens": self.tokens, "step_time_s": round(dt, 4),
                "tokens_per_s": round(n_tok / dt, 2), "world": ctx.dims.world}

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        if self.ckpt_dir is None:
            raise ValueError("ParallelTrainer.save needs an out_dir")
        loads = torch.stack(self._loads) if self._loads else torch.zeros(0)
        comm.all_reduce(loads, group=self.ctx.dp_group, tag="expert_loads")
        for acc in self._loads:
            acc.zero_()
        meta = {"config": self.config.to_dict(), "train": self.tc.to_dict(), "tokens": self.tokens,
                "expert_loads": loads.tolist(),
                "dims": {"world": self.ctx.dims.world, "ep": self.ctx.dims.ep, "fsdp": self.ctx.dims.fsdp_size,
                         "pp": self.ctx.dims.pp},
                "placements": [m.placement.to_dict() for m in expert_modules(self.model)]}
        return pckpt.save(self.ckpt_dir, self.step, self.model, self.optimizer, self.ctx, meta, self.tc.keep_last)

    def resume(self, path=None) -> dict:
        path = Path(path) if path is not None else self.ckpt_dir
        if path is None:
            raise ValueError("resume needs a checkpoint path or an out_dir")
        meta = pckpt.load(path, self.model, self.optimizer, self.ctx)
        if meta.get("config") != self.config.to_dict():
            raise ValueError(f"{meta['path']}: the checkpoint's model config differs from this run's; resume with "
                             "the same --preset/--set")
        for k in ("batch_size", "seq_len", "accum", "seed"):
            if meta["train"][k] != getattr(self.tc, k):
                raise ValueError(f"{meta['path']}: {k} is {meta['train'][k]!r} in the checkpoint but "
                                 f"{getattr(self.tc, k)!r} now; resume with the same {k}")
        for g, lr in zip(self.optimizer.param_groups, self._peak_lrs):
            g["peak_lr"] = lr
        self.step, self.tokens = int(meta["step"]), int(meta.get("tokens", 0))
        log.info("resumed from %s at step %d on %d ranks", meta["path"], self.step, self.ctx.dims.world)
        return meta

    def fit(self, resume: bool | str = False, on_step=None) -> TrainResult:
        from k3.train.metrics import MetricsWriter

        tc = self.tc
        if resume:
            self.resume(None if resume is True else resume)
        elif self.ckpt_dir is not None and pckpt.latest(self.ckpt_dir) is not None and not self.overwrite:
            raise ValueError(f"{self.ckpt_dir} already holds a checkpoint; pass --resume to continue it, "
                             "--overwrite to start over, or another --out")
        writer = MetricsWriter(self.out_dir / "metrics.jsonl", resume_step=self.step if resume else None) \
            if self.out_dir is not None and self.ctx.rank == 0 else None
        result = TrainResult(steps_done=self.step)
        start = time.perf_counter()
        saved = None
        try:
            while self.step < tc.steps:
                rec = self.train_step()
                result.losses.append(rec["loss"])
                if writer is not None:
                    writer.log(rec)
                if on_step is not None:
                    on_step(rec)
                final = self.step == tc.steps
                if self.ckpt_dir is not None and ((tc.ckpt_every and self.step % tc.ckpt_every == 0) or final):
                    saved = self.save()
        finally:
            if writer is not None:
                writer.close()
        result.steps_done, result.tokens = self.step, self.tokens
        result.elapsed_s = time.perf_counter() - start
        result.checkpoint = str(saved) if saved is not None else None
        return result
