"""MoonEP on real local gloo ranks: forward and backward equal the single-process model (outputs, every
parameter's gradient, experts gathered back), with contiguous shards and with an EPLB placement whose
hot experts have replicas, and with QAT on (MX fake quant of each rank's own expert slots); replicas stay identical
through an optimizer step; payload bytes are counted.

QAT is compared over one SGD step, not AdamW training: AdamW turns float-rounding differences in near-zero
gradients into lr-sized steps, and after ~10 steps an MXFP8/MXFP4 value that sits on a rounding midpoint flips,
so fp32 weights drift apart by ~1e-4 while the gradients at the same state agree to ~1e-10."""
import pytest
import torch

from k3.config import get_config
from k3.model.transformer import K3Model
from k3.parallel.launch import run_local

TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _ep_check(rank, world, balanced, qat=False):
    import torch.distributed as dist

    from k3.parallel import comm
    from k3.parallel.expert import apply_expert_parallel, expert_modules, gather_experts, sync_expert_grads
    from k3.parallel.placement import balanced_placement

    cfg = get_config("tiny")
    if qat:  # K3's QAT: MXFP4 expert weights, MXFP8 expert inputs, fake-quantized on each rank's own slots
        cfg = cfg.replace(qat={"expert_weights": "mxfp4", "activations": "mxfp8"})
    torch.manual_seed(0)
    ref = K3Model(cfg)
    model = K3Model(cfg)
    model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    B, T = 2 * world, 8
    x = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    w = torch.randn(B, T, cfg.vocab_size, generator=g) / (B * T) ** 0.5
    out = ref(x)
    (out * w).sum().backward()

    placements = None
    if balanced:  # a skewed load: expert 0 hottest; one redundant slot per rank
        loads = torch.tensor([1.0 / (e + 1) for e in range(cfg.n_experts)])
        p = balanced_placement(loads, world, cfg.n_experts // world + 1)
        assert not p.is_contiguous and int(p.n_replicas().max()) > 1
        placements = {i: p for i in range(cfg.n_layers)}
    apply_expert_parallel(model, dist.group.WORLD, None, placements)
    comm.STATS.reset()
    rows = slice(2 * rank, 2 * rank + 2)
    o = model(x[rows])
    fwd = comm.STATS.snapshot()
    (o * w[rows]).sum().backward()
    for n, p in model.named_parameters():  # data-parallel sum for the replicated (non-expert) parameters
        if ".experts." not in n:
            comm.all_reduce(p.grad)
    sync_expert_grads(model)

    res = {"out": _rel(o, out[rows]), "grad": 0.0, "expert_grad": 0.0, "weights": 0.0}
    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if ".experts." not in n:
            res["grad"] = max(res["grad"], _rel(p.grad, refp[n].grad))
    moes = ref.moe_layers()
    for m, mr in zip(expert_modules(model), moes):
        full = [torch.empty(m.placement.n_slots, *getattr(m, k).shape[1:]) for k in ("w1", "w3", "w2")]
        for f, k in zip(full, ("w1", "w3", "w2")):
            comm.all_gather_single(f, getattr(m, k).grad.contiguous())
            rg = getattr(mr.experts, k).grad
            for slot, e in enumerate(m.placement.slot_expert):  # every replica holds the full gradient
                res["expert_grad"] = max(res["expert_grad"], _rel(f[slot], rg[e]))
    # one optimizer step on both: replicas must stay bitwise identical, and equal the reference's experts
    # (SGD: AdamW's first step is lr * sign(g), which turns rounding noise in near-zero gradients into lr)
    for mod in (model, ref):
        torch.optim.SGD(mod.parameters(), lr=1.0).step()
    for m, mr in zip(expert_modules(model), moes):
        for k in ("w1", "w3", "w2"):
            full = torch.empty(m.placement.n_slots, *getattr(m, k).shape[1:])
            comm.all_gather_single(full, getattr(m, k).detach().contiguous())
            for reps in m.placement.replicas():
                for s in reps[1:]:
                    assert torch.equal(full[s], full[reps[0]]), "replicas diverged"
        for a, b in zip(gather_experts(m), (mr.experts.w1, mr.experts.w3, mr.experts.w2)):
            res["weights"] = max(res["weights"], _rel(a, b.detach()))
    from k3.model.accounting import a2a_bytes_per_token

    tokens = 2 * T  # this rank's tokens; the planner predicts dispatch + combine bytes per token per MoE layer
    res["a2a_bytes"] = fwd["ep_dispatch"]["payload_bytes"] + fwd["ep_combine"]["payload_bytes"]
    res["a2a_predicted"] = len(moes) * tokens * a2a_bytes_per_token(cfg, dtype_bytes=4)
    res["dispatch_bytes"] = fwd["ep_dispatch"]["payload_bytes"]
    res["dispatch_expected"] = len(moes) * tokens * cfg.n_active_experts * cfg.latent_dim * 4
    res["dispatch_calls"] = fwd["ep_dispatch"]["calls"]
    res["recv_rows"] = sum(m.last_recv_rows for m in expert_modules(model))
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_ep_forward_backward_equal_single_process(world):
    results = run_local(_ep_run_both, world, timeout_s=150)
    for balanced in (False, True, "qat"):
        per_rank = [r[balanced] for r in results]
        for r in per_rank:
            assert r["out"] < TOL and r["grad"] < TOL and r["expert_grad"] < TOL, (world, balanced, r)
            assert r["weights"] < TOL, r
            assert r["dispatch_bytes"] == r["dispatch_expected"] and r["dispatch_calls"] == 3
        # combine returns what this rank computed, so only the sum over ranks matches the per-sender formula
        assert sum(r["a2a_bytes"] for r in per_rank) == sum(r["a2a_predicted"] for r in per_rank)
        idle = [r["idle"] for r in results]
        assert idle[0]["recv_rows"] == world * 12 and all(r["recv_rows"] == 0 for r in idle[1:])
        # relative errors, on gradients of order 1 (not a tolerance larger than the gradient itself)
        assert all(r["z_grad"] < 1e-5 and r["w1_grad"] < 1e-5 and r["z_grad_scale"] > 0.1 for r in idle), idle
        # every dispatched token-slot is computed somewhere exactly once
        cfg = get_config("tiny")
        assert sum(r["recv_rows"] for r in per_rank) == world * 2 * 8 * cfg.n_active_experts * 3


def _ep_run_both(rank, world):
    return {False: _ep_check(rank, world, False), True: _ep_check(rank, world, True),
            "qat": _ep_check(rank, world, True, qat=True), "idle": _idle_rank(rank, world)}


def _idle_rank(rank, world):
    """Every token routes to rank 0's experts: the other ranks receive nothing, yet must join the backward
    all-to-alls (a rank that skipped them would hang the group)."""
    import torch.distributed as dist

    from k3.model.moe import RoutedExperts
    from k3.parallel import comm
    from k3.parallel.expert import ExpertParallel, sync_expert_grads
    from k3.parallel.placement import contiguous_placement

    torch.manual_seed(0)
    ref = RoutedExperts(2 * world, 16, 24)
    with torch.no_grad():  # O(1) gradients: at the 0.02 init they were ~1e-6, below the absolute tolerance
        for w in (ref.w1, ref.w3, ref.w2):
            w.normal_(std=0.3)
    ep = ExpertParallel(ref, contiguous_placement(2 * world, world), dist.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    z = torch.randn(6, 16, generator=g, requires_grad=True)
    experts = torch.tensor([[0, 1]] * 6)
    weights = torch.rand(6, 2, generator=g)
    ep(z, weights, experts).square().sum().backward()
    z_ref = z.detach().clone().requires_grad_(True)
    ref(z_ref, weights, experts).square().sum().backward()
    sync_expert_grads(ep)
    err = float((z.grad - z_ref.grad).abs().max() / z_ref.grad.abs().max())
    full = torch.empty(2 * world, 16, 24)
    comm.all_gather_single(full, ep.w1.grad.contiguous())
    ref_sum = ref.w1.grad.clone()
    comm.all_reduce(ref_sum)  # the experts' gradient over every rank's tokens
    return {"recv_rows": ep.last_recv_rows, "z_grad": err,
            "w1_grad": float((full - ref_sum).abs().max() / ref_sum.abs().max()),
            "z_grad_scale": float(z_ref.grad.abs().max())}


def test_ep_rejects_experts_not_divisible_without_replication():
    from k3.parallel.placement import balanced_placement, contiguous_placement

    with pytest.raises(ValueError, match="not divisible by ep = 3"):
        contiguous_placement(8, 3)
    p = balanced_placement(torch.ones(8), 3)  # with redundant slots it is fine: 3 x 3 slots
    assert p.n_slots == 9 and sorted(set(p.slot_expert)) == list(range(8))


@pytest.mark.parametrize("qat", [None, ("mxfp4", "mxfp8")])
def test_ep_single_rank_equals_routed_experts(qat):
    """A world of one, in process (no process group): dispatch/compute/combine against RoutedExperts,
    also with QAT fake-quant of the expert weights and activations."""
    from k3.model.moe import RoutedExperts
    from k3.parallel.expert import ExpertParallel
    from k3.parallel.placement import balanced_placement, contiguous_placement

    torch.manual_seed(0)
    ex = RoutedExperts(8, 64, 96, 0.02, *(qat or (None, None)))
    z = torch.randn(10, 64)
    experts = torch.stack([torch.randperm(8)[:3] for _ in range(10)])
    weights = torch.rand(10, 3)
    ref = ex(z, weights, experts)
    for p in (contiguous_placement(8, 1), balanced_placement(torch.arange(8, 0, -1).float(), 1, 10)):
        ep = ExpertParallel(ex, p)
        assert float((ep(z, weights, experts) - ref).detach().abs().max()) <= 1e-6 * float(ref.detach().abs().max())
