"""Distributed training with FSDP2 + MoonEP (+ pipeline stages): the trainer's step, batch split over ranks.

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

With pp > 1 (world = pp x dp) every rank builds the whole model from the seed, keeps its stage
(`prune_to_stage`) and then applies EP and FSDP2 inside the stage. A step runs GPipe over the `accum`
micro-batches (`run_gpipe`); the AttnRes parameters, held by every stage, get their gradients summed over
the pipeline; the clipping norm and the logged loss are summed over the world (the loss comes from the last
stage); each stage's optimizer steps its own parameters; the routers' balancing statistics are summed over
the stage's dp group (the world holds other stages' layers).
"""
from __future__ import annotations

import contextlib
import logging
import math
import shutil
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
from k3.parallel.pipeline import PipelineStage, check_tied_stages, prune_to_stage, run_gpipe, stage_shared_params
from k3.parallel.placement import Placement, contiguous_placement
from k3.train import checkpoint as ckpt
from k3.train.optim import build_optimizer
from k3.train.trainer import DATA_FIELDS, TrainConfig, TrainResult, check_schedule_fields, split_batch

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
        from k3.train.trainer import check_dataset

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
    data, data_info = meta.get("data") or {}, data_info or {}
    for k in DATA_FIELDS:  # another dataset would silently change what the resumed steps train on
        if k in data and k in data_info and data[k] != data_info[k]:
            raise ValueError(f"{meta['path']}: the checkpoint was trained on data with {k} {data[k]!r}, this "
                             f"run's data has {data_info[k]!r}; resume with --data "
                             f"{data.get('data_dir', 'DIR')} (the data it was trained on), or start a new run")


