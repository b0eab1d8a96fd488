"""Chunked parallel Kimi Delta Attention in pure torch (the CPU training / prefill path).

Inside a chunk of C tokens the delta rule is a WY/UT-style triangular system (Kimi Linear, arXiv 2510.26692,
Sec. 3), so each chunk is a few batched matmuls and one triangular solve, and only the [K, V] state passes from
chunk to chunk. The invariant that keeps it finite: a decay exp(Gamma_r - Gamma_i) is never formed as
exp(Gamma_r) * exp(-Gamma_i), which overflows fp32 within 20 tokens of strong decay. Each chunk is cut into
sub-chunks, every product is split at a reference point inside the row's sub-chunk so that no factor exceeds
exp(max_exponent), and a sub-chunk where that cannot hold gets its diagonal block formed exactly. Chunk and
sub-chunk sizes follow the gates (`chunk_size=None`); chunks run in blocks (`chunk_block`) whose intermediates
stay in cache. The derivation and the error bound: docs/architecture.md, "KDA's chunked form"; timings of the
size choices: docs/benchmarks.md (KDA).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.amp import without_autocast


CPU_BLOCK_TOKENS = 512  # tokens per block on CPU: 8 chunks of 64 (the block sizes timed: docs/benchmarks.md, KDA)
AUTO_CHUNK_SIZES = (64, 32, 16, 8, 4)  # chunk_size=None picks one of these (_auto_chunk_sizes)
MAX_AUTO_CHUNKS = 256  # ... the smallest that leaves at most this many chunks per sequence, when smaller is wanted


def _sub_chunk_candidates(C: int) -> list[int]:
    return [c for c in (32, 16, 8, 4, 2) if C % c == 0 and c < C] or [C]


def _auto_sub_chunk_size(g: torch.Tensor, C: int, max_exponent: float) -> int:
    """The largest sub-chunk size whose every half (c/2 tokens, aligned as the kernel cuts them) decays by at
    most max_exponent in every channel, so that no sub-chunk needs the exact (slow) diagonal blocks; the
    smallest candidate when none does. Larger sub-chunks mean fewer, larger matmuls (typical gates,
    logsigmoid of a unit normal, give c = 32); strong decay (g ~ -2.5 per token) picks c = 8, where the exact
    fallback at c = 16 would cost several times the whole kernel. Only a speed choice: the kernel checks
    every sub-chunk itself and stays exact whatever this returns."""
    cands = _sub_chunk_candidates(C)
    if len(cands) == 1 or g.is_meta:  # nothing to choose (an odd chunk size), or no values to choose from
        return cands[0]
    B, T, H, K = g.shape
    Tp = -(-T // C) * C                                                       # padded with g = 0, as the kernel
    x = g.detach()
    if Tp != T:
        x = F.pad(x, (0, 0, 0, 0, 0, Tp - T))
    for c in cands:                          # largest first: typical gates stop after one pass over g
        h = max(c // 2, 1)
        if not x.numel() or float(-x.reshape(B, Tp // h, h, H, K).sum(2).amin()) <= max_exponent:
            return c
    return cands[-1]


def _auto_chunk_sizes(g: torch.Tensor, max_exponent: float) -> tuple[int, int]:
    """(chunk size C, sub-chunk size c) for `chunk_kda(chunk_size=None)`: two sub-chunks per chunk, C = 2c with c
    the largest sub-chunk size the gates allow (`_auto_sub_chunk_size`), but C no smaller than needed to cut a
    sequence into at most MAX_AUTO_CHUNKS chunks (each chunk is a sequential step). Only a speed choice: every
    chunk size computes the same thing (tested).

    Why two: with C / c sub-chunks per chunk the elementwise work per token grows about as C / c, while the chunk
    count T / C is a sequential loop; at long T many tiny chunks cost more than they save, hence the floor on C
    (timings: docs/benchmarks.md, KDA)."""
    T = g.shape[1]
    floor = next((C for C in reversed(AUTO_CHUNK_SIZES) if -(-T // C) <= MAX_AUTO_CHUNKS), AUTO_CHUNK_SIZES[0])
    # the half-sub-chunk windows are aligned from the sequence start whatever C is (C is a multiple of c), so the
    # sub-chunk size found for C = 64 is the one for every C >= 2c
    c = _auto_sub_chunk_size(g, AUTO_CHUNK_SIZES[0], max_exponent)
    return max(2 * c, floor), c


def _exact_diag_blocks(g: torch.Tensor, k: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """g, k, q: [n, c, K] for n sub-chunks. Returns [n, 2, c, c]: sum_ch x_r k_i exp(Gamma_r - Gamma_i) for
    x = k, q and i <= r, each relative decay formed on its own (fp64 differences), so any decay is safe."""
    c = g.shape[-2]
    Gl = g.double().cumsum(-2)
    causal = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()
    rel = (Gl.unsqueeze(-2) - Gl.unsqueeze(-3)).to(k.dtype).masked_fill(~causal[:, :, None], float("-inf"))
    decayed_k = rel.exp() * k.unsqueeze(-3)                                   # [n, c(r), c(i), K]
    return (decayed_k @ torch.stack([k, q], dim=-1)).permute(0, 3, 1, 2)    # [n, 2, c(r), c(i)]


def _fill_chunks(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Copy x [B, T, H, D] into out [N, B, H, S, c, D] (chunk n, sub-chunk s, token j = time n*S*c + s*c + j;
    zeros past T) with one pass over x; out may be a strided view of uninitialised memory. Chunk-major, so
    that every chunk's slice in the sequential part is contiguous. Returns out."""
    N, B, H, S, c, D = out.shape
    C, T = S * c, x.shape[1]
    full = T // C

    def chunked(y: torch.Tensor, n: int) -> torch.Tensor:
        return y.reshape(B, n, S, c, H, D).permute(1, 0, 4, 2, 3, 5)

    if full:
        out[:full] = chunked(x[:, :full * C], full)
    if T % C:
        out[full:] = chunked(F.pad(x[:, full * C:], (0, 0, 0, 0, 0, C - T % C)), 1)
    return out


