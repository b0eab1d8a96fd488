"""The training loop: data -> forward/backward (accumulated) -> clip -> optimizer -> QK-Clip -> balancing.

The loop only orchestrates; optimizers (`optim`), the LR schedule (`schedule`), checkpoints (`checkpoint`)
and metrics (`metrics`, `plots`) are separate parts it calls. Batches come from a dataset's
`get_batch(index, batch_size, seq_len, seed)`, with micro-batch index = step * accum + micro, so the data
order is a pure function of (seed, step) and a resumed run sees exactly the batches an uninterrupted one
would. Together with restored model/optimizer/RNG state this makes resume on CPU bitwise exact.

Per optimizer step:
  for each micro-batch: loss = loss_fn (CE(model(x), y) by default) + model.aux_loss(); (loss / accum).backward()
  grad-norm clipping -> optimizer.step() -> QK-Clip of MLA heads (MuonClip) -> model.update_balancing()
CPU runs in fp32; CUDA uses bf16 autocast. Optional: activation checkpointing (recompute each token mixer
and channel mixer in backward), torch.compile (off by default; on CPU it did not help, docs/training.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import record_function

from k3.config import K3Config
from k3.train import checkpoint as ckpt
from k3.train.metrics import (MetricsWriter, attnres_stats, bits_per_byte, expert_load_stats, flops_per_token,
                              measured_peak_flops)
from k3.train.optim import QKClip, build_optimizer
from k3.train.schedule import WSDSchedule

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 128
    accum: int = 1
    lr: float = 3e-3
    optimizer: str = "adamw"  # adamw | muon (MuonClip: Muon + QK-Clip)
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.95  # Muon
    warmup_frac: float = 0.05
    warmup_steps: int | None = None  # overrides warmup_frac
    decay_frac: float = 0.2
    min_lr_ratio: float = 0.1
    schedule_shape: str = "linear"
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)
    qk_clip_tau: float = 100.0  # used with optimizer = muon; 0 disables
    max_minutes: float | None = None  # stop when the next step plus a final eval and save would exceed it
    # With max_minutes: treat `steps` as a cap and re-plan the total from the measured time per step (during
    # the decay only shortening it), so the WSD decay ends as the budget does (the demo).
    fit_steps_to_budget: bool = False
    eval_every: int = 0  # 0: evaluate only at the end
    eval_batches: int = 8
    eval_at_start: bool = False  # also evaluate before the first step (a fresh run's baseline)
    ckpt_every: int = 0  # 0: checkpoint only at the end
    keep_last: int = 3
    seed: int = 0
    activation_checkpointing: bool = False
    # torch.compile backend: False/"" = eager, True = "inductor"; "aot_eager" traces without code generation
    # (what the CPU test uses). On CPU inductor was not measured to help (docs/training.md).
    compile: bool | str = False
    device: str = "auto"  # auto | cpu | cuda
    record_attnres: bool = True
    measure_mfu: bool = True

    def validate(self) -> "TrainConfig":
        for name in ("steps", "batch_size", "seq_len", "accum", "eval_batches", "keep_last"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"train: {name} = {v!r} must be a positive integer")
        for name in ("eval_every", "ckpt_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"train: {name} = {v!r} must be an integer >= 0 (0 = only at the end)")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"train: lr = {self.lr!r} must be a positive number")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"train: optimizer = {self.optimizer!r}; choose adamw or muon")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"train: max_minutes = {self.max_minutes!r} must be positive")
        if self.grad_clip < 0 or self.qk_clip_tau < 0:
            raise ValueError("train: grad_clip and qk_clip_tau must be >= 0 (0 disables)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train: device = {self.device!r}; choose auto, cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("train: device = cuda but CUDA is not available")
        if self.compile not in (False, True, "") and self.compile not in _compile_backends():
            raise ValueError(f"train: compile = {self.compile!r} is not a torch.compile backend; "
                             f"choose one of {sorted(_compile_backends())}")
        if self.fit_steps_to_budget and self.max_minutes is None:
            raise ValueError("train: fit_steps_to_budget needs max_minutes")
        self.schedule()
        return self

    def schedule(self, total: int | None = None, warmup: int | None = None) -> WSDSchedule:
        total = self.steps if total is None else total
        if warmup is None:
            warmup = self.warmup_steps if self.warmup_steps is not None else \
                (math.ceil(self.warmup_frac * total) if self.warmup_frac > 0 else 0)
        warmup = min(warmup, total)
        decay = min(total - warmup, round(self.decay_frac * total))
        return WSDSchedule(total, warmup, decay, self.min_lr_ratio, self.schedule_shape)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Fields that must match for a resumed run to see the same batches and updates.
RESUME_FIELDS = ("batch_size", "seq_len", "accum", "seed", "optimizer")
DATA_FIELDS = ("tokenizer_hash", "train_tokens")  # data_info entries a resume must match
# ... and the same learning-rate schedule and update rule (read from the checkpoint's recorded train config;
# `steps` may grow: the schedule is re-planned for the new total, as documented)
SCHEDULE_FIELDS = ("lr", "warmup_steps", "warmup_frac", "decay_frac", "min_lr_ratio", "schedule_shape",
                   "weight_decay", "betas", "momentum", "grad_clip", "qk_clip_tau")
_SCHEDULE_FLAGS = {"lr": "--lr", "warmup_steps": "--warmup-steps"}  # the ones `k3 train` exposes


def check_schedule_fields(recorded: dict | None, tc: "TrainConfig", where: str) -> None:
    """A resume must train with the learning-rate schedule and update rule its checkpoint was trained with
    (`recorded`: the checkpoint's train config; an older checkpoint without one is not checked)."""
    for k in SCHEDULE_FIELDS:
        if not recorded or k not in recorded:
            continue
        have, now = recorded[k], getattr(tc, k)
        if (list(have) if isinstance(have, (list, tuple)) else have) != \
                (list(now) if isinstance(now, (list, tuple)) else now):
            flag = _SCHEDULE_FLAGS.get(k)
            fix = (f"resume with {flag} {have}" if have is not None else f"resume without {flag}") if flag else \
                f"resume with TrainConfig({k}={have!r})"
            raise ckpt.CheckpointError(f"{where}: {k} is {have!r} in the checkpoint but {now!r} now; {fix} "
                                       "(or start a new run: a resume continues the same schedule)")


def _compile_backends() -> set[str]:
    import torch._dynamo

    return set(torch._dynamo.list_backends(exclude_tags=())) | {"inductor"}


@dataclass
class TrainResult:
    steps_done: int
    losses: list[float] = field(default_factory=list)  # per optimizer step of this call
    val: list[dict] = field(default_factory=list)
    tokens: int = 0
    elapsed_s: float = 0.0
    stopped_early: bool = False
    interrupted: bool = False  # stopped by Ctrl-C (SIGINT) after a whole step, with a checkpoint of it
    checkpoint: str | None = None


def resolve_device(name: str) -> torch.device:
    """--device auto | cpu | cuda[:N] -> a torch.device this machine has (ValueError naming the flag otherwise)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {name!r} is not a device; use auto, cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine (this torch build "
                         f"{'has no CUDA' if torch.version.cuda is None else 'sees no GPU'}); use --device cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return dev


def _holds_distributed_checkpoint(path) -> bool:
    from k3.parallel.checkpoint import latest

    return latest(path) is not None


def split_batch(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A dataset batch -> (inputs [B, T], targets [B, T]): accepts (x, y), {"input_ids", "labels"} or [B, T+1]."""
    if isinstance(batch, dict):
        return batch["input_ids"], batch.get("labels", batch.get("targets"))
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, torch.Tensor) and batch.dim() == 2:
        return batch[:, :-1], batch[:, 1:]
    raise ValueError(f"dataset returned a batch of type {type(batch).__name__}; expected (inputs, targets)")


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


