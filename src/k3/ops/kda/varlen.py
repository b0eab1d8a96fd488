"""Packed sequences for the KDA op: `cu_seqlens` (fla's convention) in a batch of one packed row.

    cu_seqlens = [0, t_1, t_1 + t_2, ..., T]   int32 or int64 offsets of the sequence starts, then T

The state starts from zero (or the sequence's own initial state) at every start and each sequence's final state
comes back, so no information crosses a boundary. Sequences of similar length are laid out together as a padded
batch [n, t_max] whose padding tokens have g = 0 (no decay), beta = 0 (no write) and k = q = v = 0: they leave the
state as it was and their outputs are dropped, so one batched call of any implementation computes each of them
exactly as if it ran alone (`naive_varlen_kda`, one call per sequence, is the reference the tests compare
against). `buckets` groups them so that padding adds at most half again to a group's tokens: eight prompts of
16 ... 2048 tokens padded to one [8, 2048] batch did 4x the work of their 4,080 tokens.
"""
from __future__ import annotations

import torch

__all__ = ["check_cu_seqlens", "buckets", "pack_index", "to_padded", "from_padded", "naive_varlen_kda"]

MAX_PADDING = 1.5  # a bucket's padded tokens (count x its longest) stay within this factor of its real tokens


def check_cu_seqlens(cu_seqlens, B: int, T: int) -> None:
    """The rules, each named in the error: a 1-D int32/int64 tensor, starting at 0, strictly increasing (no empty
    sequence), ending at T, with a batch of one packed row."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens must be a 1-D tensor of sequence start offsets plus T, got {got}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 (fla's convention) or int64, got {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed in one row: batch must be 1, got {B}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must hold at least [0, T], got {cu_seqlens.tolist()}")
    c = cu_seqlens.tolist()
    if c[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {c[0]}")
    if c[-1] != T:
        raise ValueError(f"cu_seqlens must end at T = {T} (the packed row's length), got {c[-1]}")
    steps = [b - a for a, b in zip(c, c[1:])]
    if min(steps) <= 0:
        i = next(i for i, s in enumerate(steps) if s <= 0)
        raise ValueError(f"cu_seqlens must be strictly increasing (every sequence at least one token), but "
                         f"cu_seqlens[{i}] = {c[i]} and cu_seqlens[{i + 1}] = {c[i + 1]}")


def buckets(lengths: list[int]) -> list[list[int]]:
    """Sequence indices grouped for padded batches, longest first: a sequence joins the current group while the
    group's padded size stays within MAX_PADDING of its real tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and (len(g) + 1) * lengths[g[0]] <= MAX_PADDING * (sum(lengths[j] for j in g) + lengths[i]):
            g.append(i)
        else:
            groups.append([i])
    return groups


def pack_index(cu_seqlens: torch.Tensor, seqs: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor, int]:
    """For the sequences `seqs` (default all), in that order: (their packed token indices [t], row in the padded
    batch [t], position in the row [t], t_max)."""
    c = cu_seqlens.tolist()
    seqs = list(range(len(c) - 1)) if seqs is None else seqs
    dev = cu_seqlens.device
    idx = torch.cat([torch.arange(c[i], c[i + 1], device=dev) for i in seqs])
    lengths = [c[i + 1] - c[i] for i in seqs]
    row = torch.repeat_interleave(torch.arange(len(seqs), device=dev), torch.tensor(lengths, device=dev))
    pos = torch.cat([torch.arange(n, device=dev) for n in lengths])
    return idx, row, pos, max(lengths)


def to_padded(x: torch.Tensor, idx: torch.Tensor, row: torch.Tensor, pos: torch.Tensor, n: int,
              t_max: int) -> torch.Tensor:
    """x [1, T, ...] packed -> [n, t_max, ...] of the tokens `idx`, zeros after each sequence's end
    (differentiable)."""
    out = x.new_zeros(n, t_max, *x.shape[2:])
    return out.index_put((row, pos), x[0, idx])


def from_padded(y: torch.Tensor, row: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """y [n, t_max, ...] -> [t, ...], the real tokens in the order of their packed indices."""
    return y[row, pos]


def naive_varlen_kda(fn, q, k, v, g, beta, cu_seqlens, scale=None, initial_state=None, output_final_state=False):
    """Reference: `fn` (any KDA implementation) on each sequence alone, outputs concatenated, states stacked."""
    c = cu_seqlens.tolist()
    outs, states = [], []
    for i, (a, b) in enumerate(zip(c, c[1:])):
        o, s = fn(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale=scale,
                  initial_state=None if initial_state is None else initial_state[i:i + 1], output_final_state=True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), (torch.cat(states, 0) if output_final_state else None)
