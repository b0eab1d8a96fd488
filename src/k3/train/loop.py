"""The one training loop: pretraining, distributed training, distillation and RL differ only in the step function
they give it and in the parallel context they run in.

Per optimizer step: LR schedule -> `step_fn(step)` (the loss of the step's batch; it may run its own backward
passes, e.g. over micro-batches) -> the context's gradient sync and clipping -> a finite check before the update
-> optimizer step -> `after_update` (QK-Clip) -> balancing update. Around the steps: the step and token budgets,
a time budget, evaluation and checkpoint cadence, metrics JSONL, exact resume and a graceful stop on SIGINT /
SIGTERM. Everything random in a step must be a pure function of (seed, step), so a resumed run repeats exactly
the steps an uninterrupted one takes.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from k3.train import checkpoint as ckpt
from k3.train.config import DATA_FIELDS, DIVERGED_RESTART, RESUME_FIELDS, TrainConfig, check_schedule_fields
from k3.train.device import tune_cpu_allocator
from k3.train.metrics import MetricsWriter
from k3.train.optim import build_optimizer
from k3.train.signals import GracefulInterrupt

log = logging.getLogger(__name__)

# how a stopped run goes on
RESUME_ADVICE = ": the same command with --resume (and without --overwrite) continues from step {}"


@dataclass
class TrainResult:
    steps_done: int
    losses: list[float] = field(default_factory=list)  # per optimizer step of this call
    val: list[dict] = field(default_factory=list)  # evaluation records of this call
    records: list[dict] = field(default_factory=list)  # every record of this call (train and evaluation)
    tokens: int = 0
    elapsed_s: float = 0.0
    stopped_early: bool = False  # the time budget ran out
    interrupted: bool = False  # stopped by SIGINT / SIGTERM after a whole step, with a checkpoint of it
    where: str = ""  # an interrupted run: where it stopped and what it saved
    advice: str = ""  # ... and how to go on
    checkpoint: str | None = None

    def raise_if_interrupted(self) -> None:
        """For a stage of a longer pipeline (`k3 distill`, `k3 rl`): an interruption ends the whole command."""
        if self.interrupted:
            raise stop_exception(self.where, self.advice)


def stop_exception(where: str, advice: str) -> KeyboardInterrupt:
    """The KeyboardInterrupt a stop raises: its message says where the run stopped and how to go on; `where` alone
    is kept for a caller whose own advice differs (`k3 rl --demo` has no --resume)."""
    stop = KeyboardInterrupt(f"{where}{advice}")
    stop.where = where
    return stop


def _scalar(loss) -> float:
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)


def holds_checkpoint(ckpt_dir: Path) -> bool:
    """A checkpoint of either kind (single-process or distributed) lives there: a new run must not mix with it."""
    return ckpt.latest_checkpoint(ckpt_dir) is not None or ckpt.latest_distributed(ckpt_dir) is not None


class LocalContext:
    """A world of one process: the ordinary case. A distributed context (`k3.parallel.train.DistributedContext`)
    has the same methods and splits the work over ranks."""

    world = dp = 1
    rank = 0
    pipelined = False

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def check(self, config, tc: TrainConfig) -> None:
        """What this context refuses (ValueError naming the flag), before a model is built."""

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model this rank trains (a distributed context keeps its stage and shards it)."""
        return model

    def optimizer(self, model: torch.nn.Module, tc: TrainConfig):
        """None: the loop builds the one `tc` asks for."""
        return None

    def observe_loads(self, model: torch.nn.Module) -> None:
        """After each forward: a distributed context counts expert loads for the next restart's placement."""

    def rows(self, batch_size: int) -> slice:
        """The rows of a global batch this rank trains on."""
        return slice(0, batch_size)

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def any(self, flag: bool) -> bool:
        return flag

    def barrier(self) -> None:
        pass

    def clip_grads(self, model: torch.nn.Module, params: list, max_norm: float) -> torch.Tensor:
        """Finish the gradients (sync over ranks), clip them to `max_norm` (inf: no clipping), return their norm."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def balancing(self):
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ checkpoints
    def latest(self, ckpt_dir: Path) -> Path | None:
        return ckpt.latest_checkpoint(ckpt_dir)

    def holds_any(self, ckpt_dir: Path) -> bool:
        return holds_checkpoint(ckpt_dir)

    def save(self, loop: "Loop") -> Path:
        return ckpt.save_checkpoint(loop.ckpt_dir, loop.step, loop.model, loop.optimizer, loop.model.config,
                                    data_state=loop.data_state(), extra=loop.checkpoint_extra(),
                                    keep_last=loop.tc.keep_last)

    def load(self, loop: "Loop", path: Path) -> dict:
        """Restore model, optimizer and RNG from `path`; the manifest, with the recorded train config as "train"."""
        single = ckpt.latest_checkpoint(path)
        if single is None and ckpt.latest_distributed(path) is not None:
            raise ValueError(f"{path} holds a distributed (DCP) checkpoint, which one process cannot continue here; "
                             "continue it with `k3 train --resume` (any --nproc, a world of one included: DCP "
                             "reshards)")
        if single is None and not (path / ckpt.MANIFEST).is_file():
            raise ValueError(f"--resume: no checkpoint found in {path}; run without --resume to start")
        manifest = ckpt.load_checkpoint(path, loop.model, loop.optimizer, loop.model.config)
        extra = manifest.get("extra", {})
        where = f"{manifest['path']}/manifest.json"
        data = manifest.get("data", {})
        for k, now in loop.resume_fields().items():
            if k in data and data[k] != now:
                raise ckpt.CheckpointError(f"{where}: {k!r} is {data[k]!r} in the checkpoint but {now!r} now; "
                                           f"resume with the same {k} (or start a new run)")
        check_schedule_fields(extra.get("train", extra.get("loop")), loop.tc, where)
        check_data(data, loop.data_info, where)
        return {**manifest, "tokens": extra.get("tokens", 0)}


def check_data(recorded: dict, data_info: dict, where: str) -> None:
    """Another dataset would silently change what the resumed steps train on."""
    for k in DATA_FIELDS:
        if k in recorded and k in data_info and recorded[k] != data_info[k]:
            raise ckpt.CheckpointError(
                f"{where}: the checkpoint was trained on data with {k} {recorded[k]!r}, this run's data has "
                f"{data_info[k]!r}; resume with --data {recorded.get('data_dir', 'DIR')} (the data it was trained "
                "on), or start a new run")


class Loop:
    """Train `model` with `step_fn(step) -> dict` for `tc.steps` optimizer steps (or its token or time budget).

    `step_fn` returns the step's "loss" (a tensor to backpropagate, or a float when it ran the backward passes
    itself and says "backward_done"), "tokens" trained on, optionally "skip_update" (nothing to learn from: the
    step counts but the weights do not move), and any metrics for the record. `evaluate(step) -> dict | None`
    gives an evaluation record. Writes OUT/metrics.jsonl (rank 0) and OUT/checkpoint/. `manifest_extra` is stored
    in every checkpoint; `resume_fields` must be equal when a run is resumed (e.g. which teachers)."""

    def __init__(self, model: torch.nn.Module, tc: TrainConfig, step_fn: Callable[[int], dict] | None = None, *,
                 evaluate: Callable[[int], dict | None] | None = None, ctx=None,
                 out_dir: str | os.PathLike | None = None, overwrite: bool = False, optimizer=None,
                 manifest_extra: dict | None = None, resume_fields: dict | None = None,
                 data_info: dict | None = None):
        self.model = model
        self.tc = tc.validate()
        self._step_fn, self._evaluate = step_fn, evaluate
        self.ctx = ctx if ctx is not None else LocalContext(next(model.parameters()).device)
        if self.ctx.device.type == "cpu":
            tune_cpu_allocator()  # freed activations stay in the heap: no page faults per new buffer
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.overwrite = overwrite
        self.manifest_extra = dict(manifest_extra or {})
        self._resume_fields = dict(resume_fields or {})
        self.data_info = dict(data_info or {})  # stored in every checkpoint; a resume must match it
        self.optimizer = optimizer if optimizer is not None else build_optimizer(
            model, tc.optimizer, lr=tc.lr, weight_decay=tc.weight_decay, betas=tc.betas, momentum=tc.momentum)
        self._peak_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.schedule = tc.schedule()
        self.step, self.tokens = 0, 0
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.flops_per_token, self.peak_flops = None, None  # both set: records carry the MFU
        self._eval_s, self._save_s = None, None  # measured by run_eval / save, for the time budget
        self._step_s: float | None = None

    # ------------------------------------------------------------------ parts a subclass may replace
    def step_fn(self, step: int) -> dict:
        return self._step_fn(step)

    def evaluate(self, step: int) -> dict | None:
        return self._evaluate(step) if self._evaluate is not None else None

    def after_update(self) -> dict:
        """Runs after each optimizer update (QK-Clip); returns metrics for the step's record."""
        return {}

    def step_metrics(self) -> dict:
        """Metrics read after the update (expert loads, AttnRes weights)."""
        return {}

    def estimated_eval_s(self) -> float:
        """Before the first evaluation: what one will take (for the time budget)."""
        return 0.0

    # ------------------------------------------------------------------ checkpoints
    @property
    def ckpt_dir(self) -> Path | None:
        return None if self.out_dir is None else self.out_dir / "checkpoint"

    def resume_fields(self) -> dict:
        return {**{k: getattr(self.tc, k) for k in RESUME_FIELDS}, **self._resume_fields}

    def data_state(self) -> dict:
        # the schedule's settings too, for a caller deciding whether a stage is already trained (k3 distill); a
        # resume checks them against the recorded train config (check_schedule_fields)
        schedule = {k: getattr(self.tc, k) for k in ("lr", "warmup_steps", "decay_frac", "min_lr_ratio",
                                                    "weight_decay", "grad_clip")}
        return {"next_step": self.step, **schedule, **self.resume_fields(), **self.data_info}

    def checkpoint_extra(self) -> dict:
        return {**self.manifest_extra, "tokens": self.tokens, "train": self.tc.to_dict()}

    def save(self) -> Path:
        if self.ckpt_dir is None:
            raise ValueError("saving a checkpoint needs an output directory (out_dir)")
        t0 = time.perf_counter()
        try:
            return self.ctx.save(self)
        finally:
            self._save_s = time.perf_counter() - t0

    def resume(self, path: str | os.PathLike | None = None) -> dict:
        """Load model, optimizer, RNG and position from `path` (default: the latest under out_dir)."""
        path = Path(path) if path is not None else self.ckpt_dir
        if path is None:
            raise ValueError("--resume needs a checkpoint path or an output directory")
        manifest = self.ctx.load(self, path)
        for g, lr in zip(self.optimizer.param_groups, self._peak_lrs):
            g["peak_lr"] = lr  # the schedule follows this run's --lr
        self.step, self.tokens = int(manifest["step"]), int(manifest.get("tokens", 0))
        log.info("resumed from %s at step %d", manifest["path"], self.step)
        return manifest

    def set_total_steps(self, total: int) -> None:
        """Re-plan the run to `total` steps (keeps the warmup length; the decay is decay_frac of the total)."""
        total = max(int(total), self.step + 1)
        self.tc.steps = total
        self.schedule = self.tc.schedule(total, warmup=self.schedule.warmup_steps)

    def tail_seconds(self) -> float:
        """What stopping costs after the last step: a final evaluation and a checkpoint. Measured once they have
        run; before the first save, estimated from the bytes to write and hash at 100 MB/s."""
        tail = self._eval_s if self._eval_s is not None else self.estimated_eval_s()
        if self.ckpt_dir is not None:
            if self._save_s is None:
                n = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
                factor = 3 if self.tc.optimizer == "adamw" else 2.5  # weights + optimizer moments / momenta
                return tail + factor * n / 100e6
            tail += self._save_s
        return tail

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        """One optimizer step; returns the step's metrics record."""
        model, tc = self.model, self.tc
        model.train()
        t0 = time.perf_counter()
        factor = self.schedule.apply(self.optimizer, self.step)
        self.optimizer.zero_grad(set_to_none=True)
        out = dict(self.step_fn(self.step))
        model.train()  # a step may have generated in eval mode
        loss = out.pop("loss")
        skip, done = out.pop("skip_update", False), out.pop("backward_done", False)
        n_tok = int(out.pop("tokens", 0))
        t1 = time.perf_counter()
        if skip:
            # nothing to learn from (e.g. every GRPO group tied): no optimizer step, so AdamW's momentum does not
            # move the weights; the step still counts (its data was used) and the schedule moves on with it
            grad_norm = torch.zeros(())
            value = _scalar(loss)
        else:
            if not done:
                loss.backward()
            value = _scalar(loss)
            grad_norm = self.ctx.clip_grads(model, self._params, tc.grad_clip if tc.grad_clip > 0 else math.inf)
            if not (math.isfinite(value) and math.isfinite(float(grad_norm))):  # before the update: never applied
                what = f"loss is {value}" if not math.isfinite(value) else f"gradient norm is {float(grad_norm)}"
                raise ValueError(f"training diverged: {what} at step {self.step + 1} (not applied, not saved); "
                                 f"lower --lr or check the data ({DIVERGED_RESTART})")
            self.optimizer.step()
            out.update(self.after_update())
            if hasattr(model, "update_balancing"):
                with self.ctx.balancing():
                    model.update_balancing()
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        dt = time.perf_counter() - t0
        self.step += 1
        self.tokens += n_tok
        rec = {"kind": "train", "step": self.step, "loss": value, **out, "lr": self._peak_lrs[0] * factor,
               "grad_norm": float(grad_norm), "tokens": self.tokens, "step_time_s": round(dt, 4),
               "tokens_per_s": round(n_tok / dt, 2), "optimizer_s": round(time.perf_counter() - t1, 4)}
        if self.flops_per_token and self.peak_flops:
            rec["mfu"] = round(n_tok * self.flops_per_token / dt / self.peak_flops, 5)
        if self.ctx.world > 1:
            rec["world"] = self.ctx.world
        rec.update(self.step_metrics())
        return rec

    def run_eval(self) -> dict | None:
        t0 = time.perf_counter()
        rec = self.evaluate(self.step)
        if rec is None:
            return None
        self._eval_s = time.perf_counter() - t0
        return {"kind": "eval", "step": self.step, **rec}

    # ------------------------------------------------------------------ the loop
    def _done(self) -> bool:
        return self.step >= self.tc.steps or (self.tc.token_budget is not None and self.tokens >= self.tc.token_budget)

    def fit(self, resume: bool | str = False, on_step: Callable[[dict], None] | None = None,
            on_eval: Callable[[dict], None] | None = None, on_record: Callable[[dict], None] | None = None,
            graceful_interrupt: bool = False) -> TrainResult:
        """Train until `steps` (or a budget); evaluate and checkpoint periodically and at the end.

        `graceful_interrupt` (the commands): the first SIGINT (Ctrl-C) or SIGTERM ends the run after the step in
        progress (or before the first step, when it comes during the first evaluation), saves it and returns with
        `interrupted` set, `where` and `advice` saying what was saved and how to go on; the caller must then stop.
        A signal during the last step, its evaluation or its save also sets `interrupted`: that run is complete and
        saved. A second signal stops at once: KeyboardInterrupt, its message saying what the last checkpoint is.
        Without it, Ctrl-C raises KeyboardInterrupt (its message naming the last checkpoint) and SIGTERM keeps its
        default."""
        tc, ctx = self.tc, self.ctx
        self._start(resume)
        writer = MetricsWriter(self.out_dir / "metrics.jsonl", resume_step=self.step if resume else None) \
            if self.out_dir is not None and ctx.rank == 0 else None
        result = TrainResult(steps_done=self.step)
        start = time.perf_counter()
        budget = None if tc.max_minutes is None else tc.max_minutes * 60.0
        last_dt, saved_at = 0.0, None
        recent: list[float] = []  # step times of this call, for the budget's re-planning
        cap_steps = tc.steps
        graceful = graceful_interrupt and self.ckpt_dir is not None  # the same on every rank: all agree or none

        def emit(rec, cb):
            result.records.append(rec)
            if writer is not None:
                writer.log(rec)
            if cb is not None:
                cb(rec)
            if on_record is not None:
                on_record(rec)

        def run_eval():
            v = self.run_eval()
            if v is not None:
                result.val.append(v)
                emit(v, on_eval)
            return v

        interrupt = GracefulInterrupt(graceful, announce=ctx.rank == 0)
        doing = None  # what a second signal interrupts, for its message: None (a step), "evaluating", "saving"
        try:
            if tc.eval_at_start and self.step == 0:
                doing = "evaluating"
                run_eval()
            if graceful and ctx.any(interrupt.requested):  # the signal came during the first evaluation
                result.interrupted = True
                result.where, result.advice = self._stopped_message("before")
            while not result.interrupted and not self._done():
                elapsed = time.perf_counter() - start
                if budget is not None and elapsed + last_dt + self.tail_seconds() > budget:
                    result.stopped_early = True
                    log.info("time budget of %g min reached at step %d", tc.max_minutes, self.step)
                    break
                doing = None
                t_step = time.perf_counter()
                try:
                    rec = self.train_step()
                except Exception as e:
                    if interrupt.requested:  # the signal also reached helper processes (torch.compile's workers),
                        # whose death failed the step: an interruption, not an error (the last saved step stands)
                        where, advice = self._stopped_message()
                        raise stop_exception(where, advice) from e
                    raise
                last_dt = self._step_s = rec["step_time_s"]
                if result.losses:  # the first step of a call carries one-off start-up costs: not a step time
                    recent.append(time.perf_counter() - t_step)  # the step's wall time, whatever slowed it
                else:
                    t_first = time.perf_counter()
                result.losses.append(rec["loss"])
                if tc.fit_steps_to_budget and len(result.losses) >= 3:
                    self._fit_to_budget(budget, start, t_first, recent, cap_steps)
                emit(rec, on_step)
                final = self._done()
                if (tc.eval_every and self.step % tc.eval_every == 0) or final:
                    doing = "evaluating"
                    run_eval()
                stop = graceful and ctx.any(interrupt.requested)
                if self.ckpt_dir is not None and ((tc.ckpt_every and self.step % tc.ckpt_every == 0) or final
                                                  or stop):
                    doing = "saving"
                    saved_at = self.save()
                if stop:  # in the last step too: that run is complete and saved, and reported interrupted
                    result.interrupted = True
                    last = " the last of this run," if final else ""
                    result.where = f"stopped after step {self.step},{last} saved as {saved_at}"
                    result.advice = RESUME_ADVICE.format(self.step)
                    log.info("interrupted at step %d: saved a checkpoint of it", self.step)
            if result.stopped_early and result.losses and not (result.val and result.val[-1].get("step") == self.step):
                # (nothing trained in this call, the budget spent before its first step: nothing new to evaluate)
                doing = "evaluating"
                run_eval()
            saved_now = saved_at is not None and saved_at.name.endswith(f"_{self.step:06d}")
            if self.ckpt_dir is not None and result.losses and not saved_now:
                doing = "saving"
                saved_at = self.save()
            if graceful and interrupt.requested and not result.interrupted:
                # during the final evaluation or save: the run is complete and saved, and the caller stops too
                # (k3 demo skips its samples and plots; `k3 distill teachers` would go on to its next stage)
                result.interrupted = True
                result.where = f"stopped after step {self.step}, the last of this run, saved as {saved_at}"
                result.advice = RESUME_ADVICE.format(self.step)
        except KeyboardInterrupt as e:
            if hasattr(e, "where"):
                raise
            # Ctrl-C without a graceful stop, or a second signal: the step, evaluation or save in progress is lost,
            # the last checkpoint stands
            where, advice = self._stopped_message(doing)
            raise stop_exception(where, advice) from None
        finally:
            interrupt.restore()
            if writer is not None:
                writer.close()
        result.steps_done, result.tokens = self.step, self.tokens
        result.elapsed_s = time.perf_counter() - start
        if saved_at is None and self.ckpt_dir is not None:  # nothing trained (a resume at --steps): the one it holds
            saved_at = ctx.latest(self.ckpt_dir)
        result.checkpoint = str(saved_at) if saved_at is not None else None
        return result

    def _start(self, resume: bool | str) -> None:
        """Resume, or start over where --overwrite allows it (never silently over an earlier run)."""
        ctx = self.ctx
        if resume:
            self.resume(None if resume is True else resume)
        elif self.ckpt_dir is not None and ctx.holds_any(self.ckpt_dir):
            if not self.overwrite:
                raise ValueError(f"{self.ckpt_dir} already holds a checkpoint; pass --resume to continue it, "
                                 "--overwrite to start over, or another --out")
            # every rank has looked before rank 0 deletes, so none can miss the checkpoint
            ctx.barrier()
            if ctx.rank == 0:
                shutil.rmtree(self.ckpt_dir)
            ctx.barrier()

    def _fit_to_budget(self, budget: float, start: float, t_first: float, recent: list[float], cap: int) -> None:
        """Re-plan the total from the measured time per step, so the WSD decay ends as the time budget does."""
        in_decay = self.step >= self.schedule.total_steps - self.schedule.decay_steps
        elapsed = time.perf_counter() - start
        # the mean since the first step includes periodic evals and saves; the last steps' mean follows a machine
        # that slows down (another job starts): the larger of the two plans the rest
        last10 = recent[-10:]
        per_step = max((time.perf_counter() - t_first) / len(recent), sum(last10) / len(last10))
        left = budget - elapsed - self.tail_seconds()
        plan = min(cap, self.step + int(0.92 * left / per_step))
        if in_decay:  # only shorten now: what is left of the decay is compressed, so it still ends at the minimum
            plan = min(plan, self.tc.steps)  # learning rate instead of being cut off
        if plan != self.tc.steps:
            self.set_total_steps(plan)

    def _stopped_message(self, doing: str | None = None) -> tuple[str, str]:
        """What a stop leaves (the last checkpoint), and how to go on from it. `doing`: None for a stop in step
        self.step + 1, "before" for one before it, "evaluating" or "saving" for one after step self.step."""
        latest = self.ctx.latest(self.ckpt_dir) if self.ckpt_dir is not None else None
        at = {None: f"in step {self.step + 1}", "before": f"before step {self.step + 1}"}.get(
            doing, f"while {doing} step {self.step}" if self.step else f"while {doing} before the first step")
        if latest is None:
            return f"stopped {at}", "; no checkpoint was saved yet, so the same command starts over"
        done = int(latest.name.rsplit("_", 1)[-1])
        lost = "" if self.step <= done else f" (step {self.step} is trained again)" if self.step == done + 1 else \
            f" (steps {done + 1}-{self.step} are trained again)"
        return f"stopped {at}; the last checkpoint is {latest}", RESUME_ADVICE.format(done) + lost
