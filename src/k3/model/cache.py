"""Hybrid inference cache: a constant-size state per KDA layer, a latent cache per MLA layer.

`HybridCache.slots[i]` is layer i's slot, passed to that layer as `forward(x, cache=slot)`. Layers fill
and advance their own slot; prefill (many tokens) and decode (one token) use the same call.

Rows of different lengths share one batched cache for continuous batching: `HybridCache.merge` stacks
caches row-wise, `select` keeps some rows and `split` returns batch-1 caches. KDA states stack as they
are (constant size); MLA latents are packed to the front of each row and padded to the longest row, with
`MLACache.key_mask` marking the real keys. Padding never moves positions that matter: MLA is NoPE, so a
key's column says nothing about where it sits in the sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3.config import KDA


@dataclass
class KDACache:
    """conv_state: [B, C, conv_size - 1] last inputs of the short causal conv over q, k, v channels (C = 3*H*K);
    state: [B, H, K, V] recurrent delta-rule state (fp32)."""

    conv_state: torch.Tensor | None = None
    state: torch.Tensor | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.state) if t is not None)

    @property
    def empty(self) -> bool:
        return self.conv_state is None and self.state is None

    @staticmethod
    def merge(slots: list["KDACache"]) -> "KDACache":
        if all(s.empty for s in slots):
            return KDACache()
        _check_all_used(slots)
        return KDACache(torch.cat([s.conv_state for s in slots]), torch.cat([s.state for s in slots]))

    def select(self, rows: torch.Tensor) -> "KDACache":
        if self.empty:
            return KDACache()
        return KDACache(self.conv_state[rows], self.state[rows])


@dataclass
class MLACache:
    """latent: [B, T, kv_lora_rank + qk_rope_head_dim]: the compressed KV and the shared (unrotated) key slice.
    key_mask: [B, T] bool, True = a real key, False = padding; None = every key is real."""

    latent: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    @property
    def empty(self) -> bool:
        return self.latent is None

    def append(self, c_kv: torch.Tensor) -> torch.Tensor:
        if self.key_mask is not None:
            self.key_mask = torch.cat([self.key_mask, self.key_mask.new_ones(c_kv.shape[:2])], dim=1)
        self.latent = c_kv if self.latent is None else torch.cat([self.latent, c_kv], dim=1)
        return self.latent

    def nbytes(self) -> int:
        """Bytes held: the latent, and the key mask when rows are padded."""
        return sum(t.numel() * t.element_size() for t in (self.latent, self.key_mask) if t is not None)

    def row_lengths(self) -> torch.Tensor:
        """[B] real keys per row (on the CPU) of a cache that holds some."""
        if self.key_mask is None:
            return torch.full((self.latent.shape[0],), self.latent.shape[1], dtype=torch.long)
        return self.key_mask.sum(1).cpu()

    def packed(self, width: int) -> "MLACache":
        """The same keys, each row's real keys first (in order), cut or zero-padded to `width` columns."""
        latent, mask = self.latent, self.key_mask
        B, S, C = latent.shape
        lengths = self.row_lengths()  # callers pass a width >= the longest row
        if mask is not None:
            order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices  # real keys first
            latent = latent.gather(1, order[..., None].expand(B, S, C))
        latent = latent[:, :width]
        if S < width:
            latent = torch.cat([latent, latent.new_zeros(B, width - S, C)], dim=1)
        mask = torch.arange(width)[None] < lengths[:, None]
        if bool(mask.all()):
            return MLACache(latent)
        mask = mask.to(latent.device)
        return MLACache(latent * mask[..., None], mask)  # zero padding: nothing stale behind a mask

    @staticmethod
    def merge(slots: list["MLACache"]) -> "MLACache":
        if all(s.empty for s in slots):
            return MLACache()
        _check_all_used(slots)
        width = max(int(s.row_lengths().max()) for s in slots)
        parts = [s.packed(width) for s in slots]
        latent = torch.cat([p.latent for p in parts])
        if all(p.key_mask is None for p in parts):
            return MLACache(latent)
        ones = lambda p: torch.ones(p.latent.shape[:2], dtype=torch.bool, device=latent.device)  # noqa: E731
        return MLACache(latent, torch.cat([ones(p) if p.key_mask is None else p.key_mask for p in parts]))

    def select(self, rows: torch.Tensor) -> "MLACache":
        if self.empty:
            return MLACache()
        kept = MLACache(self.latent[rows], None if self.key_mask is None else self.key_mask[rows])
        return kept.packed(int(kept.row_lengths().max()))  # drops columns only the removed rows used


def _check_all_used(slots: list) -> None:
    if any(s.empty for s in slots):
        raise ValueError("cannot merge a fresh cache with caches that already hold tokens; prefill the "
                         "fresh one first (or merge it only with other fresh caches)")


