"""Attention Residuals (arXiv 2603.15031): each sublayer reads a learned softmax mix of earlier representations.

h_l = sum_i softmax_i(w_l^T (g_l * RMSNorm(v_i))) v_i, with a pseudo-query w_l (zero at init: a uniform mix) and a
key-norm weight g_l per sublayer (two per transformer layer), plus one pair for the final mix before the head.
Modes: 'block' mixes the embedding, the completed blocks of layers and the current block's partial sum (a block's
first sublayer sees no partial sum); 'full' makes every sublayer output a source; 'none' is the plain pre-norm
residual stream (no parameters). How the paper, its pseudocode and flash-attn-res were read:
docs/architecture.md, "Block AttnRes: how the sources were read".

Protocol (one state per forward; T may be 1, every token is mixed on its own):
    state = attnres.start(emb)                 # emb [B, T, D]
    for i in range(n_layers):
        h = attnres.mix(state, 2*i);     attnres.push(state, 2*i, token_mixer(norm(h)))
        h = attnres.mix(state, 2*i + 1); attnres.push(state, 2*i + 1, channel_mixer(norm(h)))
    h_final = attnres.final(state)             # then final norm + head
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from k3.config import K3Config
from k3.ops.amp import autocast_on
from k3.ops.attnres import IMPLS, Phase1Stats, attnres_mix, blockwise_mix, merged_weights, phase1, phase2
from k3.ops.attnres.decode import decode_key, decode_mix

__all__ = ["AttnRes", "AttnResState"]


class _Vectors(nn.ParameterList):
    """One 1-D parameter per AttnRes operation. Kept as vectors, not one [n, D] matrix, so that optimizer
    rules keyed on ndim (e.g. Muon for 2-D weights) treat them like norms and biases."""

    def __init__(self, n: int, d: int, value: float):
        super().__init__(nn.Parameter(torch.full((d,), value)) for _ in range(n))

    def extra_repr(self) -> str:
        return f"{len(self)} x [{self[0].shape[0]}]" if len(self) else "empty"


@dataclass
class AttnResState:
    """Depth sources of one forward pass.

    completed: sources fixed while the current block runs ([emb, b_1, ..., b_{n-1}] for block; emb and
        every output before the block for full; empty for none).
    current: sources that grow inside the block ([b_n^i] or [] for block; the block's outputs so far for
        full; [running residual] for none).
    step: the sublayer whose mix/push comes next. block_start: first sublayer of the current block.
    stats: phase-1 statistics of the current block (blockwise impl). shape: [B, T, D] of every source.
    """

    completed: list[torch.Tensor] = field(default_factory=list)
    current: list[torch.Tensor] = field(default_factory=list)
    step: int = 0
    block_start: int = 0
    stats: Phase1Stats | None = None
    shape: tuple[int, ...] = ()
    keys: list[torch.Tensor] = field(default_factory=list)  # decode: normalised keys of completed[:len(keys)]
    queries: torch.Tensor | None = None  # decode: every sublayer's w * g, [2 * n_layers + 1, D]


class AttnRes(nn.Module):
    """Pseudo-queries and key-norm weights of every AttnRes operation: 2 per layer plus the final mix.

    config.attnres: 'block' | 'full' | 'none'; impl: 'blockwise' (two-phase) | 'naive' (all sources
    stacked per mix). Both give the same outputs and gradients. Set `record_weights = True` to keep, per
    sublayer j (j = 2 * n_layers is the final mix), `last_weights[j]`: the softmax weights over its
    sources averaged over batch and tokens (detached), and `entropy()`.
    """

    def __init__(self, config: K3Config, impl: str = "blockwise"):
        super().__init__()
        assert impl in IMPLS, f"AttnRes impl = {impl!r} is unknown; pick one of {list(IMPLS)}"
        self.mode = config.attnres
        self.impl = impl
        self.n_layers = config.n_layers
        self.d_model = config.d_model
        self.eps = config.norm_eps
        self.n_sublayers = 2 * config.n_layers
        self.block_size = config.attnres_block_size  # transformer layers per block
        self.block_sublayers = 2 * self.block_size  # sublayers per block (and per phase-1 batch)
        self.n_blocks = math.ceil(config.n_layers / self.block_size)
        if self.mode != "none":
            n = self.n_sublayers + 1
            self.pseudo_query = _Vectors(n, config.d_model, 0.0)  # w_l: zero, so the first mix is uniform
            self.key_norm = _Vectors(n, config.d_model, 1.0)  # g_l of RMSNorm(v_i) in the logits
        self.record_weights = False
        self.last_weights: dict[int, torch.Tensor] = {}
        self._entropy: dict[int, torch.Tensor] = {}

    def reset_parameters(self) -> None:
        """Queries to zero (uniform mix at start, as the paper requires), key-norm weights to one."""
        if self.mode == "none":
            return
        with torch.no_grad():
            for q, g in zip(self.pseudo_query, self.key_norm):
                q.zero_()
                g.fill_(1.0)

    def extra_repr(self) -> str:
        return (f"mode={self.mode}, impl={self.impl}, d_model={self.d_model}, n_layers={self.n_layers}, "
                f"block_size={self.block_size} layers, n_blocks={self.n_blocks}")

    @property
    def final_index(self) -> int:
        return self.n_sublayers

    def n_sources(self, j: int) -> int:
        """How many sources sublayer j mixes (j = 2 * n_layers: the final mix); 1 for mode 'none'."""
        if self.mode == "none":
            return 1
        if self.mode == "full":
            return 1 + j
        return 1 + j // self.block_sublayers + (1 if j % self.block_sublayers else 0)

    # ------------------------------------------------------------------ protocol
    def start(self, emb: torch.Tensor) -> AttnResState:
        """emb [B, T, D] (D = d_model) becomes source 0."""
        if self.record_weights:
            self.last_weights, self._entropy = {}, {}
        shape = tuple(emb.shape)
        if self.mode == "none":
            return AttnResState(current=[emb], shape=shape)
        return AttnResState(completed=[emb], shape=shape)

    def mix(self, state: AttnResState, j: int) -> torch.Tensor:
        """The input h [B, T, D] of sublayer j (before its pre-norm)."""
        self._check_step(state, j, "mix")
        if self.mode == "none":
            return state.current[0]
        self._enter(state, j)
        if state.shape[1] == 1 and self.impl != "naive":  # decode: one token per row (k3.ops.attnres.decode)
            return self._decode_mix(state, j)
        q, g = self.pseudo_query[j], self.key_norm[j]
        if self.impl == "naive":
            h, weights = attnres_mix(torch.stack(state.completed + state.current), q, g, self.eps)
            self._record(j, weights)
            return h
        if state.stats is None:  # first mix of the block: phase 1 for all of its queries at once
            j0, j1 = state.block_start, min(state.block_start + self.block_sublayers, self.n_sublayers)
            queries = torch.stack([self.pseudo_query[k] for k in range(j0, j1)])
            norms = torch.stack([self.key_norm[k] for k in range(j0, j1)])
            state.stats = phase1(torch.stack(state.completed), queries, norms, self.eps)
        one = state.stats.select(j - state.block_start)
        out = phase2(one, q, g, torch.stack(state.current) if state.current else None, self.eps)
        if self.record_weights:
            self._record(j, merged_weights(one.logits, out.logits, out.m, out.l))
        return out.h.to(state.completed[0].dtype)

    def push(self, state: AttnResState, j: int, y: torch.Tensor) -> None:
        """Record sublayer j's output y [B, T, D]."""
        self._check_step(state, j, "push")
        # another shape would broadcast into the stream, another dtype promote it (the stream keeps the embedding's
        # dtype; autocast runs the sublayers in a lower one)
        assert tuple(y.shape) == state.shape, \
            f"AttnRes.push: output of sublayer {j} must have shape [B, T, D] = {list(state.shape)}, got {list(y.shape)}"
        like = (state.completed or state.current)[0]
        assert y.dtype == like.dtype or (y.is_floating_point() and autocast_on(y.device.type)), \
            f"AttnRes.push (sublayer {j}) expects y in the stream's dtype {like.dtype}, got {y.dtype}"
        if self.mode == "none":
            state.current[0] = state.current[0] + y
        else:
            self._enter(state, j)
            if self.mode == "block":
                state.current = [state.current[0] + y] if state.current else [y]
            else:
                state.current.append(y)
        state.step += 1

    def final(self, state: AttnResState) -> torch.Tensor:
        """The mix before the final norm and head, over every source: [B, T, D]."""
        assert state.step == self.n_sublayers, (f"AttnRes.final called after {state.step} of {self.n_sublayers} "
                                                "sublayer outputs; push every sublayer (0 .. 2 * n_layers - 1) first")
        if self.mode == "none":
            return state.current[0]
        j = self.final_index
        q, g = self.pseudo_query[j], self.key_norm[j]
        if self.impl == "naive":
            h, weights = attnres_mix(torch.stack(state.completed + state.current), q, g, self.eps)
        elif state.shape[1] == 1:
            return self._decode_mix(state, j)
        else:
            extra = torch.stack(state.current) if state.current else None
            h, weights = blockwise_mix(torch.stack(state.completed), q, g, extra, self.eps)
        self._record(j, weights)
        return h

    def _decode_mix(self, state: AttnResState, j: int) -> torch.Tensor:
        """Mix j at T = 1: a completed source's key is normalised once, when it is first mixed."""
        while len(state.keys) < len(state.completed):
            state.keys.append(decode_key(state.completed[len(state.keys)], self.eps))
        if state.queries is None:  # the key-norm weight folds into the query (as in phase 1), once per forward
            state.queries = torch.stack(list(self.pseudo_query)) * torch.stack(list(self.key_norm))
        keys = state.keys + [decode_key(c, self.eps) for c in state.current]
        h, weights = decode_mix(keys, state.completed + state.current, state.queries[j])
        self._record(j, weights)
        return h

    # ------------------------------------------------------------------ metrics
    def entropy(self) -> dict[int, float]:
        """Per sublayer j: mean over batch and tokens of the entropy (nats) of its weights over sources,
        from the last recorded forward. log(n_sources(j)) means a uniform mix, 0 a single source."""
        return {j: float(e) for j, e in self._entropy.items()}

    # ------------------------------------------------------------------ internals
    def _check_step(self, state: AttnResState, j: int, what: str) -> None:
        # the protocol (module docstring): start, then mix(j) and push(j) for j = 0, 1, ... in turn, then final
        assert isinstance(state, AttnResState) and j == state.step < self.n_sublayers, (
            f"AttnRes.{what}(state, {j}) out of order: the next sublayer is {getattr(state, 'step', None)} of "
            f"0 .. {self.n_sublayers - 1}; pass the AttnResState from start() and call mix(state, j) then "
            "push(state, j, y) for each j in turn")

    def _enter(self, state: AttnResState, j: int) -> None:
        """If sublayer j opens a new block, seal the finished one into the completed sources."""
        if j % self.block_sublayers or j == state.block_start:
            return
        if self.mode == "block":
            state.completed.append(state.current[0])
        else:
            state.completed.extend(state.current)
        state.current, state.block_start, state.stats = [], j, None

    def _record(self, j: int, weights: torch.Tensor) -> None:
        if not self.record_weights:
            return
        with torch.no_grad():
            w = weights.detach().float()  # [B, T, S]
            self.last_weights[j] = w.mean(dim=(0, 1))
            self._entropy[j] = -torch.special.xlogy(w, w).sum(-1).mean()
