"""Exact accounting, read from the real modules (the full preset is built on the meta device).

Every parameter is attributed to one component by where it lives in the module tree; "active" counts
what one token touches: everything except the routed experts, plus top-k / n_experts of them. Below the
parameter counts sit the byte and FLOP functions that the planner (k3.plan) and the runtime (MFU, expert
parallel traffic) share: parameter bytes by storage format, hybrid-cache bytes, forward FLOPs by term,
all-to-all bytes per token, pipeline boundary sources and an activation estimate.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from k3.config import K3Config
from k3.model.moe import GatedMLP, MoE, Router
from k3.model.transformer import K3Model

COMPONENTS = (
    "embedding", "head", "kda", "mla", "attnres", "norms", "dense_mlp",
    "moe_router", "moe_latent_proj", "moe_shared", "moe_routed",
)


def format_count(n: float, spec: str = ",.3f") -> str:
    """A parameter count in T, B, M or K (`spec` formats the number), or as it is below a thousand."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:{spec}}{unit}"
    return str(round(n))


def build_meta(config: K3Config) -> K3Model:
    """The model on the meta device: shapes and counts without memory."""
    with torch.device("meta"):
        return K3Model(config)


def _moe_component(moe: MoE, name: str) -> str:
    """name is a parameter name relative to the MoE module."""
    child_name = name.split(".")[0]
    child = getattr(moe, child_name)
    if isinstance(child, Router):
        return "moe_router"
    if child is getattr(moe, "experts", None):
        return "moe_routed"
    if isinstance(child, (GatedMLP, nn.ModuleList)):
        return "moe_shared"
    if isinstance(child, (nn.Linear, nn.RMSNorm)):  # W_down, W_up and the latent norm between them
        return "moe_latent_proj"
    raise ValueError(f"cannot attribute MoE parameter {name!r} to a component")


def component_of(model: K3Model, name: str) -> str:
    top = name.split(".")[0]
    if top == "embed":
        return "embedding"
    if top == "head":
        return "head"
    if top == "attnres":
        return "attnres"
    if top == "norm":
        return "norms"
    if top == "layers":
        _, idx, part, *rest = name.split(".")
        block = model.layers[int(idx)]
        if part in ("attn_norm", "ffn_norm"):
            return "norms"
        if part == "mixer":
            return "kda" if block.kind == "K" else "mla"
        if part == "ffn":
            return _moe_component(block.ffn, ".".join(rest)) if isinstance(block.ffn, MoE) else "dense_mlp"
    raise ValueError(f"cannot attribute parameter {name!r} to a component")


def count_params(model: K3Model) -> dict:
    """Totals and a per-component breakdown, each with total and active counts."""
    cfg = model.config
    by = {c: {"total": 0, "active": 0} for c in COMPONENTS}
    active_frac = cfg.n_active_experts / cfg.n_experts
    for name, p in model.named_parameters():  # tied weights are yielded once
        comp = component_of(model, name)
        n = p.numel()
        by[comp]["total"] += n
        by[comp]["active"] += round(n * active_frac) if comp == "moe_routed" else n
    return {
        "total": sum(v["total"] for v in by.values()),
        "active": sum(v["active"] for v in by.values()),
        "d_model": cfg.d_model,
        "latent_dim": cfg.latent_dim,
        "layers": {"total": cfg.n_layers, "kda": cfg.n_kda_layers, "mla": cfg.n_mla_layers},
        "attnres_sources": cfg.attnres_sources if cfg.attnres == "block" else None,
        "attnres": cfg.attnres,
        "experts": cfg.n_experts,
        "active_experts": cfg.n_active_experts,
        "shared_experts": cfg.n_shared_experts,
        "vocab_size": cfg.vocab_size,
        "max_context": cfg.max_context,
        "by_component": {k: v for k, v in by.items() if v["total"]},
    }


# ====================================================================================== bytes, FLOPs, traffic
# The planner (k3.plan) and the runtime (MFU in k3.train.metrics; the expert-parallel byte counters) read
# these functions; none of them keeps a dimension of its own: every width, head count and layer kind is
# read from the modules of a (meta) model.

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
MX_STORAGE = ("mxfp8", "mxfp4")
FORMATS = tuple(DTYPE_BYTES) + MX_STORAGE


def _model(model_or_config) -> K3Model:
    return model_or_config if isinstance(model_or_config, nn.Module) else build_meta(model_or_config)


