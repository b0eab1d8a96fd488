"""K3Config: the one object that drives every part of k3.

Presets are data (`PRESETS`), not subclasses. `validate()` raises `K3ConfigError` naming the field and
the fix. It runs where a config is made (`from_dict`, `replace`, `get_config`) and where a model is built from
one (`K3Model`), so an inconsistent config fails before any tensor exists; the layers trust it.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields


# the Python type each annotation names (annotations are strings here); an int is accepted as a float
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "bool": bool, "str": str,
                                                    "dict": dict, "float | None": (int, float, type(None))}


class K3ConfigError(ValueError):
    """A configuration that cannot describe a valid K3 model; the message names the field and the fix."""


KDA, MLA = "K", "M"
MAX_DIM = 2 ** 31 - 1  # the largest integer config value (a dimension or count) that validate() accepts


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1 in increasing order, by trial division up to sqrt(n) (a layout error listing the sizes
    that fit a world of 10^12 ranks counted to 10^12)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


@dataclass
class K3Config:
    name: str = "custom"
    vocab_size: int = 512
    d_model: int = 64
    n_layers: int = 4
    max_context: int = 2048

    # Sequence mixing. `layer_pattern` is one letter per layer, K = KDA, M = Gated MLA. Empty means the
    # Kimi Linear rule: every `mla_every`-th layer (1-indexed) and the last layer are MLA, the rest KDA.
    layer_pattern: str = ""
    mla_every: int = 4

    # KDA (Kimi Delta Attention): heads x head_dim for q/k/v, short causal conv, low-rank forget gate.
    kda_heads: int = 2
    kda_head_dim: int = 32
    kda_conv_size: int = 4
    kda_gate_rank: int = 32  # rank of the low-rank forget gate (f_a/f_b) and of the low-rank output gate
    # K3's bounded forget gate: log-decay g = gate_lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), in
    # (gate_lower_bound, 0). None: Kimi-Linear's unbounded g = -exp(A_log) * softplus(f + dt_bias).
    gate_lower_bound: float | None = -5.0
    # K3's full-rank output gate (one g_proj d -> H*K); false: Kimi-Linear's low-rank g_a/g_b of kda_gate_rank.
    use_full_rank_gate: bool = True
    kda_gate_bias: bool = False  # a bias on the low-rank output gate's up-projection (k3's earlier form)

    # Gated MLA: low-rank q (0 = full-rank q) and kv compression, NoPE, sigmoid output gate.
    mla_heads: int = 2
    mla_q_lora_rank: int = 32
    mla_kv_lora_rank: int = 32
    mla_qk_head_dim: int = 32  # the release's qk_nope_head_dim: the per-head query/key dims from the latent
    mla_v_head_dim: int = 32
    # The release's qk_rope_head_dim: a key slice of this width that kv_a_proj_with_mqa emits beside the latent,
    # shared by all heads and cached with it; the layers are NoPE, so it is never rotated. 0: no shared key.
    qk_rope_head_dim: int = 16
    # eps of the RMSNorms on MLA's q and kv latents: 1e-6 in the released modeling code (its RMSNorm default, not
    # rms_norm_eps); a config saved before this field existed gets norm_eps, what MLA used then
    mla_norm_eps: float = 1e-6
    # The release's mla_use_output_gate: o = attention * sigmoid(g_proj x) before o_proj (K3); Kimi-Linear has none.
    mla_use_output_gate: bool = True

    # Depth mixing: Block Attention Residuals. `attnres_sources` counts the embedding plus one source per
    # block, so the layers are grouped into `attnres_sources - 1` blocks of ceil(n_layers / blocks) layers.
    attnres: str = "block"  # block | full | none
    attnres_sources: int = 3
    # The release's attn_res_block_size: layers per block. 0 derives it from attnres_sources; when set,
    # attnres_sources must be ceil(n_layers / attn_res_block_size) + 1 (validate() names the value).
    attn_res_block_size: int = 0

    # Channel mixing: the first `n_dense_layers` layers use a dense GLU MLP, the rest (Latent)MoE.
    # hidden_act: the GLU of every MLP and expert. "situ" (K3): beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta)
    # with beta = situ_beta, lbeta = situ_linear_beta; "silu": SwiGLU, silu(g) * u.
    hidden_act: str = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    n_dense_layers: int = 1
    dense_ffn: int = 128
    moe: str = "latent"  # latent | standard
    moe_latent_dim: int = 32  # the latent width l; LatentMoE dispatches l-dim vectors (standard: d_model)
    # K3's "Stable" LatentMoE: an RMSNorm (routed_expert_norm) on the combined latent before the up-projection
    # (read by moe = latent only; a standard MoE has no latent to normalise)
    latent_moe_use_norm: bool = True
    n_experts: int = 8
    n_active_experts: int = 2
    expert_ffn: int = 64
    n_shared_experts: int = 1
    shared_ffn: int = 64  # intermediate width of each shared expert (works at full d_model)
    routed_scale: float = 1.0
    router_score: str = "sigmoid"
    balancing: str = "bias"  # none | aux_loss | bias | quantile
    bias_update_rate: float = 1e-3  # DeepSeek-V3's gamma for the auxiliary-loss-free bias
    aux_loss_coef: float = 1e-4  # DeepSeek-V3's sequence-wise balance loss alpha (used by aux_loss)
    # Quantile balancing's estimator of b_j = quantile(alpha_i - s_ij, k/E): "histogram" (as released in
    # Megatron-LM: `quantile_bins` bins over [min b - 1, max b + 1], summed over ranks), or "exact" (sorting,
    # one process; k3's earlier form, histograms over a fixed range when distributed).
    quantile_estimator: str = "histogram"
    quantile_bins: int = 1000

    norm_eps: float = 1e-6
    # eps of KDA's gated output RMSNorm. At initialisation the KDA output is tiny (per-head RMS about 5e-4 on
    # `mini`), so this norm multiplies it, and the gradient flowing back into it, by up to 1 / sqrt(eps):
    # with 1e-6 that gain (about 900) caused the gradient spikes that stalled `mini` runs (docs/architecture.md,
    # "KDA output norm eps"). A saved config that predates this field gets norm_eps, what KDA used then.
    kda_norm_eps: float = 1e-4
    init_std: float = 0.02
    tie_embeddings: bool = False
    # QAT settings, e.g. {"expert_weights": "mxfp4", "activations": "mxfp8"}; empty = full precision.
    qat: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ derived quantities
    @property
    def pattern(self) -> str:
        if self.layer_pattern:
            return self.layer_pattern
        return "".join(
            MLA if ((i + 1) % self.mla_every == 0 or i == self.n_layers - 1) else KDA
            for i in range(self.n_layers)
        )

    @property
    def n_kda_layers(self) -> int:
        return self.pattern.count(KDA)

    @property
    def n_mla_layers(self) -> int:
        return self.pattern.count(MLA)

    @property
    def attnres_blocks(self) -> int:
        return self.attnres_sources - 1

    @property
    def attnres_block_size(self) -> int:
        """Layers per AttnRes block (the last block may be shorter): attn_res_block_size when set."""
        return self.attn_res_block_size or math.ceil(self.n_layers / self.attnres_blocks)

    @property
    def mla_cache_dim(self) -> int:
        """Values an MLA layer caches per token: the latent plus the shared key (576 in K3)."""
        return self.mla_kv_lora_rank + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.moe_latent_dim if self.moe == "latent" else self.d_model

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.n_dense_layers

    # ------------------------------------------------------------------ validation
    def validate(self) -> "K3Config":
        def bad(name: str, why: str, fix: str) -> None:
            label = self.name if isinstance(self.name, str) and self.name.strip() else "config"
            raise K3ConfigError(f"{label}: {name} = {getattr(self, name, None)!r} {why}; {fix}")

        for f in fields(self):
            v = getattr(self, f.name)
            want = _FIELD_TYPES[f.type]
            ok = isinstance(v, want) and not (isinstance(v, bool) and want is not bool)
            if not ok:
                kind, example = {"int": ("an integer", "4"), "float": ("a number", "0.5"), "bool": ("true or false", "true"),
                                 "str": ("a string", f.default or "KKKM"),
                                 "dict": ("a JSON object", '\'{"expert_weights": "mxfp4"}\''),
                                 "float | None": ("a number or null", "-5.0")}[f.type]
                bad(f.name, f"is of type {type(v).__name__}, but must be {kind}",
                    f"give {kind}, e.g. --set {f.name}={example} (values are read as JSON)")
        if not self.name.strip():
            bad("name", "is empty", "give the config a name, e.g. --set name=custom")
        positive = [
            "vocab_size", "d_model", "n_layers", "max_context", "kda_heads", "kda_head_dim",
            "kda_conv_size", "kda_gate_rank", "mla_heads", "mla_kv_lora_rank", "mla_qk_head_dim",
            "mla_v_head_dim", "dense_ffn", "n_experts", "n_active_experts",
            "expert_ffn", "mla_every",
        ]
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(name, "must be a positive integer", f"set {name} to a value >= 1")
        for f in fields(self):  # a typo's extra digits: torch cannot build the tensors (an overflow traceback)
            v = getattr(self, f.name)
            if f.type == "int" and v > MAX_DIM:
                bad(f.name, "is larger than 2^31 - 1", "no tensor dimension (or count) this large can be "
                    "built; check the value for a typo")
        for what, n in [("vocab_size x d_model", self.vocab_size * self.d_model),
                        ("n_experts x expert_ffn x d_model", self.n_experts * self.expert_ffn * self.d_model)]:
            if n >= 2 ** 62:
                bad(what.split(" x ")[0], f"makes a tensor of {what} = {n} elements, more than torch can index",
                    "lower these sizes")
        for name in ["mla_q_lora_rank", "n_shared_experts", "n_dense_layers", "qk_rope_head_dim",
                     "attn_res_block_size"]:
            if getattr(self, name) < 0:
                bad(name, "must be >= 0", f"set {name} to 0 to disable it")
        for name in ["routed_scale", "norm_eps", "kda_norm_eps", "mla_norm_eps", "init_std", "situ_beta",
                     "situ_linear_beta"]:
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                bad(name, "must be a finite number > 0", f"set {name} to a finite value > 0")
        for name in ["bias_update_rate", "aux_loss_coef"]:
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                bad(name, "must be a finite number >= 0", f"set {name} to 0 to disable it")
        lb = self.gate_lower_bound
        if lb is not None and not (lb < 0 and math.isfinite(lb)):
            bad("gate_lower_bound", "must be a finite number < 0 (the log-decay lies in (gate_lower_bound, 0))",
                "use K3's -5.0, or null for Kimi-Linear's unbounded softplus gate")
        if self.kda_gate_bias and self.use_full_rank_gate:
            bad("kda_gate_bias", "is true, but only the low-rank output gate has a bias (use_full_rank_gate is true)",
                "set kda_gate_bias = false, or use_full_rank_gate = false")
        if self.hidden_act not in ("situ", "silu"):
            bad("hidden_act", "is not one of situ, silu", "pick hidden_act = situ (K3) | silu (SwiGLU)")
        if self.quantile_estimator not in ("histogram", "exact"):
            bad("quantile_estimator", "is not one of histogram, exact", "pick quantile_estimator = histogram | exact")
        if self.quantile_bins < 2:
            bad("quantile_bins", "must be an integer >= 2", "use the release's 1000")
        if self.n_shared_experts > 0 and self.shared_ffn <= 0:
            bad("shared_ffn", "must be positive when n_shared_experts > 0", "set shared_ffn or n_shared_experts = 0")
        if self.layer_pattern:
            if len(self.layer_pattern) != self.n_layers:
                bad("layer_pattern", f"has {len(self.layer_pattern)} letters but n_layers = {self.n_layers}",
                    "give one letter (K or M) per layer, or leave layer_pattern empty to use mla_every")
            if set(self.layer_pattern) - {KDA, MLA}:
                bad("layer_pattern", "may only contain 'K' (KDA) and 'M' (MLA)", "use letters K and M")
        if self.attnres not in ("block", "full", "none"):
            bad("attnres", "is not one of block, full, none", "pick attnres = block | full | none")
        v = self.attnres_sources
        if not isinstance(v, int) or isinstance(v, bool) or v < 2:  # checked once: ">= 1" here would mislead
            bad("attnres_sources", "must be an integer >= 2 (the embedding and at least one block)",
                "set attnres_sources >= 2")
        if self.attnres == "block" and self.attnres_sources > self.n_layers + 1:  # only block mode reads it
            bad("attnres_sources", f"exceeds n_layers + 1 = {self.n_layers + 1} (embedding + one block per layer)",
                "use fewer sources, or attnres = full for one source per sublayer")
        if self.attnres == "block" and self.attn_res_block_size > 0:
            real = math.ceil(self.n_layers / self.attn_res_block_size)
            if real != self.attnres_blocks:
                bad("attnres_sources", f"asks for {self.attnres_blocks} blocks, but attn_res_block_size = "
                    f"{self.attn_res_block_size} tiles n_layers = {self.n_layers} into {real}",
                    f"use attnres_sources = {real + 1} (the blocks plus the embedding), or attn_res_block_size = 0")
        elif self.attnres == "block" and math.ceil(self.n_layers / self.attnres_block_size) != self.attnres_blocks:
            real = math.ceil(self.n_layers / self.attnres_block_size)
            bad("attnres_sources", f"asks for {self.attnres_blocks} blocks, but blocks of ceil({self.n_layers}/"
                f"{self.attnres_blocks}) = {self.attnres_block_size} layers give only {real}",
                f"use attnres_sources = {real + 1}, or a count whose blocks tile n_layers")
        if self.moe not in ("latent", "standard"):
            bad("moe", "is not one of latent, standard", "pick moe = latent | standard")
        if self.n_active_experts > self.n_experts:
            bad("n_active_experts", f"(top-k) exceeds n_experts = {self.n_experts}",
                "lower n_active_experts or raise n_experts")
        if self.moe == "latent":
            if self.moe_latent_dim <= 0 or self.d_model % self.moe_latent_dim != 0:
                bad("moe_latent_dim", f"must be positive and divide d_model = {self.d_model}",
                    "pick a latent width such as d_model // 2")
        if self.n_dense_layers > self.n_layers:
            bad("n_dense_layers", f"exceeds n_layers = {self.n_layers}", "lower n_dense_layers")
        if self.balancing not in ("none", "aux_loss", "bias", "quantile"):
            bad("balancing", "is not one of none, aux_loss, bias, quantile", "pick one of those")
        if self.router_score != "sigmoid":
            bad("router_score", "is not supported", "use router_score = 'sigmoid'")
        for k, v in self.qat.items():
            if k not in ("expert_weights", "activations", "linears"):
                raise K3ConfigError(f"{self.name}: qat key {k!r} is unknown; use expert_weights, activations or linears")
            if v not in ("mxfp4", "mxfp8", "none", None):
                raise K3ConfigError(f"{self.name}: qat.{k} = {v!r} is unknown; use mxfp4, mxfp8 or none")
        return self

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "K3Config":
        if not isinstance(d, dict):
            raise K3ConfigError(f"a config is a JSON object of fields, got a {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise K3ConfigError(f"unknown config field(s) {unknown}; valid fields: {sorted(known)}")
        if is_complete_config(d):
            # a complete config saved before a field existed (checkpoints, exports) gets what the model computed
            # then: KDA's output norm used norm_eps, and the layer forms were k3's earlier (pre-release) ones
            legacy = {**LEGACY_FORMS, "kda_norm_eps": d.get("norm_eps"), "mla_norm_eps": d.get("norm_eps")}
            d = {**{k: v for k, v in legacy.items() if k not in d}, **d}
        return cls(**d).validate()

    def replace(self, **changes) -> "K3Config":
        return K3Config.from_dict({**self.to_dict(), **changes})


def read_config_file(path, flag: str = "--config") -> dict:
    """The JSON object of config fields in `path` (K3ConfigError naming the flag and the file otherwise)."""
    import json

    from k3.fileio import loads_json

    try:
        with open(path, encoding="utf-8") as f:
            d = loads_json(f.read())  # a JSONDecodeError past absurd nesting
    except FileNotFoundError:
        raise K3ConfigError(f"{flag} {path}: no such file; give the path of a config JSON "
                            "(`k3 config --preset NAME > FILE.json` writes one)") from None
    except IsADirectoryError:
        raise K3ConfigError(f"{flag} {path}: is a directory; give the path of a config JSON file") from None
    except PermissionError:
        raise K3ConfigError(f"{flag} {path}: permission denied; give a config JSON you can read") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise K3ConfigError(f"{flag} {path}: not valid JSON ({e}); give a JSON object of config fields, "
                            "as `k3 config --preset NAME` prints") from None
    if not isinstance(d, dict):
        raise K3ConfigError(f"{flag} {path}: holds a JSON {type(d).__name__}, not an object of config fields; "
                            "give one as `k3 config --preset NAME` prints")
    return d


# What a config saved before these fields existed computed: Kimi-Linear's KDA gates, MLA without the shared key,
# SwiGLU, LatentMoE without the norm, quantile balancing by sorting. Presets name the released forms.
LEGACY_FORMS: dict = dict(gate_lower_bound=None, use_full_rank_gate=False, kda_gate_bias=True, qk_rope_head_dim=0,
                          mla_use_output_gate=True, hidden_act="silu",
                          latent_moe_use_norm=False, attn_res_block_size=0, situ_beta=4.0, situ_linear_beta=25.0,
                          quantile_estimator="exact", quantile_bins=2048)


def is_complete_config(d: dict) -> bool:
    """Whether a config dict names every field (those added later aside: from_dict fills them in for configs saved
    before they existed). A complete one stands alone; a partial one is laid over something (a preset, a
    checkpoint's)."""
    return set(K3Config.__dataclass_fields__) - {"kda_norm_eps", "mla_norm_eps"} - set(LEGACY_FORMS) <= set(d)


# ---------------------------------------------------------------------- presets
PRESETS: dict[str, dict] = {
    # tests: well under 2M parameters, every feature on (KDA + MLA, block AttnRes, LatentMoE, shared expert),
    # the released forms by default (the dataclass defaults)
    "tiny": dict(name="tiny"),
    # the demo model: trains on 2 CPU cores; K3's forms, K3's ratios where they fit (rope/nope 1/2, latent d/2)
    "mini": dict(
        name="mini", vocab_size=8192, d_model=256, n_layers=8, max_context=4096,
        kda_heads=4, kda_head_dim=64, kda_gate_rank=64,
        mla_heads=4, mla_q_lora_rank=128, mla_kv_lora_rank=128, mla_qk_head_dim=64, mla_v_head_dim=64,
        qk_rope_head_dim=32,
        attnres_sources=5,
        n_dense_layers=1, dense_ffn=768,
        moe_latent_dim=128, n_experts=64, n_active_experts=8, expert_ffn=256,
        n_shared_experts=1, shared_ffn=512,
    ),
    # long context on CPU: tiny widths with K3's 3:1 KDA:MLA pattern (KKKM). The one MLA layer's prefill is
    # quadratic (about T^2/2 query-key pairs), so it gets one head of 8 dims; a chunked 1,048,576-token
    # prefill then takes on the order of an hour on one core, and its cache is 64 + 8 fp32 values a token.
    "long": dict(
        name="long", n_layers=4, max_context=2_097_152,
        mla_heads=1, mla_q_lora_rank=0, mla_kv_lora_rank=64, mla_qk_head_dim=8, mla_v_head_dim=8, qk_rope_head_dim=8,
    ),
    # Kimi K3 as released: the text config of moonshotai/Kimi-K3 (docs/architecture.md gives each value's
    # source and the release's key name). Built on the meta device for counting and planning.
    "k3": dict(
        name="k3", vocab_size=163840, d_model=7168, n_layers=93, max_context=1048576,
        kda_heads=96, kda_head_dim=128, kda_gate_rank=128, kda_conv_size=4,
        gate_lower_bound=-5.0, use_full_rank_gate=True,
        mla_heads=96, mla_q_lora_rank=1536, mla_kv_lora_rank=512, mla_qk_head_dim=128, mla_v_head_dim=128,
        qk_rope_head_dim=64, mla_use_output_gate=True,
        attnres="block", attnres_sources=9, attn_res_block_size=12,
        hidden_act="situ", situ_beta=4.0, situ_linear_beta=25.0,
        n_dense_layers=1, dense_ffn=33792,
        moe="latent", moe_latent_dim=3584, latent_moe_use_norm=True,
        n_experts=896, n_active_experts=16, expert_ffn=3072,
        n_shared_experts=2, shared_ffn=3072, routed_scale=1.0,
        balancing="quantile", quantile_estimator="histogram", quantile_bins=1000,
        norm_eps=1e-5, kda_norm_eps=1e-5, mla_norm_eps=1e-6, init_std=0.02, tie_embeddings=False,
    ),
    # Kimi-Linear-48B-A3B (moonshotai/Kimi-Linear-48B-A3B-Instruct config.json; transformers' kimi_linear): plain
    # residuals, a standard MoE, SwiGLU, the unbounded low-rank KDA gates.
    "kimi-linear-48b": dict(
        name="kimi-linear-48b", vocab_size=163840, d_model=2304, n_layers=27, max_context=1048576,
        kda_heads=32, kda_head_dim=128, kda_gate_rank=128, kda_conv_size=4,
        gate_lower_bound=None, use_full_rank_gate=False, kda_gate_bias=False,
        mla_heads=32, mla_q_lora_rank=0, mla_kv_lora_rank=512, mla_qk_head_dim=128, mla_v_head_dim=128,
        qk_rope_head_dim=64, mla_use_output_gate=False,
        attnres="none", hidden_act="silu",
        n_dense_layers=1, dense_ffn=9216,
        moe="standard", latent_moe_use_norm=False, n_experts=256, n_active_experts=8, expert_ffn=1024,
        n_shared_experts=1, shared_ffn=1024, routed_scale=2.446,
        balancing="bias", norm_eps=1e-5, kda_norm_eps=1e-5, mla_norm_eps=1e-6, init_std=0.02, tie_embeddings=False,
    ),
}


def get_config(name: str, **overrides) -> K3Config:
    if name not in PRESETS:
        raise K3ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return K3Config.from_dict({**PRESETS[name], **overrides})
