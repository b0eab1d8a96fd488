"""`k3 plan`: the four walls of a K3 configuration on a parallel layout and a GPU, what-ifs, a plot, and the
fewest GPUs that serve a request."""
from __future__ import annotations

import argparse
import json

from k3.cli_checks import output_png
from k3.model.cli import add_config_args, config_from_args


DEFAULT_CONTEXT = 1_048_576  # K3's native context


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def _bytes(x: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(x) >= div:
            return f"{x / div:,.2f} {unit}"
    return f"{x:,.0f} B"


def _time(s: float) -> str:
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:,.3f} ms"
    return f"{s * 1e6:,.2f} us"


def _flops(x: float) -> str:
    for unit, div in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= div:
            return f"{x / div:,.2f} {unit}"
    return f"{x:,.0f} FLOP"


def format_plan(r: dict) -> str:
    lay, hw, opt, mem, comm, comp, lat = (r[k] for k in ("layout", "hardware", "options", "memory", "communication",
                                                        "compute", "latency"))
    lines = [f"k3 plan: {r['config']} on {lay['gpus']} x {hw['name']} (tp={lay['tp']} ep={lay['ep']} pp={lay['pp']} "
             f"dp={lay['dp']}), {r['mode']}, context {opt['context']:,}, batch {opt['batch']}"
             + (f", {opt['micro_batches']} micro-batches ({opt.get('schedule', '1f1b')} schedule)"
                if r["mode"] == "train" else ""),
             f"per GPU of the fullest pipeline stage ({mem['stage']}); capacity {_gb(mem['capacity'])} "
             f"= {opt['mem_util']:.0%} of {hw['memory_gb']:g} GB; fits: {'yes' if r['fits'] else 'NO'}", ""]

    def row(name: str, value: str) -> None:
        lines.append(f"  {name:<44}{value:>22}")

    lines.append("memory")
    if r["mode"] == "train":
        row("weights (bf16 compute copy)", _gb(mem["weights"]))
        row(f"gradients ({opt['grad_dtype']})", _gb(mem["gradients"]))
        row(f"optimizer states + fp32 master ({opt['optimizer']}, ZeRO-{opt['zero']})", _gb(mem["optimizer_and_master"]))
        row("activations, no checkpointing", _gb(mem["activations_no_checkpointing"]))
        row("activations, per-sublayer checkpointing", _gb(mem["activations_checkpointing"]))
        row("total, no checkpointing", _gb(mem["total_no_checkpointing"]))
        row("total, checkpointing", _gb(mem["total"]))
    else:
        row(f"weights (experts {opt['expert_precision']}, rest {opt['dense_precision']})", _gb(mem["weights"]))
        row(f"MLA latent cache ({opt['cache_dtype']}, all tp ranks)", _gb(mem["mla_latent_cache"]))
        row("KDA states + conv tails (split over tp)", _gb(mem["kda_state_cache"]))
        row("cache per sequence on this GPU", _gb(mem["cache_per_sequence"]))
        row(f"prefill workspace (chunk {opt['prefill_chunk']})", _gb(mem["prefill_workspace"]))
        row("total", _gb(mem["total"]))
        bw = r["bandwidth"]
        lines += ["", "bandwidth (decode)"]
        d = bw["detail"]
        row("dense weights read per step", _bytes(d["weights_dense"]))
        row(f"routed experts touched ({d['expert_hit_fraction']:.1%} of local)", _bytes(d["weights_routed_touched"]))
        row("MLA latents read", _bytes(d["mla_latent"]))
        row("KDA states read + written", _bytes(d["kda_state_read_write"]))
        row("bytes read per decoded token", _bytes(bw["bytes_read_per_token"]))
        row("tokens/s bound (one replica, HBM)", f"{bw['tokens_per_s_bound']:,.1f}")
    lines += ["", "communication"]
    links = comm["links"]
    row("EP all-to-all bytes / token / MoE layer", _bytes(comm["a2a_bytes_per_token_per_moe_layer"]))
    if r["mode"] == "train":
        row(f"EP all-to-all per step ({links['ep']})", f"{_bytes(comm['ep_a2a_bytes_per_step'])}, {_time(comm['ep_a2a_s'])}")
        row(f"TP all-reduce per step ({links['tp']})", f"{_bytes(comm['tp_allreduce_bytes_per_step'])}, {_time(comm['tp_allreduce_s'])}")
        row(f"DP gradient reduction per step ({links['dp']})",
            f"{_bytes(comm['dp_grad_reduce_bytes_per_step'])}, {_time(comm['dp_grad_reduce_s'])}")
        row(f"PP per micro-batch ({links['pp']}), sources", f"{_bytes(comm['pp_bytes_per_microbatch'])}, {comm['pp_sources_at_boundary']}")
    else:
        row(f"EP all-to-all per decode step ({links['ep']})",
            f"{_bytes(comm['ep_a2a_bytes_per_decode_step'])}, {_time(comm['ep_a2a_s'])}")
        row(f"TP all-reduce per decode step ({links['tp']})",
            f"{_bytes(comm['tp_allreduce_bytes_per_decode_step'])}, {_time(comm['tp_allreduce_s'])}")
        row(f"PP per micro-batch ({links['pp']}), sources", f"{_bytes(comm['pp_bytes_per_microbatch'])}, {comm['pp_sources_at_boundary']}")
    row("  the same boundary with Full AttnRes", f"{_bytes(comm['pp_bytes_per_microbatch_full_attnres'])}, "
        f"{comm['pp_sources_at_boundary_full_attnres']}")
    lines += ["", "compute"]
    row("FLOPs per token, forward", _flops(comp["flops_per_token_forward"]))
    if r["mode"] == "train":
        row("FLOPs per token, backward", _flops(comp["flops_per_token_backward"]))
        row(f"step time at peak (bubble {comp['pipeline_bubble']:.1%})", _time(comp["step_time_s"]))
        lines += ["", "latency"]
        row("step time bound (overlap) / serial", f"{_time(lat['step_time_bound_s'])} / {_time(lat['step_time_serial_s'])}")
        row("tokens/s bound (all replicas)", f"{lat['tokens_per_s_bound']:,.0f}")
    else:
        row("decode compute time per step", _time(comp["decode_time_s"]))
        row(f"prefill FLOPs ({opt['context']:,} tokens, chunks of {opt['prefill_chunk']:,})", _flops(comp["prefill_flops"]))
        lines += ["", "latency"]
        row("decode per token, bound / serial", f"{_time(lat['decode_per_token_bound_s'])} / {_time(lat['decode_per_token_serial_s'])}")
        row("tokens/s bound (all replicas)", f"{lat['tokens_per_s_bound']:,.1f}")
        row("time to first token, bound / serial", f"{_time(lat['ttft_bound_s'])} / {_time(lat['ttft_serial_s'])}")
    return "\n".join(lines)


