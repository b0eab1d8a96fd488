"""MoE layer: the grouped expert path against the per-expert loop, and its share of the matmul peak.

    python benchmarks/moe.py [--json] [--quick] [--repeats N]

The layer is `k3.model.moe.MoE` at the mini widths (d_model 256, latent 128, 64 experts, top-8, expert
FFN 256, one shared expert of 512) on 4096 tokens. 'loop' is the common eager pattern: for each expert,
find its tokens, gather, run, index_add back. 'grouped' sorts the token-slots by expert once and runs all
experts as batched matmuls (the backend `auto` picks; every backend is timed too). Each repeat times the
two contenders back to back in alternating order; the speedup is the median of the per-repeat ratios, which
holds up better than a ratio of medians on a shared machine. `small_batches`: the routed experts' forward +
backward at mini's demo and training-benchmark step sizes (512 and 1024 tokens), the backend `auto` picks there
against the slices loop. GFLOP/s counts the layer's matmul FLOPs
(router, projections, routed and shared experts; backward = 2x forward) and is divided by the median
GFLOP/s of a 2048^2 fp32 matmul measured in the same process. Writes runs/bench/moe.json atomically.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from k3.config import get_config
from k3.model.moe import MoE, _grouped_backend
from k3.benchtools import bench_out, loadavg, machine, matmul_peak, paired, write_result, positive_int



def layer_flops(cfg, tokens: int) -> dict:
    """Forward matmul FLOPs of one MoE layer (elementwise work left out): the routed experts and the whole."""
    d, l, E, k = cfg.d_model, cfg.latent_dim, cfg.n_experts, cfg.n_active_experts
    routed = 3 * 2 * tokens * k * l * cfg.expert_ffn  # w1, w3, w2 on every token-slot
    rest = 2 * tokens * d * E  # router
    if cfg.moe == "latent":
        rest += 2 * 2 * tokens * d * l  # W_down, W_up
    rest += 3 * 2 * tokens * d * cfg.n_shared_experts * cfg.shared_ffn  # shared expert(s)
    return {"routed_experts": routed, "layer": routed + rest}


def _compare(make, flops: int, repeats: int) -> dict:
    """make(impl, backend) -> a callable; grouped (auto) vs loop, then each grouped backend vs loop."""
    out = {}
    for name, mult in (("forward", 1), ("forward_backward", 3)):
        p = paired(make(name, "grouped", "auto"), make(name, "loop", "auto"), repeats)
        res = {"grouped_median_ms": 1e3 * p["a_median_s"], "loop_median_ms": 1e3 * p["b_median_s"],
               "speedup_vs_loop": p["ratio_median"], "speedup_range": [p["ratio_min"], p["ratio_max"]],
               "grouped_gflops": mult * flops / p["a_median_s"] / 1e9,
               "loop_gflops": mult * flops / p["b_median_s"] / 1e9, "backends": {}}
        for backend in ("grouped_mm", "bmm", "slices"):
            if backend == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
                continue
            q = paired(make(name, "grouped", backend), make(name, "loop", "auto"), max(3, repeats // 2))
            res["backends"][backend] = {"median_ms": 1e3 * q["a_median_s"], "speedup_vs_loop": q["ratio_median"]}
        out[name] = res
    return out


def _routed_inputs(cfg, batch: int, seq: int) -> tuple:
    """A MoE layer (seed 0) and one step's inputs: x and its output gradient dy for the layer; the router's
    weights and experts, the latent tokens z and their output gradient dz for the routed experts alone."""
    torch.manual_seed(0)
    moe = MoE(cfg)
    tokens = batch * seq
    x = torch.randn(batch, seq, cfg.d_model)
    dy = torch.randn(batch, seq, cfg.d_model)
    with torch.no_grad():
        weights, experts = moe.router(x)
        z = moe.w_down(x.reshape(tokens, -1)) if moe.latent else x.reshape(tokens, -1)
    dz = torch.randn(tokens, cfg.latent_dim)
    return moe, x, dy, weights, experts, z, dz


def _experts_run(moe, z, weights, experts, dz, mode: str, impl: str, backend: str):
    """The routed experts alone, forward ('forward') or forward + backward, as one callable."""
    ex = moe.experts

    def run():
        ex.impl, ex.backend = impl, backend
        if mode == "forward":
            with torch.no_grad():
                ex(z, weights, experts)
            return
        for p in ex.parameters():
            p.grad = None
        ex(z.detach().requires_grad_(), weights, experts).backward(dz)
    return run


def bench(cfg, batch: int, seq: int, repeats: int) -> dict:
    moe, x, dy, weights, experts, z, dz = _routed_inputs(cfg, batch, seq)
    tokens = batch * seq

    def make_layer(mode, impl, backend):
        def run():
            moe.impl, moe.experts.backend = impl, backend
            if mode == "forward":
                with torch.no_grad():
                    moe(x)
                return
            for p in moe.parameters():
                p.grad = None
            moe(x.detach().requires_grad_()).backward(dy)
        return run

    def make_experts(mode, impl, backend):
        return _experts_run(moe, z, weights, experts, dz, mode, impl, backend)

    load = moe.router.last_load.float()
    flops = layer_flops(cfg, tokens)
    return {
        "tokens": tokens, "batch": batch, "seq": seq,
        "auto_backend": _grouped_backend(z.new_zeros(tokens * cfg.n_active_experts, z.shape[-1]), moe.router.last_load,
                                         moe.experts.w1, moe.experts.w2),
        "load_max_over_mean": (load.max() / load.mean()).item(),
        "forward_flops": flops,
        "layer": _compare(make_layer, flops["layer"], repeats),
        "routed_experts_only": _compare(make_experts, flops["routed_experts"], repeats),
    }


def small_batches(cfg, repeats: int) -> dict:
    """The routed experts' fwd+bwd at small token counts (mini's demo step, 4 x 128 tokens, and training benchmark
    step, 8 x 128): the CPU backend the layer picks (`_grouped_backend`) against the slices loop, side by side."""
    out = {}
    for batch, seq in ((4, 128), (8, 128)):
        moe, _, _, weights, experts, z, dz = _routed_inputs(cfg, batch, seq)
        picked = _grouped_backend(z.new_zeros(batch * seq * cfg.n_active_experts, z.shape[-1]), moe.router.last_load,
                                  moe.experts.w1, moe.experts.w2)
        p = paired(*(_experts_run(moe, z, weights, experts, dz, "forward_backward", "grouped", b)
                     for b in ("auto", "slices")), max(5, repeats))
        out[f"tokens_{batch * seq}"] = {"auto_backend": picked, "auto_median_ms": 1e3 * p["a_median_s"],
                                        "slices_median_ms": 1e3 * p["b_median_s"],
                                        "speedup_auto_vs_slices": p["ratio_median"],
                                        "speedup_range": [p["ratio_min"], p["ratio_max"]]}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="small shapes (512 tokens), few repeats")
    ap.add_argument("--repeats", type=positive_int, default=None)
    ap.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 7)
    cfg = get_config("mini")
    batch, seq = (1, 512) if args.quick else (4, 1024)
    info = machine()
    peak_before = matmul_peak(repeats)
    res = bench(cfg, batch, seq, repeats)
    res["small_batches"] = small_batches(cfg, repeats)
    peak_after = matmul_peak(repeats)
    peak = statistics.median([peak_before["median_gflops"], peak_after["median_gflops"]])
    info["loadavg_1m_end"] = loadavg()
    for part in ("layer", "routed_experts_only"):
        for name in ("forward", "forward_backward"):
            r = res[part][name]
            r["fraction_of_matmul_peak"] = r["grouped_gflops"] / peak
    result = {
        "benchmark": "moe",
        "quick": args.quick,
        "shapes": {"d_model": cfg.d_model, "latent_dim": cfg.latent_dim, "n_experts": cfg.n_experts,
                   "top_k": cfg.n_active_experts, "expert_ffn": cfg.expert_ffn, "shared_ffn": cfg.shared_ffn,
                   "n_shared_experts": cfg.n_shared_experts, "tokens": batch * seq, "dtype": "float32"},
        "repeats": repeats,
        "matmul_peak_gflops": peak,
        "matmul_peak_runs": [peak_before, peak_after],
        # headline figures: the whole layer, one training step (forward + backward)
        "speedup_vs_loop": res["layer"]["forward_backward"]["speedup_vs_loop"],
        "fraction_of_matmul_peak": res["layer"]["forward_backward"]["fraction_of_matmul_peak"],
        **res,
        "machine": info,
    }
    out_path = write_result(bench_out("moe", args.quick), result, args.json)
    if not args.json:
        for part in ("layer", "routed_experts_only"):
            for name in ("forward", "forward_backward"):
                r = res[part][name]
                print(f"{part:19s} {name:16s} grouped {r['grouped_median_ms']:8.1f} ms  loop "
                      f"{r['loop_median_ms']:8.1f} ms  speedup {r['speedup_vs_loop']:.2f}x  "
                      f"{r['grouped_gflops']:.1f} GFLOP/s = {r['fraction_of_matmul_peak']:.2f} of the "
                      f"{peak:.1f} GFLOP/s matmul peak")
        print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
