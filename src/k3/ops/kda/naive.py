"""Reference Kimi Delta Attention: one token at a time, straight from the recurrence.

Kimi Linear (arXiv 2510.26692), eq. for KDA:
    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t,
with alpha_t = exp(g_t) a per-channel decay and scale = K^-0.5 unless given (as fla's kernels). This file
is the obviously-correct twin the fast paths (`chunk.py`, `recurrent.py`) are tested against; it is slow on
purpose.
"""
from __future__ import annotations

import torch

from k3.ops.amp import without_autocast


@without_autocast
def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (<= 0); beta: [B, T, H];
    initial_state: [B, H, K, V]. Returns o: [B, T, H, V] (dtype of v) and the final state [B, H, K, V]
    (fp32) if `output_final_state`, else None. `scale` defaults to K ** -0.5."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    dtype = torch.promote_types(q.dtype, torch.float32)                  # fp32 at least; fp64 stays fp64
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for t in range(T):
        k_t, v_t, b_t = k[:, t], v[:, t], beta[:, t, :, None]
        S = g[:, t].exp()[..., None] * S                                  # Diag(alpha_t) S_{t-1}
        v_old = torch.einsum("bhk,bhkv->bhv", k_t, S)                     # what S already maps k_t to
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, b_t * (v_t - v_old))   # delta rule: move toward v_t
        outputs.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (S if output_final_state else None)
