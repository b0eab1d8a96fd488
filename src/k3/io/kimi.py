"""The released layout of Kimi-Linear (`kimi_linear`) and Kimi K3 (`kimi_k3`) checkpoints, both ways.

A folder holds `config.json` and `model.safetensors` (or shards named by `model.safetensors.index.json`);
`kimi_k3` wraps the text model (`text_config`, tensors under `language_model.`) and ships its routed experts as
compressed-tensors MXFP4, the bytes k3's packed experts hold. `tensor_map` is the one table between k3's names and
the release's; docs/checkpoints.md lists it and the config keys.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from k3.config import KDA, K3Config, K3ConfigError
from k3.fileio import loads_json

KIMI_TYPES = ("kimi_linear", "kimi_k3")
K3_PREFIX = "language_model."
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointFormatError(ValueError):
    """A released-layout folder k3 cannot read (or a model it cannot write in that layout); the message names the
    file or field and the fix."""


# ---------------------------------------------------------------------------------------------- config
def _text(d: dict, where: str) -> tuple[str, dict]:
    mt = d.get("model_type")
    if mt == "kimi_k3":
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointFormatError(f"{where}: model_type kimi_k3 without a text_config object; a kimi_k3 "
                                        "config holds its text model there")
        return mt, text
    if mt == "kimi_linear":
        return mt, d
    raise CheckpointFormatError(f"{where}: model_type {mt!r} is not a released Kimi layout; k3 reads "
                                f"{' and '.join(KIMI_TYPES)} folders, k3 checkpoints and k3 HF exports")


def _pattern(text: dict, n_layers: int, where: str) -> str:
    la = text.get("linear_attn_config") or {}
    if "full_attn_layers" in la:
        full = set(la["full_attn_layers"])
        kda = set(la.get("kda_layers", [i for i in range(1, n_layers + 1) if i not in full]))
        if full & kda or full | kda != set(range(1, n_layers + 1)):
            raise CheckpointFormatError(f"{where}: linear_attn_config.full_attn_layers and kda_layers must split "
                                        f"layers 1..{n_layers} between them (1-indexed), each layer once")
        return "".join("M" if i + 1 in full else KDA for i in range(n_layers))
    types = text.get("layer_types")
    if isinstance(types, list) and len(types) == n_layers:  # as transformers writes it back
        if set(types) - {"full_attention", "linear_attention"}:
            raise CheckpointFormatError(f"{where}: layer_types holds {sorted(set(types))}; k3 knows full_attention "
                                        "(MLA) and linear_attention (KDA)")
        return "".join("M" if t == "full_attention" else KDA for t in types)
    raise CheckpointFormatError(f"{where}: neither linear_attn_config.full_attn_layers nor layer_types says which "
                                "layers are MLA")


def _get(text: dict, *keys, default=None):
    for k in keys:
        if k in text and text[k] is not None:
            return text[k]
    return default


def config_from_kimi(d: dict, where: str = "config.json", name: str | None = None) -> K3Config:
    """The K3Config of a released config.json (kimi_linear, or kimi_k3's text_config). Fields k3 cannot express
    are refused by name."""
    mt, text = _text(d, where)

    def refuse(key, why):
        raise CheckpointFormatError(f"{where}: {key} = {text.get(key)!r} {why}; k3 cannot express it")

    if text.get("mla_use_nope", True) is not True:
        refuse("mla_use_nope", "asks for rotary MLA (k3's MLA layers are NoPE, as Kimi-Linear's and K3's)")
    if _get(text, "num_nextn_predict_layers", default=0):
        refuse("num_nextn_predict_layers", "asks for multi-token prediction layers")
    if _get(text, "moe_layer_freq", default=1) != 1:
        refuse("moe_layer_freq", "is not 1 (every layer after the dense ones is MoE in k3)")
    if _get(text, "moe_router_activation_func", default="sigmoid") != "sigmoid":
        refuse("moe_router_activation_func", "is not sigmoid")
    if _get(text, "moe_renormalize", "norm_topk_prob", default=True) is not True:
        refuse("moe_renormalize", "is false (k3 renormalises the top-k weights)")
    for key in ("num_expert_group", "n_group", "topk_group"):
        if _get(text, key, default=1) != 1:
            refuse(key, "asks for grouped routing")
    H = _get(text, "num_attention_heads")
    if _get(text, "num_key_value_heads", default=H) != H:
        refuse("num_key_value_heads", f"differs from num_attention_heads = {H}")
    la = text.get("linear_attn_config") or {}
    n_layers = _get(text, "num_hidden_layers")
    hidden_act = _get(text, "hidden_act", default="silu")
    if hidden_act not in ("silu", "situ"):
        refuse("hidden_act", "is neither silu nor situ")
    latent = _get(text, "routed_expert_hidden_size")
    block = _get(text, "attn_res_block_size")
    head_dim = _get(la, "head_dim", default=_get(text, "linear_head_dim", default=128))
    fields = dict(
        name=name or f"{mt}-{Path(where).parent.name or 'checkpoint'}",
        vocab_size=_get(text, "vocab_size"), d_model=_get(text, "hidden_size"), n_layers=n_layers,
        max_context=_get(text, "max_position_embeddings", "model_max_length", default=1048576),
        layer_pattern=_pattern(text, n_layers, where),
        kda_heads=_get(la, "num_heads", default=_get(text, "linear_num_heads", default=32)),
        kda_head_dim=head_dim,
        kda_conv_size=_get(la, "short_conv_kernel_size", default=_get(text, "linear_conv_kernel_dim", default=4)),
        kda_gate_rank=head_dim,  # f_a_proj: hidden -> head_dim, and g_a_proj the same
        gate_lower_bound=_get(la, "gate_lower_bound"), use_full_rank_gate=bool(la.get("use_full_rank_gate", False)),
        kda_gate_bias=False,
        mla_heads=H, mla_q_lora_rank=_get(text, "q_lora_rank", default=0),
        mla_kv_lora_rank=_get(text, "kv_lora_rank"), mla_qk_head_dim=_get(text, "qk_nope_head_dim"),
        qk_rope_head_dim=_get(text, "qk_rope_head_dim", default=0), mla_v_head_dim=_get(text, "v_head_dim"),
        mla_use_output_gate=bool(text.get("mla_use_output_gate", False)),
        attnres="block" if block else "none",
        attnres_sources=(math.ceil(n_layers / block) + 1) if block else 3, attn_res_block_size=block or 0,
        hidden_act=hidden_act,
        situ_beta=float(_get(text, "activation_situ_beta", default=4.0)),
        situ_linear_beta=float(_get(text, "activation_situ_linear_beta", default=25.0)),
        n_dense_layers=_get(text, "first_k_dense_replace", default=1), dense_ffn=_get(text, "intermediate_size"),
        moe="latent" if latent else "standard", moe_latent_dim=latent or 32,
        latent_moe_use_norm=bool(text.get("latent_moe_use_norm", False)),
        n_experts=_get(text, "num_experts", "num_local_experts", "n_routed_experts"),
        n_active_experts=_get(text, "num_experts_per_token", "num_experts_per_tok"),
        expert_ffn=_get(text, "moe_intermediate_size"),
        n_shared_experts=_get(text, "num_shared_experts", "n_shared_experts", default=0),
        shared_ffn=_get(text, "moe_intermediate_size"),
        routed_scale=float(_get(text, "routed_scaling_factor", default=1.0)),
        balancing="quantile" if latent else "bias",
        norm_eps=float(_get(text, "rms_norm_eps", default=1e-5)),
        kda_norm_eps=float(_get(text, "rms_norm_eps", default=1e-5)), mla_norm_eps=1e-6,
        init_std=float(_get(text, "initializer_range", default=0.02)),
        tie_embeddings=bool(_get(text, "tie_word_embeddings", default=d.get("tie_word_embeddings", False))),
        qat={"expert_weights": "mxfp4"} if _mxfp4_experts(d, text) else {},
    )
    missing = [k for k, v in fields.items() if v is None and k != "gate_lower_bound"]
    if missing:
        raise CheckpointFormatError(f"{where}: no value for k3's {missing}; the config lacks the released keys "
                                    "they come from (hidden_size, num_hidden_layers, vocab_size, ...)")
    try:
        return K3Config.from_dict(fields)
    except K3ConfigError as e:
        raise CheckpointFormatError(f"{where}: describes a model k3 cannot build: {e}") from None


def _mxfp4_experts(d: dict, text: dict) -> bool:
    q = d.get("quantization_config") or text.get("quantization_config")
    if not q:
        return False
    if q.get("quant_method") != "compressed-tensors" or q.get("format") != "mxfp4-pack-quantized":
        raise CheckpointFormatError(f"config.json: quantization_config {q.get('quant_method')!r} / "
                                    f"{q.get('format')!r} is not one k3 reads; it reads compressed-tensors "
                                    "mxfp4-pack-quantized routed experts (K3's release)")
    return True


def released_type(config: K3Config) -> str:
    """kimi_linear when the model has none of K3's additions, else kimi_k3."""
    plain = (config.attnres == "none" and config.hidden_act == "silu" and config.moe == "standard"
             and not config.use_full_rank_gate and config.gate_lower_bound is None)
    return "kimi_linear" if plain else "kimi_k3"


TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def token_ids(d: dict) -> dict:
    """bos/eos/pad_token_id of a released config.json (a kimi_k3 text_config's, else the top level's)."""
    text = d.get("text_config", d) if d.get("model_type") == "kimi_k3" else d
    return {k: text.get(k, d.get(k)) for k in TOKEN_KEYS}


def kimi_config(config: K3Config, model_type: str | None = None, token_ids: dict | None = None) -> dict:
    """The released config.json for a k3 config (refusing what the release cannot say); `token_ids` gives
    bos/eos/pad_token_id (default: k3's tokenizer's, <|bos|> 0, <|eos|> 1, <|pad|> 2)."""
    mt = model_type or released_type(config)
    if mt not in KIMI_TYPES:
        raise CheckpointFormatError(f"model_type {mt!r}: write one of {KIMI_TYPES}")
    c = config

    def refuse(field, why):
        raise CheckpointFormatError(f"{c.name}: {field} = {getattr(c, field)!r} {why}; the released layout has "
                                    "no place for it")

    if c.kda_gate_bias:
        refuse("kda_gate_bias", "(k3's earlier output-gate bias)")
    if c.kda_norm_eps != c.norm_eps:
        refuse("kda_norm_eps", f"differs from norm_eps = {c.norm_eps} (the release's one rms_norm_eps)")
    if c.mla_norm_eps != 1e-6:
        refuse("mla_norm_eps", "is not the released modeling code's fixed 1e-6")
    if c.kda_gate_rank != c.kda_head_dim:
        refuse("kda_gate_rank", f"differs from kda_head_dim = {c.kda_head_dim} (the release's gate rank)")
    if c.attnres == "full":
        refuse("attnres", "(Full AttnRes)")
    if c.n_shared_experts and c.shared_ffn != c.expert_ffn:
        refuse("shared_ffn", f"differs from expert_ffn = {c.expert_ffn} (one moe_intermediate_size for both)")
    if c.qat.get("activations") not in (None, "none") or c.qat.get("linears") not in (None, "none"):
        refuse("qat", "quantizes more than the routed-expert weights")
    if c.qat.get("expert_weights") == "mxfp8":
        refuse("qat", "packs the experts in MXFP8 (the release ships MXFP4)")
    if mt == "kimi_linear" and released_type(c) != "kimi_linear":
        raise CheckpointFormatError(f"{c.name} has K3's additions (AttnRes, SiTU, LatentMoE or the K3 KDA gates); "
                                    "kimi_linear cannot hold them: write kimi_k3")
    mla = [i + 1 for i, k in enumerate(c.pattern) if k != KDA]
    la = {"full_attn_layers": mla, "kda_layers": [i + 1 for i, k in enumerate(c.pattern) if k == KDA],
          "num_heads": c.kda_heads, "head_dim": c.kda_head_dim, "short_conv_kernel_size": c.kda_conv_size}
    if c.gate_lower_bound is not None:
        la["gate_lower_bound"] = c.gate_lower_bound
    if c.use_full_rank_gate:
        la["use_full_rank_gate"] = True
    text = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.mla_heads, "num_key_value_heads": c.mla_heads,
        "q_lora_rank": c.mla_q_lora_rank or None, "kv_lora_rank": c.mla_kv_lora_rank,
        "qk_nope_head_dim": c.mla_qk_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.mla_v_head_dim, "mla_use_nope": True,
        "intermediate_size": c.dense_ffn, "first_k_dense_replace": c.n_dense_layers, "moe_layer_freq": 1,
        "num_experts": c.n_experts, "num_experts_per_token": c.n_active_experts,
        "num_shared_experts": c.n_shared_experts, "moe_intermediate_size": c.expert_ffn,
        "routed_scaling_factor": c.routed_scale, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
        "num_expert_group": 1, "topk_group": 1, "hidden_act": c.hidden_act,
        "rms_norm_eps": c.norm_eps, "initializer_range": c.init_std, "tie_word_embeddings": c.tie_embeddings,
        "max_position_embeddings": c.max_context, "model_max_length": c.max_context,
        "num_nextn_predict_layers": 0, "linear_attn_config": la, "torch_dtype": "float32",
        **(token_ids if token_ids is not None else {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}),
    }
    if c.mla_use_output_gate:
        text["mla_use_output_gate"] = True
    if c.hidden_act == "situ":
        text.update(activation_situ_beta=c.situ_beta, activation_situ_linear_beta=c.situ_linear_beta)
    if c.moe == "latent":
        text.update(routed_expert_hidden_size=c.moe_latent_dim, latent_moe_use_norm=c.latent_moe_use_norm)
    if c.attnres == "block":
        text["attn_res_block_size"] = c.attnres_block_size
    if mt == "kimi_linear":
        return text
    out = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
           "tie_word_embeddings": c.tie_embeddings, **{k: text[k] for k in TOKEN_KEYS if k in text}}
    if c.qat.get("expert_weights") == "mxfp4":
        out["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                "num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True,
                "dynamic": False, "scale_dtype": "torch.uint8", "observer": "minmax"}}},
            # everything but the routed experts stays unquantized
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                       "re:.*block_sparse_moe\\.gate.*", "re:.*routed_expert_.*", "re:.*lm_head.*"]}
    return out


