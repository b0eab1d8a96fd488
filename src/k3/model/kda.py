"""Kimi Delta Attention layer (Kimi Linear, arXiv 2510.26692, Sec. 3 and Fig. 3).

x -> q, k, v projections -> short causal depthwise conv + SiLU -> L2-normalised q, k (per head);
per-channel forget gate alpha = exp(g) from f = W_alpha_up W_alpha_down x + dt_bias:
    K3 (bounded, `gate_lower_bound` lb):  g = lb * sigmoid(exp(A_log) * f), in (lb, 0)
    Kimi-Linear (gate_lower_bound None):  g = -exp(A_log) * softplus(f)
write strength beta = sigmoid(W_beta x); the KDA recurrence (k3.ops.kda); per-head RMSNorm gated by
sigmoid(W_g x), full rank in K3 (`use_full_rank_gate`, the release's g_proj) or low rank (W_gate_up
W_gate_down, Kimi-Linear's g_a/g_b); output projection. The op never sees positions, so no RoPE.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3.model.cache import KDACache
from k3.model.packing import packed_linear
from k3.ops.amp import as_dtype, at_least_fp32
from k3.ops.kda import kda, kda_step


class KimiDeltaAttention(nn.Module):
    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        d, H, K, r = config.d_model, config.kda_heads, config.kda_head_dim, config.kda_gate_rank
        self.n_heads, self.head_dim, self.conv_size, self.eps = H, K, config.kda_conv_size, config.kda_norm_eps
        self.q_proj = nn.Linear(d, H * K, bias=False)
        self.k_proj = nn.Linear(d, H * K, bias=False)
        self.v_proj = nn.Linear(d, H * K, bias=False)
        # one depthwise causal conv over the concatenated [q; k; v] channels (the cache keeps its inputs)
        self.conv_weight = nn.Parameter(torch.empty(3 * H * K, 1, config.kda_conv_size))
        self.alpha_down = nn.Linear(d, r, bias=False)            # low-rank, per-channel forget gate
        self.alpha_up = nn.Linear(r, H * K, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))                # per-head decay rate, log space
        self.dt_bias = nn.Parameter(torch.empty(H * K))          # per-channel gate bias
        self.beta_proj = nn.Linear(d, H, bias=False)
        self.lower_bound = config.gate_lower_bound
        if config.use_full_rank_gate:
            self.g_proj = nn.Linear(d, H * K, bias=False)        # full-rank output gate (K3)
        else:
            self.gate_down = nn.Linear(d, r, bias=False)         # low-rank output gate (Kimi-Linear)
            self.gate_up = nn.Linear(r, H * K, bias=config.kda_gate_bias)
        self.norm_weight = nn.Parameter(torch.empty(K))          # RMSNorm weight, shared by the heads
        self.o_proj = nn.Linear(H * K, d, bias=False)
        for p in (self.A_log, self.dt_bias):
            p._no_weight_decay = True
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.config.init_std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        bound = 1.0 / math.sqrt(self.conv_size)                  # nn.Conv1d's default fan-in bound
        nn.init.uniform_(self.conv_weight, -bound, bound)
        if self.lower_bound is None:
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())  # decay rates in [1, 16], as fla
            nn.init.zeros_(self.dt_bias)
        else:  # the bounded gate's init in fla and transformers' glm5_next: A_log 0, dt_bias = softplus^-1(dt),
            # dt log-uniform in [1e-3, 0.1], so g = lb * sigmoid(dt_bias) starts near 0 (long memory)
            nn.init.zeros_(self.A_log)
            dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        nn.init.ones_(self.norm_weight)

    def _short_conv(self, x: torch.Tensor, cache: KDACache | None, segments=None) -> torch.Tensor:
        """x: [B, T, C] -> SiLU(causal depthwise conv(x)), continuing from cache.conv_state [B, C, W-1]. With
        `segments`, a tap that would reach back into another document reads zero instead."""
        B, T, C = x.shape
        if segments is not None:
            W = self.conv_size  # tap i of the kernel reads the token W - 1 - i steps back
            y = sum(self.conv_weight[:, 0, W - 1 - j] * _shift(x, j) * segments.same[j][..., None]
                    for j in range(W))
            return F.silu(y)
        x = x.transpose(1, 2)
        prev = cache.conv_state if cache is not None else None  # its shape: HybridCache.check
        prev = x.new_zeros(B, C, self.conv_size - 1) if prev is None else prev.to(x.dtype)
        x = torch.cat([prev, x], dim=-1)                         # [B, C, W - 1 + T]
        if cache is not None:
            cache.conv_state = x[..., x.shape[-1] - (self.conv_size - 1):].clone()
        return F.silu(F.conv1d(x, self.conv_weight, groups=C)).transpose(1, 2)

    def forward(self, x: torch.Tensor, cache: KDACache | None = None, segments=None,
                doc_slots: list[KDACache] | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> y: [B, T, d_model]. With a cache slot, continues from (and refills) its
        conv_state and recurrent state, so prefill-then-decode equals one full forward. `segments`
        (k3.model.segments, no cache): the documents inside each row, kept apart; `doc_slots`: one fresh
        KDACache per document, left as a prefill of that document alone would leave it."""
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        if self._decodes(T, cache, segments):
            return self._decode(x, cache)
        raw = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        qkv = self._short_conv(raw, cache, segments)
        q, k, v = qkv.view(B, T, 3, H, K).unbind(2)
        q, k = (t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.beta_proj(x))
        if segments is not None:  # the rows' documents as one packed row: the state restarts at each
            flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
            o, states = kda(*flat, cu_seqlens=segments.cu_seqlens, output_final_state=doc_slots is not None)
            o = o.view(B, T, H, -1)
            state = None
            for n, (slot, (b, s, e)) in enumerate(zip(doc_slots or [], segments.runs)):
                slot.state = states[n:n + 1]
                W1 = self.conv_size - 1  # the conv's inputs of the document's last W - 1 tokens, zeros before it
                tail = raw[b, max(s, e - W1):e].t()[None]
                slot.conv_state = F.pad(tail, (W1 - tail.shape[-1], 0)).clone()
        else:
            o, state = kda(q, k, v, g, beta, initial_state=None if cache is None else cache.state,
                           output_final_state=cache is not None)
        if cache is not None:
            cache.state = state
        o = at_least_fp32(o)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * at_least_fp32(self.norm_weight)
        o = o.to(x.dtype) * torch.sigmoid(self.output_gate(x)).view(B, T, H, K)
        return self.o_proj(o.reshape(B, T, H * K))

    @staticmethod
    def _decodes(T: int, cache: KDACache | None, segments) -> bool:
        """Whether `forward` takes `_decode`: one token continuing a filled cache."""
        return T == 1 and segments is None and cache is not None and cache.state is not None

    def _decode(self, x: torch.Tensor, cache: KDACache) -> torch.Tensor:
        """`forward` for one token from a filled cache, in half the small kernels: the six projections that read x
        run as one product where k3.model.packing allows, the conv is a dot product with the cached window
        (F.conv1d costs ~10x that), q and k are normalised together, and the recurrence takes one step
        (`kda_step`)."""
        B, _, d = x.shape
        H, K = self.n_heads, self.head_dim
        x1 = x.view(B, d)
        gate_in = self.g_proj if hasattr(self, "g_proj") else self.gate_down
        q, k, v, a, b, o_in = packed_linear(
            self, "decode_in", (self.q_proj, self.k_proj, self.v_proj, self.alpha_down, self.beta_proj, gate_in), x1)
        raw = torch.cat([q, k, v], dim=-1)  # [B, 3HK]
        # the window is [B, 3HK, W]: the cached W - 1 inputs, then this one
        window = torch.cat([as_dtype(cache.conv_state, raw.dtype), raw.unsqueeze(-1)], dim=-1)
        cache.conv_state = window[..., 1:]
        qkv = F.silu((window * self.conv_weight[:, 0]).sum(-1)).view(B, 3, H, K)
        qk = qkv[:, :2]
        q, k = (qk * torch.rsqrt(qk.pow(2).sum(-1, keepdim=True) + 1e-6)).unbind(1)
        g = self._decay(self.alpha_up(a)).view(B, H, K)
        beta = torch.sigmoid(b)
        o, cache.state = kda_step(q, k, qkv[:, 2], g, beta, cache.state)
        o = at_least_fp32(o)
        o = F.rms_norm(o, (K,), at_least_fp32(self.norm_weight), self.eps)  # the same norm as forward's, fused
        gate = o_in if hasattr(self, "g_proj") else self.gate_up(o_in)
        o = as_dtype(o, x.dtype) * torch.sigmoid(gate).view(B, H, K)
        return self.o_proj(o.view(B, 1, H * K))

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] -> log-decay g [B, T, H, K] (fp32 or wider), <= 0."""
        return self._decay(self.alpha_up(self.alpha_down(x)))

    def _decay(self, f: torch.Tensor) -> torch.Tensor:
        """The gate's up-projection f [..., H*K] -> log-decay g [..., H, K]."""
        H, K = self.n_heads, self.head_dim
        f = at_least_fp32(f.view(*f.shape[:-1], H, K) + self.dt_bias.view(H, K))
        rate = at_least_fp32(self.A_log).exp().view(H, 1)
        if self.lower_bound is None:
            return -rate * F.softplus(f)
        return self.lower_bound * torch.sigmoid(rate * f)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] -> the output gate's pre-activation [B, T, H*K]."""
        return self.g_proj(x) if hasattr(self, "g_proj") else self.gate_up(self.gate_down(x))


def _shift(x: torch.Tensor, j: int) -> torch.Tensor:
    """x [B, T, C] -> x delayed by j tokens along T (zeros first)."""
    return x if j == 0 else F.pad(x, (0, 0, j, 0))[:, : x.shape[1]]