@dataclass
class HybridCache:
    slots: list = field(default_factory=list)
    seen_tokens: int = 0
    # tokens each row has seen, where rows differ (a merge of caches of different lengths); None: every row has
    # seen `seen_tokens`. MLA latents also record it (their padding), KDA states do not, so a KDA-only cache
    # relies on this to split back into its rows' lengths.
    row_tokens: list[int] | None = None

    @classmethod
    def for_config(cls, config) -> "HybridCache":
        return cls([KDACache() if t == "K" else MLACache() for t in config.pattern])

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.slots)

    @classmethod
    def merge(cls, caches: list["HybridCache"]) -> "HybridCache":
        """Stack caches (any batch sizes, any lengths) row-wise, in order, into one batched cache."""
        if not caches:
            raise ValueError("merge needs at least one cache")
        if len({len(c) for c in caches}) != 1:
            raise ValueError(f"caches have {sorted({len(c) for c in caches})} slots; merge caches of one model")
        for i, group in enumerate(zip(*(c.slots for c in caches))):
            kinds = {type(s).__name__ for s in group}
            widths = {(name, tuple(t.shape[2:])) for s in group for name, t in vars(s).items()
                      if isinstance(t, torch.Tensor) and t.dim() > 2}  # all but batch and length
            if len(kinds) > 1 or len(widths) > len({name for name, _ in widths}):
                raise ValueError(f"cache slot {i} differs between the caches ({', '.join(sorted(kinds))}; "
                                 f"{sorted(widths)}); merge caches of one model")
        slots = [type(group[0]).merge(list(group)) for group in zip(*(c.slots for c in caches))]
        per_row = [n for c in caches for n in c.tokens_per_row()]
        return cls(slots, max(c.seen_tokens for c in caches), per_row if len(set(per_row)) > 1 else None)

    def tokens_per_row(self) -> list[int]:
        """Tokens seen by each row (empty for a fresh cache)."""
        if self.row_tokens is not None:
            return list(self.row_tokens)
        return [self.seen_tokens] * (self.batch_size or 0)

    def select(self, rows) -> "HybridCache":
        """A cache of only `rows` (a list or 1-d tensor of row indices), padding columns trimmed."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        n = self.batch_size
        if rows.dim() != 1 or not rows.numel():
            raise ValueError(f"select takes a non-empty list of row indices, got {rows.tolist()}")
        if n is not None and (int(rows.min()) < 0 or int(rows.max()) >= n):
            raise ValueError(f"select: rows {rows.tolist()} outside the cache's rows 0..{n - 1}")
        out = HybridCache([s.select(rows.to(_device(s, rows))) for s in self.slots], self.seen_tokens)
        if self.row_tokens is not None:
            kept = [self.row_tokens[i] for i in rows.tolist()]
            out.seen_tokens = max(kept, default=0)
            out.row_tokens = kept if len(set(kept)) > 1 else None
        else:
            widths = [s.length for s in out.slots if isinstance(s, MLACache) and not s.empty]
            if widths:
                out.seen_tokens = max(widths)
        return out

    def split(self) -> list["HybridCache"]:
        """Batch-1 caches, one per row, without padding."""
        if self.batch_size is None:
            raise ValueError("a fresh cache has no rows to split")
        return [self.select([i]) for i in range(self.batch_size)]

    @property
    def batch_size(self) -> int | None:
        """Rows held, or None while every slot is still empty (a fresh cache fits any batch)."""
        for s in self.slots:
            t = s.latent if isinstance(s, MLACache) else s.state
            if t is not None:
                return t.shape[0]
        return None

    def check(self, config, batch: int) -> None:
        """Every slot is of its layer's kind and its tensors have the shapes `config` gives them and the batch `batch`
        (a ValueError names the slot and the shape); checked before a forward touches any slot, so a cache of another
        model or batch fails without being half advanced."""
        fix = "make the cache with model.new_cache() (one per model and batch of sequences)"
        H, K, W = config.kda_heads, config.kda_head_dim, config.kda_conv_size
        for i, (kind, slot) in enumerate(zip(config.pattern, self.slots)):
            if not isinstance(slot, KDACache if kind == KDA else MLACache):
                raise ValueError(f"cache slot {i} is a {type(slot).__name__}, but layer {i} is "
                                 f"{'KDA' if kind == KDA else 'MLA'}; make the cache with model.new_cache()")
            if isinstance(slot, KDACache):
                want = {"conv_state": (batch, 3 * H * K, W - 1), "state": (batch, H, K, K)}
            else:
                S = slot.length
                want = {"latent": (batch, S, config.mla_cache_dim), "key_mask": (batch, S)}
            for name, shape in want.items():
                t = getattr(slot, name)
                if t is not None and not (isinstance(t, torch.Tensor) and tuple(t.shape) == shape):
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"cache slot {i} ({type(slot).__name__}.{name}) is {got}, but this model and "
                                     f"a batch of {batch} need {shape}; {fix}")

    def snapshot(self) -> list[dict]:
        """The slots' tensors, by reference (layers replace them, never write into them): `restore` undoes a
        forward that failed part way."""
        return [dict(vars(s)) for s in self.slots]

    def restore(self, snapshot: list[dict]) -> None:
        for slot, saved in zip(self.slots, snapshot):
            vars(slot).update(saved)

    def __getitem__(self, i: int):
        return self.slots[i]

    def __len__(self) -> int:
        return len(self.slots)


def _device(slot, rows: torch.Tensor) -> torch.device:
    t = slot.latent if isinstance(slot, MLACache) else slot.state
    return rows.device if t is None else t.device