# ---------------------------------------------------------------------------------------------- tensor map
@dataclass
class Entry:
    """One k3 tensor and the released tensor(s) it is stored as. `to_k3(list) -> tensor`, `to_kimi(tensor) ->
    list`, in the order of `names`; `alt` lists other accepted spellings of each name (read only)."""

    k3: str
    names: list[str]
    to_k3: Callable[[list[torch.Tensor]], torch.Tensor]
    to_kimi: Callable[[torch.Tensor], list[torch.Tensor]]
    alt: dict[str, str] | None = None


def _same(k3: str, name: str, alt: dict | None = None) -> Entry:
    return Entry(k3, [name], lambda ts: ts[0], lambda t: [t], alt)


def tensor_map(config: K3Config, model_type: str, packed: bool) -> list[Entry]:
    """Every tensor of the k3 model `config` describes, in order, with its released name(s)."""
    c = config
    P = K3_PREFIX if model_type == "kimi_k3" else ""
    m = P + "model."
    out = [_same("embed.weight", m + "embed_tokens.weight")]
    H, K = c.kda_heads, c.kda_head_dim
    for i, kind in enumerate(c.pattern):
        L, s = f"layers.{i}.", f"{m}layers.{i}."
        a = s + "self_attn."
        out += [_same(L + "attn_norm.weight", s + "input_layernorm.weight"),
                _same(L + "ffn_norm.weight", s + "post_attention_layernorm.weight")]
        if kind == KDA:
            x = L + "mixer."
            out += [_same(x + f"{n}.weight", a + f"{n}.weight") for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            out.append(Entry(x + "conv_weight", [a + "q_conv1d.weight", a + "k_conv1d.weight", a + "v_conv1d.weight"],
                             lambda ts: torch.cat(ts, 0), lambda t: list(t.chunk(3, 0))))
            out += [_same(x + "alpha_down.weight", a + "f_a_proj.weight"),
                    _same(x + "alpha_up.weight", a + "f_b_proj.weight"),
                    _same(x + "beta_proj.weight", a + "b_proj.weight"),
                    _same(x + "dt_bias", a + "dt_bias"), _same(x + "norm_weight", a + "o_norm.weight")]
            shape = (1, 1, H, 1) if model_type == "kimi_linear" else (H,)
            out.append(Entry(x + "A_log", [a + "A_log"], lambda ts, H=H: _a_log(ts[0], H),
                             lambda t, shape=shape: [t.reshape(shape)]))
            if c.use_full_rank_gate:
                out.append(_same(x + "g_proj.weight", a + "g_proj.weight"))
            else:
                out += [_same(x + "gate_down.weight", a + "g_a_proj.weight"),
                        _same(x + "gate_up.weight", a + "g_b_proj.weight")]
        else:
            x = L + "mixer."
            q = ([("wq_a", "q_a_proj"), ("wq_b", "q_b_proj")] if c.mla_q_lora_rank else [("wq", "q_proj")])
            out += [_same(x + f"{k}.weight", a + f"{r}.weight") for k, r in q]
            if c.mla_q_lora_rank:
                out.append(_same(x + "q_norm.weight", a + "q_a_layernorm.weight"))
            out += [_same(x + "wkv_a.weight", a + "kv_a_proj_with_mqa.weight"),
                    _same(x + "kv_norm.weight", a + "kv_a_layernorm.weight"),
                    _same(x + "wkv_b.weight", a + "kv_b_proj.weight"), _same(x + "wo.weight", a + "o_proj.weight")]
            if c.mla_use_output_gate:
                out.append(_same(x + "w_gate.weight", a + "g_proj.weight"))
        f = L + "ffn."
        if not c.is_moe_layer(i):
            out += [_same(f + f"{k}.weight", s + f"mlp.{r}.weight", {s + f"mlp.{r}.weight": s + f"block_sparse_moe.{r}.weight"})
                    for k, r in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))]
        else:
            b = s + "block_sparse_moe."
            out += [_same(f + "router.weight", b + "gate.weight"),
                    _same(f + "router.bias", b + "gate.e_score_correction_bias")]
            out += _expert_entries(f + "experts.", b + "experts.", c.n_experts, packed)
            if c.moe == "latent":
                out += [_same(f + "w_down.weight", b + "routed_expert_down_proj.weight"),
                        _same(f + "w_up.weight", b + "routed_expert_up_proj.weight")]
                if c.latent_moe_use_norm:
                    out.append(_same(f + "latent_norm.weight", b + "routed_expert_norm.weight"))
            if c.n_shared_experts:
                out += [_same(f + f"shared.{k}.weight", b + f"shared_experts.{r}.weight")
                        for k, r in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))]
        if c.attnres == "block":
            for j, part in ((2 * i, "self_attention_res"), (2 * i + 1, "mlp_res")):
                out += [Entry(f"attnres.pseudo_query.{j}", [s + f"{part}_proj.weight"], lambda ts: ts[0].reshape(-1),
                              lambda t: [t.reshape(1, -1)]),
                        _same(f"attnres.key_norm.{j}", s + f"{part}_norm.weight")]
    out.append(_same("norm.weight", m + "norm.weight"))
    if c.attnres == "block":
        j = 2 * c.n_layers
        out += [Entry(f"attnres.pseudo_query.{j}", [m + "output_attn_res_proj.weight"], lambda ts: ts[0].reshape(-1),
                      lambda t: [t.reshape(1, -1)]),
                _same(f"attnres.key_norm.{j}", m + "output_attn_res_norm.weight")]
    if not c.tie_embeddings:
        out.append(_same("head.weight", P + "lm_head.weight"))
    return out