def _check_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".k3-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"output folder {path} is not writable ({e.strerror or e}); pass another --out") from None


def dataset_vocab_size(dataset) -> int | None:
    v = getattr(dataset, "vocab_size", None)
    if v is None:
        v = getattr(dataset, "manifest", {}).get("vocab_size")
    return v


# a resume keeps the run's learning rate (it is refused under another): what a lower --lr takes
DIVERGED_RESTART = "a run with another --lr starts over: --overwrite or another --out"


def check_dataset(dataset, name: str, config: K3Config, batch_size: int, seq_len: int, seed: int,
                  min_tokens: int | None = None) -> None:
    """Fail before training on a dataset that cannot produce one batch or whose ids exceed the vocab."""
    if dataset is None or not hasattr(dataset, "get_batch"):
        raise ValueError(f"{name} dataset {dataset!r} has no get_batch(step, batch_size, seq_len, seed)")
    vocab = dataset_vocab_size(dataset)
    if vocab is not None and vocab != config.vocab_size:
        raise ValueError(f"{name} data was tokenized with a vocabulary of {vocab} tokens but the model has "
                         f"vocab_size = {config.vocab_size}; use --set vocab_size={vocab} or retokenize with "
                         f"--vocab-size {config.vocab_size}")
    n_tokens = _n_tokens(dataset)
    need = min_tokens if min_tokens is not None else seq_len + 1
    if n_tokens is not None and n_tokens < need:
        if min_tokens is None:
            more = ("more text, a larger share of it for validation (`k3 tokenize --val-fraction`)"
                    if name == "validation" else "more text")
            raise ValueError(f"{name} data has {n_tokens:,} tokens, fewer than one window needs ({need:,} = seq_len "
                             f"+ 1); give {more}, or lower --seq-len")
        raise ValueError(f"{name} data has {n_tokens:,} tokens, fewer than one batch needs ({need:,} = "
                         f"batch_size x seq_len + 1); give more text or lower --batch-size / --seq-len")
    x, y = split_batch(dataset.get_batch(0, batch_size, seq_len, seed))
    if tuple(x.shape) != (batch_size, seq_len) or tuple(y.shape) != (batch_size, seq_len):
        raise ValueError(f"{name} data returned batches of shape {tuple(x.shape)}/{tuple(y.shape)}, expected "
                         f"({batch_size}, {seq_len})")
    top = int(max(x.max(), y.max()))
    if top >= config.vocab_size or int(min(x.min(), y.min())) < 0:
        raise ValueError(f"{name} data holds token id {top} but the model's vocab_size is {config.vocab_size}; "
                         "the data and the model use different tokenizers")


