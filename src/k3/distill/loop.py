"""Post-training stages (SFT, on-policy distillation, GRPO) on the one loop (`k3.train.loop`).

A stage gives `step_fn(step) -> dict` (the step's loss and metrics; see `Loop`) and gets back its records. An
interruption ends the whole command, so it is raised (KeyboardInterrupt saying where the run stopped and how
`--resume` goes on) instead of returned.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from k3.train.config import post_training
from k3.train.loop import RESUME_ADVICE, Loop, stop_exception

__all__ = ["LoopConfig", "StepLoop", "RESUME_ADVICE", "stop_exception"]

LoopConfig = post_training  # a TrainConfig with the post-training defaults


class StepLoop(Loop):
    """The one loop for a post-training stage on `model`, writing OUT/metrics.jsonl and OUT/checkpoint/.
    `manifest_extra` is stored in every checkpoint (e.g. the tokenizer's sha256); `resume_fields` are checked
    equal on resume (e.g. batch shape, which teachers)."""

    def __init__(self, model: torch.nn.Module, config, out_dir: str | os.PathLike | None,
                 manifest_extra: dict | None = None, resume_fields: dict | None = None):
        super().__init__(model, config, out_dir=out_dir, manifest_extra=manifest_extra, resume_fields=resume_fields)

    def fit(self, step_fn: Callable[[int], dict], *, resume: bool = False, overwrite: bool = False,
            evaluate: Callable[[int], dict | None] | None = None,
            on_record: Callable[[dict], None] | None = None, graceful_interrupt: bool = False) -> list[dict]:
        """Train to `steps` (or the token budget); returns this call's records (train and eval). A stop
        (`graceful_interrupt`: see `Loop.fit`) raises KeyboardInterrupt naming the checkpoint and how to go on."""
        self._step_fn, self._evaluate, self.overwrite = step_fn, evaluate, overwrite
        result = super().fit(resume=resume, on_record=on_record, graceful_interrupt=graceful_interrupt)
        result.raise_if_interrupted()
        return result.records