def _a_log(t: torch.Tensor, H: int) -> torch.Tensor:
    """A_log as released: [1, 1, H, 1] (Kimi-Linear), [H], or K3's [P >= H] whose entries past H are zero."""
    flat = t.reshape(-1)
    if flat.numel() > H and bool(flat[H:].ne(0).any()):
        raise CheckpointFormatError(f"A_log holds {flat.numel()} values, {H} heads, and the padding is not zero")
    return flat[:H]


def _expert_entries(k3: str, rel: str, E: int, packed: bool) -> list[Entry]:
    """Stacked k3 experts <-> one released tensor per expert (transposed: the release stores [out, in])."""
    out = []
    for w in ("w1", "w3", "w2"):
        if packed:  # k3's packed codes are already [E, out, in/2] and [E, out, in/32]: per expert, as released
            for part, sfx in (("codes", "weight_packed"), ("scales", "weight_scale")):
                out.append(Entry(f"{k3}{w}_{part}", [f"{rel}{e}.{w}.{sfx}" for e in range(E)],
                                 lambda ts: torch.stack(ts), lambda t: list(t.unbind(0))))
        else:
            out.append(Entry(f"{k3}{w}", [f"{rel}{e}.{w}.weight" for e in range(E)],
                             lambda ts: torch.stack(ts).transpose(1, 2), lambda t: list(t.transpose(1, 2).unbind(0))))
    return out


