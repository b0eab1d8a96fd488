"""Prefix cache over the hybrid cache: reuse what an earlier prompt left, within a byte budget.

An MLA layer's cache after a prefix is the prefix's latents, so any prefix of a cached sequence can be
reused. A KDA layer's cache is a recurrent state and a conv tail that summarise the whole prefix: it can
only be reused where it was snapshotted. The engine therefore prefills in pieces that end at multiples of
`block` tokens and hands every block boundary, and the end of every prompt, to `insert`; `match` finds
the longest snapshotted prefix of a new prompt, and the engine recomputes only the tokens after it.

The cache is a radix tree of token blocks, as SGLang's RadixAttention keeps one (Zheng et al., arXiv
2312.07104): a node holds one block's tokens (a full block, or the shorter tail a prompt ended with, as a
leaf), its latents in each MLA layer, and the KDA states and conv tails at its end. A sequence's latents
are stored once, block by block, whatever the number of snapshots along it. A hit copies out of the
tree (`HybridCache` layers replace their tensors, never write into them, and the copy is cheap beside the
prefill it saves), so nothing in the tree is ever in use and any leaf may be evicted: least recently used
first, until the bytes held fit `max_bytes`. Evicting only leaves keeps every node's path whole.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from k3.model.cache import HybridCache, KDACache, MLACache


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    parent: "_Node | None"
    latents: list[torch.Tensor] = field(default_factory=list)  # per MLA slot: [1, len(tokens), C]
    kda: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per KDA slot: (conv_state, state); None: none kept
    children: dict = field(default_factory=dict)  # token tuple -> _Node
    nbytes: int = 0
    start: int = 0  # tokens before this node's block

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class PrefixCache:
    """Snapshots of batch-1 `HybridCache`s keyed by the tokens they have seen.

    `match(ids)` -> (n, cache): the longest prefix of `ids` (shorter than `ids`: the last token is always
    computed, for its logits) with a snapshot, and a fresh batch-1 cache that has seen it; (0, None) on a miss
    (or, with `longer_than`, when nothing longer than that is cached). `again`: a request that looked before looks
    again (not counted as a lookup).
    `insert(ids, n, cache)` records `cache`, which has seen `ids[:n]`, at n (a multiple of `block` or the end of
    a prompt)."""

    def __init__(self, pattern: str, block: int = 256, max_bytes: int = 1 << 30):
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"prefix cache block = {block!r} must be an integer >= 1")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"prefix cache max_bytes = {max_bytes!r} must be an integer >= 0")
        self.pattern, self.block, self.max_bytes = pattern, block, max_bytes
        self.root = _Node((), None)
        self._lru: collections.OrderedDict[_Node, None] = collections.OrderedDict()  # oldest first
        self.bytes = 0
        self.lookups = self.hits = self.tokens_reused = self.tokens_looked_up = 0
        self.inserts = self.evictions = 0

    # ------------------------------------------------------------------ lookup
    def _path(self, ids: list[int], limit: int) -> list[_Node]:
        """Nodes along `ids` whose blocks end at or before `limit`: full blocks, then the longest tail."""
        path, node, pos, B = [], self.root, 0, self.block
        while pos + B <= limit:
            child = node.children.get(tuple(ids[pos:pos + B]))
            if child is None:
                break
            path.append(child)
            node, pos = child, pos + B
        return path

    def match(self, ids: list[int], longer_than: int = 0, again: bool = False) -> tuple[int, HybridCache | None]:
        if not again:
            self.lookups += 1
            self.tokens_looked_up += len(ids)
        limit = len(ids) - 1
        path = self._path(ids, limit)
        best = max((i for i, n in enumerate(path) if n.kda is not None), default=-1)
        # a prompt's tail shorter than a block, under the deepest node or under one whose snapshot is gone
        tail, parent_at = None, -1
        for i in range(len(path) - 1, best - 1, -1):
            node = path[i] if i >= 0 else self.root
            for toks, child in node.children.items():
                if len(toks) < self.block and child.kda is not None and node.end + len(toks) <= limit \
                        and tuple(ids[node.end:node.end + len(toks)]) == toks \
                        and (tail is None or child.end > tail.end):
                    tail, parent_at = child, i
            if tail is not None:
                break
        if tail is not None and (best < 0 or tail.end > path[best].end):
            path = path[:parent_at + 1] + [tail]
        elif best >= 0:
            path = path[:best + 1]
        else:
            return 0, None
        n = path[-1].end
        if n <= longer_than:
            return 0, None
        for node in reversed(path):  # leaves older than their parents: LRU eviction meets children first
            self._lru.move_to_end(node)
        self.hits += not longer_than
        self.tokens_reused += n - longer_than
        return n, self._build(path)

    def _build(self, path: list[_Node]) -> HybridCache:
        last = path[-1]
        slots, m, k = [], 0, 0
        for kind in self.pattern:
            if kind == "K":
                conv, state = last.kda[k]
                slots.append(KDACache(conv.clone(), state.clone()))
                k += 1
            else:
                slots.append(MLACache(torch.cat([n.latents[m] for n in path], dim=1)))
                m += 1
        return HybridCache(slots, last.end)

    # ------------------------------------------------------------------ insertion and eviction
    def insert(self, ids: list[int], n: int, cache: HybridCache) -> None:
        """Record `cache` (batch 1, no padding, has seen ids[:n]) at n. Blocks on the way that are not in the
        tree (never inserted, or evicted) are added with their latents and no snapshot."""
        if self.max_bytes == 0 or n < 1 or any(isinstance(s, MLACache) and s.key_mask is not None for s in cache.slots):
            return  # a padded row (never the engine's batch-1 prefill caches): its columns are not its positions
        node, pos, B = self.root, 0, self.block
        path = []
        while pos < n:
            end = min(pos + B, n)
            toks = tuple(ids[pos:end])
            child = node.children.get(toks)
            if child is None:
                if node.end % B:  # a tail node has no children: a prompt end inside a block is a leaf
                    return
                child = _Node(toks, node, start=pos)
                child.latents = [s.latent[:, pos:end].clone() for s in cache.slots if isinstance(s, MLACache)]
                child.nbytes = _bytes(child.latents)
                node.children[toks] = child
                self.bytes += child.nbytes
                self._lru[child] = None
            path.append(child)
            node, pos = child, end
        if node.kda is None:
            node.kda = [(s.conv_state.clone(), s.state.clone()) for s in cache.slots if isinstance(s, KDACache)]
            extra = sum(_bytes(t) for t in node.kda)
            node.nbytes += extra
            self.bytes += extra
            self.inserts += 1
        for p in reversed(path):
            self._lru.move_to_end(p)
        self._evict()

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._lru:
            victim = next((n for n in self._lru if not n.children), None)
            if victim is None:  # cannot happen in a tree (some node is a leaf); kept as a guard
                break
            del self._lru[victim]
            del victim.parent.children[victim.tokens]
            self.bytes -= victim.nbytes
            self.evictions += 1

    def clear(self) -> None:
        self.root, self._lru, self.bytes = _Node((), None), collections.OrderedDict(), 0

    def stats(self) -> dict:
        return {"block": self.block, "max_bytes": self.max_bytes, "bytes": self.bytes, "nodes": len(self._lru),
                "lookups": self.lookups, "hits": self.hits, "tokens_looked_up": self.tokens_looked_up,
                "tokens_reused": self.tokens_reused, "snapshots_inserted": self.inserts,
                "evictions": self.evictions}
