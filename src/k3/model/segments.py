"""Document boundaries inside a batch of packed rows: what keeps one document's tokens out of another's.

Pretraining packs documents into one stream; a training window then holds several. `doc_ids` [B, T] labels each
token with its document (any integers; a boundary wherever the label changes from one token to the next, and at
every row's start). From it, once per forward:
  - KDA's recurrence restarts at each boundary (`cu_seqlens` over the B*T tokens as one packed row, k3.ops.kda),
  - the short convolution drops every tap that would reach back across one (`same[j]`: token t and t - j share a
    document),
  - MLA attends only within a document: one causal attention per document (`runs`), which costs the sum of the
    documents' squared lengths rather than the row's.
Token-local parts (norms, AttnRes over depth, MoE) need nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Segments:
    doc_ids: torch.Tensor       # [B, T] long
    cu_seqlens: torch.Tensor    # [N + 1] int32 over the flattened B*T tokens
    same: list[torch.Tensor]    # same[j] [B, T] bool: token t - j exists and is in t's document (same[0] all true)
    runs: list[tuple[int, int, int]]  # (row, start, end) of each document, in the order of cu_seqlens

    @classmethod
    def from_doc_ids(cls, doc_ids: torch.Tensor, max_lag: int) -> "Segments":
        B, T = doc_ids.shape
        d = doc_ids.long()
        start = torch.ones(B, T, dtype=torch.bool, device=d.device)
        start[:, 1:] = d[:, 1:] != d[:, :-1]
        starts = start.reshape(-1).nonzero().squeeze(-1)
        cu = torch.cat([starts, starts.new_tensor([B * T])]).to(torch.int32)
        # a label that comes back later in the row is a new document: number the runs
        run = start.long().cumsum(1)
        same = [torch.ones(B, T, dtype=torch.bool, device=d.device)]
        for j in range(1, max_lag + 1):
            s = torch.zeros(B, T, dtype=torch.bool, device=d.device)
            s[:, j:] = run[:, j:] == run[:, :-j]
            same.append(s)
        flat = cu.tolist()
        runs = [(a // T, a % T, a % T + (b - a)) for a, b in zip(flat, flat[1:])]
        return cls(run, cu, same, runs)