# ---------------------------------------------------------------------------------------------- reading
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsFile:
    """One safetensors file read tensor by tensor with plain reads at the header's offsets (the format: an 8-byte
    little-endian header length, a JSON header, the data). Nothing stays mapped: a checkpoint many times the RAM
    streams through in the memory of one tensor. The header is checked against the file size up front, so a
    truncated file is named before any tensor is read. `safetensors.safe_open` is the reference in the tests."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if n < 2 or 8 + n > size:
                    raise ValueError(f"header length {n} for a file of {size} bytes")
                header = loads_json(f.read(n))
        except (OSError, ValueError) as e:
            raise CheckpointFormatError(f"{path}: not a readable safetensors file ({e}); the file is truncated or "
                                        "damaged: fetch it again") from None
        header.pop("__metadata__", None)
        self.start, self.meta = 8 + n, header
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if self.start + end > size:
            raise CheckpointFormatError(f"{path}: the header describes {self.start + end} bytes, the file holds {size}; "
                                        "it is truncated: fetch it again")
        for k, v in header.items():
            if v.get("dtype") not in _DTYPES:
                raise CheckpointFormatError(f"{path}: tensor {k} has dtype {v.get('dtype')!r}, which k3 does not read")

    def keys(self):
        return self.meta.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.meta[key]["shape"])

    def get(self, key: str) -> torch.Tensor:
        m = self.meta[key]
        begin, end = m["data_offsets"]
        buf = bytearray(end - begin)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.start + begin)
            got = f.readinto(buf)
        if got != len(buf):
            raise CheckpointFormatError(f"{self.path}: tensor {key} ends past the file; it is truncated: fetch it again")
        dtype = _DTYPES[m["dtype"]]
        t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        return t.reshape(m["shape"])


class Tensors:
    """The safetensors of a folder (one file or shards named by the index), read one tensor at a time. Every
    problem is named with the file: a missing or truncated shard, an index naming a shard that is not there."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / INDEX
        if index.is_file():
            data = _read_json(index)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointFormatError(f"{index}: no weight_map object; an index maps each tensor to its shard")
            files = sorted(set(weight_map.values()))
        elif (folder / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            raise CheckpointFormatError(f"{folder}: neither {SINGLE} nor {INDEX}; a released checkpoint folder holds "
                                        "its tensors in one of them")
        self.files, self.where = {}, {}
        for name in files:
            path = folder / name
            if not path.is_file():
                raise CheckpointFormatError(f"{index}: names shard {name}, which is not in {folder} (an incomplete "
                                            "download or copy?); fetch it again")
            self.files[name] = SafetensorsFile(path)
            for k in self.files[name].keys():
                self.where[k] = name
        if weight_map is not None:
            lost = sorted(k for k, f in weight_map.items() if self.where.get(k) != f)
            if lost:
                raise CheckpointFormatError(f"{index}: {len(lost)} tensor(s) it lists are not in their shard, e.g. "
                                            f"{lost[:3]}; the index and the shards do not belong together")

    def keys(self) -> set[str]:
        return set(self.where)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.files[self.where[key]].shape(key)

    def get(self, key: str) -> torch.Tensor:
        return self.files[self.where[key]].get(key)


def _read_json(path: Path):
    try:
        with open(path, encoding="utf-8") as f:
            return loads_json(f.read())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointFormatError(f"{path}: not readable JSON ({type(e).__name__}: {e}); fetch the file again") \
            from None


def config_model_type(path: str | os.PathLike) -> str | None:
    """The model_type of `path`/config.json, or None when there is no readable config object."""
    try:
        d = loads_json((Path(path) / "config.json").read_text(encoding="utf-8"))  # bounded nesting
    except (OSError, ValueError):
        return None
    return d.get("model_type") if isinstance(d, dict) else None


def is_kimi_folder(path: str | os.PathLike) -> bool:
    return config_model_type(path) in KIMI_TYPES


def _resolve_names(entries: list[Entry], tensors: Tensors, where: Path) -> dict[str, str]:
    """Each expected released name -> the name present (an accepted alternative spelling); missing and extra
    tensors listed, before anything is read."""
    present = tensors.keys()
    chosen, missing = {}, []
    for e in entries:
        for n in e.names:
            alt = (e.alt or {}).get(n)
            if n in present:
                chosen[n] = n
            elif alt in present:
                chosen[n] = alt
            else:
                missing.append(n)
    extra = sorted(present - set(chosen.values()))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if extra:
            parts.append(f"{len(extra)} not part of the model config.json describes: {extra[:8]}"
                         f"{' ...' if len(extra) > 8 else ''}")
        raise CheckpointFormatError(f"{where}: the tensors do not match config.json: " + "; ".join(parts)
                                    + "; the folder and its config.json must come from the same model")
    return chosen


def read_config(path: Path) -> tuple[dict, K3Config]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointFormatError(f"{path}: no config.json; a released checkpoint folder holds one")
    d = _read_json(cfg_path)
    if not isinstance(d, dict):
        raise CheckpointFormatError(f"{cfg_path}: holds a JSON {type(d).__name__}, not a config object")
    return d, config_from_kimi(d, str(cfg_path), name=path.name or None)


def load_kimi(path: str | os.PathLike, dtype: torch.dtype | None = None, device="cpu"):
    """K3Model (eval mode) from a released-layout folder; MXFP4 experts stay packed (k3's PackedRoutedExperts).
    Names, shapes and shards are checked before any tensor is read; `device="meta"` reads none."""
    from k3.model.transformer import K3Model
    from k3.quant.export import build_packed_model

    path = Path(path)
    d, config = read_config(path)
    mt = d["model_type"]
    packed = bool(config.qat.get("expert_weights"))
    with torch.device("meta"):
        model = build_packed_model(config) if packed else K3Model(config)
    entries = tensor_map(config, mt, packed)
    if str(device) == "meta":
        return model.eval()
    tensors = Tensors(path)
    chosen = _resolve_names(entries, tensors, path)
    want = dict(model.state_dict(keep_vars=True))
    for e in entries:  # every shape before any data
        got = _converted_shape(e, [tensors.shape(chosen[n]) for n in e.names])
        if got is not None and tuple(want[e.k3].shape) != got:
            raise CheckpointFormatError(f"{path}: {e.names[0]}{' ...' if len(e.names) > 1 else ''} has shape "
                                        f"{got} as k3's {e.k3}, but config.json wants {tuple(want[e.k3].shape)}")
    model = fill_model(model.to_empty(device=device), entries, tensors, chosen, path)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def fill_model(model, entries, tensors, chosen: dict, path) -> torch.nn.Module:
    """Copy each entry's released tensors, converted to k3's form, into `model` (allocated, e.g. by to_empty);
    the buffers a checkpoint does not hold are reset."""
    state = model.state_dict()  # views of the parameters and persistent buffers
    with torch.no_grad():
        for e in entries:
            t = e.to_k3([tensors.get(chosen[n]) for n in e.names])
            if tuple(t.shape) != tuple(state[e.k3].shape):
                raise CheckpointFormatError(f"{path}: {e.names[0]}: as k3's {e.k3} it has shape {tuple(t.shape)}, "
                                            f"config.json wants {tuple(state[e.k3].shape)}")
            state[e.k3].copy_(t)
        _reset_unsaved(model)
    return model


def _converted_shape(e: Entry, shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The k3 shape `e.to_k3` will produce, from the released shapes alone (None: check after conversion)."""
    metas = [torch.empty(s, device="meta") for s in shapes]
    try:
        return tuple(e.to_k3(metas).shape)
    except CheckpointFormatError:
        raise
    except Exception:  # noqa: BLE001  (e.g. A_log's padding check needs values)
        return None


def _reset_unsaved(model) -> None:
    """The router state the release does not hold comes back from to_empty uninitialised: balancing counters start
    at zero, and the quantile histogram's range is the release's [min b - 1, max b + 1] of the loaded bias."""
    from k3.model.moe import Router

    for m in model.modules():
        if isinstance(m, Router):
            m._load_acc.zero_()
            if hasattr(m, "_qb_hist"):
                m._qb_hist.zero_()
                b = m.bias.float()
                m.qb_bounds.copy_(torch.stack([b.min() - 1, b.max() + 1]))


# ---------------------------------------------------------------------------------------------- writing
def kimi_tensors(config: K3Config, get: Callable[[str], torch.Tensor], model_type: str,
                 dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(released name, tensor) in order, asking `get(k3_name)` for one k3 tensor at a time (streaming)."""
    packed = bool(config.qat.get("expert_weights"))
    for e in tensor_map(config, model_type, packed):
        t = get(e.k3)
        for name, r in zip(e.names, e.to_kimi(t)):
            r = r.contiguous()
            if dtype is not None and r.is_floating_point() and not name.endswith(("e_score_correction_bias", "A_log",
                                                                                  "dt_bias")):
                r = r.to(dtype)
            yield name, r


def write_safetensors(items: Iterable[tuple[str, torch.Tensor]], out: Path, max_shard_bytes: int = 1 << 30,
                      metadata: dict | None = None) -> None:
    """Write (name, tensor) pairs as shards of at most `max_shard_bytes` (one file when they fit), holding one
    shard's tensors at a time, plus the index when there is more than one shard."""
    from safetensors.torch import save_file

    shards, current, size, weight_map, total = [], {}, 0, {}, 0
    tmp_names = []

    def flush():
        nonlocal current, size
        if not current:
            return
        name = f"model-{len(tmp_names) + 1:05d}.safetensors"
        save_file(current, str(out / name), metadata={"format": "pt", **(metadata or {})})
        tmp_names.append(name)
        for k in current:
            weight_map[k] = name
        current, size = {}, 0

    for name, t in items:
        n = t.numel() * t.element_size()
        if current and size + n > max_shard_bytes:
            flush()
        current[name] = t
        size += n
        total += n
    flush()
    if len(tmp_names) == 1:
        os.replace(out / tmp_names[0], out / SINGLE)
        return
    count = len(tmp_names)
    final = {}
    for i, name in enumerate(tmp_names):
        new = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        os.replace(out / name, out / new)
        final[name] = new
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}
    (out / INDEX).write_text(json.dumps(index, indent=2), encoding="utf-8")
