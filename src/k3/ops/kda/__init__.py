"""Kimi Delta Attention (KDA) op: one dispatch function over the reference and fast paths.

    naive      token loop, the obviously-correct reference            (naive.py)
    chunk      chunked WY/UT form, matmul-bound, for training/prefill (chunk.py)
    recurrent  step loop tuned for decode / short T                   (recurrent.py)
    fla        flash-linear-attention's Triton kernels (CUDA only)

All share `(q, k, v, g, beta, scale, initial_state, output_final_state)` with q/k already L2-normalised
by the caller, g the per-channel log-decay and beta the delta-rule write strength (Kimi Linear,
arXiv 2510.26692).
"""
from __future__ import annotations

import logging

import torch

from k3.ops.kda.chunk import chunk_kda
from k3.ops.kda.naive import naive_recurrent_kda
from k3.ops.kda.recurrent import fused_recurrent_kda, recurrent_kda_step
from k3.ops.kda.varlen import buckets, check_cu_seqlens, from_padded, pack_index, to_padded

__all__ = ["kda", "kda_step", "chunk_kda", "naive_recurrent_kda", "fused_recurrent_kda", "choose_impl", "IMPLS"]

logger = logging.getLogger(__name__)

IMPLS = ("naive", "chunk", "recurrent", "fla")
RECURRENT_MAX_T = 16  # on CPU, at most this many tokens go through the step loop instead of chunks
_warned_no_fla = False


_fla_import_error: str | None = None


def _fla_kda():
    """fla's (chunk_kda, fused_recurrent_kda), or None when fla is missing or fails to import (a Triton it does
    not support raises other errors than ImportError); the reason is kept for the warning."""
    global _fla_import_error
    try:
        from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_recurrent
    except Exception as e:  # noqa: BLE001
        _fla_import_error = f"{type(e).__name__}: {e}"
        return None
    return fla_chunk, fla_recurrent


def choose_impl(q: torch.Tensor) -> str:
    """The implementation `kda(..., impl=None)` uses for these inputs."""
    global _warned_no_fla
    if q.is_cuda:
        if _fla_kda() is not None:
            return "fla"
        if not _warned_no_fla:
            logger.warning("fla is not usable (%s): KDA on CUDA runs the pure-torch kernels; pip install 'k3[gpu]' "
                           "(fla-core with a Triton it supports)", _fla_import_error)
            _warned_no_fla = True
    return "recurrent" if q.shape[1] <= RECURRENT_MAX_T else "chunk"


def _check(q, k, v, g, beta, initial_state, n_seqs: int | None = None) -> None:
    def bad(name: str, want: str, x: torch.Tensor) -> None:
        raise ValueError(f"{name} must be {want}, got shape {tuple(x.shape)} (q is {tuple(q.shape)})")

    if q.dim() != 4:
        bad("q", "[B, T, H, K]", q)
    B, T, H, K = q.shape
    if k.shape != q.shape:
        bad("k", f"[B, T, H, K] = {[B, T, H, K]} like q", k)
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        bad("v", f"[B, T, H, V] = {[B, T, H, 'V']}", v)
    if g.shape != q.shape:
        bad("g", f"[B, T, H, K] = {[B, T, H, K]} like q", g)
    if beta.shape != q.shape[:3]:
        bad("beta", f"[B, T, H] = {[B, T, H]}", beta)
    N = B if n_seqs is None else n_seqs
    if initial_state is not None and initial_state.shape != (N, H, K, v.shape[-1]):
        bad("initial_state", f"[N, H, K, V] = {[N, H, K, v.shape[-1]]} (one per sequence of cu_seqlens)" if n_seqs
            else f"[B, H, K, V] = {[B, H, K, v.shape[-1]]}", initial_state)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    impl: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (<= 0); beta: [B, T, H];
    initial_state: [B, H, K, V]. Returns (o [B, T, H, V], final state [B, H, K, V] or None).

    impl: None picks fla's Triton kernels for CUDA tensors (our kernels, with a warning, if fla is
    missing) and on CPU 'recurrent' for T <= 16, else 'chunk'; or force one of 'naive', 'chunk',
    'recurrent', 'fla'.

    cu_seqlens: N packed sequences in one row (B = 1), fla's convention (k3.ops.kda.varlen): the state restarts
    at every start; initial_state and the final state are then [N, H, K, V], one per sequence."""
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1])
    n_seqs = None if cu_seqlens is None else cu_seqlens.numel() - 1
    _check(q, k, v, g, beta, initial_state, n_seqs)
    impl = choose_impl(q) if impl is None else impl
    if cu_seqlens is not None and impl != "fla":
        # padded batches of similar lengths: padding has g = 0 and beta = 0, so it leaves every state as it was
        cu = cu_seqlens.to(q.device)
        c = cu.tolist()
        o = v.new_empty(v.shape)
        states = [None] * n_seqs
        for group in buckets([b - a for a, b in zip(c, c[1:])]):
            idx, row, pos, t_max = pack_index(cu, group)
            padded = [to_padded(x, idx, row, pos, len(group), t_max) for x in (q, k, v, g, beta)]
            init = None if initial_state is None else initial_state[group]
            og, sg = kda(*padded, scale=scale, initial_state=init, output_final_state=output_final_state, impl=impl)
            o = o.index_put((torch.zeros_like(idx), idx), from_padded(og, row, pos).to(o.dtype))
            for j, i in enumerate(group):
                states[i] = None if sg is None else sg[j:j + 1]
        return o, (torch.cat(states) if output_final_state else None)
    args = (q, k, v, g, beta)
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state)
    if impl == "fla":
        fns = _fla_kda()
        if fns is None or not q.is_cuda:
            raise ValueError("impl='fla' needs fla installed and CUDA tensors; use impl='chunk' on CPU")
        fla_chunk, fla_recurrent = fns
        # fla's fused_recurrent_kda has no backward; use it only for short, gradient-free calls (decode)
        needs_grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (*args, initial_state)
        )
        fn = fla_recurrent if q.shape[1] <= RECURRENT_MAX_T and not needs_grad else fla_chunk
        # the Triton kernels take q, k, v, beta in one dtype (under autocast the L2-normalised q, k come out
        # fp32 and v bf16); the log-decay g stays fp32, as fla's own layers keep it
        q, k, beta = (x.to(v.dtype) for x in (q, k, beta))
        if cu_seqlens is not None:
            kwargs["cu_seqlens"] = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return fn(q, k, v, g.float(), beta, **kwargs)
    fns = {"naive": naive_recurrent_kda, "chunk": chunk_kda, "recurrent": fused_recurrent_kda}
    if impl not in fns:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    return fns[impl](*args, **kwargs)


def kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token: q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] -> (o [B, H, V], new
    state). On the CPU `recurrent_kda_step` (`kda` at T = 1 with half its small kernels); elsewhere `kda` itself."""
    if q.device.type == "cpu":
        return recurrent_kda_step(q, k, v, g, beta, state)
    o, state = kda(*(x.unsqueeze(1) for x in (q, k, v, g, beta)), initial_state=state, output_final_state=True)
    return o.squeeze(1), state
