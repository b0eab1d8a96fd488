"""A step loop for post-training (SFT, on-policy distillation): schedule, clip, step, checkpoint, metrics.

The caller gives `step_fn(step) -> dict`, which computes the step's loss (a scalar tensor under `"loss"`)
and its metrics; the loop does the rest with the trainer's parts (`k3.train.optim`, `schedule`,
`checkpoint`, `metrics`). A step_fn that accumulates gradients itself (micro-batches, to bound memory)
runs its own backward passes and returns `"backward_done": True` beside the loss it reports; the loop
then skips its backward. Everything random in a step must be a pure function of `(seed, step)` (per-step
generators, not the global RNG), so a run resumed from a checkpoint repeats exactly the steps an
uninterrupted run would have taken (tested: N steps == N/2, resume, N/2, losses equal).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from k3.train import checkpoint as ckpt
from k3.train.metrics import MetricsWriter
from k3.train.optim import build_optimizer
from k3.train.schedule import WSDSchedule

log = logging.getLogger(__name__)


@dataclass
class LoopConfig:
    steps: int = 100
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    decay_frac: float = 0.0  # post-training runs may stop on a token budget, so no decay by default
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    optimizer: str = "adamw"
    ckpt_every: int = 0  # 0: only at the end
    keep_last: int = 2
    seed: int = 0
    token_budget: int | None = None  # stop once this many loss tokens were trained on (a cap besides steps)
    eval_every: int = 0  # 0: evaluate at the start and the end only (when an evaluator is given)

    def validate(self) -> "LoopConfig":
        for name in ("steps", "keep_last"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} = {v!r} must be a positive integer")
        for name in ("ckpt_every", "eval_every", "warmup_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} = {v!r} must be an integer >= 0")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr = {self.lr!r} must be a positive number")
        if not self.grad_clip >= 0:  # NaN too; inf is as good as 0 (no clipping)
            raise ValueError(f"grad_clip = {self.grad_clip} must be >= 0 (0 disables clipping)")
        if not 0 <= self.decay_frac <= 1:
            raise ValueError(f"decay_frac = {self.decay_frac} must be a fraction of the steps, in [0, 1]")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"token_budget = {self.token_budget} must be a positive number of tokens")
        self.schedule()
        return self

    def schedule(self) -> WSDSchedule:
        warmup = min(self.warmup_steps, self.steps)
        decay = min(self.steps - warmup, round(self.decay_frac * self.steps))
        return WSDSchedule(self.steps, warmup, decay, self.min_lr_ratio)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# how a stopped run goes on (a Ctrl-C's message)
RESUME_ADVICE = ": the same command with --resume (and without --overwrite) continues from step {}"

# Settings a resumed run must share with the run it continues (the learning-rate schedule's among them: a resumed
# run repeats the uninterrupted one). `steps` is not one of them: a run may be continued to more steps.
RESUME_FIELDS = ("seed", "optimizer", "lr", "warmup_steps", "decay_frac", "min_lr_ratio", "weight_decay", "grad_clip")


def _stop(where: str, advice: str) -> KeyboardInterrupt:
    """The KeyboardInterrupt a graceful stop raises: its message says where the run stopped and how to go on;
    `where` alone is kept for a caller whose own advice differs (k3 rl --demo has no --resume)."""
    stop = KeyboardInterrupt(f"{where}{advice}")
    stop.where = where
    return stop


class StepLoop:
    """Runs `step_fn` for `config.steps` optimizer steps on `model`, writing OUT/metrics.jsonl and
    OUT/checkpoint/. `manifest_extra` is stored in every checkpoint (e.g. the tokenizer's sha256);
    `resume_fields` are checked equal on resume (e.g. batch shape, which teachers)."""

    def __init__(self, model: torch.nn.Module, config: LoopConfig, out_dir: str | os.PathLike | None,
                 manifest_extra: dict | None = None, resume_fields: dict | None = None):
        self.model = model
        self.lc = config.validate()
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.manifest_extra = dict(manifest_extra or {})
        self.resume_fields = {**{k: getattr(self.lc, k) for k in RESUME_FIELDS}, **(resume_fields or {})}
        self.optimizer = build_optimizer(model, self.lc.optimizer, lr=self.lc.lr, weight_decay=self.lc.weight_decay)
        self._peak_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.schedule = self.lc.schedule()
        self.step = 0
        self.tokens = 0
        self._params = [p for p in model.parameters() if p.requires_grad]

    @property
    def ckpt_dir(self) -> Path | None:
        return None if self.out_dir is None else self.out_dir / "checkpoint"

    def save(self) -> Path:
        if self.ckpt_dir is None:
            raise ValueError("saving needs an output directory")
        return ckpt.save_checkpoint(self.ckpt_dir, self.step, self.model, self.optimizer, self.model.config,
                                    data_state={"next_step": self.step, **self.resume_fields},
                                    extra={**self.manifest_extra, "tokens": self.tokens, "loop": self.lc.to_dict()},
                                    keep_last=self.lc.keep_last)

    def resume(self) -> dict:
        if self.ckpt_dir is None or ckpt.latest_checkpoint(self.ckpt_dir) is None:
            raise ValueError(f"--resume: no checkpoint in {self.ckpt_dir}; run without --resume to start")
        manifest = ckpt.load_checkpoint(self.ckpt_dir, self.model, self.optimizer, self.model.config)
        data = manifest.get("data", {})
        for k, v in self.resume_fields.items():
            if k in data and data[k] != v:
                raise ckpt.CheckpointError(f"{manifest['path']}/manifest.json: {k!r} is {data[k]!r} in the "
                                           f"checkpoint but {v!r} now; resume with the same setting or start over")
        for g, lr in zip(self.optimizer.param_groups, self._peak_lrs):
            g["peak_lr"] = lr
        self.step = int(manifest["step"])
        self.tokens = int(manifest.get("extra", {}).get("tokens", 0))
        log.info("resumed from %s at step %d", manifest["path"], self.step)
        return manifest

    def _done(self) -> bool:
        return self.step >= self.lc.steps or (self.lc.token_budget is not None and self.tokens >= self.lc.token_budget)

    def fit(self, step_fn: Callable[[int], dict], *, resume: bool = False, overwrite: bool = False,
            evaluate: Callable[[int], dict | None] | None = None,
            on_record: Callable[[dict], None] | None = None, graceful_interrupt: bool = False) -> list[dict]:
        """Train to `steps` (or the token budget); returns this call's records (train and eval).

        `graceful_interrupt` (the `k3 rl` and `k3 distill` commands): the first SIGINT (Ctrl-C) or SIGTERM ends the
        run after the step in progress, saves that step and raises KeyboardInterrupt saying so and how `--resume`
        goes on; a second one stops at once (the last saved checkpoint stands). Without it, Ctrl-C raises
        KeyboardInterrupt as usual and SIGTERM keeps its default."""
        from k3.train.trainer import GracefulInterrupt
        if resume:
            self.resume()
        elif self.ckpt_dir is not None and ckpt.latest_checkpoint(self.ckpt_dir) is not None:
            if not overwrite:
                raise ValueError(f"{self.ckpt_dir} already holds a checkpoint; pass --resume to continue it, "
                                 "--overwrite to start over, or another --out")
            shutil.rmtree(self.ckpt_dir)
        writer = MetricsWriter(self.out_dir / "metrics.jsonl", resume_step=self.step if resume else None) \
            if self.out_dir is not None else None
        records: list[dict] = []

        def emit(rec: dict) -> None:
            records.append(rec)
            if writer is not None:
                writer.log(rec)
            if on_record is not None:
                on_record(rec)

        def run_eval() -> None:
            if evaluate is not None:
                rec = evaluate(self.step)
                if rec is not None:
                    emit({"kind": "eval", "step": self.step, **rec})

        interrupt = GracefulInterrupt(graceful_interrupt and self.ckpt_dir is not None)
        doing = None  # what a second signal interrupts, for its message: None (a step) or "evaluating"/"saving"
        try:
            if not resume and self.step == 0:
                doing = "evaluating"
                run_eval()
            saved = None
            while not self._done():
                if interrupt.requested:  # the signal came before this step (during the first evaluation)
                    where, advice = self._interrupted_message("before")
                    raise _stop(where, advice)
                doing = None
                try:
                    rec = self.train_step(step_fn)
                except (KeyboardInterrupt, Exception) as e:
                    if not isinstance(e, KeyboardInterrupt) and not interrupt.requested:
                        raise
                    # a second signal, or a step that failed because the first one also reached a helper: the
                    # step in progress is lost, the last checkpoint stands
                    where, advice = self._interrupted_message()
                    raise _stop(where, advice) from None if isinstance(e, KeyboardInterrupt) else e
                emit(rec)
                if self.lc.eval_every and self.step % self.lc.eval_every == 0 and not self._done():
                    doing = "evaluating"
                    run_eval()
                if self.ckpt_dir is not None and self.lc.ckpt_every and self.step % self.lc.ckpt_every == 0:
                    doing = "saving"
                    saved = self.save()
                if interrupt.requested and not self._done():  # on the last step the run completes, below
                    if saved is None or not saved.name.endswith(f"_{self.step:06d}"):
                        doing = "saving"
                        saved = self.save()
                    raise _stop(f"stopped after step {self.step}, saved as {saved}", RESUME_ADVICE.format(self.step))
            trained = any(r.get("kind") == "train" for r in records)
            if trained and records[-1].get("kind") == "train":  # a final evaluation after the last step
                doing = "evaluating"
                run_eval()
            fresh = ckpt.latest_checkpoint(self.ckpt_dir) is None if self.ckpt_dir is not None else False
            if self.ckpt_dir is not None and (trained or fresh) and \
                    (saved is None or not saved.name.endswith(f"_{self.step:06d}")):
                doing = "saving"
                saved = self.save()
            if interrupt.requested:  # during the last step, its evaluation or its save: the run is complete and
                # saved, and the caller stops too (`k3 distill teachers` would go on to its next stage)
                latest = ckpt.latest_checkpoint(self.ckpt_dir)
                raise _stop(f"stopped after step {self.step}, the last of this run, saved as {latest}",
                            RESUME_ADVICE.format(self.step))
        except KeyboardInterrupt as e:
            if hasattr(e, "where") or not interrupt.requested:
                raise
            # a second signal while evaluating or saving (an interrupted save leaves the checkpoint before it)
            where, advice = self._interrupted_message(doing)
            raise _stop(where, advice) from None
        finally:
            interrupt.restore()
            if writer is not None:
                writer.close()
        return records

    def _interrupted_message(self, doing: str | None = None) -> tuple[str, str]:
        """What a stop leaves (the last checkpoint), and how to continue from it. `doing`: None for a stop in step
        self.step + 1, "before" for one before it, "evaluating" or "saving" for one after step self.step."""
        latest = ckpt.latest_checkpoint(self.ckpt_dir) if self.ckpt_dir is not None else None
        at = {None: f"in step {self.step + 1}", "before": f"before step {self.step + 1}"}.get(
            doing, f"while {doing} step {self.step}" if self.step else f"while {doing} before the first step")
        if latest is None:
            return f"stopped {at}", "; no checkpoint was saved yet, so the same command starts over"
        done = int(latest.name.rsplit("_", 1)[-1])
        lost = "" if self.step <= done else f" (step {self.step} is trained again)" if self.step == done + 1 else \
            f" (steps {done + 1}-{self.step} are trained again)"
        return f"stopped {at}; the last checkpoint is {latest}", RESUME_ADVICE.format(done) + lost

    def train_step(self, step_fn: Callable[[int], dict]) -> dict:
        model = self.model
        t0 = time.perf_counter()
        factor = self.schedule.apply(self.optimizer, self.step)
        self.optimizer.zero_grad(set_to_none=True)
        out = step_fn(self.step)
        loss = out.pop("loss")
        model.train()
        skip, done = out.pop("skip_update", False), out.pop("backward_done", False)
        if skip:
            # nothing to learn from (e.g. every GRPO group tied): no optimizer step, so AdamW's momentum does not
            # move the weights; the step still counts (its data was used) and the schedule moves on with it
            grad_norm = torch.zeros(())
        else:
            if not done:
                loss.backward()
            clip = self.lc.grad_clip if self.lc.grad_clip > 0 else math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(self._params, clip)
            self.optimizer.step()
            if hasattr(model, "update_balancing"):
                model.update_balancing()
        value = float(loss.detach())
        if not math.isfinite(value):
            from k3.train.trainer import DIVERGED_RESTART

            raise ValueError(f"training diverged: loss is {value} at step {self.step + 1}; lower --lr "
                             f"({DIVERGED_RESTART})")
        self.step += 1
        n_tok = int(out.pop("tokens", 0))
        self.tokens += n_tok
        dt = time.perf_counter() - t0
        return {"kind": "train", "step": self.step, "loss": value, "lr": self._peak_lrs[0] * factor,
                "grad_norm": float(grad_norm), "tokens": self.tokens, "step_time_s": round(dt, 4),
                "tokens_per_s": round(n_tok / dt, 2), **out}
