"""Pretraining: next-token cross-entropy over a dataset's batches, run by the one loop (`k3.train.loop`).

Batches come from a dataset's `get_batch(index, batch_size, seq_len, seed)`, with micro-batch index = step * accum +
micro, so the data order is a pure function of (seed, step) and a resumed run sees exactly the batches an
uninterrupted one would; with restored model, optimizer and RNG state, resume on CPU is bitwise exact. In a
distributed context each rank trains on its rows of the same global batch (and, with pipeline stages, on its
stage's layers), so the loss trajectory equals the single-process one.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from k3.config import K3Config
from k3.train import checkpoint as ckpt
from k3.train.batches import _n_tokens, check_dataset, evaluate, has_documents, split_batch
from k3.train.config import TrainConfig
from k3.train.device import autocast, resolve_device, tune_cpu_allocator
from k3.train.loop import LocalContext, Loop, TrainResult
from k3.train.metrics import attnres_stats, bits_per_byte, expert_load_stats, flops_per_token, measured_peak_flops
from k3.train.optim import QKClip

__all__ = ["Trainer", "TrainConfig", "TrainResult", "train", "apply_activation_checkpointing"]


class Trainer(Loop):
    """Pretrain a K3Model (built here from `config` and the seed) on a dataset; metrics.jsonl and checkpoints go
    under `out_dir`. `ctx`: a distributed context (`k3.parallel.train.DistributedContext`) splits the batch, the
    experts and the layers over ranks; None is one process on `train.device`. `on_step(record)` / `on_eval(record)`
    callbacks of `fit` receive each metrics record (the CLI's progress bar)."""

    def __init__(self, config: K3Config, train: TrainConfig, train_data, val_data=None,
                 out_dir: str | os.PathLike | None = None, bytes_per_token: float | None = None,
                 data_info: dict | None = None, overwrite: bool = False, ctx=None):
        from k3.model.transformer import K3Model

        config, tc = config.validate(), train.validate()
        if tc.seq_len > config.max_context:
            raise ValueError(f"seq_len = {tc.seq_len} exceeds the model's max_context = {config.max_context}")
        if out_dir is not None:
            _check_writable(Path(out_dir))
        if ctx is not None:
            ctx.check(config, tc)  # what a distributed run refuses, before the model is built
        check_dataset(train_data, "training", config, tc.batch_size, tc.seq_len, tc.seed,
                      min_tokens=tc.batch_size * tc.seq_len + 1)
        if val_data is not None:
            check_dataset(val_data, "validation", config, tc.batch_size, tc.seq_len, tc.seed)
        ctx = ctx if ctx is not None else LocalContext(resolve_device(tc.device))
        if ctx.device.type == "cpu":
            tune_cpu_allocator()  # before the precision probe, which times steps as the loop will run them
        # "auto" is settled here, once, so the loop, its records and its checkpoints name what ran
        precision, self.precision_reason = _resolve_precision(tc.precision, ctx)
        tc.precision = precision  # in place, as the loop sets tc.steps: callers keep adjusting the same config
        torch.manual_seed(tc.seed)  # model init is a function of the seed (on every rank alike)
        model = K3Model(config).to(ctx.device)
        if tc.activation_checkpointing:
            apply_activation_checkpointing(model)
        if tc.record_attnres and hasattr(model, "attnres"):
            model.attnres.record_weights = True
        model = ctx.prepare(model)  # a distributed context keeps this rank's stage and shards it
        super().__init__(model, tc, ctx=ctx, out_dir=out_dir, overwrite=overwrite, optimizer=ctx.optimizer(model, tc),
                         data_info=data_info, manifest_extra={"precision_reason": self.precision_reason})
        self.config = config
        self.train_data, self.val_data = train_data, val_data
        # document masking needs a dataset that knows where its documents start (k3's packed datasets do)
        self.doc_mask = tc.doc_mask and has_documents(train_data)
        self.bytes_per_token = bytes_per_token
        self.device = ctx.device
        self.qk_clip = QKClip(model, tc.qk_clip_tau) if tc.optimizer == "muon" and tc.qk_clip_tau > 0 else None
        backend = "inductor" if tc.compile is True else tc.compile
        self.forward = torch.compile(model, backend=backend) if backend else model
        self.flops_per_token = flops_per_token(model, tc.seq_len)["total"] if ctx.world == 1 else None
        self._loads = None

    def fit(self, *args, **kwargs) -> TrainResult:
        if self.tc.measure_mfu and self.peak_flops is None and self.flops_per_token:
            self.peak_flops = measured_peak_flops(self.device, torch.bfloat16 if self.device.type == "cuda"
                                                  else torch.float32)
        return super().fit(*args, **kwargs)

    def loss_fn(self, logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training objective of one micro-batch (inputs x, targets y), logged as the step's loss:
        next-token cross-entropy. A subclass may replace it (e.g. distillation from a teacher on x)."""
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def micro_batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's rows of micro-batch `micro` of `step`: inputs, targets, and document ids with doc_mask."""
        tc, rows = self.tc, self.ctx.rows(self.tc.batch_size)
        index = step * tc.accum + micro
        if self.doc_mask:
            x, y, d = self.train_data.get_batch(index, tc.batch_size, tc.seq_len, tc.seed, docs=True)
            d = d[rows].to(self.device, non_blocking=True)
        else:
            (x, y), d = split_batch(self.train_data.get_batch(index, tc.batch_size, tc.seq_len, tc.seed)), None
        return x[rows].to(self.device, non_blocking=True), y[rows].to(self.device, non_blocking=True), d

    def step_fn(self, step: int) -> dict:
        """Forward and backward over the step's `accum` micro-batches; the mean loss over the global batch."""
        tc, model, ctx = self.tc, self.model, self.ctx
        n_tok = tc.accum * tc.batch_size * tc.seq_len
        if ctx.pipelined:
            loss = ctx.pipeline_step(model, [self.micro_batch(step, m) for m in range(tc.accum)])
            return {"loss": loss, "backward_done": True, "tokens": n_tok}
        loss_sum, aux_sum, t_fwd, t_bwd = 0.0, 0.0, 0.0, 0.0
        self._loads = None
        for micro in range(tc.accum):
            x, y, d = self.micro_batch(step, micro)
            t1 = time.perf_counter()
            with record_function("k3::forward"), autocast(self.device, self.tc.precision):
                logits = self.forward(x) if d is None else self.forward(x, doc_ids=d)
                loss = self.loss_fn(logits, x, y)
                aux = model.aux_loss()
                total = loss + aux
            t2 = time.perf_counter()
            with record_function("k3::backward"):
                (total / tc.accum).backward()
            t_fwd, t_bwd = t_fwd + t2 - t1, t_bwd + time.perf_counter() - t2
            loss_sum += float(loss.detach())
            aux_sum += float(aux.detach()) if isinstance(aux, torch.Tensor) else float(aux)
            if self.qk_clip is not None:
                self.qk_clip.observe()
            ctx.observe_loads(model)
            self._loads = self._accumulate_loads(self._loads)
        if ctx.world > 1:  # the mean over the data-parallel ranks' rows
            loss_sum = float(ctx.all_sum(torch.tensor(loss_sum, dtype=torch.float64, device=self.device))) / ctx.dp
        return {"loss": loss_sum / tc.accum, "backward_done": True, "tokens": n_tok, "aux_loss": aux_sum / tc.accum,
                "precision": tc.precision,
                # host wall time per phase (on CUDA, device work shows up where the host waits for it)
                "forward_s": round(t_fwd, 4), "backward_s": round(t_bwd, 4)}

    def after_update(self) -> dict:
        if self.qk_clip is None:
            return {}
        with record_function("k3::qk_clip"):
            return self.qk_clip.apply() or {}

    def step_metrics(self) -> dict:
        if self.ctx.world > 1:
            return {}
        rec = expert_load_stats(self.model) if self._loads is None else _load_record(self._loads)
        rec.update(attnres_stats(self.model))
        return rec

    def _accumulate_loads(self, loads):
        """Sum the routers' per-expert token counts over the step's micro-batches (for metrics only)."""
        if not hasattr(self.model, "moe_layers"):
            return None
        cur = [getattr(m.router, "last_load", None) for m in self.model.moe_layers()]
        if not cur or any(c is None for c in cur):
            return None
        cur = [c.detach().float().cpu() for c in cur]
        return cur if loads is None else [a + b for a, b in zip(loads, cur)]

    def estimated_eval_s(self) -> float:
        """Before the first evaluation, from the last training step: an eval batch is a forward of one
        micro-batch, at most half of its forward and backward."""
        if self.val_data is None or self._step_s is None:
            return 0.0
        tc = self.tc
        n = tc.eval_batches
        if n is None:  # the whole split
            tokens = _n_tokens(self.val_data)
            n = max(1, -(-tokens // (tc.batch_size * tc.seq_len))) if tokens else 1
        return n * self._step_s / (2 * tc.accum)

    def run_eval(self) -> dict | None:
        if self.val_data is None:
            return None
        t0 = time.perf_counter()
        loss = evaluate(self.model, self.val_data, self.tc.eval_batches, self.tc.batch_size, self.tc.seq_len,
                        seed=self.tc.seed, device=self.device, doc_mask=self.doc_mask, precision=self.tc.precision)
        self._eval_s = time.perf_counter() - t0
        rec = {"kind": "val", "step": self.step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}
        if self.bytes_per_token:
            rec["val_bpb"] = bits_per_byte(loss, self.bytes_per_token)
        return rec


def _resolve_precision(requested: str, ctx) -> tuple[str, str]:
    """TrainConfig.precision -> (fp32 | bf16, why). Several CPU processes do not probe: each would measure a
    different share of the machine, and all ranks must agree."""
    from k3.train.precision import resolve_precision

    if requested == "auto" and ctx.world > 1 and ctx.device.type == "cpu":
        return "fp32", f"auto in a {ctx.world}-process CPU run: fp32 (the bf16 probe measures one process)"
    return resolve_precision(requested, ctx.device)


def _load_record(loads: list[torch.Tensor]) -> dict:
    ratios = [float(l.max() / l.mean()) if float(l.mean()) > 0 else float("nan") for l in loads]
    return {"expert_load_max_mean": [round(r, 4) for r in ratios],
            "expert_load_max_mean_overall": round(sum(ratios) / len(ratios), 4),
            "expert_load": [[round(float(x) / max(float(l.sum()), 1e-12), 5) for x in l] for l in loads]}


def _check_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".k3-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"output folder {path} is not writable ({e.strerror or e}); pass another --out") from None


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every layer's token mixer and channel mixer in backward (torch.utils.checkpoint).

    Applied from outside by wrapping each module's `forward` on the instance, so parameter names (and
    checkpoints) are unchanged. Only when grad is on and no inference cache is passed. The recompute in
    backward must not count tokens twice: routers accumulate balancing statistics in forward, so the
    recompute runs inside `balancing_stats_paused` (the routers' public `collect_stats` switch).
    """
    from torch.utils.checkpoint import checkpoint

    from k3.model.moe import balancing_stats_paused

    for block in model.layers:
        for mod in (block.mixer, block.ffn):
            if getattr(mod, "_k3_checkpointed", False):
                continue
            inner = mod.forward

            def fwd(x, *args, _inner=inner, _mod=mod, **kwargs):
                if not (torch.is_grad_enabled() and kwargs.get("cache") is None):
                    return _inner(x, *args, **kwargs)
                calls = [0]

                def run(*a, **k):
                    calls[0] += 1
                    if calls[0] == 1:
                        return _inner(*a, **k)
                    with balancing_stats_paused(_mod):  # the recompute during backward
                        return _inner(*a, **k)

                return checkpoint(run, x, *args, use_reentrant=False, **kwargs)

            mod.forward = fwd
            mod._k3_checkpointed = True


def train(config: K3Config, train_data, val_data=None, out_dir: str | os.PathLike | None = None,
          resume: bool = False, overwrite: bool = False, on_step=None, on_eval=None,
          **train_kwargs) -> tuple[Trainer, TrainResult]:
    """Build a Trainer from `TrainConfig(**train_kwargs)` and run it."""
    trainer = Trainer(config, TrainConfig(**train_kwargs), train_data, val_data, out_dir, overwrite=overwrite)
    return trainer, trainer.fit(resume=resume, on_step=on_step, on_eval=on_eval)
