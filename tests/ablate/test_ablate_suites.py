import pytest

from k3.ablate.suites import (ALL_ABLATIONS, SCALES, build_groups, matched_moe_overrides, moe_active_params,
                              moe_payload, select)
from k3.config import get_config


def test_select_orders_and_checks_names():
    assert select("core") == list(ALL_ABLATIONS)
    assert select("core", ["probe", "depth"]) == ["depth", "probe"]
    with pytest.raises(ValueError) as e:
        select("core", ["depth", "attention"])
    assert "'attention'" in str(e.value) and "depth, seq, moe, balancing, precision, probe" in str(e.value)
    with pytest.raises(ValueError, match="valid suites: core"):
        select("everything")


@pytest.mark.parametrize("scale", ["full", "quick"])
def test_every_variant_is_a_valid_config(scale):
    base = SCALES[scale].base_config()
    for g in build_groups(base, select("core")):
        labels = [v.label for v in g.variants]
        assert g.baseline in labels and len(set(labels)) == len(labels)
        assert any(v.overrides == {} for v in g.variants)  # the base config itself is one variant
        for v in g.variants:
            base.replace(**v.overrides)
        for c in g.claims:
            assert c.a in labels and c.b in labels


def test_full_scale_keeps_mini_shape():
    base, mini = SCALES["full"].base_config(), get_config("mini")
    assert (base.n_layers, base.pattern, base.attnres_sources, base.vocab_size) == \
           (mini.n_layers, mini.pattern, mini.attnres_sources, mini.vocab_size)
    assert base.pattern.count("K") == 3 * base.pattern.count("M")
    assert base.d_model // base.moe_latent_dim == mini.d_model // mini.moe_latent_dim


@pytest.mark.parametrize("scale", ["full", "quick"])
def test_moe_matches_are_computed_from_the_real_modules(scale):
    base = SCALES[scale].base_config()
    flops, comm = matched_moe_overrides(base)
    latent_active = moe_active_params(base)
    std_flops, std_comm = base.replace(**flops), base.replace(**comm)
    # equal active FLOPs: same experts and top-k, expert width solved so active parameters agree
    assert (std_flops.n_experts, std_flops.n_active_experts) == (base.n_experts, base.n_active_experts)
    assert abs(moe_active_params(std_flops) - latent_active) / latent_active < 0.005
    f = std_flops.expert_ffn  # and it is the best integer width
    for other in (f - 1, f + 1):
        assert abs(moe_active_params(base.replace(**{**flops, "expert_ffn": other})) - latent_active) >= \
               abs(moe_active_params(std_flops) - latent_active)
    # equal communication: the routed payload per token is the same; the FLOPs-matched one sends alpha x more
    alpha = base.d_model // base.moe_latent_dim
    assert moe_payload(std_comm) == moe_payload(base)
    assert moe_payload(std_flops) == alpha * moe_payload(base)
    assert std_comm.n_experts * alpha == base.n_experts and std_comm.expert_ffn == base.expert_ffn


def test_incompatible_combinations_are_clear_errors():
    base = SCALES["quick"].base_config()
    with pytest.raises(ValueError) as e:
        build_groups(base, ["depth", "moe"], {"attnres": "full"})
    assert "incompatible combination" in str(e.value) and "depth" in str(e.value) and "attnres" in str(e.value)
    with pytest.raises(ValueError, match="needs MoE layers"):
        build_groups(base.replace(n_dense_layers=base.n_layers), ["balancing"])
    with pytest.raises(ValueError, match="must divide|alpha"):
        matched_moe_overrides(base.replace(n_experts=9, n_active_experts=3))
    with pytest.raises(ValueError, match="LatentMoE base"):
        build_groups(base.replace(moe="standard"), ["moe"])
    with pytest.raises(ValueError, match="hybrid base pattern"):
        build_groups(base.replace(layer_pattern="KKKK"), ["seq"])
    with pytest.raises(ValueError, match="already quantizes"):
        build_groups(base.replace(qat={"expert_weights": "mxfp4"}), ["depth"])