def check_format(fmt: str, what: str = "format") -> str:
    if fmt not in FORMATS:
        raise ValueError(f"{what} {fmt!r} is unknown; use one of {list(FORMATS)}")
    return fmt


def element_bytes(fmt: str) -> float:
    """Bytes per element of a plain format; MX formats include their shared scale (4.25 / 8.25 bits)."""
    check_format(fmt)
    if fmt in DTYPE_BYTES:
        return float(DTYPE_BYTES[fmt])
    from k3.ops.mx import mx_bits_per_element

    return mx_bits_per_element(fmt) / 8


def tensor_bytes(shape, fmt: str, block_size: int = 32) -> float:
    """Storage bytes of one tensor of `shape` in `fmt`.

    Plain formats: numel x element size. MX (OCP MX v1.0, as k3.ops.mx stores them): element codes (4 bits
    for mxfp4, packed two per byte; 8 bits for mxfp8) plus one E8M0 scale byte per block of `block_size`
    elements along the last dim (a short last block still takes a whole scale byte).
    """
    check_format(fmt)
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if fmt in DTYPE_BYTES:
        return float(n * DTYPE_BYTES[fmt])
    if len(shape) < 2:
        raise ValueError(f"{fmt} stores matrices in blocks along the last dim; a {len(shape)}-D tensor "
                         f"{list(shape)} has no such layout; keep vectors in bf16 or fp32")
    from k3.ops.mx import MX_FORMATS

    rows = n // shape[-1]
    scales = rows * math.ceil(shape[-1] / block_size)
    return float(math.ceil(n * MX_FORMATS[fmt].bits / 8) + scales)


@dataclass(frozen=True)
class Precision:
    """Storage format by kind of parameter: `routed` = routed experts' matrices, `dense` = every other
    matrix (attention, shared experts, dense MLP, router, latent projections, embedding, head), `vector` =
    1-D parameters (norms, biases, decay rates, AttnRes pseudo-queries), which MX cannot block."""

    routed: str = "mxfp4"
    dense: str = "bf16"
    vector: str = "bf16"

    def __post_init__(self):
        check_format(self.routed, "routed-expert precision")
        check_format(self.dense, "dense precision")
        check_format(self.vector, "vector precision")
        if self.vector in MX_STORAGE:
            raise ValueError(f"vector precision {self.vector!r}: 1-D parameters cannot be MX-blocked; use bf16 or fp32")

    def format_of(self, component: str, p: torch.Tensor) -> str:
        if p.dim() < 2:
            return self.vector
        return self.routed if component == "moe_routed" else self.dense


@dataclass(frozen=True)
class ParamInfo:
    """One parameter: `layer` is its transformer layer, -1 for the embedding (first pipeline stage) and
    n_layers for what runs after the last layer (final AttnRes mix, final norm, head)."""

    name: str
    param: torch.Tensor
    component: str
    layer: int


