"""Warmup-stable-decay (WSD) learning-rate schedule.

Linear warmup to the peak, a long constant phase, then a short decay to `min_ratio * peak` over the last
`decay_steps` steps. WSD was popularised by MiniCPM (Hu et al., arXiv 2404.06395); Hägele et al.
(arXiv 2405.18392) found a "1 - sqrt" decay shape matches cosine at equal compute. Kimi K2 (arXiv
2507.20534) trains with a WSD schedule too. The schedule is a pure function of the step, so a resumed run
needs no scheduler state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SHAPES = ("linear", "cosine", "sqrt")


@dataclass(frozen=True)
class WSDSchedule:
    total_steps: int
    warmup_steps: int = 0
    decay_steps: int = 0
    min_ratio: float = 0.1
    shape: str = "linear"  # linear | cosine | sqrt ("1 - sqrt", arXiv 2405.18392)

    def __post_init__(self) -> None:
        if not isinstance(self.total_steps, int) or self.total_steps < 1:
            raise ValueError(f"total_steps = {self.total_steps!r} must be a positive integer")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError(f"warmup_steps = {self.warmup_steps} and decay_steps = {self.decay_steps} must be >= 0")
        if self.warmup_steps + self.decay_steps > self.total_steps:
            raise ValueError(f"warmup_steps + decay_steps = {self.warmup_steps + self.decay_steps} exceeds "
                             f"total_steps = {self.total_steps}; shorten warmup or decay")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_ratio = {self.min_ratio} must be in [0, 1]")
        if self.shape not in SHAPES:
            raise ValueError(f"shape = {self.shape!r} is not one of {SHAPES}")

    @classmethod
    def from_fractions(cls, total_steps: int, warmup_frac: float = 0.05, decay_frac: float = 0.2,
                       min_ratio: float = 0.1, shape: str = "linear") -> "WSDSchedule":
        for name, v in (("warmup_frac", warmup_frac), ("decay_frac", decay_frac)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} = {v} must be in [0, 1]")
        warmup = min(total_steps, math.ceil(warmup_frac * total_steps)) if warmup_frac > 0 else 0
        decay = min(total_steps - warmup, round(decay_frac * total_steps))
        return cls(total_steps, warmup, decay, min_ratio, shape)

    def factor(self, step: int) -> float:
        """Multiplier of the peak LR for optimizer step `step` (0-based: the first update is step 0)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_start = self.total_steps - self.decay_steps
        if step < decay_start or self.decay_steps == 0:
            return 1.0
        p = min(1.0, (step - decay_start + 1) / self.decay_steps)  # reaches 1 on the last step
        if self.shape == "linear":
            d = 1.0 - p
        elif self.shape == "cosine":
            d = 0.5 * (1.0 + math.cos(math.pi * p))
        else:
            d = 1.0 - math.sqrt(p)
        return self.min_ratio + (1.0 - self.min_ratio) * d

    def apply(self, optimizer, step: int) -> float:
        """Set every param group's lr to its `peak_lr` times factor(step); returns the factor."""
        f = self.factor(step)
        for group in optimizer.param_groups:
            group["lr"] = group.setdefault("peak_lr", group["lr"]) * f
        return f
