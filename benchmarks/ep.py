"""MoonEP traffic: all-to-all bytes of LatentMoE vs standard MoE, EPLB-style load smoothing on Zipf routing,
and the bytes between pipeline stages for Block vs Full AttnRes. Everything is measured on local gloo ranks.

    python benchmarks/ep.py [--json] [--quick] [--repeats N]

1. payload: the `mini` model (d_model 256, 64 experts, top-8) with moe=latent (latent 128) and moe=standard
   (payload d_model), EP over 2 ranks, forward + backward of the same batch; bytes are read from the one
   instrumented wrapper (k3.parallel.comm) under the tags ep_dispatch / ep_combine (forward) and their _grad
   twins (backward). Reported per token per MoE layer, per rank (median over ranks and repeats).
   `latent_payload_ratio` = latent / standard forward bytes per token per MoE layer; each is also compared
   with k3.model.accounting.a2a_bytes_per_token (the planner's prediction, at 4 bytes per fp32 element).
2. load skew: one ExpertParallel layer (64 experts, top-8, latent 128) over 4 ranks fed with routing drawn
   from Zipf(s) over the experts (k distinct experts per token). Batch A's observed loads build a balanced
   placement (2 redundant slots per rank); batch B, drawn afresh, is dispatched with the contiguous and the
   balanced placement; the tokens each rank actually received give max/mean before and after. Zipf's hot experts
   have the lowest ids, so contiguous shards are the worst case; the same batch is also dispatched with the
   experts in one random order (`shuffled`), and the expected max/mean over 200 random orders (from batch A's
   loads) gives the typical case.
3. pipeline: tiny split into 2 stages (send/recv of the AttnRes sources); payload bytes per micro-batch
   for attnres block and full; `block_over_full_stage_bytes` against the sources ratio
   k3.model.accounting.pipeline_sources predicts, plus the predicted ratios for the k3 preset.
4. trajectory: tiny trained 20 steps on the standard-library corpus by the single-process Trainer and by
   2 ranks (FSDP2 + EP 2), in fp32 and in fp64; max |loss difference| per step.
Writes runs/bench/ep.json atomically.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3.config import get_config
from k3.benchtools import bench_out, loadavg, machine, write_result, positive_int



# ---------------------------------------------------------------------- 1. payload
def _payload(rank, world, repeats, batch, seq):
    import torch.distributed as dist
    import torch.nn.functional as F

    from k3.model.accounting import a2a_bytes_per_token
    from k3.model.transformer import K3Model
    from k3.parallel import comm
    from k3.parallel.expert import apply_expert_parallel

    out = {}
    for moe in ("latent", "standard"):
        cfg = get_config("mini", moe=moe)
        torch.manual_seed(0)
        model = K3Model(cfg)
        apply_expert_parallel(model, dist.group.WORLD)
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        n_moe = len(model.moe_layers())
        rows, times = [], []
        for r in range(repeats + 1):  # the first is a warm-up
            comm.STATS.reset()
            t0 = time.perf_counter()
            with comm.tagged("fwd"):
                logits = model(x)
            with comm.tagged("bwd"):
                F.cross_entropy(logits.reshape(-1, cfg.vocab_size), x.reshape(-1)).backward()
            dt = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            s = comm.STATS.snapshot()
            if r == 0:
                continue
            tok = batch * seq * n_moe

            def per_tok(tags, field="payload_bytes"):
                return sum(s.get(t, {}).get(field, 0) for t in tags) / tok

            rows.append({
                "fwd_payload": per_tok(["fwd/ep_dispatch", "fwd/ep_combine"]),
                "fwd_remote": per_tok(["fwd/ep_dispatch", "fwd/ep_combine"], "remote_bytes"),
                "bwd_payload": per_tok(["bwd/ep_combine_grad", "bwd/ep_dispatch_grad"]),
                "counts_bytes": per_tok(["fwd/ep_counts"]),
            })
            times.append(dt)
        out[moe] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out[moe]["fwd_bwd_s"] = statistics.median(times)
        out[moe]["predicted_fwd_payload"] = a2a_bytes_per_token(cfg, dtype_bytes=4)
        out[moe].update(dispatch_dim=cfg.latent_dim, d_model=cfg.d_model, top_k=cfg.n_active_experts,
                        moe_layers=n_moe, tokens_per_rank=batch * seq)
    return out


# ---------------------------------------------------------------------- 2. load skew
def _skew(rank, world, n_experts, top_k, dim, tokens, zipf_s, redundant_per_rank):
    import torch.distributed as dist

    from k3.model.moe import RoutedExperts
    from k3.parallel import comm
    from k3.parallel.expert import ExpertParallel
    from k3.parallel.placement import (Placement, balanced_placement, contiguous_placement, max_over_mean,
                                       zipf_loads)

    torch.manual_seed(0)
    experts = RoutedExperts(n_experts, dim, 2 * dim)
    p = zipf_loads(n_experts, zipf_s).float()

    def draw(seed):
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        idx = torch.multinomial(p.expand(tokens, n_experts), top_k, replacement=False, generator=g)
        return torch.randn(tokens, dim, generator=g), torch.rand(tokens, top_k, generator=g), idx

    _, _, seen = draw(1)  # batch A: the observed loads
    loads = torch.bincount(seen.flatten(), minlength=n_experts).double()
    comm.all_reduce(loads)
    balanced = balanced_placement(loads, world, n_experts // world + redundant_per_rank)
    z, w, idx = draw(2)  # batch B: measured
    out = {}
    # Zipf popularity is sorted by expert id, so contiguous shards are the worst case (the hottest experts all on
    # rank 0); experts in a random order over the ranks (one seeded permutation) is the typical case
    perm = torch.randperm(n_experts, generator=torch.Generator().manual_seed(0))
    shuffled = Placement(n_experts, world, tuple(perm.tolist()))
    out["shuffled_order"] = perm.tolist()
    orders = [Placement(n_experts, world, tuple(torch.randperm(n_experts, generator=torch.Generator().manual_seed(s))
                                                .tolist())) for s in range(200)]
    out["shuffled_expected_over_200_orders"] = sorted(max_over_mean(o.rank_loads(loads)) for o in orders)
    for name, placement in (("before", contiguous_placement(n_experts, world)), ("shuffled", shuffled),
                            ("after", balanced)):
        ep = ExpertParallel(experts, placement, dist.group.WORLD)
        with torch.no_grad():
            ep(z, w, idx)
        received = torch.tensor([float(ep.last_recv_rows)])
        allr = torch.zeros(world)
        comm.all_gather_single(allr, received)
        out[name] = allr.tolist()
    out["expected_after"] = balanced.rank_loads(loads).tolist()
    out["placement"] = balanced.to_dict()
    out["hot_expert_replicas"] = int(balanced.n_replicas()[0])
    return out


# ---------------------------------------------------------------------- 3. pipeline
def _stages(rank, world, micro, batch, seq):
    from k3.model.transformer import K3Model
    from k3.parallel import comm
    from k3.model.accounting import pipeline_sources
    from k3.parallel.pipeline import PipelineStage, run_gpipe

    out = {}
    for a in ("block", "full"):
        cfg = get_config("tiny", attnres=a)
        torch.manual_seed(0)
        model = K3Model(cfg)
        g = torch.Generator().manual_seed(3)
        xs = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g) for _ in range(micro)]
        stage = PipelineStage(model, rank, world)
        comm.STATS.reset()
        run_gpipe(stage, xs, xs)
        s = comm.STATS.snapshot()
        out[a] = {"bytes_per_micro": s.get("pp_activations", {}).get("payload_bytes", 0) / micro,
                  "grad_bytes_per_micro": s.get("pp_grads", {}).get("payload_bytes", 0) / micro,
                  "header_bytes_per_micro": s.get("pp_header", {}).get("payload_bytes", 0) / micro,
                  "predicted_sources": pipeline_sources(model, len(stage.layers)) if stage.first else None}
    return out


# ---------------------------------------------------------------------- 4. loss trajectory
TRAJ = dict(steps=20, batch_size=4, seq_len=32, warmup_steps=2, measure_mfu=False, record_attnres=False)


def _traj_rank(rank, world, data_dir, dtype):
    from k3.data import load_data
    from k3.parallel.mesh import ParallelDims, build_context
    from k3.parallel.train import ParallelTrainer
    from k3.train.trainer import TrainConfig

    torch.set_default_dtype(getattr(torch, dtype))
    ctx = build_context(ParallelDims(world, ep=world))
    t = ParallelTrainer(get_config("tiny"), TrainConfig(**TRAJ), load_data(data_dir).train, ctx)
    return t.fit().losses


def trajectory(data_dir: str) -> dict:
    """Loss per step: 2-rank FSDP2 + EP against the single-process Trainer, in fp32 and in fp64."""
    from k3.data import load_data
    from k3.parallel.launch import run_local
    from k3.train.trainer import TrainConfig, Trainer

    out = {}
    for dtype in ("float32", "float64"):
        torch.set_default_dtype(getattr(torch, dtype))
        try:
            ref = Trainer(get_config("tiny"), TrainConfig(**TRAJ), load_data(data_dir).train, None).fit().losses
        finally:
            torch.set_default_dtype(torch.float32)
        dist_losses = run_local(_traj_rank, 2, data_dir, dtype, timeout_s=600)[0]
        diff = [abs(a - b) for a, b in zip(dist_losses, ref)]
        out[dtype] = {"max_abs_diff": max(diff), "max_abs_diff_first_8": max(diff[:8]),
                      "abs_diff_per_step": diff, "single_process": ref, "two_ranks": dist_losses}
    return out


def predicted_stage_ratios(name: str, n_stages: int) -> list[dict]:
    """Per stage boundary of preset `name`: sources that cross for block and full AttnRes (meta device)."""
    from k3.model.accounting import build_meta, pipeline_sources
    from k3.parallel.pipeline import stage_layers

    cfg = get_config(name)
    block, full = build_meta(cfg.replace(attnres="block")), build_meta(cfg.replace(attnres="full"))
    rows = []
    for r in stage_layers(cfg.n_layers, n_stages)[1:]:
        b, f = pipeline_sources(block, r.start), pipeline_sources(full, r.start)
        rows.append({"first_layer": r.start, "block_sources": b, "full_sources": f, "ratio": b / f})
    return rows


def main(argv=None) -> dict:
    from k3.parallel.launch import run_local
    from k3.parallel.placement import max_over_mean

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats, for smoke tests")
    ap.add_argument("--repeats", type=positive_int, default=None)
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the skewed routing (default 1.0)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    repeats = args.repeats or (1 if args.quick else 3)
    batch, seq = (1, 32) if args.quick else (2, 64)
    machine_before = machine(backend="gloo (local processes)")

    pay = run_local(_payload, 2, repeats, batch, seq, timeout_s=600)
    lat = {k: statistics.median(r["latent"][k] for r in pay) for k in ("fwd_payload", "fwd_remote", "bwd_payload")}
    std = {k: statistics.median(r["standard"][k] for r in pay) for k in ("fwd_payload", "fwd_remote", "bwd_payload")}

    skew_cfg = dict(n_experts=64, top_k=8, dim=128, tokens=512 if args.quick else 2048, zipf_s=args.zipf,
                    redundant_per_rank=2)
    sk = run_local(_skew, 4, *skew_cfg.values(), timeout_s=600)[0]

    micro = 2
    st_ranks = run_local(_stages, 2, micro, 2, 16, timeout_s=600)
    st = st_ranks[0]  # stage 0 sends the sources; stage 1 sends their gradients back
    for a in ("block", "full"):
        st[a]["grad_bytes_per_micro"] = st_ranks[1][a]["grad_bytes_per_micro"]
    pred = st["block"]["predicted_sources"] / st["full"]["predicted_sources"]

    import tempfile

    from k3.data import prepare_data

    with tempfile.TemporaryDirectory(prefix="k3-ep-bench-") as d:
        prepare_data(d, vocab_size=512, max_bytes=300_000)  # the standard-library corpus, a 512-token BPE
        traj = trajectory(d)

    result = {
        "benchmark": "ep",
        "quick": args.quick,
        "latent_payload_ratio": lat["fwd_payload"] / std["fwd_payload"],
        "latent_payload_ratio_remote": lat["fwd_remote"] / std["fwd_remote"],
        "latent_payload_ratio_backward": lat["bwd_payload"] / std["bwd_payload"],
        "design_payload_ratio": get_config("mini").latent_dim / get_config("mini").d_model,
        "bytes_per_token_per_moe_layer": {
            "latent": {"forward": lat["fwd_payload"], "forward_remote": lat["fwd_remote"],
                       "backward": lat["bwd_payload"]},
            "standard": {"forward": std["fwd_payload"], "forward_remote": std["fwd_remote"],
                         "backward": std["bwd_payload"]},
            "formula": "forward = 2 (dispatch + combine) x top_k x dispatch_dim x 4 bytes (fp32)",
            "predicted_forward": {m: pay[0][m]["predicted_fwd_payload"] for m in ("latent", "standard")},
        },
        "payload_run": {"model": "mini", "ep": 2, "batch_per_rank": [batch, seq], "repeats": repeats,
                        "per_rank": pay},
        "rank_load_max_over_mean_before": max_over_mean(torch.tensor(sk["before"])),
        "rank_load_max_over_mean_shuffled": max_over_mean(torch.tensor(sk["shuffled"])),
        "rank_load_max_over_mean_random_order_median":
            statistics.median(sk["shuffled_expected_over_200_orders"]),
        "rank_load_max_over_mean_random_order_p90":
            sk["shuffled_expected_over_200_orders"][int(0.9 * len(sk["shuffled_expected_over_200_orders"]))],
        "rank_load_max_over_mean_after": max_over_mean(torch.tensor(sk["after"])),
        "rank_load_max_over_mean_after_expected": max_over_mean(torch.tensor(sk["expected_after"])),
        "skew_run": {**skew_cfg, "ep": 4, "tokens_per_rank_before": sk["before"],
                     "tokens_per_rank_after": sk["after"], "tokens_per_rank_shuffled": sk["shuffled"],
                     "shuffled_order": sk["shuffled_order"], "hot_expert_replicas": sk["hot_expert_replicas"],
                     "placement": sk["placement"]},
        "block_over_full_stage_bytes": st["block"]["bytes_per_micro"] / st["full"]["bytes_per_micro"],
        "block_over_full_stage_sources_predicted": pred,
        "stage_run": {"model": "tiny", "stages": 2, "micro_batches": micro, "micro_batch": [2, 16], **st},
        "k3_predicted_stage_sources": {f"pp{n}": predicted_stage_ratios("k3", n) for n in (2, 8)},
        "trajectory_fp32_max_abs_diff": traj["float32"]["max_abs_diff"],
        "trajectory_fp64_max_abs_diff": traj["float64"]["max_abs_diff"],
        "trajectory_run": {"model": "tiny", "ranks": 2, "ep": 2, "fsdp": 2, **TRAJ, **traj},
        "definitions": {
            "latent_payload_ratio": "forward all-to-all payload bytes per token per MoE layer (dispatch + "
                                    "combine, as handed to all_to_all_single), LatentMoE / standard MoE, same "
                                    "d_model and top-k; median over ranks and repeats",
            "rank_load_max_over_mean": "token-slots received per EP rank (measured in the dispatch), max / mean",
            "block_over_full_stage_bytes": "activation bytes sent from stage 0 to stage 1 per micro-batch, "
                                           "attnres block / attnres full",
            "trajectory_*_max_abs_diff": "max over 20 steps of |train loss, 2 ranks (FSDP2 + EP) - train loss, "
                                         "single-process Trainer| on the same global batches",
        },
        "machine": machine_before,
        "loadavg_1m_after": loadavg(),
    }
    out_path = write_result(bench_out("ep", args.quick), result, args.json)
    if not args.json:
        print(f"bytes/token/MoE layer (forward): latent {lat['fwd_payload']:.0f}, standard {std['fwd_payload']:.0f} "
              f"-> latent_payload_ratio {result['latent_payload_ratio']:.3f} (design {result['design_payload_ratio']})")
        print(f"rank load max/mean on Zipf({args.zipf}): before {result['rank_load_max_over_mean_before']:.3f}, "
              f"after {result['rank_load_max_over_mean_after']:.3f}")
        print(f"stage bytes block/full: {result['block_over_full_stage_bytes']:.3f} (predicted {pred:.3f})")
        print(f"2-rank vs single-process loss, max |diff| over 20 steps: fp32 "
              f"{result['trajectory_fp32_max_abs_diff']:.2e}, fp64 {result['trajectory_fp64_max_abs_diff']:.2e}")
        print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