SHORT = {"memory_gb": "mem GB", "weights_gb": "weights GB", "a2a_bytes_per_token_per_layer": "a2a B/tok",
         "pp_bytes_per_microbatch": "pp B/mb", "flops_per_token_forward": "FLOP/tok", "cache_gb_per_sequence": "cache GB/seq",
         "bytes_read_per_token": "HBM B/tok", "comm_s_per_decode_step": "comm s/step", "decode_ms_per_token": "decode ms",
         "tokens_per_s": "tok/s", "ttft_s": "TTFT s", "activations_gb_checkpointing": "act GB",
         "comm_s_per_step": "comm s/step", "step_time_s": "step s"}


def format_what_ifs(w: dict) -> str:
    """One row per variant; under each what-if, its ratio to the base."""
    base = w["base"]
    keys = [k for k in base if k != "fits"]
    names = [n for n in w if n != "base"]
    lines = ["what-ifs: value per GPU (worst stage), and x base under it",
             f"{'':<15}" + "".join(f"{SHORT.get(k, k)[:11]:>12}" for k in keys),
             f"{'k3 (base)':<15}" + "".join(f"{base[k]:>12.4g}" for k in keys)]
    for n in names:
        if "error" in w[n]:
            lines.append(f"{n:<15}  {w[n]['error']}")
            continue
        h, ratio = w[n]["headline"], w[n]["ratio"]
        lines.append(f"{n:<15}" + "".join(f"{h[k]:>12.4g}" for k in keys))
        lines.append(f"{'':<15}" + "".join(
            f"{('x' + format(ratio[k], '.3g')) if ratio[k] is not None else '-':>12}" for k in keys))
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    from k3.plan.walls import Layout, Options, min_gpus_to_serve, plan
    from k3.plan.whatif import parse_what_ifs, what_ifs

    config = config_from_args(args)
    if args.stream_experts:
        return _cmd_stream(args, config)
    context = args.context if args.context is not None else min(DEFAULT_CONTEXT, config.max_context)
    options = Options(mode="train" if args.train else "serve", context=context, batch=args.batch,
                      micro_batches=args.micro_batches, expert_precision=args.expert_precision,
                      dense_precision=args.dense_precision, cache_dtype=args.cache_dtype, act_dtype=args.act_dtype,
                      a2a_dtype=args.a2a_dtype, optimizer=args.optimizer, zero=args.zero,
                      grad_dtype=args.grad_dtype, mem_util=args.mem_util, prefill_chunk=args.prefill_chunk,
                      schedule=args.schedule).check()
    if args.plot and args.train:
        raise ValueError("--plot draws the serving walls against context; drop --train to plot them")
    if args.min_gpus and args.train:
        raise ValueError("--min-gpus plans serving; drop --train")
    given = [f"--{k}" for k in ("tp", "ep", "pp", "dp") if getattr(args, k) is not None]
    if args.min_gpus and given:
        raise ValueError(f"--min-gpus chooses the layout itself; drop {' '.join(given)} "
                         "(or drop --min-gpus to plan that layout)")
    if args.plot:
        output_png("--plot", args.plot, "walls.png")
    names = parse_what_ifs(args.what_if) if args.what_if else []
    out: dict = {}
    if args.min_gpus:
        found = min_gpus_to_serve(config, args.hardware, options)
        layout = Layout(**{k: found["layout"][k] for k in ("tp", "ep", "pp", "dp")})
        out["min_gpus"] = {"gpus": found["gpus"], "layout": found["layout"]}
    else:
        layout = Layout(**{k: 1 if getattr(args, k) is None else getattr(args, k) for k in ("tp", "ep", "pp", "dp")})
    result = plan(config, args.hardware, layout, options)
    out["plan"] = result
    if names:
        out["what_if"] = what_ifs(config, args.hardware, layout, options, names)
    if args.plot:
        from k3.plan.plots import plot_walls

        out["plot"] = str(plot_walls(args.plot, config, args.hardware, layout, options, names, progress=not args.json))
    if args.json:
        print(json.dumps(out, indent=2, default=float))
        return 0
    if "min_gpus" in out:
        print(f"fewest {result['hardware']['name']} GPUs that hold {config.name} for {options.batch} x "
              f"{options.context:,} tokens: {out['min_gpus']['gpus']} (tp={layout.tp} ep={layout.ep} pp={layout.pp} dp={layout.dp})\n")
    print(format_plan(result))
    if names:
        print()
        print(format_what_ifs(out["what_if"]))
    if args.plot:
        print(f"\nplot: {out['plot']}")
    return 0