def layer_of(model: K3Model, name: str) -> int:
    parts = name.split(".")
    L = model.config.n_layers
    if parts[0] == "layers":
        return int(parts[1])
    if parts[0] == "embed":
        return -1
    if parts[0] == "attnres" and len(parts) == 3:
        return min(int(parts[2]) // 2, L)  # pseudo-query / key norm j serves sublayer j of layer j // 2
    return L


_INFOS: "weakref.WeakKeyDictionary[K3Model, list[ParamInfo]]" = weakref.WeakKeyDictionary()


def iter_params(model: K3Model) -> list[ParamInfo]:
    """Every parameter with its component and layer (computed once per model: the planner asks often)."""
    infos = _INFOS.get(model)
    if infos is None or len(infos) != sum(1 for _ in model.parameters()):
        infos = [ParamInfo(name, p, component_of(model, name), layer_of(model, name))
                 for name, p in model.named_parameters()]
        _INFOS[model] = infos
    return infos


def param_bytes(model_or_config, precision: Precision | None = None, fraction=None) -> dict:
    """Bytes of the parameters, by component. precision None: as the model stores them (numel x element
    size); otherwise the storage format `precision.format_of` picks. `fraction(info) -> float` scales each
    parameter (a shard of it on one GPU, 0 for parameters elsewhere)."""
    model = _model(model_or_config)
    by: dict[str, dict] = {}
    for info in iter_params(model):
        p = info.param
        share = 1.0 if fraction is None else float(fraction(info))
        if share == 0:
            continue
        if precision is None:
            fmt, b = str(p.dtype).replace("torch.", ""), float(p.numel() * p.element_size())
        else:
            fmt = precision.format_of(info.component, p)
            b = tensor_bytes(p.shape, fmt)
        d = by.setdefault(info.component, {"params": 0.0, "bytes": 0.0, "formats": []})
        d["params"] += p.numel() * share
        d["bytes"] += b * share
        if fmt not in d["formats"]:
            d["formats"].append(fmt)
    return {"bytes": sum(v["bytes"] for v in by.values()), "params": sum(v["params"] for v in by.values()),
            "by_component": by}


# ---------------------------------------------------------------------------------------------- cache
def cache_bytes(model_or_config, context: int, batch: int = 1, latent: str = "bf16", conv: str = "bf16",
                state: str = "fp32", layers=None) -> dict:
    """Bytes of the hybrid inference cache (k3.model.cache) after `context` tokens, for `batch` sequences.

    Per MLA layer the latent c_kv and the shared key [B, T, kv_lora_rank + qk_rope_head_dim] in `latent`; per KDA layer the recurrent state
    [B, H, K, V] in `state` (fp32 in every KDA kernel) and the short-conv tail [B, 3*H*K, conv_size - 1] in
    `conv` (the activation dtype). Only the MLA part grows with context. `layers`: a subset of layer indices.
    """
    model = _model(model_or_config)
    from k3.model.kda import KimiDeltaAttention

    out = {"mla_latent": 0.0, "kda_state": 0.0, "kda_conv": 0.0}
    for i, block in enumerate(model.layers):
        if layers is not None and i not in layers:
            continue
        m = block.mixer
        if isinstance(m, KimiDeltaAttention):
            V = m.v_proj.out_features // m.n_heads
            out["kda_state"] += batch * m.n_heads * m.head_dim * V * element_bytes(state)
            out["kda_conv"] += batch * m.conv_weight.shape[0] * (m.conv_size - 1) * element_bytes(conv)
        else:
            out["mla_latent"] += batch * context * (m.kv_lora_rank + m.rope_dim) * element_bytes(latent)
    out["total"] = out["mla_latent"] + out["kda_state"] + out["kda_conv"]
    return out


# ---------------------------------------------------------------------------------------------- FLOPs
def matmul_weights(model_or_config) -> dict:
    """Weights one token multiplies by, per component: every parameter of 2+ dims except the embedding
    table (a lookup), routed experts at exactly top-k of n_experts (each token runs k whole experts), and the
    head even when tied to the embedding. 1-D parameters (norms, biases, gates' rates) do no matmul."""
    model = _model(model_or_config)
    by: dict[str, int] = {}
    for info in iter_params(model):
        p = info.param
        if p.dim() < 2 or info.component == "embedding":
            continue
        n = p.numel()
        if info.component == "moe_routed":
            n = n // p.shape[0] * model.config.n_active_experts
        by[info.component] = by.get(info.component, 0) + n
    if model.head.weight is model.embed.weight:
        by["head"] = by.get("head", 0) + model.head.weight.numel()
    return by


def attention_pairs(tokens: int, past: int = 0, causal: bool = True) -> int:
    """(query, key) pairs scored when `tokens` new queries follow `past` cached keys. causal: only the
    visible pairs (what kernels that skip masked tiles compute, and the usual model-FLOPs convention);
    otherwise the whole [tokens, past + tokens] rectangle (what a masked dense product computes)."""
    if causal:
        return tokens * past + tokens * (tokens + 1) // 2
    return tokens * (past + tokens)


def forward_flops(model_or_config, tokens: int, past: int = 0, batch: int = 1, absorb: bool = False,
                  causal: bool = True, layers=None, include_head: bool = True) -> dict:
    """Forward FLOPs (2 per multiply-add) of one call on `batch` sequences of `tokens` new tokens after
    `past` cached ones, by term; matmul-like work only (norms, softmax, gates and other elementwise ops are
    not counted, as in the usual model-FLOPs convention).

      matmul             2 x matmul_weights per token, all but the routed experts
      matmul_routed      2 x routed-expert weights per token at top-k / n_experts (k whole experts)
      mla_latent_up_past prefill form (absorb False): W_UK, W_UV re-expand the `past` cached latents
      mla_attention      per MLA layer and (query, key) pair: 2 H (K + V) (q k and p v), or 4 H C in the
                         absorbed form (scores and weighted sum over the C-wide latent)
      kda_state_read     per KDA layer and token 4 H K V: k^T S and q^T S, each a [K] x [K, V] product
      kda_state_update   per KDA layer and token 2 H K V: the rank-1 write S += k u^T
      attnres            4 D per source mixed (scores and weighted sum), summed over the mixes
      moe_combine        2 top-k x dispatch_dim per MoE layer and token (the weighted sum of expert outputs)
    `layers` restricts to those transformer layers; `include_head` adds the final mix and the head.
    """
    model = _model(model_or_config)
    from k3.model.kda import KimiDeltaAttention

    cfg = model.config
    L = cfg.n_layers
    keep = set(range(L)) if layers is None else set(layers)
    weights, routed = 0, 0
    for info in iter_params(model):
        p = info.param
        if p.dim() < 2 or info.component == "embedding":
            continue
        if not (info.layer in keep or (include_head and info.layer == L)):
            continue
        if info.component == "moe_routed":
            routed += p.numel() // p.shape[0] * cfg.n_active_experts
        else:
            weights += p.numel()
    if include_head and model.head.weight is model.embed.weight:
        weights += model.head.weight.numel()
    n_tok = batch * tokens
    t = {k: 0 for k in ("matmul", "matmul_routed", "mla_latent_up_past", "mla_attention", "kda_state_read",
                        "kda_state_update", "attnres", "moe_combine")}
    t["matmul"] = 2 * weights * n_tok
    t["matmul_routed"] = 2 * routed * n_tok
    pairs = batch * attention_pairs(tokens, past, causal)
    for i in sorted(keep):
        block = model.layers[i]
        m = block.mixer
        if isinstance(m, KimiDeltaAttention):
            V = m.v_proj.out_features // m.n_heads
            t["kda_state_read"] += 4 * m.n_heads * m.head_dim * V * n_tok
            t["kda_state_update"] += 2 * m.n_heads * m.head_dim * V * n_tok
        else:
            H, K, V, C, R = m.n_heads, m.qk_head_dim, m.v_head_dim, m.kv_lora_rank, m.rope_dim
            if absorb:  # scores over C + R values, the weighted sum over C
                t["mla_attention"] += 2 * H * (2 * C + R) * pairs
            else:
                t["mla_attention"] += 2 * H * (K + R + V) * pairs
                t["mla_latent_up_past"] += 2 * m.wkv_b.weight.numel() * batch * past
        if isinstance(block.ffn, MoE):
            t["moe_combine"] += 2 * block.ffn.router.top_k * block.ffn.dispatch_dim * n_tok
    ar = model.attnres
    if ar.mode != "none":
        mixes = [j for j in range(2 * L) if j // 2 in keep] + ([2 * L] if include_head else [])
        t["attnres"] = 4 * cfg.d_model * sum(ar.n_sources(j) for j in mixes) * n_tok
    t["total"] = sum(t.values())
    return t


def prefill_flops(model_or_config, tokens: int, chunk: int, layers=None, include_head: bool = True) -> dict:
    """Forward FLOPs of prefilling one sequence of `tokens` in chunks of `chunk` (the last one shorter), by term:
    the sum of `forward_flops(chunk_k, past=start_k)` over the chunks, computed in closed form. Chunking
    leaves every term but one as in a single call (the same tokens, the same causal (query, key) pairs); each
    chunk's prefill-form MLA re-expands the latents of every earlier chunk (`mla_latent_up_past`)."""
    f = forward_flops(model_or_config, tokens, layers=layers, include_head=include_head)
    per_past = forward_flops(model_or_config, 0, past=1, layers=layers, include_head=include_head)["mla_latent_up_past"]
    n = -(-tokens // chunk)  # chunks; chunk k starts after k * chunk tokens
    f["mla_latent_up_past"] += per_past * chunk * n * (n - 1) // 2
    f["total"] = sum(v for k, v in f.items() if k != "total")
    return f


def flops_per_token(model_or_config, seq_len: int) -> dict:
    """Training FLOPs per token (forward + backward = 3 x forward) of sequences of `seq_len` tokens, the
    figure MFU divides by. Keys: total, params (the weight matmuls and the MoE combine), mla, kda, attnres,
    active_params (matmul weights per token), forward (the forward total)."""
    model = _model(model_or_config)
    f = forward_flops(model, seq_len, batch=1)
    per = {k: 3.0 * v / seq_len for k, v in f.items()}
    return {"total": per["total"], "params": per["matmul"] + per["matmul_routed"] + per["moe_combine"],
            "mla": per["mla_attention"] + per["mla_latent_up_past"],
            "kda": per["kda_state_read"] + per["kda_state_update"], "attnres": per["attnres"],
            "active_params": int(sum(matmul_weights(model).values())), "forward": f["total"] / seq_len}


# ---------------------------------------------------------------------------------------------- traffic
def a2a_bytes_per_token(model_or_config, dtype_bytes: float = 2.0) -> float:
    """Expert-parallel all-to-all payload of one token through one MoE layer, forward:
    top_k x dispatch_dim x dtype_bytes x 2 (dispatch to the k experts, combine back). dispatch_dim is the
    latent width for LatentMoE, d_model for standard MoE. Counts every routed copy, also those whose
    expert sits on the sending rank; under uniform routing (ep - 1) / ep of it crosses links. Backward moves
    the same again (the gradients of combine and dispatch)."""
    if isinstance(model_or_config, nn.Module):
        moes = model_or_config.moe_layers()
        if not moes:
            return 0.0
        top_k, dim = moes[0].router.top_k, moes[0].dispatch_dim
    else:
        cfg = model_or_config
        if cfg.n_dense_layers >= cfg.n_layers:
            return 0.0
        top_k, dim = cfg.n_active_experts, cfg.latent_dim
    return float(top_k * dim * dtype_bytes * 2)


def pipeline_sources(model_or_config, layer: int) -> int:
    """[B, T, d_model] tensors a pipeline stage that starts at transformer layer `layer` must receive: the
    AttnRes sources sublayer 2*layer mixes. Block: the embedding, the completed blocks and the partial
    block if the stage starts inside one; Full: every earlier sublayer output and the embedding; none: 1."""
    model = _model(model_or_config)
    L = model.config.n_layers
    if not 0 < layer < L:
        raise ValueError(f"a pipeline boundary sits before layer 1 .. {L - 1}, got {layer}")
    return model.attnres.n_sources(2 * layer)


def activation_bytes_per_token(model_or_config, act_bytes: float = 2.0, layers=None, checkpoint: bool = False) -> dict:
    """Estimated activation bytes kept for backward, per token, over `layers` (an estimate in the style of
    Korthikanti et al., arXiv 2205.05198, with sizes read from the modules; not measured).

    Without checkpointing each layer keeps: the inputs and outputs of its two pre-norms (4 d), its two
    sublayer outputs (2 d, the AttnRes sources / partial sums), the output of every Linear in the token mixer
    and in the channel mixer (routed experts x top-k, their dispatched inputs x top-k), the short-conv output
    (KDA), the materialised keys and values (MLA prefill form) and the router scores (fp32). With per-sublayer
    checkpointing (what k3.train does): 6 d per layer (norm inputs, checkpointed inputs, outputs), plus
    `recompute`, the largest single sublayer rebuilt during its backward (one at a time).
    """
    model = _model(model_or_config)
    from k3.model.kda import KimiDeltaAttention

    cfg, d = model.config, model.config.d_model
    keep = range(cfg.n_layers) if layers is None else layers
    kept = 0.0
    biggest = 0.0
    for i in keep:
        block = model.layers[i]
        m = block.mixer
        mixer = sum(lin.out_features for lin in m.modules() if isinstance(lin, nn.Linear))
        if isinstance(m, KimiDeltaAttention):
            mixer += m.conv_weight.shape[0]
        # (MLA's k and v are views of wkv_b's output, already counted with the Linear outputs)
        f = block.ffn
        if isinstance(f, MoE):
            k = f.router.top_k
            ffn = f.router.n_experts * 2  # fp32 scores, counted in bf16 elements
            ffn += sum(lin.out_features for lin in f.modules() if isinstance(lin, nn.Linear))
            e = f.experts
            ffn += k * (e.dim + 3 * e.ffn + e.dim)  # dispatched copy, w1 / w3 outputs and product, expert output
        else:
            ffn = sum(lin.out_features for lin in f.modules() if isinstance(lin, nn.Linear)) + f.w1.out_features
        full = 6 * d + mixer + ffn
        kept += (6 * d) if checkpoint else full
        biggest = max(biggest, mixer + 2 * d, ffn + 2 * d)
    out = {"kept": kept * act_bytes, "recompute": biggest * act_bytes if checkpoint else 0.0}
    out["peak"] = out["kept"] + out["recompute"]
    return out
