"""Where each routed expert lives on the EP ranks: contiguous shards, or an EPLB-style balanced placement.

A placement is a table of *slots*: `n_ranks` ranks hold `slots_per_rank` slots each, and slot g (on rank
g // slots_per_rank) holds logical expert `slot_expert[g]`. Contiguous EP gives rank r the experts
r*S .. r*S + S - 1. A balanced placement (DeepSeek's EPLB, github.com/deepseek-ai/EPLB) gives the redundant
slots to the experts with the largest load per replica, then packs the replicas, heaviest first, onto the least
loaded rank; `route` spreads a replicated expert's token-slots over its replicas round-robin. The algorithm and
its sources: docs/distributed.md ("Load-skew smoothing").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Placement", "contiguous_placement", "balanced_placement", "zipf_loads", "max_over_mean"]


@dataclass(frozen=True)
class Placement:
    n_experts: int
    n_ranks: int
    slot_expert: tuple[int, ...]  # [n_ranks * slots_per_rank]: logical expert of each slot

    def __post_init__(self):
        if self.n_ranks < 1 or len(self.slot_expert) % self.n_ranks:
            raise ValueError(f"placement: {len(self.slot_expert)} slots do not split evenly over {self.n_ranks} ranks")
        held = set(self.slot_expert)
        if held != set(range(self.n_experts)):
            missing = sorted(set(range(self.n_experts)) - held)[:8]
            raise ValueError(f"placement: every expert needs at least one slot; missing {missing}")

    @property
    def slots_per_rank(self) -> int:
        return len(self.slot_expert) // self.n_ranks

    @property
    def n_slots(self) -> int:
        return len(self.slot_expert)

    @property
    def is_contiguous(self) -> bool:
        return self.slot_expert == tuple(range(self.n_experts))

    def local_experts(self, rank: int) -> list[int]:
        S = self.slots_per_rank
        return list(self.slot_expert[rank * S:(rank + 1) * S])

    def replicas(self) -> list[list[int]]:
        """For each logical expert, the global slots holding it (ascending)."""
        out: list[list[int]] = [[] for _ in range(self.n_experts)]
        for g, e in enumerate(self.slot_expert):
            out[e].append(g)
        return out

    def n_replicas(self) -> torch.Tensor:
        return torch.tensor([len(r) for r in self.replicas()])

    def replica_table(self) -> torch.Tensor:
        """[E, max_replicas] global slot ids, padded by repeating each expert's first slot."""
        reps = self.replicas()
        width = max(len(r) for r in reps)
        return torch.tensor([r + [r[0]] * (width - len(r)) for r in reps])

    def route(self, experts: torch.Tensor, src_rank: int) -> torch.Tensor:
        """experts [M] logical ids of this sender's token-slots -> [M] global slot ids."""
        if self.is_contiguous:
            return experts
        n_rep = self.n_replicas().to(experts.device)
        table = self.replica_table().to(experts.device)
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=self.n_experts)
        starts = counts.cumsum(0) - counts
        occ = torch.empty_like(experts)
        occ[order] = torch.arange(experts.numel(), device=experts.device) - starts[experts[order]]
        pick = (occ + src_rank) % n_rep[experts]
        return table[experts, pick]

    def rank_loads(self, loads: torch.Tensor) -> torch.Tensor:
        """Expected token-slots per rank when each expert's load [E] splits evenly over its replicas."""
        per_replica = loads.double() / self.n_replicas().double()
        slot_load = per_replica[torch.tensor(self.slot_expert)]
        return slot_load.view(self.n_ranks, self.slots_per_rank).sum(1)

    def to_dict(self) -> dict:
        return {"n_experts": self.n_experts, "n_ranks": self.n_ranks, "slot_expert": list(self.slot_expert)}

    @classmethod
    def from_dict(cls, d: dict) -> "Placement":
        return cls(int(d["n_experts"]), int(d["n_ranks"]), tuple(int(x) for x in d["slot_expert"]))


def contiguous_placement(n_experts: int, n_ranks: int) -> Placement:
    """Rank r holds experts r*E/R .. (r+1)*E/R - 1; E must divide by R."""
    if n_ranks < 1:
        raise ValueError(f"ep = {n_ranks} must be >= 1")
    if n_experts % n_ranks:
        raise ValueError(f"n_experts = {n_experts} is not divisible by ep = {n_ranks}: pick an ep that divides "
                         f"{n_experts}, or use a balanced placement with replication (slots_per_rank = "
                         f"{math.ceil(n_experts / n_ranks)} gives {n_ranks * math.ceil(n_experts / n_ranks) - n_experts} "
                         "redundant slots for hot experts)")
    return Placement(n_experts, n_ranks, tuple(range(n_experts)))


def balanced_placement(loads, n_ranks: int, slots_per_rank: int | None = None,
                       redundant: int | None = None) -> Placement:
    """EPLB-style placement from observed expert loads [E] (token-slots per expert).

    slots_per_rank: slots on each rank (default: ceil(E / R), plus `redundant` / R extra when given).
    """
    loads = torch.as_tensor(loads, dtype=torch.float64).flatten()
    E, R = loads.numel(), n_ranks
    if R < 1:
        raise ValueError(f"ep = {R} must be >= 1")
    if (loads < 0).any() or not torch.isfinite(loads).all():
        raise ValueError("expert loads must be finite and >= 0")
    if slots_per_rank is None:
        slots_per_rank = math.ceil(E / R) + math.ceil((redundant or 0) / R)
    if slots_per_rank * R < E:
        raise ValueError(f"{R} ranks x {slots_per_rank} slots = {slots_per_rank * R} < n_experts = {E}; "
                         f"give at least {math.ceil(E / R)} slots per rank")
    n_slots = slots_per_rank * R
    # 1. replicate: one redundant slot at a time to the expert with the heaviest load per replica
    count = [1] * E
    w = (loads + 1e-9).tolist()  # a tiny floor so that zero-load experts still order deterministically
    for _ in range(n_slots - E):
        e = max(range(E), key=lambda i: (w[i] / count[i], -i))
        count[e] += 1
    # 2. pack: heaviest replicas first, each to the lightest rank with a free slot (avoiding duplicates)
    replicas = sorted(((w[e] / count[e], e) for e in range(E) for _ in range(count[e])), key=lambda t: (-t[0], t[1]))
    rank_load = [0.0] * R
    rank_items: list[list[int]] = [[] for _ in range(R)]
    for load, e in replicas:
        free = [r for r in range(R) if len(rank_items[r]) < slots_per_rank]
        fresh = [r for r in free if e not in rank_items[r]] or free
        r = min(fresh, key=lambda i: (rank_load[i], i))
        rank_items[r].append(e)
        rank_load[r] += load
    return Placement(E, R, tuple(e for items in rank_items for e in items))


def zipf_loads(n_experts: int, s: float = 1.0) -> torch.Tensor:
    """Zipf(s) probabilities over experts [E] (expert 0 the hottest); a skewed routing distribution."""
    p = 1.0 / torch.arange(1, n_experts + 1, dtype=torch.float64) ** s
    return p / p.sum()


def max_over_mean(x: torch.Tensor) -> float:
    x = torch.as_tensor(x, dtype=torch.float64)
    return float(x.max() / x.mean()) if float(x.mean()) > 0 else float("nan")