def _n_tokens(dataset) -> int | None:
    for attr in ("n_tokens", "num_tokens"):
        v = getattr(dataset, attr, None)
        if isinstance(v, int):
            return v
    try:
        return len(dataset)
    except TypeError:
        return None


def eval_batches(dataset, batch_size: int, seq_len: int, max_batches: int | None = None, seed: int = 0):
    """Validation batches of non-overlapping windows [B, T] -> (inputs, targets).

    All of the split in order (`max_batches` None), or `max_batches` batches of windows spread evenly over
    the whole split, so a capped evaluation is not just the split's first document(s). Datasets without a
    flat `tokens` array fall back to `iter_eval_batches` or to get_batch(i, ...) for i < max_batches.
    """
    tokens = getattr(dataset, "tokens", None)
    if tokens is not None and hasattr(tokens, "__len__") and len(tokens) > seq_len:
        n_windows = (len(tokens) - 1) // seq_len
        if max_batches is None or max_batches * batch_size >= n_windows:
            picks = np.arange(n_windows)
        else:
            picks = np.unique(np.linspace(0, n_windows - 1, max_batches * batch_size).round().astype(np.int64))
        for i in range(0, len(picks), batch_size):
            w = np.stack([np.asarray(tokens[s * seq_len:s * seq_len + seq_len + 1], dtype=np.int64)
                          for s in picks[i:i + batch_size]])
            yield torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())
        return
    if hasattr(dataset, "iter_eval_batches"):
        yield from dataset.iter_eval_batches(batch_size, seq_len, max_batches)
        return
    if max_batches is None:
        raise ValueError("eval_batches: this dataset has no tokens array or iter_eval_batches; give max_batches")
    for i in range(max_batches):
        yield split_batch(dataset.get_batch(i, batch_size, seq_len, seed))


