"""The four walls of one K3 configuration on one parallel layout: memory, bandwidth, communication, latency
(and the compute bound under them), per GPU.

Every size comes from the meta-instantiated model through `k3.model.accounting`; this module only places them
on a layout (GPUs = tp x dp x pp, tensor parallel innermost; the routed experts over ep of a stage's tp x dp
GPUs) and divides by the hardware's rates. All times are bounds from peak rates: `bound` = the largest of the
compute, memory-traffic and communication times (perfect overlap), `serial` = their sum (no overlap). What each
rank holds and which links a group uses: docs/planner.md, "How a layout is placed".
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

from k3.config import K3Config, divisors
from k3.model import accounting as acc
from k3.plan.hardware import Hardware, load_hardware

MODES = ("serve", "train")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Options:
    """What is planned and in which formats. `batch`: sequences per data-parallel replica (serving: served
    at once; training: per micro-batch). `micro_batches`: per optimizer step (training; default 2 x pp)."""

    mode: str = "serve"
    context: int = 1048576
    batch: int = 1
    micro_batches: int | None = None
    expert_precision: str = "mxfp4"
    dense_precision: str = "bf16"
    cache_dtype: str = "bf16"
    act_dtype: str = "bf16"
    a2a_dtype: str = "bf16"
    optimizer: str = "muon"
    zero: int = 1
    grad_dtype: str = "fp32"
    mem_util: float = 0.9
    prefill_chunk: int = 8192
    # pipeline schedule (training): 1f1b keeps pp - s micro-batches' activations on stage s; gpipe, what
    # k3.parallel runs today, keeps all of them until the backward
    schedule: str = "1f1b"

    def check(self) -> "Options":
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is unknown; use one of {list(MODES)}")
        if not isinstance(self.context, int) or self.context <= 0:
            raise ValueError(f"context = {self.context!r} must be a positive number of tokens, e.g. 1048576")
        if not isinstance(self.batch, int) or self.batch <= 0:
            raise ValueError(f"batch = {self.batch!r} must be a positive number of sequences")
        if self.micro_batches is not None and self.micro_batches <= 0:
            raise ValueError(f"micro_batches = {self.micro_batches} must be positive")
        for name in ("expert_precision", "dense_precision"):
            acc.check_format(getattr(self, name), name.replace("_", " "))
        for name in ("cache_dtype", "act_dtype", "a2a_dtype", "grad_dtype"):
            v = getattr(self, name)
            if v not in acc.DTYPE_BYTES:
                raise ValueError(f"{name.replace('_', ' ')} {v!r} is unknown; use one of {list(acc.DTYPE_BYTES)}")
        if self.optimizer not in ("muon", "adamw"):
            raise ValueError(f"optimizer {self.optimizer!r} is unknown; use muon or adamw")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero = {self.zero} is unknown; use 0 (none), 1 (optimizer states), 2 (+ gradients), 3 (+ weights)")
        if not 0 < self.mem_util <= 1:
            raise ValueError(f"mem_util = {self.mem_util} must be in (0, 1]: the share of HBM the plan may fill")
        if self.prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk = {self.prefill_chunk} must be positive")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"schedule {self.schedule!r} is unknown; use 1f1b or gpipe (what k3.parallel runs)")
        return self


# ---------------------------------------------------------------------------------------------- model cache
@functools.lru_cache(maxsize=32)
def _meta(config_json: str):
    return acc.build_meta(K3Config.from_dict(__import__("json").loads(config_json)))


def meta_model(config: K3Config):
    """The meta model of a config (cached: the planner evaluates the same config at many contexts)."""
    return _meta(config.to_json())


# ---------------------------------------------------------------------------------------------- layout


def tp_split_dims(config: K3Config) -> dict[str, int]:
    """The sizes tensor parallelism splits; tp must divide each."""
    dims = {"vocab_size": config.vocab_size}
    if config.n_kda_layers:
        dims["kda_heads"] = config.kda_heads
    if config.n_mla_layers:
        dims["mla_heads"] = config.mla_heads
    if config.n_dense_layers:
        dims["dense_ffn"] = config.dense_ffn
    if config.n_dense_layers < config.n_layers:
        if config.n_shared_experts:
            dims["shared experts width"] = config.n_shared_experts * config.shared_ffn
        if config.moe == "latent":
            dims["moe_latent_dim"] = config.moe_latent_dim
    return dims


def _check_context(config: K3Config, options: Options) -> None:
    if options.context > config.max_context:
        raise ValueError(f"context = {options.context} exceeds {config.name}'s max_context = {config.max_context}; "
                         f"plan a context of at most {config.max_context}")


def check_layout(config: K3Config, layout: Layout) -> None:
    """Raise ValueError naming what does not divide and listing the sizes that would fit."""
    for k in ("tp", "ep", "pp", "dp"):
        v = getattr(layout, k)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"--{k} = {v!r} must be a positive integer")
    problems = []
    dims = tp_split_dims(config)
    bad = {k: v for k, v in dims.items() if v % layout.tp}
    if bad:
        fit = divisors(math.gcd(*dims.values()))
        problems.append(f"tp = {layout.tp} does not divide {', '.join(f'{k} = {v}' for k, v in bad.items())}; "
                        f"tensor-parallel sizes that fit: {', '.join(map(str, fit))}")
    has_moe = config.n_dense_layers < config.n_layers
    # ep must divide both the experts and the tp x dp GPUs of a stage (which spread the experts); the sizes
    # offered satisfy both, so following the advice never meets the other condition
    fit = [e for e in divisors(layout.tp * layout.dp) if not has_moe or config.n_experts % e == 0]
    if has_moe and config.n_experts % layout.ep:
        problems.append(f"ep = {layout.ep} does not divide n_experts = {config.n_experts}; with tp x dp = "
                        f"{layout.tp * layout.dp} GPUs per stage, expert-parallel sizes that fit: "
                        f"{', '.join(map(str, fit))}")
    elif (layout.tp * layout.dp) % layout.ep:
        problems.append(f"ep = {layout.ep} must divide tp x dp = {layout.tp * layout.dp} (the experts of a stage are "
                        f"spread over its tp x dp GPUs); with this tp and dp: ep in {', '.join(map(str, fit))}")
    if layout.pp > config.n_layers:
        problems.append(f"pp = {layout.pp} exceeds n_layers = {config.n_layers}; pipeline sizes that fit: 1 .. "
                        f"{config.n_layers} (each stage needs at least one layer)")
    if problems:
        raise ValueError(f"layout tp={layout.tp} ep={layout.ep} pp={layout.pp} dp={layout.dp} does not fit "
                         f"{config.name}: " + "; ".join(problems))


def stages(n_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges per pipeline stage, the first n_layers % pp stages one layer longer."""
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


