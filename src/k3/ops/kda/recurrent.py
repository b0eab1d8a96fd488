"""Step-by-step Kimi Delta Attention for decoding and short sequences (Kimi Linear, arXiv 2510.26692).

Same recurrence as `naive.py`, arranged so the output needs no extra pass over the updated state:
    S' = Diag(alpha_t) S,  u = beta_t (v_t - S'^T k_t),  S_t = S' + k_t u^T,  o_t = S'^T q_t + (q_t . k_t) u.
The mat-vecs are single-row matmuls on purpose: on CPU, torch runs those without a parallel region,
which a [2, K] x [K, V] batch (k and q stacked) enters, and there it stalls whenever the threads are busy.
Functional (no in-place writes), so it is differentiable and never modifies `initial_state`.
"""
from __future__ import annotations

import torch

from k3.ops.amp import as_dtype, without_autocast


@without_autocast
def fused_recurrent_kda(
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
    (fp32, or fp64 for fp64 inputs) if `output_final_state`, else None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    q = q * scale
    alpha = g.exp()
    qk = (q * k).sum(-1, keepdim=True)                                        # [B, T, H, 1]
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for t in range(T):
        S = alpha[:, t, :, :, None] * S                                       # S' = Diag(alpha_t) S
        k_S = (k[:, t, :, None, :] @ S).squeeze(-2)                           # [B, H, V]: k^T S'
        q_S = (q[:, t, :, None, :] @ S).squeeze(-2)
        u = beta[:, t, :, None] * (v[:, t] - k_S)
        S = torch.addcmul(S, k[:, t, :, :, None], u[:, :, None, :])
        outputs.append(torch.addcmul(q_S, qk[:, t], u))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (S if output_final_state else None)


@without_autocast
def recurrent_kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of `fused_recurrent_kda` without the T axis (a decode step): q, k, g: [B, H, K]; v: [B, H, V];
    beta: [B, H]; state: [B, H, K, V]. Returns o [B, H, V] (dtype of v) and the new state (fp32, or fp64)."""
    K, out_dtype = q.shape[-1], v.dtype
    scale = K ** -0.5 if scale is None else scale
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta, state = (as_dtype(x, dtype) for x in (q, k, v, g, beta, state))
    q = q * scale
    S = g.exp().unsqueeze(-1) * state                                         # S' = Diag(alpha) S
    k_S, q_S = (torch.stack((k, q), dim=-2) @ S).unbind(-2)                   # [B, H, V] each, one product
    u = beta.unsqueeze(-1) * (v - k_S)
    S = torch.addcmul(S, k.unsqueeze(-1), u.unsqueeze(-2))
    o = torch.addcmul(q_S, (q * k).sum(-1, keepdim=True), u)
    return as_dtype(o, out_dtype), S

