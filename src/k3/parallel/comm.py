"""The one door to torch.distributed collectives in k3.parallel: every call is counted in bytes.

Each wrapper calls the matching `torch.distributed` function and records, under a tag (default: the
collective's name), the calls, the payload (bytes this rank hands in) and the remote bytes (what leaves it for
other ranks; the rule per collective: docs/distributed.md, "Payload accounting"). Counts are per process
(`STATS.snapshot()`, `STATS.reset()`). Without a process group the collectives act as in a world of one, so EP
modules also run in one process. FSDP2's all-gather and reduce-scatter come here too (installed by
k3.parallel.fsdp); the router's balancing all-reduce inside the model and DCP's collectives are not counted.
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict

import torch
import torch.distributed as dist

__all__ = ["STATS", "CommStats", "all_to_all_single", "all_reduce", "all_gather_single", "reduce_scatter_single",
           "send", "recv", "broadcast", "barrier", "world_size", "rank", "tagged"]


class CommStats:
    """Per-tag counters: {tag: {"calls", "payload_bytes", "remote_bytes"}}."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stats: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "payload_bytes": 0, "remote_bytes": 0})
        self._prefix: list[str] = []

    def record(self, tag: str, payload: int, remote: int) -> None:
        if self._prefix:
            tag = f"{self._prefix[-1]}/{tag}"
        with self._lock:
            s = self._stats[tag]
            s["calls"] += 1
            s["payload_bytes"] += int(payload)
            s["remote_bytes"] += int(remote)

    def reset(self) -> None:
        with self._lock:
            self._stats.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {k: dict(v) for k, v in self._stats.items()}

    def total(self, field: str = "remote_bytes", prefix: str = "") -> int:
        return sum(v[field] for k, v in self.snapshot().items() if k.startswith(prefix))


STATS = CommStats()


@contextlib.contextmanager
def tagged(prefix: str):
    """Inside the block, every recorded tag is prefixed with `prefix/` (e.g. 'forward', 'backward')."""
    STATS._prefix.append(prefix)
    try:
        yield
    finally:
        STATS._prefix.pop()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _alone() -> bool:
    """No process group: a world of one, where every collective is a local copy (or nothing)."""
    return not (dist.is_available() and dist.is_initialized())


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None,
                      input_split_sizes: list[int] | None, group=None, tag: str = "all_to_all"):
    """dist.all_to_all_single; splits are rows along dim 0 (None: equal splits)."""
    R = world_size(group)
    me = rank(group)
    row = _nbytes(input) // max(input.shape[0], 1) if input.dim() else _nbytes(input)
    if input_split_sizes is None:
        own = input.shape[0] // R
    else:
        own = input_split_sizes[me]
    STATS.record(tag, _nbytes(input), _nbytes(input) - own * row)
    if _alone():
        return output.copy_(input)
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None, tag: str = "all_reduce", async_op: bool = False):
    R = world_size(group)
    STATS.record(tag, _nbytes(t), 2 * (R - 1) * _nbytes(t) // R)
    if _alone():
        return None
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, tag: str = "all_gather",
                      async_op: bool = False):
    R = world_size(group)
    STATS.record(tag, _nbytes(input), (R - 1) * _nbytes(input))
    if _alone():
        return output.copy_(input)
    return dist.all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          tag: str = "reduce_scatter", async_op: bool = False):
    R = world_size(group)
    STATS.record(tag, _nbytes(input), (R - 1) * _nbytes(input) // R)
    if _alone():
        return output.copy_(input)
    return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def broadcast(t: torch.Tensor, src: int, group=None, tag: str = "broadcast"):
    R = world_size(group)
    sent = (R - 1) * _nbytes(t) if rank() == src else 0
    STATS.record(tag, _nbytes(t), sent)
    if _alone():
        return None
    return dist.broadcast(t, src=src, group=group)


def send(t: torch.Tensor, dst: int, group=None, tag: str = "send"):
    STATS.record(tag, _nbytes(t), _nbytes(t))
    return dist.send(t.contiguous(), dst=dst, group=group)


def recv(t: torch.Tensor, src: int, group=None, tag: str = "recv"):
    STATS.record(tag, 0, 0)  # the sender counts the bytes; this counts the call
    return dist.recv(t, src=src, group=group)


def barrier(group=None):
    STATS.record("barrier", 0, 0)
    if _alone():
        return None
    return dist.barrier(group=group)


# ---------------------------------------------------------------------- autograd
class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all of rows: the gradient travels back with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, tag):
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.tag = out_splits, in_splits, group, tag
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, tag=tag)
        return out

    @staticmethod
    def backward(ctx, g):
        gx = g.new_empty((sum(ctx.in_splits), *g.shape[1:]))
        all_to_all_single(gx, g.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group, tag=f"{ctx.tag}_grad")
        return gx, None, None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None,
                    tag: str = "all_to_all") -> torch.Tensor:
    """x [sum(in_splits), ...] -> [sum(out_splits), ...]: rows in_splits[r] go to rank r; autograd-aware."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group, tag)