# which parameters tensor parallelism splits, per component (names relative to the sublayer)
_TP_REPLICATED = {
    "kda": ("alpha_down", "gate_down", "norm_weight"),  # low-rank down-projections and the shared norm
    "mla": ("wq_a", "q_norm", "wkv_a", "kv_norm"),       # the q and kv latents are shared by every head
}
_TP_SPLIT_COMPONENTS = ("kda", "mla", "dense_mlp", "moe_shared", "moe_latent_proj", "embedding", "head")


def tp_splits(info: acc.ParamInfo) -> bool:
    if info.component not in _TP_SPLIT_COMPONENTS:
        return False
    if info.component in _TP_REPLICATED:
        sub = info.name.split(".")[3]  # layers.i.mixer.<sub>...
        return sub not in _TP_REPLICATED[info.component]
    return True


def _on_stage(info: acc.ParamInfo, layers: range, n_layers: int, tied: bool = False) -> bool:
    """Whether a stage holds the parameter. A tied embedding is also the head: the last stage holds a copy."""
    first, last = layers.start == 0, layers.stop == n_layers
    return info.layer in layers or (first and info.layer == -1) or (last and info.layer == n_layers) or (
        last and tied and info.layer == -1)


def _link(hw: Hardware, group_span: int) -> tuple[float, str]:
    nvlink = group_span <= hw.nvlink_domain
    return hw.link_bytes_s(nvlink), "nvlink" if nvlink else "network"