def _cmd_stream(args: argparse.Namespace, config) -> int:
    from k3.plan.stream import format_stream_plan, stream_plan

    if args.ram is None or args.disk_gbps is None:
        raise ValueError("--stream-experts plans one machine: give its --ram GB and --disk-gbps (a disk's read rate; "
                         "benchmarks/stream.py measures it)")
    r = stream_plan(config, args.ram, args.disk_gbps, args.mem_gbps, args.expert_gbps, args.dense_precision,
                    args.lookahead)
    print(json.dumps(r, indent=2) if args.json else format_stream_plan(r))
    return 0


def register(sub) -> None:
    p = sub.add_parser("plan", help="four walls (memory, bandwidth, communication, latency) of a layout on a GPU",
                       description="Per-GPU memory, decode bandwidth, communication, compute and latency bounds of a "
                                   "K3 configuration on a parallel layout, computed from the meta-instantiated model.")
    add_config_args(p, default="k3")
    p.add_argument("--hardware", default="h200", help="preset (h100, h200, b200, gb200-nvl72) or a FILE.yaml (default h200)")
    for k, h in (("tp", "tensor parallel"), ("ep", "expert parallel (divides tp x dp)"), ("pp", "pipeline stages"),
                 ("dp", "data-parallel replicas")):
        p.add_argument(f"--{k}", type=int, default=None, help=f"{h} size (default 1)")
    p.add_argument("--context", type=int, default=None,
                   help=f"tokens per sequence (default {DEFAULT_CONTEXT}, or the preset's max_context when smaller)")
    p.add_argument("--batch", type=int, default=1, help="sequences per replica (training: per micro-batch)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--serve", action="store_true", help="plan serving (the default)")
    mode.add_argument("--train", action="store_true", help="plan training")
    p.add_argument("--micro-batches", type=int, default=None, help="training: micro-batches per step (default 2 x pp)")
    p.add_argument("--expert-precision", default="mxfp4", help="routed experts' storage when serving (default mxfp4)")
    p.add_argument("--dense-precision", default="bf16", help="other matrices when serving (bf16, fp8, mxfp8)")
    p.add_argument("--cache-dtype", default="bf16", help="MLA latent cache dtype (default bf16)")
    p.add_argument("--act-dtype", default="bf16", help="activation dtype (default bf16)")
    p.add_argument("--a2a-dtype", default="bf16", help="all-to-all payload dtype (default bf16)")
    p.add_argument("--optimizer", default="muon", choices=["muon", "adamw"], help="training optimizer (default muon)")
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage over data parallel (default 1)")
    p.add_argument("--grad-dtype", default="fp32", help="gradient dtype (default fp32)")
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"],
                   help="training: pipeline schedule (default 1f1b; gpipe is what k3.parallel runs today and keeps "
                        "every micro-batch's activations)")
    p.add_argument("--mem-util", type=float, default=0.9, help="share of HBM a plan may fill (default 0.9)")
    p.add_argument("--prefill-chunk", type=int, default=8192, help="serving: tokens per prefill chunk (default 8192)")
    p.add_argument("--what-if", metavar="A,B,...", help="no-latentmoe,full-attention,all-kda,full-attnres,no-attnres,bf16-experts")
    p.add_argument("--min-gpus", action="store_true", help="serving: find the fewest GPUs that hold the request, plan that")
    p.add_argument("--plot", metavar="FILE.png", help="write each wall against context 1k..1M (with the what-ifs)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    st = p.add_argument_group("one machine, routed experts streamed from disk (docs/serving.md)")
    st.add_argument("--stream-experts", action="store_true",
                    help="plan serving with the routed experts read from disk through a RAM cache")
    st.add_argument("--ram", type=float, default=None, metavar="GB", help="the machine's RAM for the model")
    st.add_argument("--disk-gbps", type=float, default=None, help="disk read rate, GB/s")
    st.add_argument("--mem-gbps", type=float, default=16.0,
                    help="rate the trunk's matrices are applied at, GB/s of weights (default 16)")
    st.add_argument("--expert-gbps", type=float, default=0.2,
                    help="rate packed MXFP4 experts are dequantized and applied at, GB/s (default 0.2)")
    st.add_argument("--lookahead", type=float, default=0.5,
                    help="share of a layer's missed experts the lookahead router guesses (default 0.5)")
    p.set_defaults(func=cmd_plan)