class ParallelTrainer:
    """Train a K3Model over a ParallelContext; rank 0 writes metrics, all ranks write checkpoints.
    `placements`: {MoE layer index over the whole model: Placement}."""

    def __init__(self, config: K3Config, tc: TrainConfig, train_data, ctx: ParallelContext,
                 out_dir=None, placements: dict[int, Placement] | None = None, overwrite: bool = False,
                 data_info: dict | None = None):
        from k3.model.transformer import K3Model

        self.config, self.tc, self.ctx = config.validate(), tc.validate(), ctx
        self.data_info = dict(data_info or {})  # stored as the checkpoint's `data`; a resume must match it
        dims = ctx.dims
        check_parallel_settings(config, tc, dims, train_data)  # before the model is built
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.overwrite = overwrite
        self.train_data = train_data
        torch.manual_seed(tc.seed)  # the same init as the single-process Trainer, on every rank
        self.model = K3Model(config).to(ctx.device)
        moe_ids = [i for i in range(config.n_layers) if config.is_moe_layer(i)]  # layer of each MoE index
        self.stage = None
        if dims.pp > 1:
            held = prune_to_stage(self.model, ctx.pp_rank, dims.pp)
            self._moe_index = [g for g, i in enumerate(moe_ids) if i in held]  # this stage's MoE layers
        else:
            self._moe_index = list(range(len(moe_ids)))
        self._n_moe = len(moe_ids)
        self.placements = dict(placements or {})
        local = {k: self.placements[g] for k, g in enumerate(self._moe_index) if g in self.placements}
        parallelize(self.model, ctx, local)
        if dims.pp > 1:
            self.stage = PipelineStage(self.model, ctx.pp_rank, dims.pp, ranks=ctx.pp_ranks, group=ctx.pp_group)
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

    def _observe_loads(self) -> None:
        for acc, moe in zip(self._loads, self.model.moe_layers()):
            if moe.router.last_load is not None:
                acc += moe.router.last_load.to(acc)

    def _micro_batch(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of micro-batch `micro` of the current step."""
        tc, rows = self.tc, self.rows()
        x, y = split_batch(self.train_data.get_batch(self.step * tc.accum + micro, tc.batch_size, tc.seq_len, tc.seed))
        return x[rows].to(self.ctx.device), y[rows].to(self.ctx.device)

    def train_step(self) -> dict:
        return self._pipeline_step() if self.stage is not None else self._data_parallel_step()

    def _pipeline_step(self) -> dict:
        """GPipe over the accum micro-batches; the same update as the single-process step."""
        tc, model, ctx = self.tc, self.model, self.ctx
        model.train()
        t0 = time.perf_counter()
        lr_factor = self.schedule.apply(self.optimizer, self.step)
        self.optimizer.zero_grad(set_to_none=True)
        batches = [self._micro_batch(m) for m in range(tc.accum)]
        losses = run_gpipe(self.stage, [x for x, _ in batches], [y for _, y in batches],
                           on_forward=lambda m: self._observe_loads())
        sync_expert_grads(model, 1.0 / ctx.dims.dp)
        sync_stage_shared_grads(model, ctx)
        norm = global_grad_norm(model, ctx)
        # the last stage's losses (each mean CE / accum) reach every rank, rank 0 (first stage) included
        loss_sum = torch.tensor(sum(losses), dtype=torch.float64, device=ctx.device)
        comm.all_reduce(loss_sum, tag="loss")
        loss = float(loss_sum) / ctx.dims.dp
        self._check_finite(loss, norm)
        clip_grads_(model, norm, tc.grad_clip if tc.grad_clip > 0 else math.inf)
        self.optimizer.step()
        with router_balancing_over(ctx.dp_group):
            model.update_balancing()
        return self._record(loss, norm, lr_factor, t0)

    def _data_parallel_step(self) -> dict:
        tc, model, ctx = self.tc, self.model, self.ctx
        model.train()
        t0 = time.perf_counter()
        lr_factor = self.schedule.apply(self.optimizer, self.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=ctx.device)
        for micro in range(tc.accum):
            x, y = self._micro_batch(micro)
            logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            total = loss + model.aux_loss()
            (total / tc.accum).backward()
            loss_sum += loss.detach()
            self._observe_loads()
        sync_expert_grads(model, 1.0 / ctx.dims.dp)
        norm = global_grad_norm(model, ctx)
        comm.all_reduce(loss_sum, group=ctx.dp_group, tag="loss")
        loss = float(loss_sum) / ctx.dims.dp / tc.accum
        self._check_finite(loss, norm)
        clip_grads_(model, norm, tc.grad_clip if tc.grad_clip > 0 else math.inf)
        self.optimizer.step()
        model.update_balancing()
        return self._record(loss, norm, lr_factor, t0)

    def _check_finite(self, loss: float, norm: torch.Tensor) -> None:
        """Before the update, on every rank alike (loss and norm are global): a non-finite step is never applied
        and so never saved."""
        if not (math.isfinite(loss) and math.isfinite(float(norm))):
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {float(norm)}"
            raise ValueError(f"training diverged: {what} at step {self.step + 1} (not applied, not saved); lower "
                             "--lr or check the data")

    def _record(self, loss: float, norm: torch.Tensor, lr_factor: float, t0: float) -> dict:
        tc, ctx = self.tc, self.ctx
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
        # every MoE layer of the whole model: this stage fills its rows, the sum over the world adds the dp
        # ranks' token-slots and the other stages' rows
        loads = torch.zeros(self._n_moe, self.config.n_experts, dtype=torch.float64, device=self.ctx.device)
        for g, acc in zip(self._moe_index, self._loads):
            loads[g] = acc.to(loads.device)
        comm.all_reduce(loads, group=self.ctx.dp_group if self.ctx.dims.pp == 1 else None, tag="expert_loads")
        loads = loads.cpu()
        for acc in self._loads:
            acc.zero_()
        # placements of every MoE layer, as apply_expert_parallel made them (rank 0 holds only its stage's)
        placements = [self.placements.get(g) or contiguous_placement(self.config.n_experts, self.ctx.dims.ep)
                      for g in range(self._n_moe)]
        meta = {"config": self.config.to_dict(), "train": self.tc.to_dict(), "tokens": self.tokens,
                "expert_loads": loads.tolist(),
                "dims": {"world": self.ctx.dims.world, "ep": self.ctx.dims.ep, "fsdp": self.ctx.dims.fsdp_size,
                         "pp": self.ctx.dims.pp},
                "placements": [p.to_dict() for p in placements], "data": self.data_info}
        return pckpt.save(self.ckpt_dir, self.step, self.model, self.optimizer, self.ctx, meta, self.tc.keep_last)

    def resume(self, path=None) -> dict:
        path = Path(path) if path is not None else self.ckpt_dir
        if path is None:
            raise ValueError("resume needs a checkpoint path or an out_dir")
        if pckpt.latest(path) is None and ckpt.latest_checkpoint(path) is not None:
            raise ValueError(f"{path} holds a single-process checkpoint, not a distributed one; resume it without "
                             "--nproc (or start a new distributed run with another --out)")
        meta = pckpt.read_meta(path)  # checked before any collective load: a mismatch is a clear error, not DCP's
        check_resume_meta(meta, self.config, self.tc, self.data_info)
        meta = pckpt.load(path, self.model, self.optimizer, self.ctx)
        for g, lr in zip(self.optimizer.param_groups, self._peak_lrs):
            g["peak_lr"] = lr
        self.step, self.tokens = int(meta["step"]), int(meta.get("tokens", 0))
        log.info("resumed from %s at step %d on %d ranks", meta["path"], self.step, self.ctx.dims.world)
        return meta

    def _agree_to_stop(self, requested: bool) -> bool:
        """Whether any rank was asked to stop (a 4-byte all-reduce, MAX): every rank gets the same answer after
        the same step, so they all save that step together and stop."""
        flag = torch.tensor([int(requested)], dtype=torch.int32, device=self.ctx.device)
        comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, tag="stop_request")
        return bool(flag.item())

    def fit(self, resume: bool | str = False, on_step=None, graceful_interrupt: bool = False) -> TrainResult:
        """Train to `steps`, saving every `ckpt_every` steps and at the end. `graceful_interrupt` (`k3 train`): a
        SIGINT or SIGTERM to any rank (torchrun passes on what it receives) ends the run on every rank after the
        same step, which is saved; `interrupted` is set. A second signal stops that rank at once."""
        from k3.train.metrics import MetricsWriter
        from k3.train.trainer import GracefulInterrupt

        tc = self.tc
        if resume:
            self.resume(None if resume is True else resume)
        elif self.ckpt_dir is not None and (pckpt.latest(self.ckpt_dir) is not None
                                            or ckpt.latest_checkpoint(self.ckpt_dir) is not None):
            if not self.overwrite:
                raise ValueError(f"{self.ckpt_dir} already holds a checkpoint; pass --resume to continue it, "
                                 "--overwrite to start over, or another --out")
            # start over: the old steps must not mix with (or be pruned instead of) the new. Every rank has
            # looked before rank 0 deletes (first barrier), so no rank can miss the checkpoint, skip the barriers
            # and wait in a training collective instead.
            comm.barrier()
            if self.ctx.rank == 0:
                shutil.rmtree(self.ckpt_dir)
            comm.barrier()
        writer = MetricsWriter(self.out_dir / "metrics.jsonl", resume_step=self.step if resume else None) \
            if self.out_dir is not None and self.ctx.rank == 0 else None
        result = TrainResult(steps_done=self.step)
        start = time.perf_counter()
        saved = None
        agree = graceful_interrupt and self.ckpt_dir is not None  # the same on every rank: all take part or none
        interrupt = GracefulInterrupt(agree, announce=self.ctx.rank == 0)
        try:
            while self.step < tc.steps:
                rec = self.train_step()
                result.losses.append(rec["loss"])
                if writer is not None:
                    writer.log(rec)
                if on_step is not None:
                    on_step(rec)
                final = self.step == tc.steps
                stop = agree and self._agree_to_stop(interrupt.requested)
                if self.ckpt_dir is not None and ((tc.ckpt_every and self.step % tc.ckpt_every == 0) or final or stop):
                    saved = self.save()
                if stop:  # in the last step too: that run is complete and saved, and reported interrupted
                    result.interrupted = True
                    log.info("interrupted at step %d: saved a checkpoint of it on every rank", self.step)
                    break
        finally:
            interrupt.restore()
            if writer is not None:
                writer.close()
        result.steps_done, result.tokens = self.step, self.tokens
        result.elapsed_s = time.perf_counter() - start
        if saved is None and self.ckpt_dir is not None:  # nothing trained (a resume at --steps): the one it holds
            saved = pckpt.latest(self.ckpt_dir)
        result.checkpoint = str(saved) if saved is not None else None
        return result