def _pp_link(hw: Hardware, stage_ranks: int, stage: int) -> tuple[float, str]:
    """The link from pipeline stage `stage` to the next: rank r sends to r + stage_ranks (stages are
    consecutive blocks of tp x dp ranks, nodes consecutive blocks of nvlink_domain); NVLink when every pair
    of the boundary lies inside one node, the network when any pair crosses nodes."""
    D = hw.nvlink_domain
    first = stage * stage_ranks
    nvlink = all(r // D == (r + stage_ranks) // D for r in range(first, first + stage_ranks))
    return hw.link_bytes_s(nvlink), "nvlink" if nvlink else "network"


# ---------------------------------------------------------------------------------------------- the walls
def plan(config: K3Config, hardware: Hardware | str, layout: Layout, options: Options | None = None) -> dict:
    """The four walls, per GPU of the worst pipeline stage (and per stage), as one JSON-able dict."""
    options = (options or Options()).check()
    hw = load_hardware(hardware)
    check_layout(config, layout)
    model = meta_model(config)
    cfg = model.config
    _check_context(cfg, options)
    if options.mode == "train" and layout.pp > 1 and cfg.tie_embeddings:
        raise ValueError("tied embeddings put one matrix on the first and the last stage, whose gradients a training "
                         "pipeline would have to sum (k3.parallel refuses it); use pp = 1 or untied embeddings "
                         "(tie_embeddings = false)")
    L, tp, ep, pp, dp = cfg.n_layers, layout.tp, layout.ep, layout.pp, layout.dp
    train = options.mode == "train"
    B, N = options.batch, options.context
    act_b = acc.DTYPE_BYTES[options.act_dtype]
    a2a_b = acc.DTYPE_BYTES[options.a2a_dtype]
    m = options.micro_batches or 2 * pp
    st = stages(L, pp)
    serve_prec = acc.Precision(routed=options.expert_precision, dense=options.dense_precision, vector="bf16")
    train_prec = acc.Precision(routed="bf16", dense="bf16", vector="fp32")  # compute copies of the weights
    edp = tp * dp // ep  # replicas of each expert shard (its data-parallel group)

    def fraction(layers: range):
        def f(info: acc.ParamInfo) -> float:
            if not _on_stage(info, layers, L, cfg.tie_embeddings):
                return 0.0
            if info.component == "moe_routed":
                return 1.0 / ep
            return 1.0 / tp if tp_splits(info) else 1.0
        return f

    # optimizer: which parameters Muon takes (one fp32 momentum) and which AdamW takes (two fp32 moments)
    muon_names = set()
    if train and options.optimizer == "muon":
        from k3.train.optim import split_params

        muon_names = {n for n, _ in split_params(model)[0]}

    per_stage = []
    for s, layers in enumerate(st):
        frac = fraction(layers)
        last = s == pp - 1
        mem: dict = {}
        if train:
            w = acc.param_bytes(model, train_prec, frac)
            mem["weights"] = _shard_zero(w, 3, options.zero, dp, edp)
            mem["weights_detail"] = _by_component(w)
            n_all = w["params"]
            n_routed = w["by_component"].get("moe_routed", {}).get("params", 0.0)
            grads = _split(n_routed, n_all - n_routed, acc.DTYPE_BYTES[options.grad_dtype])
            mem["gradients"] = _zero_div(grads, 2, options.zero, dp, edp)
            states = 0.0
            for info in acc.iter_params(model):
                share = frac(info)
                if not share:
                    continue
                k = 1 if info.name in muon_names else 2
                n = info.param.numel() * share * (k + 1)  # moments + fp32 master copy
                states += n * 4 / (_zero_group(info.component, dp, edp) if options.zero >= 1 else 1)
            mem["optimizer_and_master"] = states
            tokens_mb = B * N
            # 1F1B: stage s holds pp - s micro-batches' activations; GPipe all m until the backward starts
            in_flight = m if options.schedule == "gpipe" else min(pp - s, m)
            no_ck = acc.activation_bytes_per_token(model, act_b, layers, checkpoint=False)
            ck = acc.activation_bytes_per_token(model, act_b, layers, checkpoint=True)
            mem["activations_no_checkpointing"] = tokens_mb * no_ck["kept"] * in_flight / tp
            mem["activations_checkpointing"] = tokens_mb * (ck["kept"] * in_flight + ck["recompute"]) / tp
            mem["total_no_checkpointing"] = (mem["weights"] + mem["gradients"] + mem["optimizer_and_master"]
                                             + mem["activations_no_checkpointing"])
            mem["total"] = mem["total_no_checkpointing"] - mem["activations_no_checkpointing"] + mem["activations_checkpointing"]
        else:
            w = acc.param_bytes(model, serve_prec, frac)
            mem["weights"] = w["bytes"]
            mem["weights_detail"] = _by_component(w)
            c = acc.cache_bytes(model, N, B, latent=options.cache_dtype, conv=options.act_dtype, layers=set(layers))
            # KDA states are split by heads over tp; the MLA latent is shared by the heads, so every tp rank keeps all of it
            mem["mla_latent_cache"] = c["mla_latent"]
            mem["kda_state_cache"] = (c["kda_state"] + c["kda_conv"]) / tp
            mem["cache_per_sequence"] = (c["mla_latent"] + (c["kda_state"] + c["kda_conv"]) / tp) / B
            ws = acc.activation_bytes_per_token(model, act_b, layers, checkpoint=True)["recompute"]
            mem["prefill_workspace"] = min(options.prefill_chunk, N) * ws / tp
            mem["total"] = mem["weights"] + mem["mla_latent_cache"] + mem["kda_state_cache"] + mem["prefill_workspace"]
        mem["capacity"] = hw.memory_bytes * options.mem_util
        mem["fits"] = mem["total"] <= mem["capacity"]

        # ------------------------------------------------ traffic and compute for this stage
        n_moe = sum(1 for i in layers if cfg.is_moe_layer(i))
        ep_bw, ep_link = _link(hw, ep)
        tp_bw, tp_link = _link(hw, tp)
        dp_bw, dp_link = _link(hw, tp * dp)
        pp_bw, pp_link = _pp_link(hw, tp * dp, s) if not last else (hw.link_bytes_s(True), "none")
        a2a_tok = acc.a2a_bytes_per_token(model, a2a_b)
        boundary = layers.stop if not last else None
        carried = acc.pipeline_sources(model, boundary) if boundary else 0
        carried_full = acc.pipeline_sources(_full_attnres(cfg), boundary) if boundary else 0
        comm: dict = {"links": {"ep": ep_link, "tp": tp_link, "dp": dp_link, "pp": pp_link}}
        comm["a2a_bytes_per_token_per_moe_layer"] = a2a_tok
        comm["pp_sources_at_boundary"] = carried
        comm["pp_sources_at_boundary_full_attnres"] = carried_full

        if train:
            tokens = B * N  # per micro-batch per replica
            gpu_tokens = tokens / tp
            f = acc.forward_flops(model, N, batch=B, layers=layers, include_head=last)
            step_flops = 3 * _sum(f) * m / tp
            comp_t = _compute_time(f, hw, options, train=True) * 3 * m / tp
            a2a = 2 * gpu_tokens * n_moe * a2a_tok * (ep - 1) / ep * m
            tp_ar = 2 * 2 * 2 * (tp - 1) / tp * tokens * cfg.d_model * act_b * len(layers) * m
            pp_x = 2 * carried * tokens * cfg.d_model * act_b  # activations forward, gradients backward
            pp_x_full = 2 * carried_full * tokens * cfg.d_model * act_b
            g = acc.param_bytes(model, train_prec, frac)
            n_routed = g["by_component"].get("moe_routed", {}).get("params", 0.0)
            gb = acc.DTYPE_BYTES[options.grad_dtype]
            # a ring reduce-scatter of the gradients moves (n-1)/n of their bytes; a ring all-gather of the bf16
            # compute weights (n-1)/n of theirs, n = each parameter's data-parallel group
            grad_rs = (dp - 1) / dp * (g["params"] - n_routed) * gb + (edp - 1) / edp * n_routed * gb
            routed_b = g["by_component"].get("moe_routed", {}).get("bytes", 0.0)
            weight_ag = (dp - 1) / dp * (g["bytes"] - routed_b) + (edp - 1) / edp * routed_b
            if options.zero == 0:  # all-reduce (reduce-scatter + all-gather) of the accumulated gradients
                dp_red = 2 * grad_rs
            elif options.zero == 1:  # accumulated gradients reduce-scattered to their optimizer shard, weights gathered
                dp_red = grad_rs + weight_ag
            elif options.zero == 2:  # sharded gradients: each micro-batch's are reduce-scattered as they are made
                dp_red = m * grad_rs + weight_ag
            else:  # ZeRO-3 (FSDP): that, and the sharded weights gathered for every micro-batch's forward and backward
                dp_red = m * grad_rs + 2 * m * weight_ag
            comm.update({
                "ep_a2a_bytes_per_step": a2a, "ep_a2a_s": a2a / ep_bw,
                "tp_allreduce_bytes_per_step": tp_ar, "tp_allreduce_s": tp_ar / tp_bw,
                "pp_bytes_per_microbatch": pp_x, "pp_bytes_per_microbatch_full_attnres": pp_x_full,
                "pp_s_per_step": pp_x * m / pp_bw,
                "dp_grad_reduce_bytes_per_step": dp_red, "dp_grad_reduce_s": dp_red / dp_bw,
            })
            comm["total_s"] = comm["ep_a2a_s"] + comm["tp_allreduce_s"] + comm["pp_s_per_step"] + comm["dp_grad_reduce_s"]
            compute = {"flops_per_token_forward": _sum(f) / tokens, "flops_per_token_backward": 2 * _sum(f) / tokens,
                       "flops_per_step_per_gpu": step_flops, "time_s": comp_t,
                       "forward_terms_per_token": {k: v / tokens for k, v in f.items() if k != "total"}}
            per_stage.append({"stage": s, "layers": [layers.start, layers.stop - 1], "memory": mem,
                              "communication": comm, "compute": compute})
        else:
            # decode: one token for each of the replica's B sequences, after N cached tokens
            f = acc.forward_flops(model, 1, past=N, batch=B, absorb=True, layers=layers, include_head=last)
            comp_t = _compute_time(f, hw, options, train=False) / tp
            # tokens reaching one expert-parallel group in a step: the busiest group's share, at least one (a
            # GPU that receives a token reads its experts even when there are fewer tokens than groups)
            group_tokens = max(1, math.ceil(B * dp / edp))
            read = _decode_bytes(model, cfg, layers, frac, serve_prec, options, group_tokens, tp, B, last)
            bw_t = read["total"] / hw.hbm_bytes_s
            gpu_tokens = B / tp
            a2a = gpu_tokens * n_moe * a2a_tok * (ep - 1) / ep
            tp_ar = 2 * 2 * (tp - 1) / tp * B * cfg.d_model * act_b * len(layers)
            pp_x = carried * B * cfg.d_model * act_b
            pp_x_full = carried_full * B * cfg.d_model * act_b
            comm.update({
                "ep_a2a_bytes_per_decode_step": a2a, "ep_a2a_s": a2a / ep_bw,
                "tp_allreduce_bytes_per_decode_step": tp_ar, "tp_allreduce_s": tp_ar / tp_bw,
                "pp_bytes_per_microbatch": pp_x, "pp_bytes_per_microbatch_full_attnres": pp_x_full,
                "pp_s": pp_x / pp_bw,
            })
            comm["total_s"] = comm["ep_a2a_s"] + comm["tp_allreduce_s"] + comm["pp_s"]
            # prefill of one request of N tokens (time to first token)
            fp = acc.prefill_flops(model, N, options.prefill_chunk, layers=layers, include_head=last)
            pre_t = _compute_time(fp, hw, options, train=False) / tp
            pre_comm = (N / tp * n_moe * a2a_tok * (ep - 1) / ep / ep_bw
                        + 2 * 2 * (tp - 1) / tp * N * cfg.d_model * act_b * len(layers) / tp_bw
                        + carried * N * cfg.d_model * act_b / pp_bw)
            compute = {"flops_per_token_forward": _sum(f) / B, "decode_time_s": comp_t,
                       "prefill_flops": _sum(fp), "prefill_time_s": pre_t,
                       "forward_terms_per_decoded_token": {k: v / B for k, v in f.items() if k != "total"}}
            bandwidth = {"bytes_read_per_decode_step": read["total"], "detail": read, "time_s": bw_t}
            per_stage.append({"stage": s, "layers": [layers.start, layers.stop - 1], "memory": mem,
                              "bandwidth": bandwidth, "communication": comm, "compute": compute,
                              "prefill_communication_s": pre_comm})

    worst = max(per_stage, key=lambda x: x["memory"]["total"])
    out = {
        "config": cfg.name, "mode": options.mode, "hardware": hw.to_dict(), "layout": asdict(layout) | {"gpus": layout.gpus},
        "options": asdict(options) | {"micro_batches": m if train else None},
        "fits": all(x["memory"]["fits"] for x in per_stage),
        "memory": _public(worst["memory"]) | {"stage": worst["stage"]},
    }
    if train:
        comp = sum(x["compute"]["time_s"] for x in per_stage) / pp  # stages run concurrently
        comp_max = max(x["compute"]["time_s"] for x in per_stage)
        bubble = (pp - 1) / m
        comm_max = max(x["communication"]["total_s"] for x in per_stage)
        tokens_step = B * N * m * dp
        fwd_tok = sum(x["compute"]["flops_per_token_forward"] for x in per_stage)
        out["communication"] = _public(max(per_stage, key=lambda x: x["communication"]["total_s"])["communication"])
        out["compute"] = {"flops_per_token_forward": fwd_tok, "flops_per_token_backward": 2 * fwd_tok,
                          "step_time_s": comp_max * (1 + bubble), "pipeline_bubble": bubble,
                          "stage_time_s": [x["compute"]["time_s"] for x in per_stage], "mean_stage_time_s": comp}
        out["latency"] = {"step_time_bound_s": max(comp_max * (1 + bubble), comm_max),
                          "step_time_serial_s": comp_max * (1 + bubble) + comm_max,
                          "tokens_per_step": tokens_step,
                          "tokens_per_s_bound": tokens_step / max(comp_max * (1 + bubble), comm_max)}
        out["bandwidth"] = None
    else:
        dec = [max(x["bandwidth"]["time_s"], x["compute"]["decode_time_s"], x["communication"]["total_s"]) for x in per_stage]
        ser = [x["bandwidth"]["time_s"] + x["compute"]["decode_time_s"] + x["communication"]["total_s"] for x in per_stage]
        pre = [max(x["compute"]["prefill_time_s"], x["prefill_communication_s"]) for x in per_stage]
        pre_ser = [x["compute"]["prefill_time_s"] + x["prefill_communication_s"] for x in per_stage]
        bytes_step = max(x["bandwidth"]["bytes_read_per_decode_step"] for x in per_stage)
        out["bandwidth"] = {"bytes_read_per_decode_step": bytes_step,
                            "bytes_read_per_token": bytes_step / B,
                            "time_s": max(x["bandwidth"]["time_s"] for x in per_stage),
                            "tokens_per_s_bound": B / sum(x["bandwidth"]["time_s"] for x in per_stage),
                            "detail": max(per_stage, key=lambda x: x["bandwidth"]["time_s"])["bandwidth"]["detail"]}
        out["communication"] = _public(max(per_stage, key=lambda x: x["communication"]["total_s"])["communication"])
        fwd_tok = sum(x["compute"]["flops_per_token_forward"] for x in per_stage)
        out["compute"] = {"flops_per_token_forward": fwd_tok,  # serving: no backward
                          "decode_time_s": sum(x["compute"]["decode_time_s"] for x in per_stage),
                          "prefill_flops": sum(x["compute"]["prefill_flops"] for x in per_stage),
                          "prefill_time_s": max(x["compute"]["prefill_time_s"] for x in per_stage)}
        out["latency"] = {"decode_per_token_bound_s": sum(dec), "decode_per_token_serial_s": sum(ser),
                          "tokens_per_s_bound": B * dp / sum(dec),
                          # chunked prefill keeps every stage busy, so the slowest stage sets the pace
                          "ttft_bound_s": max(pre), "ttft_serial_s": sum(pre_ser)}
    out["stages"] = [_public_stage(x) for x in per_stage]
    return out


def _full_attnres(cfg: K3Config):
    return meta_model(cfg.replace(attnres="full"))


def _sum(f: dict) -> float:
    return float(f["total"])


def _compute_time(f: dict, hw: Hardware, options: Options, train: bool) -> float:
    """Seconds at peak: routed-expert matmuls at the experts' precision (serving), the rest at the dense
    precision (fp8 when the dense weights are 8-bit), attention and state work at bf16."""
    dense = "fp8" if options.dense_precision in ("fp8", "mxfp8") and not train else "bf16"
    routed = {"mxfp4": "fp4", "fp8": "fp8", "mxfp8": "fp8"}.get(options.expert_precision, "bf16") if not train else "bf16"
    bf16 = hw.peak_flops("bf16")[0]
    return (f["matmul"] / hw.peak_flops(dense)[0] + f["matmul_routed"] / hw.peak_flops(routed)[0]
            + (f["total"] - f["matmul"] - f["matmul_routed"]) / bf16)


def _decode_bytes(model, cfg, layers: range, frac, prec, options: Options, group_tokens: int, tp: int, B: int,
                  last: bool = True) -> dict:
    """HBM bytes one GPU reads in one decode step: its weights (routed experts only where some token of the
    step lands, expected under uniform routing), each sequence's MLA latents (every tp rank reads all of
    them) and its KDA states (read and written back, split over tp)."""
    w = acc.param_bytes(model, prec, frac)
    routed = w["by_component"].get("moe_routed", {}).get("bytes", 0.0)
    hit = 1.0 - (1.0 - cfg.n_active_experts / cfg.n_experts) ** group_tokens if routed else 0.0
    c = acc.cache_bytes(model, options.context, B, latent=options.cache_dtype, conv=options.act_dtype, layers=set(layers))
    # the embedding is a lookup: a step reads B rows of it, not the table; a tied table is also the head, which
    # the last stage reads whole for the logits
    table = w["by_component"].get("embedding", {}).get("bytes", 0.0)
    rows = B * cfg.d_model * acc.element_bytes(prec.dense) / tp if table else 0.0
    if cfg.tie_embeddings and last:
        table = rows = 0.0
    out = {"weights_dense": w["bytes"] - routed - table + rows, "weights_routed_touched": routed * hit,
           "expert_hit_fraction": hit, "mla_latent": c["mla_latent"],
           "kda_state_read_write": 2 * (c["kda_state"] + c["kda_conv"]) / tp}
    out["total"] = out["weights_dense"] + out["weights_routed_touched"] + out["mla_latent"] + out["kda_state_read_write"]
    return out


def _by_component(w: dict) -> dict:
    return {k: {"params": v["params"], "bytes": v["bytes"], "formats": v["formats"]} for k, v in w["by_component"].items()}


def _split(n_routed: float, n_other: float, b: float) -> dict:
    return {"routed": n_routed * b, "other": n_other * b}


def _zero_group(component: str, dp: int, edp: int) -> int:
    return edp if component == "moe_routed" else dp


def _zero_div(parts: dict, stage: int, zero: int, dp: int, edp: int) -> float:
    if zero >= stage:
        return parts["routed"] / edp + parts["other"] / dp
    return parts["routed"] + parts["other"]


def _shard_zero(w: dict, stage: int, zero: int, dp: int, edp: int) -> float:
    routed = w["by_component"].get("moe_routed", {}).get("bytes", 0.0)
    return _zero_div({"routed": routed, "other": w["bytes"] - routed}, stage, zero, dp, edp)


def _public(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in ("weights_detail",)}


def _public_stage(x: dict) -> dict:
    y = dict(x)
    y["memory"] = _public(x["memory"])
    return y


# ---------------------------------------------------------------------------------------------- searches
def min_gpus_to_serve(config: K3Config, hardware: Hardware | str, options: Options | None = None,
                      max_gpus: int = 4096) -> dict:
    """The fewest GPUs whose memory holds the model and the cache of `options.batch` sequences of
    `options.context` tokens. Searches tp (within one NVLink domain) x pp x dp with the routed experts
    spread over every GPU of a stage (ep = tp x dp); among layouts of that size, the fastest decode wins."""
    options = (options or Options()).check()
    hw = load_hardware(hardware)
    if options.mode != "serve":
        raise ValueError("min_gpus_to_serve plans serving; use mode 'serve'")
    L = config.n_layers
    _check_context(config, options)  # not a matter of GPUs: said once, not swallowed by the search
    tp_fit = divisors(math.gcd(*tp_split_dims(config).values()))
    prec = acc.Precision(routed=options.expert_precision, dense=options.dense_precision, vector="bf16")
    weights = acc.param_bytes(meta_model(config), prec)["bytes"]
    for n in range(1, max_gpus + 1):
        if weights / n > hw.memory_bytes * options.mem_util:
            continue  # the weights alone do not fit in n GPUs
        best = None
        for tp in (t for t in tp_fit if n % t == 0 and t <= hw.nvlink_domain):
            for pp in (p for p in divisors(n // tp) if p <= L):
                dp = n // (tp * pp)
                ep = tp * dp
                if config.n_dense_layers < L and config.n_experts % ep:
                    continue
                layout = Layout(tp=tp, ep=ep, pp=pp, dp=dp)
                if _max_stage_weights(config, prec, layout) > hw.memory_bytes * options.mem_util:
                    continue  # cheap pre-check: some stage's weights alone overflow
                try:
                    r = plan(config, hw, layout, options)
                except ValueError:
                    continue
                if r["fits"] and (best is None or r["latency"]["decode_per_token_bound_s"]
                                  < best["latency"]["decode_per_token_bound_s"]):
                    best = r
        if best is not None:
            return {"gpus": n, "layout": best["layout"], "plan": best}
    raise ValueError(f"no layout of up to {max_gpus} {hw.name} GPUs holds {config.name} at context "
                     f"{options.context} x batch {options.batch}; lower the context or use bigger GPUs")


def _max_stage_weights(config: K3Config, prec: acc.Precision, layout: Layout) -> float:
    """Largest per-GPU weight bytes over the stages (the same placement as `plan`, from per-layer sums)."""
    table = _layer_weight_table(config.to_json(), prec)
    L = config.n_layers
    worst = 0.0
    for layers in stages(L, layout.pp):
        keys = list(layers) + ([-1] if layers.start == 0 else []) + ([L] if layers.stop == L else [])
        split, repl, routed = (sum(table.get(k, (0.0, 0.0, 0.0))[i] for k in keys) for i in range(3))
        worst = max(worst, split / layout.tp + repl + routed / layout.ep)
    return worst


@functools.lru_cache(maxsize=64)
def _layer_weight_table(config_json: str, prec: acc.Precision) -> dict:
    model = _meta(config_json)
    table: dict[int, list[float]] = {}
    for info in acc.iter_params(model):
        b = acc.tensor_bytes(info.param.shape, prec.format_of(info.component, info.param))
        row = table.setdefault(info.layer, [0.0, 0.0, 0.0])
        row[2 if info.component == "moe_routed" else 0 if tp_splits(info) else 1] += b
    return {k: tuple(v) for k, v in table.items()}
