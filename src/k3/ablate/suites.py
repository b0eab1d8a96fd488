"""The ablation suites as data: the base model, the groups of matched variants, and the claims they test.

A *group* varies one design choice of K3 and keeps everything else at the base config; a *variant* is a
dict of K3Config overrides (or, for post-training quantization, an evaluation of another variant's
weights). Variants that reduce to the base config are the same run (the cache key is the config), so the
base is trained once per seed and shared by every group.

Scales: `full` is the default suite (a mini-shaped model, 3 seeds), `quick` the smoke test (the tiny
shape, 2 seeds, a few dozen steps). Both read the same tokenized data as `k3 demo` (runs/data).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from k3.config import KDA, MLA, K3Config, get_config

# ---------------------------------------------------------------------------------------------- scales
# mini's depth (8 layers, KKKMKKKM = 3:1 with a final MLA), AttnRes blocks (4 blocks + embedding), MoE
# layout (first layer dense, one shared expert, latent width d/2) and vocabulary, at half mini's width and
# half its experts, so that 11 configs x 3 seeds fit in about two hours on two CPU cores.
ABLATION_SHAPE = dict(
    d_model=128, kda_heads=2, mla_heads=2, mla_q_lora_rank=64, mla_kv_lora_rank=64, kda_gate_rank=32,
    dense_ffn=384, moe_latent_dim=64, n_experts=32, n_active_experts=4, expert_ffn=128, shared_ffn=256,
)

# The quantization recipe of the precision group (the MX/QAT issue): MXFP4 expert weights, MXFP8 activations.
QAT_RECIPE = {"expert_weights": "mxfp4", "activations": "mxfp8"}


@dataclass(frozen=True)
class ProbeSettings:
    """Needle retrieval (see k3.ablate.probe): model shape, training and the evaluation lengths."""
    d_model: int = 64
    n_layers: int = 4
    n_keys: int = 8
    n_values: int = 8
    n_filler: int = 16
    train_len: int = 64
    eval_lengths: tuple[int, ...] = (32, 64, 128, 256, 512)
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    # 0.1, not the LM default 0.02: at 0.02 the q.k product starts near a saddle (both factors tiny) and a small
    # MLA model stayed at chance on this task (docs/ablations.md, "Design notes from building the probe")
    init_std: float = 0.1
    eval_batches: int = 4
    eval_batch_size: int = 16


@dataclass(frozen=True)
class Scale:
    """Everything that sizes a suite: the base model, the training run, the seeds, the probe."""
    name: str
    preset: str
    overrides: dict
    steps: int
    batch_size: int
    seq_len: int
    lr: float = 3e-3
    eval_batches: int = 16
    seeds: tuple[int, ...] = (0, 1, 2)
    probe: ProbeSettings = field(default_factory=ProbeSettings)

    def base_config(self, extra: dict | None = None) -> K3Config:
        return get_config(self.preset, **{**self.overrides, **(extra or {})})

    def train_settings(self, seed: int) -> dict:
        """TrainConfig fields of one run (everything else keeps the trainer's defaults)."""
        return dict(steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len, lr=self.lr,
                    eval_batches=self.eval_batches, seed=seed, device="cpu", measure_mfu=False,
                    record_attnres=False)

    def replace(self, **changes) -> "Scale":
        return dataclasses.replace(self, **changes)


SCALES: dict[str, Scale] = {
    "full": Scale("full", "mini", ABLATION_SHAPE, steps=300, batch_size=8, seq_len=128, seeds=(0, 1, 2),
                  probe=ProbeSettings()),
    "quick": Scale("quick", "tiny", dict(vocab_size=8192), steps=30, batch_size=4, seq_len=64, eval_batches=4,
                   seeds=(0, 1),
                   probe=ProbeSettings(n_layers=4, train_len=32, eval_lengths=(32, 64, 128), steps=60,
                                       batch_size=8, eval_batches=2)),
}


# ---------------------------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class Variant:
    label: str
    overrides: dict = field(default_factory=dict)
    ptq_of: str | None = None  # evaluate that variant's trained weights in a model built with `overrides`


@dataclass(frozen=True)
class Claim:
    """A claim of the K3 design, tested on paired seeds: metric(a) - metric(b) per seed.

    kind 'lower':  a's metric is lower than b's (the 95% CI of the mean difference lies below 0);
    kind 'higher': a's metric is higher than b's;
    kind 'within': a is worse than b by less than `margin_frac` of the gain of b over `margin_ref`
                   (non-inferiority; the margin is measured in the same run, not assumed).
    """
    id: str
    text: str
    source: str
    a: str
    b: str
    metric: str = "val_loss"
    kind: str = "lower"
    margin_ref: str | None = None
    margin_frac: float = 0.5


@dataclass(frozen=True)
class Group:
    name: str
    title: str
    varies: tuple[str, ...]  # config fields this group sets: a --set on one of them is incompatible
    baseline: str
    variants: tuple[Variant, ...]
    claims: tuple[Claim, ...]
    metrics: tuple[str, ...] = ("val_loss",)

    def variant(self, label: str) -> Variant:
        for v in self.variants:
            if v.label == label:
                return v
        raise ValueError(f"group {self.name} has no variant {label!r}; it has {[v.label for v in self.variants]}")


ATTNRES_SRC = "Attention Residuals, arXiv 2603.15031"
KIMI_LINEAR_SRC = "Kimi Linear, arXiv 2510.26692"
LATENT_SRC = "LatentMoE, arXiv 2601.18089"
DSV3_SRC = "DeepSeek-V3, arXiv 2412.19437, sec. 2.1.2"
QB_SRC = "Quantile Balancing, J. Su, kexue.fm/archives/11619"
MXQ_SRC = "MXFP4 PTQ, arXiv 2509.23202; QAT: the MX/QAT issue"


def depth_group(base: K3Config) -> Group:
    return Group(
        "depth", "Depth mixing: AttnRes none / full / block", ("attnres", "attnres_sources"), "block",
        (Variant("none", {"attnres": "none"}), Variant("full", {"attnres": "full"}), Variant("block", {})),
        (Claim("attnres-block-beats-none", "Block AttnRes lowers loss compared with plain residuals",
               ATTNRES_SRC, "block", "none"),
         Claim("attnres-full-beats-none", "Full AttnRes lowers loss compared with plain residuals",
               ATTNRES_SRC, "full", "none"),
         Claim("attnres-block-recovers-full", "Block AttnRes keeps most of Full AttnRes's gain (worse than "
               "Full by less than half of Full's gain over none)", ATTNRES_SRC, "block", "full", kind="within",
               margin_ref="none")),
    )


def sequence_group(base: K3Config) -> Group:
    L = base.n_layers
    hybrid = base.pattern
    if hybrid.count(KDA) == 0 or hybrid.count(MLA) == 0:
        raise ValueError(f"the seq ablation needs a hybrid base pattern, got {hybrid!r}; leave layer_pattern "
                         "empty (the 3:1 rule) or drop --only seq")
    return Group(
        "seq", f"Sequence mixing: all-MLA vs {hybrid} (3:1 KDA:MLA) vs all-KDA", ("layer_pattern", "mla_every"),
        "3:1",
        (Variant("all-MLA", {"layer_pattern": MLA * L}), Variant("3:1", {}), Variant("all-KDA", {"layer_pattern": KDA * L})),
        (Claim("hybrid-beats-all-mla", "The 3:1 KDA:MLA hybrid reaches lower loss than all-MLA",
               KIMI_LINEAR_SRC, "3:1", "all-MLA"),
         Claim("hybrid-beats-all-kda", "The 3:1 hybrid reaches lower loss than all-KDA", KIMI_LINEAR_SRC,
               "3:1", "all-KDA")),
    )


def moe_group(base: K3Config) -> Group:
    flops, comm = matched_moe_overrides(base)
    return Group(
        "moe", "MoE: LatentMoE vs standard MoE at equal active FLOPs and at equal communication",
        ("moe", "moe_latent_dim", "n_experts", "n_active_experts", "expert_ffn"), "latent",
        (Variant("latent", {}), Variant("standard@flops", flops), Variant("standard@comm", comm)),
        (Claim("latent-beats-standard-equal-flops", "LatentMoE beats standard MoE at equal active FLOPs",
               LATENT_SRC, "latent", "standard@flops"),
         Claim("latent-beats-standard-equal-comm", "LatentMoE (N and top-k scaled by d/l) beats standard MoE "
               "at equal communication", LATENT_SRC, "latent", "standard@comm")),
    )


def balancing_group(base: K3Config) -> Group:
    return Group(
        "balancing", "Load balancing: none vs auxiliary loss vs auxiliary-loss-free bias vs Quantile Balancing",
        ("balancing",), "bias",
        tuple(Variant(b, {"balancing": b}) if b != base.balancing else Variant(b, {})
              for b in ("none", "aux_loss", "bias", "quantile")),
        (Claim("bias-balances-load", "The auxiliary-loss-free bias lowers max/mean expert load vs no balancing",
               DSV3_SRC, "bias", "none", metric="load_max_mean"),
         Claim("bias-no-worse-loss-than-aux", "The auxiliary-loss-free bias reaches lower loss than the "
               "auxiliary loss", DSV3_SRC, "bias", "aux_loss"),
         Claim("aux-balances-load", "The auxiliary loss lowers max/mean expert load vs no balancing", DSV3_SRC,
               "aux_loss", "none", metric="load_max_mean"),
         Claim("quantile-balances-better", "Quantile Balancing reaches a lower max/mean expert load than the "
               "bias update", QB_SRC, "quantile", "bias", metric="load_max_mean")),
        metrics=("val_loss", "load_max_mean"),
    )


def precision_group(base: K3Config) -> Group:
    return Group(
        "precision", "Precision: fp32 vs PTQ vs QAT (MXFP4 expert weights, MXFP8 activations)", ("qat",), "fp32",
        (Variant("fp32", {}), Variant("ptq", {"qat": QAT_RECIPE}, ptq_of="fp32"), Variant("qat", {"qat": QAT_RECIPE})),
        (Claim("ptq-degrades", "PTQ to MXFP4/MXFP8 raises loss over fp32", MXQ_SRC, "ptq", "fp32", kind="higher"),
         Claim("qat-beats-ptq", "QAT reaches lower loss than PTQ", MXQ_SRC, "qat", "ptq")),
    )


GROUP_BUILDERS = {
    "depth": depth_group, "seq": sequence_group, "moe": moe_group, "balancing": balancing_group,
    "precision": precision_group,
}
PROBE = "probe"
SUITES = {"core": ("depth", "seq", "moe", "balancing", "precision", PROBE)}
ALL_ABLATIONS = (*GROUP_BUILDERS, PROBE)
MOE_GROUPS = ("moe", "balancing", "precision")  # need at least one MoE layer in the base


def select(suite: str = "core", only: list[str] | None = None) -> list[str]:
    """Names of the ablations to run, in suite order; unknown names are an error that lists the valid ones."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; valid suites: {', '.join(SUITES)}")
    names = SUITES[suite]
    if not only:
        return list(names)
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ValueError(f"unknown ablation(s) {', '.join(map(repr, unknown))}; valid ablations in suite "
                         f"{suite!r}: {', '.join(names)}")
    return [n for n in names if n in only]


def build_groups(base: K3Config, names: list[str], user_set: dict | None = None) -> list[Group]:
    """The Group objects for `names`, checked against the base config and the user's --set fields."""
    user_set = user_set or {}
    if base.qat:
        raise ValueError(f"the base config already quantizes (qat = {base.qat}); the ablations train in fp32 "
                         "and the precision group adds QAT itself: drop qat from --set")
    groups = []
    for name in names:
        if name == PROBE:
            continue
        if name in MOE_GROUPS and not any(base.is_moe_layer(i) for i in range(base.n_layers)):
            raise ValueError(f"incompatible combination: the {name} ablation needs MoE layers but n_dense_layers "
                             f"= {base.n_dense_layers} >= n_layers = {base.n_layers}; lower n_dense_layers or drop "
                             f"{name} (valid with this base: {[n for n in ALL_ABLATIONS if n not in MOE_GROUPS]})")
        g = GROUP_BUILDERS[name](base)
        clash = sorted(set(user_set) & set(g.varies))
        if clash:
            raise ValueError(f"incompatible combination: --set {', '.join(clash)} conflicts with the {name} "
                             f"ablation, which varies {', '.join(g.varies)}; drop the --set or leave {name} out "
                             f"(--only with some of: {', '.join(n for n in ALL_ABLATIONS if n != name)})")
        groups.append(g)
    return groups


# ---------------------------------------------------------------------------------------------- MoE matching
def moe_active_params(config: K3Config) -> int:
    """Active parameters (what one token touches) of the whole model, counted on the meta-device modules."""
    from k3.model.accounting import build_meta, count_params

    return count_params(build_meta(config))["active"]


def moe_payload(config: K3Config) -> int:
    """Values one token sends to its experts per MoE layer: top-k x the dispatch width (what all-to-all moves)."""
    from k3.model.accounting import build_meta

    moe = build_meta(config).moe_layers()[0]
    return config.n_active_experts * moe.dispatch_dim


def matched_moe_overrides(base: K3Config) -> tuple[dict, dict]:
    """Standard-MoE counterparts of a LatentMoE base: (equal active FLOPs, equal communication).

    Equal active FLOPs: same experts N and top-k K, expert width f chosen so that the model's active
    parameters (6 x active params = the matmul FLOPs per token of k3.train.metrics) match the base. Active
    params are affine in f, so two counts of the real modules give the slope; the integer f nearest the
    match is then re-counted. Equal communication: alpha = d / l, N / alpha experts and K / alpha active,
    width f unchanged, so each token sends K/alpha x d = K x l values, as the LatentMoE base does.
    """
    if base.moe != "latent":
        raise ValueError(f"the moe ablation compares a LatentMoE base with standard MoE; the base has moe = "
                         f"{base.moe!r}: drop --set moe or leave moe out")
    d, l = base.d_model, base.moe_latent_dim
    alpha = d // l
    target = moe_active_params(base)
    std = dict(moe="standard")
    a1 = moe_active_params(base.replace(**std, expert_ffn=1))
    a2 = moe_active_params(base.replace(**std, expert_ffn=2))
    slope = a2 - a1
    f = max(1, round(1 + (target - a1) / slope))
    flops = dict(std, expert_ffn=f)
    if d % l or base.n_experts % alpha or base.n_active_experts % alpha:
        raise ValueError(f"incompatible combination: equal communication scales experts and top-k by "
                         f"alpha = d_model / moe_latent_dim = {d}/{l}, which must divide n_experts = "
                         f"{base.n_experts} and n_active_experts = {base.n_active_experts}; pick values "
                         f"divisible by {alpha} or leave moe out")
    comm = dict(std, n_experts=base.n_experts // alpha, n_active_experts=base.n_active_experts // alpha)
    return flops, comm


# ---------------------------------------------------------------------------------------------- probe claims
# metrics of a probe run: acc_in = mean accuracy at lengths <= the training length, acc_long = beyond it
PROBE_CLAIMS = (
    Claim("hybrid-retrieves-beyond-kda", "KDA propagates history, MLA does global correction: the 3:1 hybrid "
          "retrieves needles beyond the training length more accurately than all-KDA", KIMI_LINEAR_SRC,
          "3:1", "all-KDA", metric="acc_long", kind="higher"),
    Claim("mla-retrieves-beyond-kda", "All-MLA retrieves needles beyond the training length more accurately "
          "than all-KDA", KIMI_LINEAR_SRC, "all-MLA", "all-KDA", metric="acc_long", kind="higher"),
    Claim("hybrid-retrieves-in-distribution", "At and below the training length the 3:1 hybrid retrieves "
          "more accurately than all-KDA", KIMI_LINEAR_SRC, "3:1", "all-KDA", metric="acc_in", kind="higher"),
)
