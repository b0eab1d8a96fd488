"""Hybrid inference cache: a constant-size state per KDA layer, a latent cache per MLA layer.

`HybridCache.slots[i]` is layer i's slot, passed to that layer as `forward(x, cache=slot)`. Layers fill
and advance their own slot; prefill (many tokens) and decode (one token) use the same call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KDACache:
    """conv_state: [B, C, conv_size - 1] last inputs of the short causal conv over q, k, v channels (C = 3*H*K);
    state: [B, H, K, V] recurrent delta-rule state (fp32)."""

    conv_state: torch.Tensor | None = None
    state: torch.Tensor | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.state) if t is not None)


@dataclass
class MLACache:
    """latent: [B, T, kv_lora_rank] compressed KV; NoPE means no separate rotary key is kept."""

    latent: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def append(self, c_kv: torch.Tensor) -> torch.Tensor:
        self.latent = c_kv if self.latent is None else torch.cat([self.latent, c_kv], dim=1)
        return self.latent

    def nbytes(self) -> int:
        return 0 if self.latent is None else self.latent.numel() * self.latent.element_size()


@dataclass
class HybridCache:
    slots: list = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def for_config(cls, config) -> "HybridCache":
        return cls([KDACache() if t == "K" else MLACache() for t in config.pattern])

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.slots)

    def __getitem__(self, i: int):
        return self.slots[i]

    def __len__(self) -> int:
        return len(self.slots)
