"""The one loop's settings (`TrainConfig`), and what a resumed run must share with the run it continues."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from k3.cli_checks import FieldError, flag, flag_name, seed as seed_type
from k3.train import checkpoint as ckpt
from k3.train.schedule import WSDSchedule


@dataclass
class TrainConfig:
    """The loop's settings. Those made with `flag()` are also the flags of the commands that train (`k3 train`,
    `k3 demo`, `k3 distill`, `k3 rl`), each with this name and help; a command picks its own and their defaults."""

    steps: int = flag(200, "optimizer steps (default %(default)s)")
    batch_size: int = flag(8, "sequences per micro-batch (default %(default)s)")
    seq_len: int = flag(128, "tokens per sequence (default %(default)s)")
    accum: int = flag(1, "gradient accumulation micro-batches per step (default %(default)s)")
    lr: float = flag(3e-3, "peak learning rate (default %(default)s)")
    optimizer: str = flag("adamw", "adamw, or muon = MuonClip (Muon on matrices + AdamW on the rest + QK-Clip)",
                          choices=("adamw", "muon"))
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.95  # Muon
    warmup_frac: float = 0.05
    # overrides warmup_frac; `k3 rl` spelled it --warmup
    warmup_steps: int | None = flag(None, "LR warmup steps (default %(default)s)", aliases=("--warmup",))
    decay_frac: float = flag(0.2, "fraction of steps in the final LR decay (default %(default)s)")
    min_lr_ratio: float = 0.1
    schedule_shape: str = "linear"
    # the norm is logged also when it is not clipped
    grad_clip: float = flag(1.0, "gradient-norm clipping threshold (default %(default)s; 0: no clipping)")
    qk_clip_tau: float = 100.0  # used with optimizer = muon; 0 disables
    # stop when the next step plus a final eval and save would exceed it
    max_minutes: float | None = flag(None, "time budget: stop cleanly and save")
    # With max_minutes: treat `steps` as a cap and re-plan the total from the measured time per step (during
    # the decay only shortening it), so the WSD decay ends as the budget does (the demo).
    fit_steps_to_budget: bool = False
    # also stop once this many tokens were trained on (post-training)
    token_budget: int | None = flag(None, "stop after this many tokens trained on")
    eval_every: int = flag(0, "evaluate every N steps (default %(default)s; 0: at the end only)")
    eval_batches: int = flag(8, "validation batches per evaluation (default %(default)s)")
    eval_at_start: bool = False  # also evaluate before the first step (a fresh run's baseline)
    ckpt_every: int = flag(0, "checkpoint every N steps (default %(default)s; 0: at the end only)")
    keep_last: int = flag(3, "checkpoints to keep (default %(default)s)")
    seed: int = flag(0, "seed for init and the data order (default %(default)s)", type=seed_type)
    # keep each packed document to itself: KDA's state, the short convolution and MLA restart at every <|eos|>
    # (a dataset that does not know its document starts has no boundaries to mask)
    doc_mask: bool = flag(True, "let KDA state, convolutions and attention cross document boundaries (<|eos|>) "
                          "inside a training window, as before; default: each document is kept to itself",
                          name="--no-doc-mask")
    activation_checkpointing: bool = flag(False, "recompute mixers in backward")
    # torch.compile backend: False/"" = eager, True = "inductor"; "aot_eager" traces without code generation
    # (what the CPU test uses). On CPU inductor was not measured to help (docs/training.md).
    compile: bool | str = flag(False, "torch.compile the model (default backend inductor; off unless given)",
                               nargs="?", const="inductor", metavar="BACKEND")
    device: str = flag("auto", choices=("auto", "cpu", "cuda"))
    # the arithmetic of forward and loss: fp32, or bf16 autocast (fp32 master weights and optimizer state either
    # way); "auto" is resolved by k3.train.precision before a run starts
    precision: str = flag("fp32", "fp32, bf16 (autocast; weights and optimizer state stay fp32), or auto: "
                          "bf16 only where a probe on this host measures it faster", choices=("auto", "fp32", "bf16"))
    record_attnres: bool = True
    measure_mfu: bool = True

    def validate(self) -> "TrainConfig":
        for name in ("steps", "batch_size", "seq_len", "accum", "eval_batches", "keep_last"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise FieldError(name, f"{v!r} must be a positive integer")
        if self.warmup_steps is not None and (not isinstance(self.warmup_steps, int) or self.warmup_steps < 0):
            raise FieldError("warmup_steps", f"{self.warmup_steps!r} must be an integer >= 0")
        for name in ("eval_every", "ckpt_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise FieldError(name, f"{v!r} must be an integer >= 0 (0 = only at the end)")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise FieldError("lr", f"{self.lr!r} must be a positive number")
        if self.optimizer not in ("adamw", "muon"):
            raise FieldError("optimizer", f"{self.optimizer!r}; choose adamw or muon")
        if not 0 <= self.decay_frac <= 1:
            raise FieldError("decay_frac", f"{self.decay_frac} must be a fraction of the steps, in [0, 1]")
        if self.token_budget is not None and self.token_budget < 1:
            raise FieldError("token_budget", f"{self.token_budget} must be a positive number of tokens")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise FieldError("max_minutes", f"{self.max_minutes!r} must be positive")
        if not self.grad_clip >= 0:  # NaN too; inf, like 0, does not clip
            raise FieldError("grad_clip", f"{self.grad_clip} must be a number >= 0 (0: no clipping)")
        if not self.qk_clip_tau >= 0:
            raise FieldError("qk_clip_tau", f"{self.qk_clip_tau} must be a number >= 0 (0: no QK-Clip)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise FieldError("device", f"{self.device!r}; choose auto, cpu or cuda")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise FieldError("precision", f"{self.precision!r}; choose auto, fp32 or bf16")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise FieldError("device", "cuda but CUDA is not available")
        if self.compile not in (False, True, "") and self.compile not in _compile_backends():
            raise FieldError("compile", f"{self.compile!r} is not a torch.compile backend; "
                             f"choose one of {sorted(_compile_backends())}")
        if self.fit_steps_to_budget and self.max_minutes is None:
            raise ValueError("fit_steps_to_budget needs max_minutes")
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
RESUME_FIELDS = ("batch_size", "seq_len", "accum", "seed", "optimizer", "doc_mask")
DATA_FIELDS = ("tokenizer_hash", "train_tokens")  # data_info entries a resume must match
# ... and the same learning-rate schedule and update rule (read from the checkpoint's recorded train config;
# `steps` may grow: the schedule is re-planned for the new total, as documented)
SCHEDULE_FIELDS = ("lr", "warmup_steps", "warmup_frac", "decay_frac", "min_lr_ratio", "schedule_shape",
                   "weight_decay", "betas", "momentum", "grad_clip", "qk_clip_tau")

_FLAGGED = ("lr", "warmup_steps")  # settings every training command takes as flags


def check_schedule_fields(recorded: dict | None, tc: "TrainConfig", where: str) -> None:
    """A resume must train with the learning-rate schedule and update rule its checkpoint was trained with
    (`recorded`: the checkpoint's train config; an older checkpoint without one is not checked)."""
    for k in SCHEDULE_FIELDS:
        if not recorded or k not in recorded:
            continue
        have, now = recorded[k], getattr(tc, k)
        if (list(have) if isinstance(have, (list, tuple)) else have) != \
                (list(now) if isinstance(now, (list, tuple)) else now):
            flag = flag_name(TrainConfig, k) if k in _FLAGGED else None
            fix = (f"resume with {flag} {have}" if have is not None else f"resume without {flag}") if flag else \
                f"resume with TrainConfig({k}={have!r})"
            raise ckpt.CheckpointError(f"{where}: {k} is {have!r} in the checkpoint but {now!r} now; {fix} "
                                       "(or start a new run: a resume continues the same schedule)")


def _compile_backends() -> set[str]:
    import torch._dynamo

    return set(torch._dynamo.list_backends(exclude_tags=())) | {"inductor"}


# a resume keeps the run's learning rate (it is refused under another): what a lower --lr takes
DIVERGED_RESTART = "a run with another --lr starts over: --overwrite or another --out"

# Post-training (SFT, MOPD, GRPO) defaults: no weight decay, a short warmup, no decay (a run may stop on a token
# budget), the first and last evaluation, two checkpoints kept.
POST_TRAINING = dict(steps=100, weight_decay=0.0, warmup_steps=10, decay_frac=0.0, keep_last=2, eval_at_start=True)


def post_training(**settings) -> TrainConfig:
    """A TrainConfig with the post-training defaults, overridden by `settings`."""
    return TrainConfig(**{**POST_TRAINING, **settings})