def eval_batch_count(dataset, batch_size: int, seq_len: int, max_batches: int | None = None) -> int | None:
    """How many batches `eval_batches` yields for these arguments (None where the dataset cannot say)."""
    tokens = getattr(dataset, "tokens", None)
    if tokens is not None and hasattr(tokens, "__len__") and len(tokens) > seq_len:
        n_windows = (len(tokens) - 1) // seq_len
        if max_batches is not None and max_batches * batch_size < n_windows:
            n_windows = len(np.unique(np.linspace(0, n_windows - 1, max_batches * batch_size).round()))
        return -(-n_windows // batch_size)
    return max_batches


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, batches: int | None, batch_size: int, seq_len: int, seed: int = 0,
             device: torch.device | str = "cpu", progress: Callable[[int], None] | None = None) -> float:
    """Mean cross-entropy (nats / token) over `batches` validation batches spread evenly over the split (None:
    all of them; see `eval_batches`). `progress(1)` is called after each batch."""
    device = torch.device(device)
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    try:
        for x, y in eval_batches(dataset, batch_size, seq_len, batches, seed):
            x, y = x.to(device), y.to(device)
            with _autocast(device):
                logits = model(x)
            total += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                           reduction="sum"))
            n += y.numel()
            if progress is not None:
                progress(1)
    finally:
        model.train(was_training)
    if n == 0:
        raise ValueError("evaluation saw no tokens; the validation split is smaller than one sequence")
    return total / n


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Trainer:
    """Train a K3Model on a dataset; writes metrics.jsonl and checkpoints under `out_dir`.

    Parts are plain attributes (model, optimizer, schedule, metrics writer) so a caller can swap one.
    `on_step(record)` / `on_eval(record)` callbacks receive each metrics record (the CLI's progress bar).
    """

    def __init__(self, config: K3Config, train: TrainConfig, train_data, val_data=None,
                 out_dir: str | os.PathLike | None = None, bytes_per_token: float | None = None,
                 data_info: dict | None = None, overwrite: bool = False):
        self.overwrite = overwrite
        self.config = config.validate()
        self.tc = train.validate()
        if self.tc.seq_len > config.max_context:
            raise ValueError(f"seq_len = {self.tc.seq_len} exceeds the model's max_context = {config.max_context}")
        self.out_dir = Path(out_dir) if out_dir is not None else None
        if self.out_dir is not None:
            _check_writable(self.out_dir)
        check_dataset(train_data, "training", config, self.tc.batch_size, self.tc.seq_len, self.tc.seed,
                      min_tokens=self.tc.batch_size * self.tc.seq_len + 1)
        if val_data is not None:
            check_dataset(val_data, "validation", config, self.tc.batch_size, self.tc.seq_len, self.tc.seed)
        self.train_data, self.val_data = train_data, val_data
        self.bytes_per_token = bytes_per_token
        self.data_info = data_info or {}
        self.device = resolve_device(self.tc.device)

        from k3.model.transformer import K3Model

        torch.manual_seed(self.tc.seed)  # model init is a function of the seed
        self.model = K3Model(config).to(self.device)
        if self.tc.activation_checkpointing:
            apply_activation_checkpointing(self.model)
        if self.tc.record_attnres and hasattr(self.model, "attnres"):
            self.model.attnres.record_weights = True
        self.optimizer = build_optimizer(self.model, self.tc.optimizer, lr=self.tc.lr,
                                         weight_decay=self.tc.weight_decay, betas=self.tc.betas,
                                         momentum=self.tc.momentum)
        self._peak_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.schedule = self.tc.schedule()
        self.qk_clip = QKClip(self.model, self.tc.qk_clip_tau) \
            if self.tc.optimizer == "muon" and self.tc.qk_clip_tau > 0 else None
        backend = "inductor" if self.tc.compile is True else self.tc.compile
        self.forward = torch.compile(self.model, backend=backend) if backend else self.model
        self.step = 0
        self.tokens = 0
        self.flops_per_token = flops_per_token(self.model, self.tc.seq_len)["total"]
        self.peak_flops = None
        self._eval_s, self._save_s = None, None  # measured by run_eval / save
        self._step_s: float | None = None  # the last training step's time, to estimate an eval not yet run
        self._params = [p for p in self.model.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ checkpoints
    @property
    def ckpt_dir(self) -> Path | None:
        return None if self.out_dir is None else self.out_dir / "checkpoint"

    def data_state(self) -> dict:
        return {"next_step": self.step, **{k: getattr(self.tc, k) for k in RESUME_FIELDS}, **self.data_info}

    def save(self) -> Path:
        if self.ckpt_dir is None:
            raise ValueError("Trainer.save needs an out_dir")
        t0 = time.perf_counter()
        try:
            return self._save()
        finally:
            self._save_s = time.perf_counter() - t0

    def tail_seconds(self) -> float:
        """What stopping costs after the last step: a final evaluation and a checkpoint. Measured when they
        have run; before the first evaluation, estimated from the last training step (an eval batch is a forward
        of one micro-batch: at most half of its forward and backward); before the first save, from the bytes to
        write and hash at 100 MB/s."""
        tail = 0.0
        if self.val_data is not None:
            tail = self._eval_s if self._eval_s is not None else self._estimated_eval_s()
        if self.ckpt_dir is not None:
            if self._save_s is None:
                n = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
                factor = 3 if self.tc.optimizer == "adamw" else 2.5  # weights + optimizer moments / momenta
                return tail + factor * n / 100e6
            tail += self._save_s
        return tail

    def _estimated_eval_s(self) -> float:
        if self._step_s is None:
            return 0.0
        tc = self.tc
        n = tc.eval_batches
        if n is None:  # the whole split
            tokens = _n_tokens(self.val_data)
            n = max(1, -(-tokens // (tc.batch_size * tc.seq_len))) if tokens else 1
        return n * self._step_s / (2 * tc.accum)

    def _save(self) -> Path:
        return ckpt.save_checkpoint(self.ckpt_dir, self.step, self.model, self.optimizer, self.config,
                                    data_state=self.data_state(),
                                    extra={"tokens": self.tokens, "train": self.tc.to_dict()},
                                    keep_last=self.tc.keep_last)

    def resume(self, path: str | os.PathLike | None = None) -> dict:
        """Load model, optimizer, RNG and position from `path` (default: the latest under out_dir)."""
        path = Path(path) if path is not None else self.ckpt_dir
        if path is not None and ckpt.latest_checkpoint(path) is None and _holds_distributed_checkpoint(path):
            raise ValueError(f"{path} holds a distributed (DCP) checkpoint, which this Trainer cannot load; continue it "
                             "with `k3 train --resume` (any --nproc, a world of one included: DCP reshards) or "
                             "k3.parallel.train.ParallelTrainer")
        if path is None or ckpt.latest_checkpoint(path) is None and not (path / ckpt.MANIFEST).is_file():
            raise ValueError(f"--resume: no checkpoint found in {path}")
        manifest = ckpt.load_checkpoint(path, self.model, self.optimizer, self.config)
        data = manifest.get("data", {})
        for k in RESUME_FIELDS:
            if k in data and data[k] != getattr(self.tc, k):
                raise ckpt.CheckpointError(
                    f"{manifest['path']}/manifest.json: data field {k!r} is {data[k]!r} in the checkpoint but "
                    f"{getattr(self.tc, k)!r} now; resume with the same {k} (or start a new run)")
        check_schedule_fields(manifest.get("extra", {}).get("train"), self.tc, f"{manifest['path']}/manifest.json")
        for k in DATA_FIELDS:  # another dataset would silently change what the resumed steps train on
            if k in data and k in self.data_info and data[k] != self.data_info[k]:
                raise ckpt.CheckpointError(
                    f"{manifest['path']}/manifest.json: the checkpoint was trained on data with {k} {data[k]!r}, "
                    f"this run's data has {self.data_info[k]!r}; resume with --data {data.get('data_dir', 'DIR')} "
                    "(the data it was trained on), or start a new run")
        for g, lr in zip(self.optimizer.param_groups, self._peak_lrs):
            g["peak_lr"] = lr  # the schedule follows this run's --lr
        self.step = int(manifest["step"])
        self.tokens = int(manifest.get("extra", {}).get("tokens", 0))
        if self.step >= self.tc.steps:
            log.debug("checkpoint is at step %d, already >= steps = %d; nothing to train", self.step, self.tc.steps)
        log.info("resumed from %s at step %d", manifest["path"], self.step)
        return manifest

    def set_total_steps(self, total: int) -> None:
        """Re-plan the run to `total` steps (keeps the warmup length; the decay is decay_frac of the total)."""
        total = max(int(total), self.step + 1)
        self.tc.steps = total
        self.schedule = self.tc.schedule(total, warmup=self.schedule.warmup_steps)

    # ------------------------------------------------------------------ loop
    def loss_fn(self, logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training objective of one micro-batch (inputs x, targets y), logged as the step's loss:
        next-token cross-entropy. A subclass may replace it (e.g. distillation from a teacher on x)."""
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def train_step(self) -> dict:
        """One optimizer step (accum micro-batches); returns the step's metrics record."""
        tc, model = self.tc, self.model
        model.train()
        t0 = time.perf_counter()
        lr_factor = self.schedule.apply(self.optimizer, self.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, aux_sum = 0.0, 0.0
        loads = None
        t_fwd = t_bwd = 0.0
        for micro in range(tc.accum):
            x, y = split_batch(self.train_data.get_batch(self.step * tc.accum + micro, tc.batch_size, tc.seq_len,
                                                         tc.seed))
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            t1 = time.perf_counter()
            with record_function("k3::forward"), _autocast(self.device):
                logits = self.forward(x)
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
            loads = self._accumulate_loads(loads)
        t3 = time.perf_counter()
        with record_function("k3::optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self._params, tc.grad_clip if tc.grad_clip > 0 else math.inf)
            loss = loss_sum / tc.accum
            if not (math.isfinite(loss) and math.isfinite(float(grad_norm))):  # before the update: never applied
                what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {float(grad_norm)}"
                raise ValueError(f"training diverged: {what} at step {self.step + 1} (not applied, not saved); "
                                 f"lower --lr or check the data ({DIVERGED_RESTART})")
            self.optimizer.step()
        t_opt = time.perf_counter() - t3
        clip = None
        if self.qk_clip is not None:
            with record_function("k3::qk_clip"):
                clip = self.qk_clip.apply()
        with record_function("k3::balancing"):
            if hasattr(model, "update_balancing"):
                model.update_balancing()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        n_tok = tc.accum * tc.batch_size * tc.seq_len
        self.step += 1
        self.tokens += n_tok
        rec = {"kind": "train", "step": self.step, "loss": loss, "aux_loss": aux_sum / tc.accum,
               "lr": self._peak_lrs[0] * lr_factor, "grad_norm": float(grad_norm), "tokens": self.tokens,
               "step_time_s": round(dt, 4), "tokens_per_s": round(n_tok / dt, 2),
               # host wall time per phase (on CUDA, device work shows up where the host waits for it)
               "forward_s": round(t_fwd, 4), "backward_s": round(t_bwd, 4), "optimizer_s": round(t_opt, 4)}
        if self.peak_flops:
            rec["mfu"] = round(n_tok * self.flops_per_token / dt / self.peak_flops, 5)
        if clip is not None:
            rec.update(clip)
        rec.update(expert_load_stats(model) if loads is None else _load_record(loads))
        rec.update(attnres_stats(model))
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

    def run_eval(self) -> dict | None:
        if self.val_data is None:
            return None
        t0 = time.perf_counter()
        loss = evaluate(self.model, self.val_data, self.tc.eval_batches, self.tc.batch_size, self.tc.seq_len,
                        seed=self.tc.seed, device=self.device)
        self._eval_s = time.perf_counter() - t0
        rec = {"kind": "val", "step": self.step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}
        if self.bytes_per_token:
            rec["val_bpb"] = bits_per_byte(loss, self.bytes_per_token)
        return rec

    def fit(self, resume: bool | str = False, on_step: Callable[[dict], None] | None = None,
            on_eval: Callable[[dict], None] | None = None, graceful_interrupt: bool = False) -> TrainResult:
        """Train until `steps` (or the time budget); evaluate and checkpoint periodically and at the end.

        `graceful_interrupt` (the `k3 train` and `k3 demo` commands): the first SIGINT (Ctrl-C) or SIGTERM ends the
        run after the step in progress (or before the first step, when it comes during the first evaluation), saves
        it and returns with `interrupted` set; the caller must then stop. A signal during the last step, its
        evaluation or its save also sets `interrupted`: that run is complete and saved. Without it, Ctrl-C raises
        KeyboardInterrupt as usual."""
        tc = self.tc
        if resume:
            self.resume(None if resume is True else resume)
        elif self.ckpt_dir is not None and (ckpt.latest_checkpoint(self.ckpt_dir) is not None
                                            or _holds_distributed_checkpoint(self.ckpt_dir)):
            if not self.overwrite:
                raise ValueError(f"{self.ckpt_dir} already holds a checkpoint; pass --resume to continue it, "
                                 "--overwrite to start over, or another --out")
            shutil.rmtree(self.ckpt_dir)
        if tc.measure_mfu and self.peak_flops is None:
            self.peak_flops = measured_peak_flops(self.device, torch.bfloat16 if self.device.type == "cuda"
                                                  else torch.float32)
        writer = MetricsWriter(self.out_dir / "metrics.jsonl", resume_step=self.step if resume else None) \
            if self.out_dir is not None else None
        result = TrainResult(steps_done=self.step)
        start = time.perf_counter()
        budget = None if tc.max_minutes is None else tc.max_minutes * 60.0
        last_dt, saved_at = 0.0, None
        recent: list[float] = []  # step times of this call, for the budget's re-planning
        cap_steps = tc.steps

        def emit(rec, cb):
            if writer is not None:
                writer.log(rec)
            if cb is not None:
                cb(rec)

        interrupt = GracefulInterrupt(graceful_interrupt and self.ckpt_dir is not None)
        try:
            if tc.eval_at_start and self.step == 0:
                v = self.run_eval()
                if v is not None:
                    result.val.append(v)
                    emit(v, on_eval)
            while self.step < tc.steps:
                if interrupt.requested:  # the signal came before this step (during the first evaluation)
                    result.interrupted = True
                    log.info("interrupted before step %d", self.step + 1)
                    break
                elapsed = time.perf_counter() - start
                if budget is not None and elapsed + last_dt + self.tail_seconds() > budget:
                    result.stopped_early = True
                    log.info("time budget of %g min reached at step %d", tc.max_minutes, self.step)
                    break
                t_step = time.perf_counter()
                try:
                    rec = self.train_step()
                except Exception as e:
                    if interrupt.requested:  # the Ctrl-C also reached helper processes (torch.compile's workers),
                        # whose death failed the step: an interruption, not an error (the last saved step stands)
                        raise KeyboardInterrupt(f"during step {self.step + 1} ({type(e).__name__})") from e
                    raise
                last_dt = self._step_s = rec["step_time_s"]
                if result.losses:  # the first step of a call carries one-off start-up costs: not a step time
                    recent.append(time.perf_counter() - t_step)  # the step's wall time, whatever slowed it
                else:
                    t_first = time.perf_counter()
                result.losses.append(rec["loss"])
                if tc.fit_steps_to_budget and len(result.losses) >= 3:
                    in_decay = self.step >= self.schedule.total_steps - self.schedule.decay_steps
                    elapsed = time.perf_counter() - start
                    # the mean since the first step includes periodic evals and saves; the last steps' mean
                    # follows a machine that slows down (another job starts): the larger of the two plans the rest
                    last10 = recent[-10:]
                    per_step = max((time.perf_counter() - t_first) / len(recent), sum(last10) / len(last10))
                    left = budget - elapsed - self.tail_seconds()
                    plan = min(cap_steps, self.step + int(0.92 * left / per_step))
                    if in_decay:  # only shorten now: what is left of the decay is compressed, so it still ends
                        plan = min(plan, tc.steps)  # at the minimum learning rate instead of being cut off
                    if plan != tc.steps:
                        self.set_total_steps(plan)
                emit(rec, on_step)
                final = self.step == tc.steps
                if (tc.eval_every and self.step % tc.eval_every == 0) or final:
                    v = self.run_eval()
                    if v is not None:
                        result.val.append(v)
                        emit(v, on_eval)
                if self.ckpt_dir is not None and ((tc.ckpt_every and self.step % tc.ckpt_every == 0) or final):
                    saved_at = self.save()
                if interrupt.requested and not final:  # a signal during the last step: the run completes, below
                    result.interrupted = True
                    log.info("interrupted at step %d: saving a checkpoint of it", self.step)
                    break
            if result.stopped_early and result.losses and not (result.val and result.val[-1].get("step") == self.step):
                # (nothing trained in this call, the budget spent before its first step: nothing new to evaluate)
                v = self.run_eval()
                if v is not None:
                    result.val.append(v)
                    emit(v, on_eval)
            saved_now = saved_at is not None and saved_at.name.endswith(f"_{self.step:06d}")
            if self.ckpt_dir is not None and result.losses and not saved_now:
                saved_at = self.save()
            # a signal during the last step, its evaluation or its save: the run is complete and saved, and the
            # caller stops too (k3 demo skips its samples and plots)
            result.interrupted = result.interrupted or interrupt.requested
        finally:
            interrupt.restore()
            if writer is not None:
                writer.close()
        result.steps_done = self.step
        result.tokens = self.tokens
        result.elapsed_s = time.perf_counter() - start
        if saved_at is None and self.ckpt_dir is not None:  # nothing trained (a resume at --steps): the one it holds
            saved_at = ckpt.latest_checkpoint(self.ckpt_dir)
        result.checkpoint = str(saved_at) if saved_at is not None else None
        return result


class GracefulInterrupt:
    """While a run with a checkpoint directory trains, the first SIGINT (Ctrl-C) or SIGTERM (`kill PID`, a
    supervisor's stop, `docker stop`, a scheduler's preemption) asks it to stop after the step in progress and save a
    checkpoint (a step cut half way, e.g. inside the optimizer update, could not be saved as any step); a second one
    stops at once. A distributed run agrees on the request over all ranks after every step (`ParallelTrainer.fit`),
    so every rank stops and saves at the same step. A caller outside the main thread keeps the default, and so does
    a signal that someone else already handles. SIGHUP keeps its default: after a hang-up the terminal the progress
    bar writes to is gone."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self, enabled: bool, announce: bool = True):
        import signal
        import threading

        self.requested = False
        self.announce = announce
        self._previous: dict = {}
        if not enabled or threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            untouched = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            if signal.getsignal(sig) is untouched:  # someone else handles it (or ignores it): leave it to them
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        import signal

        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.announce:
            try:
                print(f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint; press Ctrl-C again (or send "
                      "the signal again) to stop at once", file=sys.stderr, flush=True)
            except OSError:  # no terminal to tell any more: the save matters more
                pass

    def restore(self) -> None:
        import signal

        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def _load_record(loads: list[torch.Tensor]) -> dict:
    ratios = [float(l.max() / l.mean()) if float(l.mean()) > 0 else float("nan") for l in loads]
    return {"expert_load_max_mean": [round(r, 4) for r in ratios],
            "expert_load_max_mean_overall": round(sum(ratios) / len(ratios), 4),
            "expert_load": [[round(float(x) / max(float(l.sum()), 1e-12), 5) for x in l] for l in loads]}


def train(config: K3Config, train_data, val_data=None, out_dir: str | os.PathLike | None = None,
          resume: bool = False, overwrite: bool = False, on_step=None, on_eval=None,
          **train_kwargs) -> tuple[Trainer, TrainResult]:
    """Build a Trainer from `TrainConfig(**train_kwargs)` and run it."""
    trainer = Trainer(config, TrainConfig(**train_kwargs), train_data, val_data, out_dir, overwrite=overwrite)
    return trainer, trainer.fit(resume=resume, on_step=on_step, on_eval=on_eval)


def _recorded_tokenizer_nearby(manifest: dict) -> str | None:
    """For checkpoints that record only their tokenizer's sha256 (`k3 rl`, `k3 distill`: extra.tokenizer_sha256):
    the tokenizer.json with that fingerprint in a directory above the checkpoint (an experiment root keeps it
    there, e.g. ROOT/tokenizer.json beside ROOT/<run>/checkpoint/), else None."""
    from k3.data import load_tokenizer

    want = (manifest.get("extra") or {}).get("tokenizer_sha256")
    if not want or not manifest.get("path"):
        return None
    for parent in list(Path(manifest["path"]).resolve().parents)[:4]:
        candidate = parent / "tokenizer.json"
        if candidate.is_file():
            try:
                if load_tokenizer(candidate).fingerprint == want:
                    return str(candidate)
            except ValueError:
                continue
    return None


def trained_tokenizer_hash(manifest: dict) -> str | None:
    """The fingerprint of the tokenizer a checkpoint's model was trained with, where its manifest records one:
    `k3 train` in the data state (data.tokenizer_hash), `k3 rl` / `k3 distill` in extra.tokenizer_sha256."""
    return (manifest.get("data") or {}).get("tokenizer_hash") or (manifest.get("extra") or {}).get("tokenizer_sha256")


def checkpoint_tokenizer(manifest: dict, vocab_size: int, tokenizer_path=None):
    """The tokenizer a trained model reads: `tokenizer_path`, else the one its manifest names; refused when its
    size is not the model's or it is not the tokenizer the training data was tokenized with (same size, other
    ids would give wrong text without any error)."""
    from k3.data import load_tokenizer

    data = manifest.get("data") or {}
    tok_path = tokenizer_path or data.get("tokenizer") or _recorded_tokenizer_nearby(manifest)
    if not tok_path:
        raise ValueError(f"the checkpoint {manifest.get('path')} does not name its tokenizer; pass --tokenizer PATH")
    try:
        tokenizer = load_tokenizer(tok_path)
    except ValueError as err:
        if tokenizer_path is not None:
            raise
        raise ValueError(f"{err}. That is the tokenizer the checkpoint names; pass --tokenizer PATH to the "
                         "tokenizer.json the model was trained with") from None
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(f"tokenizer {tok_path} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                         f"{vocab_size}; pass the tokenizer the model was trained with")
    trained = trained_tokenizer_hash(manifest)
    if not trained and data.get("data_dir") and (Path(data["data_dir"]) / "train.json").is_file():
        trained = json.loads((Path(data["data_dir"]) / "train.json").read_text()).get("tokenizer_hash")
    if trained and trained != tokenizer.fingerprint:
        raise ValueError(f"tokenizer {tok_path} is not the one the model's training data was tokenized with "
                         f"(fingerprint {tokenizer.fingerprint[:12]}..., trained with {trained[:12]}...); pass "
                         "that tokenizer.json" + (f" (the checkpoint names {data['tokenizer']})" if data.get("tokenizer")
                                                  and str(data["tokenizer"]) != str(tok_path) else ""))
    return tokenizer


def _hf_export_type(path: Path) -> str | None:
    """config.json's model_type when `path` holds an HF transformers directory (k3's is "k3")."""
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def load_trained_model(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """(K3Model, manifest) from a checkpoint directory or a root holding `latest`; config from the manifest.

    Distributed (DCP) checkpoints of `k3 train --nproc N` load too, whole, into one process."""
    from k3.model.transformer import K3Model

    path = Path(path)
    if not (path / ckpt.MANIFEST).is_file() and _holds_distributed_checkpoint(path):  # from `k3 train --nproc N`
        from k3.parallel import checkpoint as pckpt

        model = K3Model(K3Config.from_dict(pckpt.read_meta(path)["config"]))
        meta = pckpt.load_model_weights(path, model)
        return model.to(device).eval(), pckpt.as_manifest(meta)
    found = path if (path / ckpt.MANIFEST).is_file() else ckpt.latest_checkpoint(path)
    if found is None and _hf_export_type(path) == "k3":
        raise ValueError(f"{path} is a Hugging Face transformers export (k3 export --format hf): load it with "
                         "transformers (import k3.serve.hf, then AutoModelForCausalLM.from_pretrained; docs/serving.md). "
                         "k3 eval, sample and serve read the k3 checkpoint it was exported from")
    if found is None:
        inner = path / "checkpoint"
        hint = (f"; {inner} holds one: pass that" if _holds_distributed_checkpoint(inner)
                or ckpt.latest_checkpoint(inner) else "")
        raise ValueError(f"no checkpoint at {path}; train one with `k3 train --out DIR` (it writes DIR/checkpoint) "
                         "or `k3 demo` (runs/demo/checkpoint)"
                         + hint)
    manifest = ckpt.read_manifest(found, verify=False)
    if "mx_export" in manifest.get("extra", {}):  # written by `k3 export --format mx`: packed routed experts
        from k3.quant.export import load_packed

        return load_packed(found, device)
    config = K3Config.from_dict(manifest["config"])
    model = K3Model(config)
    manifest = ckpt.load_checkpoint(found, model, config=config, restore_rng=False)
    return model.to(device).eval(), manifest
