"""Expert placement (contiguous and EPLB-style balanced), replica routing, mesh factoring and stage splits:
pure functions, no processes."""
import pytest
import torch

from k3.parallel.mesh import ParallelDims
from k3.parallel.pipeline import stage_layers
from k3.parallel.placement import (Placement, balanced_placement, contiguous_placement, max_over_mean,
                                   zipf_loads)


def test_contiguous_placement_and_its_errors():
    p = contiguous_placement(8, 4)
    assert p.is_contiguous and p.slots_per_rank == 2 and p.local_experts(3) == [6, 7]
    with pytest.raises(ValueError, match="not divisible by ep = 3"):
        contiguous_placement(8, 3)
    with pytest.raises(ValueError, match="every expert needs at least one slot"):
        Placement(4, 2, (0, 1, 2, 2))
    with pytest.raises(ValueError, match="slots"):
        balanced_placement(torch.ones(8), 4, slots_per_rank=1)


@pytest.mark.parametrize("E,R,extra", [(64, 4, 1), (64, 8, 2), (896, 64, 1)])
def test_balanced_placement_flattens_zipf(E, R, extra):
    loads = zipf_loads(E, 1.0) * 10_000
    before = max_over_mean(contiguous_placement(E, R).rank_loads(loads))
    p = balanced_placement(loads, R, E // R + extra)
    after = max_over_mean(p.rank_loads(loads))
    assert before > 2.0 and after <= 1.1, (before, after)
    assert p.n_slots == R * (E // R + extra)
    reps = p.replicas()
    assert len(reps[0]) > 1  # the hottest expert is replicated ...
    assert all(len({g // p.slots_per_rank for g in r}) == len(r) for r in reps)  # ... on distinct ranks
    # the greedy replication never gives a colder expert more replicas than a hotter one
    n = p.n_replicas()
    assert all(n[i] >= n[i + 1] for i in range(E - 1))


def test_balanced_placement_is_the_brute_force_optimum_on_a_small_case():
    """Greedy EPLB against an exhaustive search: 4 experts, 2 ranks x 3 slots."""
    import itertools

    loads = torch.tensor([8.0, 4.0, 2.0, 1.0])
    p = balanced_placement(loads, 2, 3)
    got = float(p.rank_loads(loads).max())
    best = float("inf")
    for slots in itertools.product(range(4), repeat=6):
        if set(slots) != {0, 1, 2, 3}:
            continue
        best = min(best, float(Placement(4, 2, slots).rank_loads(loads).max()))
    assert got <= best * 1.1, (got, best)


def test_route_splits_an_experts_tokens_evenly_over_its_replicas():
    p = Placement(3, 3, (0, 1, 0, 2, 0, 0))  # expert 0 has 4 replicas, on ranks 0, 1, 2, 2
    experts = torch.tensor([0] * 400 + [1] * 10 + [2] * 7)[torch.randperm(417)]
    for src in range(3):
        slots = p.route(experts, src)
        assert torch.equal(torch.tensor(p.slot_expert)[slots], experts)  # always a replica of the right expert
        counts = torch.bincount(slots, minlength=6)
        assert counts[[0, 2, 4, 5]].tolist() == [100, 100, 100, 100]
    # a short run of one expert starts at a different replica on each sender
    firsts = {int(p.route(torch.tensor([0]), src)) for src in range(3)}
    assert len(firsts) == 3


def test_world_size_that_does_not_factor_is_refused():
    ParallelDims(8, ep=4, fsdp=2, pp=2)
    with pytest.raises(ValueError, match="does not factor"):
        ParallelDims(6, ep=4)
    with pytest.raises(ValueError, match="pp = 4 does not divide"):
        ParallelDims(6, pp=4)
    with pytest.raises(ValueError, match="fsdp = 3"):
        ParallelDims(4, fsdp=3)
    with pytest.raises(ValueError, match="ep"):
        ParallelDims(4, ep=0)
    d = ParallelDims(8, ep=2, fsdp=4)
    assert (d.dp, d.edp, d.fsdp_size) == (8, 4, 4)


def test_stage_layers():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert [len(r) for r in stage_layers(93, 8)] == [12, 12, 12, 12, 12, 11, 11, 11]
    with pytest.raises(ValueError, match="cannot split"):
        stage_layers(4, 5)
