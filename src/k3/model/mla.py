"""Gated Multi-head Latent Attention: latent KV cache, NoPE, sigmoid output gate, absorbed decode.

- MLA (DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3, arXiv 2412.19437 and its `inference/model.py`):
  keys and values are up-projected from one normalised latent `c_kv = RMSNorm(W_DKV x)`; only `c_kv`
  is cached. At decode the key up-projection W_UK is absorbed into the query and W_UV is applied after
  attending over latents, so k and v are never materialised.
- NoPE (Kimi Linear, arXiv 2510.26692): the MLA layers carry no rotary embedding; position comes from
  the KDA layers. The released Kimi-Linear and K3 keep DeepSeek's decoupled key slice all the same:
  `kv_a_proj_with_mqa` emits the latent (kv_lora_rank) and a key k_s of qk_rope_head_dim values, shared by
  every head and never rotated; each head's query has a matching slice q_s, so a logit is
  q_nope . W_UK c_kv + q_s . k_s, scaled by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), and the cache holds
  [c_kv, k_s] (512 + 64 = 576 values per token in K3).
- Output gate (Gated Attention, arXiv 2505.06708, "G1"): o = SDPA(q, k, v) * sigmoid(W_g x), elementwise
  and query dependent, before the output projection W_O.
- QK-Clip (Kimi K2, arXiv 2507.20534): with `track_max_logits` the layer records the per-head max logit
  S_max^h; `qk_clip_` rescales head h's query rows and key rows by sqrt(gamma_h), gamma_h = min(1, tau/S_max^h).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.cache import MLACache
from k3.model.packing import packed_linear
from k3.ops.amp import at_least_fp32
from k3.ops.mx.fake import fake_quant



def _as(h: torch.Tensor, norm: nn.RMSNorm) -> torch.Tensor:
    return h.to(norm.weight.dtype)

class GatedMLA(nn.Module):
    """x [B, T, d_model] -> y [B, T, d_model]; `cache` is this layer's MLACache slot (latent only).

    Weights, named after DeepSeek-V3 (H heads, K = qk_head_dim (nope), R = qk_rope_head_dim, V = v_head_dim,
    C = kv_lora_rank):
      q:  wq [H*(K+R), d]   or   wq_a [q_lora, d] -> q_norm -> wq_b [H*(K+R), q_lora]; per head K nope rows, R shared-key rows
      kv: wkv_a [C+R, d] -> (kv_norm(first C) = c_kv, last R = k_s), both cached;
          wkv_b [H*(K+V), C], per head K key rows (W_UK) then V value rows (W_UV)
      gate: w_gate [H*V, d] (with mla_use_output_gate);  out: wo [d, H*V]
    QK-Clip rescales, for head h, its query rows and its key rows of `wkv_b` (see `qk_clip_`); the value rows
    and the shared key are left alone.
    """

    def __init__(self, config: K3Config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.d_model, self.n_heads = config.d_model, config.mla_heads
        self.q_lora_rank, self.kv_lora_rank = config.mla_q_lora_rank, config.mla_kv_lora_rank
        self.qk_head_dim, self.v_head_dim = config.mla_qk_head_dim, config.mla_v_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.softmax_scale = 1.0 / math.sqrt(self.qk_head_dim + self.rope_dim)
        d, H, K, V, C, R = self.d_model, self.n_heads, self.qk_head_dim, self.v_head_dim, self.kv_lora_rank, self.rope_dim
        if self.q_lora_rank > 0:
            self.wq_a = nn.Linear(d, self.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(self.q_lora_rank, eps=config.mla_norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, H * (K + R), bias=False)
        else:
            self.wq = nn.Linear(d, H * (K + R), bias=False)
        self.wkv_a = nn.Linear(d, C + R, bias=False)
        self.kv_norm = nn.RMSNorm(C, eps=config.mla_norm_eps)
        self.wkv_b = nn.Linear(C, H * (K + V), bias=False)  # no bias: absorption needs it linear
        self.w_gate = nn.Linear(d, H * V, bias=False) if config.mla_use_output_gate else None
        self.wo = nn.Linear(H * V, d, bias=False)
        self.absorb: bool | None = None  # None: absorbed path exactly when decoding (cache given, T == 1)
        self.track_max_logits = False
        self.max_logits: torch.Tensor | None = None  # [H], set by forward when tracking
        if self.wo.weight.device.type != "meta":
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=config.init_std)

    @property
    def q_proj(self) -> nn.Linear:
        """The linear whose output rows are the per-head queries (wq_b, or wq for full-rank q)."""
        return self.wq_b if self.q_lora_rank > 0 else self.wq

    def forward(self, x: torch.Tensor, cache: MLACache | None = None, absorb: bool | None = None,
                segments=None, doc_slots: list[MLACache] | None = None) -> torch.Tensor:
        """`segments` (k3.model.segments, no cache): each token attends only within its own document;
        `doc_slots`: one fresh MLACache per document, filled with that document's latents (packed prefill)."""
        B, T, _ = x.shape
        # under autocast the projections come out bf16: the norms take them in their weights' dtype, which keeps
        # the fused rms_norm and the fp32 latent the cache stores (a bf16 input with fp32 weights is neither)
        reads_x = [self.wq_a if self.q_lora_rank > 0 else self.wq, self.wkv_a]
        reads_x += [self.w_gate] if self.w_gate is not None else []
        # a decode step runs the projections of x as one product (k3.model.packing); elsewhere each runs alone
        projected = packed_linear(self, "decode_in", reads_x, x) if cache is not None and T == 1 else None
        q_x, kv_x = projected[:2] if projected else (reads_x[0](x), self.wkv_a(x))
        q_in = self.q_norm(_as(q_x, self.q_norm)) if self.q_lora_rank > 0 else None
        q = (self.q_proj(q_in) if q_in is not None else q_x).view(B, T, self.n_heads, self.qk_head_dim + self.rope_dim)
        c_kv, k_s = kv_x.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = torch.cat([self.kv_norm(_as(c_kv, self.kv_norm)), k_s], dim=-1)  # [B, T, C + R]: what the cache holds
        P, key_mask = 0, None
        if cache is not None:
            if cache.latent is not None and cache.latent.dtype != c_kv.dtype:  # HybridCache.check sees shapes only
                raise ValueError(f"the cache's latent is {cache.latent.dtype} but this layer computes "
                                 f"{c_kv.dtype}; decode with the dtype (and autocast) the cache was filled with")
            P = cache.length
            c_kv = cache.append(c_kv)  # [B, P + T, C]
            key_mask = cache.key_mask  # [B, P + T] when rows of different lengths share the cache
        absorb = absorb if absorb is not None else self.absorb
        if absorb is None:
            absorb = cache is not None and T == 1
        if segments is not None:  # one causal attention per document
            o = q.new_empty(B, T, self.n_heads, self.v_head_dim)
            maxes = []
            for b, s, e in segments.runs:
                o[b:b + 1, s:e] = self._naive(q[b:b + 1, s:e], c_kv[b:b + 1, s:e], 0)
                if self.track_max_logits:
                    maxes.append(self.max_logits)
            if self.track_max_logits:
                self.max_logits = torch.stack(maxes).amax(0)
            if doc_slots is not None:
                for slot, (b, s, e) in zip(doc_slots, segments.runs):
                    slot.append(c_kv[b:b + 1, s:e])
        else:
            o = (self._absorbed if absorb else self._naive)(q, c_kv, P, key_mask)  # [B, T, H, V]
        o = o.reshape(B, T, -1)
        if self.w_gate is not None:
            o = o * torch.sigmoid(projected[2] if projected else self.w_gate(x))
        return self.wo(o)

    def _naive(self, q: torch.Tensor, c_kv: torch.Tensor, P: int, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Materialise k, v [B, S, H, *] from the latent and run SDPA; queries sit at positions P..P+T-1."""
        B, T, H, _ = q.shape
        K, R, S = self.qk_head_dim, self.rope_dim, c_kv.shape[1]
        c_kv, k_s = c_kv.split([self.kv_lora_rank, R], dim=-1)
        k, v = self.wkv_b(c_kv).view(B, S, H, K + self.v_head_dim).split([K, self.v_head_dim], dim=-1)
        if R:  # the shared key slice joins every head's key
            k = torch.cat([k, k_s[:, :, None, :].expand(B, S, H, R)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        causal = P == 0 and key_mask is None
        mask = None if causal else _visible(T, S, P, key_mask, q.device)
        if self.track_max_logits:
            self._track(torch.einsum("bhtk,bhsk->bhts", q, k) * self.softmax_scale, T, S, P, key_mask)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale)
        return o.transpose(1, 2)

    def _absorbed(self, q: torch.Tensor, c_kv: torch.Tensor, P: int,
                  key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attend in latent space: q W_UK scores against c_kv directly, W_UV applied after the softmax."""
        B, T, H, _ = q.shape
        K, R, S = self.qk_head_dim, self.rope_dim, c_kv.shape[1]
        q, q_s = q.split([K, R], dim=-1)
        c_kv, k_s = c_kv.split([self.kv_lora_rank, R], dim=-1)
        w = self.wkv_b.weight
        if getattr(self.wkv_b, "weight_format", None) is not None:  # QAT on the linears: compute what the naive
            # path's QATLinear computes (weight and input fake-quantized)
            w = fake_quant(w, self.wkv_b.weight_format, dim=1)
            c_kv = fake_quant(c_kv, self.wkv_b.act_format)
        w = w.view(H, K + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, :K], w[:, K:]
        # matmuls, not einsum: at decode torch.einsum's own planning cost about as much as these small products
        q_latent = q.transpose(1, 2) @ w_uk  # [B, H, T, C]
        scores = q_latent @ c_kv.transpose(1, 2).unsqueeze(1)  # [B, H, T, S]
        if R:
            scores = scores + q_s.transpose(1, 2) @ k_s.transpose(1, 2).unsqueeze(1)
        scores = scores * self.softmax_scale
        if self.track_max_logits:
            self._track(scores, T, S, P, key_mask)
        scores = scores.masked_fill(~_visible(T, S, P, key_mask, q.device), float("-inf"))
        p = torch.softmax(at_least_fp32(scores), dim=-1).to(c_kv.dtype)
        o_latent = p @ c_kv.unsqueeze(1)  # [B, H, T, C]
        return (o_latent @ w_uv.transpose(1, 2)).transpose(1, 2)  # [B, T, H, V]

    def _track(self, scores: torch.Tensor, T: int, S: int, P: int, key_mask: torch.Tensor | None = None) -> None:
        """scores [B, H, T, S] pre-softmax scaled logits; keeps the max over visible entries per head."""
        masked = scores.detach().masked_fill(~_visible(T, S, P, key_mask, scores.device), float("-inf"))
        self.max_logits = masked.amax(dim=(0, 2, 3))

    @torch.no_grad()
    def qk_clip_(self, tau: float = 100.0) -> torch.Tensor:
        """QK-Clip (Kimi K2): gamma_h = min(1, tau / S_max^h), applied per head.

        Uses `max_logits` from the last tracked forward; returns gamma [H]. The per-head halves (q_nope rows and
        W_UK rows) take sqrt(gamma_h) each; the shared key k_s belongs to every head, so as in K2 it is left alone
        and head h's q_s rows take the whole gamma_h.
        """
        assert self.max_logits is not None, \
            "qk_clip_ needs max_logits; set track_max_logits = True and run a forward first"
        H, K, V, R = self.n_heads, self.qk_head_dim, self.v_head_dim, self.rope_dim
        gamma = (tau / self.max_logits.clamp_min(1e-30)).clamp(max=1.0)
        s = gamma.sqrt().to(self.wkv_b.weight.dtype)
        wq = self.q_proj.weight.view(H, K + R, -1)
        wq[:, :K].mul_(s[:, None, None])
        wq[:, K:].mul_(gamma.to(wq.dtype)[:, None, None])
        self.wkv_b.weight.view(H, K + V, -1)[:, :K].mul_(s[:, None, None])
        return gamma


def _causal_mask(T: int, S: int, P: int, device) -> torch.Tensor:
    """[T, S] bool, True = visible: query i (absolute position P + i) sees keys 0..P + i."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=P)


def _visible(T: int, S: int, P: int, key_mask: torch.Tensor | None, device) -> torch.Tensor:
    """The causal mask [T, S], or [B, 1, T, S] with padded keys (key_mask [B, S] False) hidden as well."""
    mask = _causal_mask(T, S, P, device)
    return mask if key_mask is None else mask & key_mask[:, None, None, :]