def _chunk_range(kq: torch.Tensor, g: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S_: torch.Tensor,
                 c: int, scale: float, max_exponent: float) -> tuple[torch.Tensor, torch.Tensor]:
    """N consecutive chunks in the layouts of `chunk_kda` (kq [N, B, H, S, 2, c, K], g [N, B, H, S, c, K],
    v [N, B, H, C, V], beta [N, B, H, C, 1]) from the incoming state S_ [B*H, K, V] -> (o [N, B, H, C, V], the
    outgoing state [B*H, K, V])."""
    N, B, H, S, _, _, K = kq.shape
    C, V, dtype = S * c, v.shape[-1], kq.dtype
    ks, qs = kq.unbind(-3)                                                    # [N, B, H, S, c, K]
    # cumulative log-decays. Inside a sub-chunk: prefix sums as one matmul with 0/1 matrices, giving Gamma
    # since the sub-chunk start (Gl) and the decay still to come before its end (tot - Gl, summed directly
    # rather than subtracted, so it stays accurate). Across sub-chunks: fp64, so their differences are exact.
    ones = torch.ones(c, c, dtype=dtype, device=kq.device)
    Gl, to_end = (torch.cat([ones.tril(), ones.triu(1)]) @ g).unflatten(-2, (2, c)).unbind(-3)
    tot = Gl[..., -1, :]                                                      # [..., S, K]
    G_end = tot.double().cumsum(-2)                                           # differences of these stay exact
    G_start = F.pad(G_end[..., :-1, :], (0, 0, 1, 0))
    mid = Gl[..., max(c // 2 - 1, 0), :]
    centred = torch.maximum(-mid, mid - tot).amax(-1) <= max_exponent         # [..., S]
    rho = mid * centred.unsqueeze(-1)                                         # reference point of each sub-chunk

    to_rho = (Gl - rho.unsqueeze(-2)).exp()                                   # exp(Gamma_r - rho_a), <= e^max_exponent
    rows = (kq * to_rho.unsqueeze(-3)).flatten(-3, -2)                        # [..., S(a), 2c(r), K]
    decay_G = to_rho * (G_start + rho.double()).to(dtype).exp().unsqueeze(-2)  # exp(Gamma) from the chunk start
    kG, qG = (ks * decay_G).flatten(-3, -2), (qs * decay_G).flatten(-3, -2)   # [..., C, K]
    k_dec = ks * to_end.exp()                                                 # k_i exp(end_b - Gamma_i), <= |k|
    k_end = (k_dec * (G_end[..., -1:, :] - G_end).to(dtype).exp().unsqueeze(-2)).flatten(-3, -2)  # to chunk end

    # exp(rho_a - end_b) for every pair of sub-chunks: <= 1 for b < a, the bounded diagonal for b = a
    between = (G_start + rho.double()).unsqueeze(-2) - G_end.unsqueeze(-3)    # [..., S(a), S(b), K]
    later = torch.ones(S, S, dtype=torch.bool, device=kq.device).triu(1)
    between = between.to(dtype).clamp_max(max_exponent).masked_fill(later[:, :, None], float("-inf")).exp()
    cols = (between.unsqueeze(-2) * k_dec.unsqueeze(-4)).flatten(-3, -2)     # [..., S(a), C(i), K]
    A = (rows @ cols.transpose(-1, -2)).unflatten(-2, (2, c))               # [..., S(a), 2, c(r), C(i)]
    if not centred.is_meta and not bool(centred.all()):                       # strong decay: exact diagonal blocks
        idx = (~centred).nonzero(as_tuple=True)
        exact = _exact_diag_blocks(g[idx], ks[idx], qs[idx])                 # [n, 2, c, c]
        cols_idx = idx[-1][:, None] * c + torch.arange(c, device=kq.device)   # [n, c]
        n = cols_idx.shape[0]
        A = A.index_put(idx, A[idx].scatter(-1, cols_idx[:, None, None, :].expand(n, 2, c, c), exact))
    A = A.transpose(-4, -3).reshape(N, B, H, 2, C, C)
    keep = torch.ones(C, C, dtype=torch.bool, device=kq.device).tril()
    A_kk, A_qk = A.masked_fill(~torch.stack([keep.tril(-1), keep]), 0.0).unbind(-3)

    # UT transform: invert the unit-lower-triangular T of every chunk at once, then plain matmuls
    eye = torch.eye(C, dtype=dtype, device=kq.device)
    T_inv = torch.linalg.solve_triangular(eye + A_kk * beta, eye, upper=False, unitriangular=True)
    T_inv = T_inv * beta.transpose(-1, -2)                                    # T^-1 Diag(beta)
    U = (T_inv @ v).flatten(1, 2)                                             # [N, B*H, C, V]
    W = (T_inv @ kG).flatten(1, 2)                                            # [N, B*H, C, K]

    # the only sequential part: Delta_n = U_n - W_n S_n, S_{n+1} = Diag(exp Gamma_C) S_n + K_end^T Delta_n;
    # every per-chunk operand below is a contiguous slice
    k_end = k_end.transpose(-1, -2).flatten(1, 2)                             # [N, B*H, K, C]
    decay = G_end[..., -1, :].to(dtype).exp().unsqueeze(-1).flatten(1, 2)     # [N, B*H, K, 1]
    if torch.is_grad_enabled() and any(x.requires_grad for x in (U, W, k_end, decay, S_)):
        states, deltas = [], []
        for n in range(N):
            states.append(S_)
            delta = torch.baddbmm(U[n], W[n], S_, alpha=-1)
            deltas.append(delta)
            S_ = torch.baddbmm(decay[n] * S_, k_end[n], delta)
        S_all, D_all = torch.stack(states), torch.stack(deltas)
    else:  # no autograd: the same operations, written in place into the stacked buffers (no stack copies)
        S_all = torch.empty(N + 1, B * H, K, V, dtype=dtype, device=kq.device)
        D_all = torch.empty(N, B * H, C, V, dtype=dtype, device=kq.device)
        S_all[0] = S_
        for n in range(N):
            torch.baddbmm(U[n], W[n], S_all[n], alpha=-1, out=D_all[n])
            torch.baddbmm(decay[n] * S_all[n], k_end[n], D_all[n], out=S_all[n + 1])
        S_, S_all = S_all[N].clone(), S_all[:N]  # a view would keep the whole [N + 1] buffer alive in the cache
    S_in = S_all.flatten(0, 1)                                                # [N*B*H, K, V] state entering chunks
    o = torch.baddbmm(qG.flatten(0, 2) @ S_in, A_qk.flatten(0, 2), D_all.flatten(0, 1),
                      beta=scale, alpha=scale)                                # q was left unscaled until here
    return o.view(N, B, H, C, V), S_


@without_autocast
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int | None = None,
    sub_chunk_size: int | None = None,
    max_exponent: float = 30.0,
    chunk_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (<= 0); beta: [B, T, H];
    initial_state: [B, H, K, V]. Returns o: [B, T, H, V] (dtype of v) and the final state [B, H, K, V]
    (fp32, or fp64 for fp64 inputs) if `output_final_state`, else None. Any T works: the tail chunk is
    padded with g = 0, beta = 0 tokens, which leave the state untouched. Differentiable via autograd.
    `chunk_size` (default: chosen from the gates, 64 for typical ones; `_auto_chunk_sizes`; 64 when only
    `sub_chunk_size` is given), `sub_chunk_size` (default: chosen from the gates, `_auto_sub_chunk_size`) and
    `max_exponent` tune the safe factorisation (module docstring). `chunk_block`: chunks processed together, the
    state handed from block to block (None: 512 tokens' worth on CPU, where a block's intermediates then stay in
    cache; all chunks on other devices; 0: all)."""
    if chunk_block is not None and (not isinstance(chunk_block, int) or chunk_block < 0):
        raise ValueError(f"chunk_block must be a non-negative int or None, got {chunk_block!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None (chosen from the gates), got {chunk_size!r}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if chunk_size is None and sub_chunk_size is None:
        C, c = _auto_chunk_sizes(g, max_exponent)
    else:
        C = chunk_size or AUTO_CHUNK_SIZES[0]
        c = sub_chunk_size or _auto_sub_chunk_size(g, C, max_exponent)
    if chunk_block is None:
        chunk_block = max(1, CPU_BLOCK_TOKENS // C) if q.device.type == "cpu" else 0
    if C % c:
        raise ValueError(f"sub_chunk_size {c} must divide chunk_size {C}")
    S = C // c
    scale = K ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    dtype = torch.promote_types(q.dtype, torch.float32)                      # fp32 at least; fp64 stays fp64
    N = -(-T // C)  # 0 for T = 0: no chunk, the state passes through

    def empty(*shape: int) -> torch.Tensor:  # every element is written by _fill_chunks (padding included)
        return torch.empty(*shape, dtype=dtype, device=q.device)

    S_ = torch.zeros(B * H, K, V, dtype=dtype, device=q.device) if initial_state is None \
        else initial_state.to(dtype).flatten(0, 1)
    q, k, g, v, beta = (x.to(dtype) for x in (q, k, g, v, beta.unsqueeze(-1)))
    # a decay of exactly -inf (alpha = 0) made -inf - -inf = NaN in the cumulative-sum differences; below -1e4
    # exp() is 0 in fp64 already, so the floor changes no value (nor a gradient: the decay's is 0 there too)
    g = g.clamp(min=-1e4)
    o = torch.empty(B, N * C, H, V, dtype=dtype, device=q.device)
    o_chunks = o.view(B, N, C, H, V).permute(1, 0, 3, 2, 4)                  # [N, B, H, C, V] view of o
    # blocks of chunks: each block is laid out, computed and written out while its intermediates are in
    # cache; the state runs from block to block
    step = max(1, min(N, chunk_block) if chunk_block else N)  # >= 1: a range step, also for N = 0
    for n0 in range(0, N, step):
        n, t = min(step, N - n0), slice(n0 * C, (n0 + step) * C)
        # chunk-major, zero-padded layouts [n, B, H, ...]; k and q of a sub-chunk sit side by side so one
        # matmul serves both
        kq = empty(n, B, H, S, 2, c, K)
        _fill_chunks(kq[..., 0, :, :], k[:, t])
        _fill_chunks(kq[..., 1, :, :], q[:, t])
        g_b = _fill_chunks(empty(n, B, H, S, c, K), g[:, t])
        v_b = _fill_chunks(empty(n, B, H, S, c, V), v[:, t]).flatten(-3, -2)       # [n, B, H, C, V]
        beta_b = _fill_chunks(empty(n, B, H, S, c, 1), beta[:, t]).flatten(-3, -2)  # [n, B, H, C, 1]
        o_chunks[n0:n0 + n], S_ = _chunk_range(kq, g_b, v_b, beta_b, S_, c, scale, max_exponent)
    o = o[:, :T].contiguous()
    return o.to(out_dtype), (S_.view(B, H, K, V) if output_final_state else None)
