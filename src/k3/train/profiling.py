"""Where a training step's time goes: KDA, MLA, MoE, AttnRes, the optimizer, and the rest.

`ComponentTimer(model)` wraps, from outside and on the instances, every token mixer, channel mixer, the
AttnRes mix/push/final calls, the embedding and the head. Each call runs inside a
`torch.profiler.record_function("k3::<component>")` range and, while the timer is enabled, is timed: forward
as the call's wall time; backward from a gradient hook on the call's output (its backward starts) to one on
its input (it ends). AttnRes's backward is the gaps between those intervals. Two hooks per component, instead
of torch.profiler's per-op overhead; why, and what the shares mean: docs/training.md ("Benchmark"). On CUDA,
`sync=True` synchronises at every boundary, so the times are device times.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.profiler import record_function

COMPONENTS = ("kda", "mla", "moe", "dense_mlp", "attnres", "embed_head")


class ComponentTimer:
    def __init__(self, model: torch.nn.Module, sync: bool = False):
        from k3.config import KDA

        assert getattr(model, "_k3_timer", None) is None, "this model already has a ComponentTimer"
        self.sync = sync and torch.cuda.is_available()
        self.enabled = False
        self.reset()
        for block in model.layers:
            self._wrap(block.mixer, "forward", "kda" if block.kind == KDA else "mla", backward=True)
            self._wrap(block.ffn, "forward", "moe" if hasattr(block.ffn, "router") else "dense_mlp", backward=True)
        for name in ("mix", "push", "final"):
            if hasattr(model.attnres, name):
                self._wrap(model.attnres, name, "attnres", backward=False)
        self._wrap(model.embed, "forward", "embed_head", backward=False)
        self._wrap(model.head, "forward", "embed_head", backward=True)
        model._k3_timer = self

    def reset(self) -> None:
        self.forward: dict[str, float] = defaultdict(float)
        self.intervals: list[tuple[float, float, str]] = []

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _wrap(self, obj, name: str, label: str, backward: bool) -> None:
        inner = getattr(obj, name)

        def wrapped(*args, _inner=inner, **kwargs):
            with record_function("k3::" + label):
                if not self.enabled:
                    return _inner(*args, **kwargs)
                t0 = self._now()
                out = _inner(*args, **kwargs)
                self.forward[label] += self._now() - t0
            x = args[0] if args else None
            if backward and torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad \
                    and isinstance(x, torch.Tensor) and x.requires_grad:
                box = {}

                def start(_g):
                    box["t"] = self._now()

                def end(_g):
                    if "t" in box:
                        self.intervals.append((box.pop("t"), self._now(), label))

                out.register_hook(start)
                x.register_hook(end)
            return out

        setattr(obj, name, wrapped)

    def split(self, forward_total: float, backward_total: float) -> dict:
        """Seconds per component for the calls since `reset()`: {"forward": {...}, "backward": {...}}, each
        with an "other" entry making up the given totals (loss, norms, glue)."""
        fwd = dict(self.forward)
        fwd["other"] = max(0.0, forward_total - sum(fwd.values()))
        iv = sorted(self.intervals)
        bwd: dict[str, float] = defaultdict(float)
        for s, e, label in iv:
            bwd[label] += e - s
        bwd["attnres"] += sum(max(0.0, iv[i + 1][0] - iv[i][1]) for i in range(len(iv) - 1))
        bwd["other"] = max(0.0, backward_total - sum(bwd.values()))
        return {"forward": fwd, "backward": dict(bwd)}
