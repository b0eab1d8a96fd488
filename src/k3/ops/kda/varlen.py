"""Packed sequences for the KDA op: `cu_seqlens` (fla's convention) in a batch of one packed row.

    cu_seqlens = [0, t_1, t_1 + t_2, ..., T]   int32 or int64 offsets of the sequence starts, then T

The state starts from zero (or the sequence's own initial state) at every start and each sequence's final state
comes back, so no information crosses a boundary. The packed row is laid out as a padded batch [N, T_max] whose
padding tokens have g = 0 (no decay), beta = 0 (no write) and k = q = v = 0: they leave the state as it was and
their outputs are dropped, so one batched call of any implementation computes every sequence exactly as if it ran
alone (`naive_varlen_kda`, one call per sequence, is the reference the tests compare against).
"""
from __future__ import annotations

import torch

__all__ = ["check_cu_seqlens", "pack_index", "to_padded", "from_padded", "naive_varlen_kda"]


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


def pack_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sequence id [T], position in its sequence [T], T_max) of each packed token."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    pos = torch.arange(seq.numel(), device=cu_seqlens.device) - cu_seqlens[:-1].long()[seq]
    return seq, pos, int(lengths.max())


def to_padded(x: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, N: int, T_max: int) -> torch.Tensor:
    """x [1, T, ...] packed -> [N, T_max, ...], zeros after each sequence's end (differentiable)."""
    out = x.new_zeros(N, T_max, *x.shape[2:])
    return out.index_put((seq, pos), x[0])


def from_padded(y: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """y [N, T_max, ...] -> [1, T, ...], the real tokens in packed order."""
    return y[seq, pos].unsqueeze(0)


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
