"""Where a training step's time goes: KDA, MLA, MoE, AttnRes, the optimizer, and the rest.

`ComponentTimer(model)` wraps, from outside and on the instances, every token mixer, channel mixer, the
AttnRes mix/push/final calls, the embedding and the head. Each call runs inside a
`torch.profiler.record_function("k3::<component>")` range (so profiler traces show the components) and,
while the timer is enabled, is timed:

- forward: wall time of the call (CPU ops are synchronous);
- backward: a tensor hook on the call's output fires when the gradient reaching the component is complete
  (its backward starts) and a hook on its input fires when the gradient leaving it is complete (its
  backward ends). The autograd engine runs one graph task on one thread and gives parameter-gradient
  accumulation top priority, so the interval holds that component's backward. AttnRes's mixes have many
  inputs, so its backward is measured as the gaps between consecutive component intervals, which also
  hold the pre-norms' backward (a small elementwise op); the time before the head's interval (the loss)
  and after the first layer's (the embedding) counts as "other".

Why not torch.profiler: on CPU its per-op overhead inflated the MoE backward (many small ops) from about
2 s to 25 s in one `mini` step, which made its shares meaningless. The timer adds two hooks per component.
On CUDA, pass `sync=True` to synchronise at every boundary (slower, but the times are then device times).
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
