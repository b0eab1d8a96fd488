"""The planner's walls, layouts, what-ifs and hardware presets (on the tiny preset, so every plan is instant)."""
import re
from pathlib import Path

import pytest

from k3.config import get_config
from k3.model import accounting as acc
from k3.plan import Layout, Options, check_layout, load_hardware, min_gpus_to_serve, plan, preset_names
from k3.plan.walls import stages
from k3.plan.whatif import WHAT_IFS, what_ifs

TINY = get_config("tiny")  # 4 layers (KKKM), 2 + 2 heads, 8 experts top-2, d 64, latent 32
SMALL_GPU = dict(name="toy", description="a tiny GPU for tests", memory_gb=0.0005, hbm_tb_s=1.0, nvlink_gb_s=100.0,
                 nvlink_domain=4, network_gb_s=10.0, tflops={"bf16": 100.0, "fp8": 200.0, "fp4": None})


def _serve(**kw):
    return Options(context=kw.pop("context", 512), **kw)


@pytest.fixture
def toy_yaml(tmp_path):
    import yaml

    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(SMALL_GPU))
    return str(path)


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("layout,pattern", [
    (Layout(tp=3), r"tp = 3 does not divide .*kda_heads = 2.*sizes that fit: 1, 2"),
    (Layout(ep=3, dp=3), r"ep = 3 does not divide n_experts = 8; with tp x dp = 3 GPUs per stage, .*fit: 1$"),
    (Layout(ep=3, dp=4), r"ep = 3 does not divide n_experts = 8; .*fit: 1, 2, 4$"),
    (Layout(ep=4, dp=2), r"ep = 4 must divide tp x dp = 2.*ep in 1, 2"),
    (Layout(pp=5), r"pp = 5 exceeds n_layers = 4; pipeline sizes that fit: 1 \.\. 4"),
    (Layout(tp=0), r"--tp = 0 must be a positive integer"),
])
def test_bad_layouts_name_what_fits(layout, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_layout(TINY, layout)
    with pytest.raises(ValueError, match=pattern):
        plan(TINY, "h100", layout, _serve())


def test_bad_hardware_and_context(tmp_path):
    with pytest.raises(ValueError, match=r"unknown hardware 'h300'; presets: b200, gb200-nvl72, h100, h200"):
        plan(TINY, "h300", Layout(), _serve())
    for ctx in (0, -5):
        with pytest.raises(ValueError, match="context = .* must be a positive number of tokens"):
            plan(TINY, "h100", Layout(), Options(context=ctx))
    with pytest.raises(ValueError, match="exceeds tiny's max_context = 2048"):
        plan(TINY, "h100", Layout(), Options(context=4096))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmemory_gb: -1\n")
    with pytest.raises(ValueError, match="missing fields"):
        load_hardware(str(bad))
    with pytest.raises(FileNotFoundError):
        load_hardware(str(tmp_path / "none.yaml"))


# ---------------------------------------------------------------------------------------------- hardware
def test_presets_load_and_are_documented():
    doc = (Path(__file__).parents[2] / "docs" / "planner.md").read_text()
    assert set(preset_names()) == {"h100", "h200", "b200", "gb200-nvl72"}
    for name in preset_names():
        hw = load_hardware(name)
        assert hw.memory_gb > 0 and hw.hbm_tb_s > 0 and hw.tflops["bf16"] > 0
        # every preset number appears in the docs' sourced table row of that GPU
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{name}` |"))
        for v in (hw.memory_gb, hw.hbm_tb_s, hw.nvlink_gb_s, hw.network_gb_s, *[x for x in hw.tflops.values() if x]):
            assert re.search(rf"\b{v:g}\b", row.replace(",", "")), (name, v, row)
    assert load_hardware("h100").peak_flops("fp4") == (1978.9e12, "fp8")  # no FP4 on Hopper: FP8 instead
    assert load_hardware("b200").peak_flops("fp4")[1] == "fp4"


def test_user_yaml(toy_yaml):
    hw = load_hardware(toy_yaml)
    assert hw.name == "toy" and hw.nvlink_domain == 4
    r = plan(TINY, toy_yaml, Layout(), _serve())
    assert r["hardware"]["name"] == "toy"


# ---------------------------------------------------------------------------------------------- the walls
JSON_KEYS = {"config", "mode", "hardware", "layout", "options", "fits", "memory", "bandwidth", "communication",
             "compute", "latency", "stages"}


def test_serve_plan_keys_and_sums():
    r = plan(TINY, "h100", Layout(), _serve(batch=3))
    assert set(r) == JSON_KEYS
    m = r["memory"]
    assert {"weights", "mla_latent_cache", "kda_state_cache", "cache_per_sequence", "total", "capacity", "fits"} <= set(m)
    assert m["weights"] == acc.param_bytes(TINY, acc.Precision())["bytes"]  # one GPU holds everything
    c = acc.cache_bytes(TINY, 512, 3)
    assert m["mla_latent_cache"] + m["kda_state_cache"] == pytest.approx(c["total"])
    assert {"bytes_read_per_token", "tokens_per_s_bound"} <= set(r["bandwidth"])
    assert {"a2a_bytes_per_token_per_moe_layer", "ep_a2a_bytes_per_decode_step", "pp_bytes_per_microbatch",
            "pp_bytes_per_microbatch_full_attnres", "tp_allreduce_bytes_per_decode_step"} <= set(r["communication"])
    assert {"flops_per_token_forward", "prefill_flops"} <= set(r["compute"])
    assert {"decode_per_token_bound_s", "ttft_bound_s", "tokens_per_s_bound"} <= set(r["latency"])
    assert r["communication"]["ep_a2a_bytes_per_decode_step"] == 0  # ep = 1: nothing leaves the GPU


def test_layout_splits_the_weights():
    one = plan(TINY, "h100", Layout(), _serve())["memory"]["weights"]
    prec = acc.Precision()
    routed = acc.param_bytes(TINY, prec)["by_component"]["moe_routed"]["bytes"]
    two = plan(TINY, "h100", Layout(ep=2, dp=2), _serve())["memory"]["weights"]
    assert two == pytest.approx(one - routed / 2)  # experts split over 2 GPUs, the rest replicated
    r = plan(TINY, "h100", Layout(pp=2), _serve())
    assert sum(s["memory"]["weights"] for s in r["stages"]) == pytest.approx(one)  # stages partition the model
    assert [list(x) for x in stages(93, 8)][0] == list(range(12)) and len(stages(93, 8)[-1]) == 11
    tp = plan(TINY, "h100", Layout(tp=2), _serve())["memory"]
    assert tp["weights"] < one and tp["kda_state_cache"] == pytest.approx(
        plan(TINY, "h100", Layout(), _serve())["memory"]["kda_state_cache"] / 2)


def test_memory_grows_with_context_only_through_mla():
    a, b = (plan(TINY, "h100", Layout(), _serve(context=n))["memory"] for n in (256, 1024))
    assert b["mla_latent_cache"] == 4 * a["mla_latent_cache"]
    assert b["kda_state_cache"] == a["kda_state_cache"]


def test_train_plan():
    r = plan(TINY, "h100", Layout(pp=2, dp=2, ep=2), Options(mode="train", context=256, batch=2))
    assert set(r) == JSON_KEYS and r["bandwidth"] is None
    m = r["memory"]
    for k in ("weights", "gradients", "optimizer_and_master", "activations_no_checkpointing",
              "activations_checkpointing", "total", "total_no_checkpointing"):
        assert m[k] > 0, k
    assert m["activations_checkpointing"] < m["activations_no_checkpointing"]
    c = r["communication"]
    assert c["dp_grad_reduce_bytes_per_step"] > 0 and c["ep_a2a_bytes_per_step"] > 0
    assert r["compute"]["flops_per_token_backward"] == 2 * r["compute"]["flops_per_token_forward"]
    zero0 = plan(TINY, "h100", Layout(dp=2), Options(mode="train", context=256, zero=0))["memory"]
    zero1 = plan(TINY, "h100", Layout(dp=2), Options(mode="train", context=256, zero=1))["memory"]
    assert zero1["optimizer_and_master"] == pytest.approx(zero0["optimizer_and_master"] / 2)


def test_pipeline_transfers_block_vs_full():
    r = plan(TINY, "h100", Layout(pp=2), _serve(batch=1))
    c = r["stages"][0]["communication"]
    # tiny: blocks of 2 layers; a boundary before layer 2 carries the embedding and block 1 ...
    assert c["pp_sources_at_boundary"] == 2
    # ... Full AttnRes carries the embedding and all 4 sublayer outputs before it
    assert c["pp_sources_at_boundary_full_attnres"] == 5
    assert c["pp_bytes_per_microbatch"] == 2 * TINY.d_model * 2  # bf16, one token


def test_min_gpus(toy_yaml):
    opts = _serve(context=2048, prefill_chunk=16)
    found = min_gpus_to_serve(TINY, toy_yaml, opts)
    n = found["gpus"]
    assert found["plan"]["fits"] and n > 1
    # no layout of n - 1 GPUs fits (exhaustive over the same search space)
    from k3.config import divisors as _divisors

    for tp in _divisors(n - 1):
        for pp in _divisors((n - 1) // tp):
            dp = (n - 1) // (tp * pp)
            try:
                r = plan(TINY, toy_yaml, Layout(tp=tp, ep=tp * dp, pp=pp, dp=dp), opts)
            except ValueError:
                continue
            assert not r["fits"]


# ---------------------------------------------------------------------------------------------- what-ifs
def test_what_ifs_move_the_expected_wall():
    w = what_ifs(TINY, "h100", Layout(pp=2), _serve(context=1024), list(WHAT_IFS))
    r = {n: w[n]["ratio"] for n in WHAT_IFS}
    assert r["no-latentmoe"]["a2a_bytes_per_token_per_layer"] == 2  # d_model / latent = 64 / 32
    assert r["bf16-experts"]["weights_gb"] > 1 and r["bf16-experts"]["a2a_bytes_per_token_per_layer"] == 1
    assert r["full-attention"]["cache_gb_per_sequence"] > 1
    assert r["all-kda"]["cache_gb_per_sequence"] < 1
    assert r["full-attnres"]["pp_bytes_per_microbatch"] > 1
    assert w["no-attnres"]["headline"]["pp_bytes_per_microbatch"] == TINY.d_model * 2  # just the residual
    kda_only = [plan(get_config("tiny", layer_pattern="KKKK"), "h100", Layout(), _serve(context=n))["memory"]
                for n in (256, 2048)]
    assert kda_only[0]["cache_per_sequence"] == kda_only[1]["cache_per_sequence"]  # constant in context


def test_decode_reads_the_experts_of_a_gpu_that_receives_a_token():
    # fewer tokens per step than expert-parallel groups (B x dp = 1 < edp = tp x dp / ep = 2): the GPU that
    # gets the token still reads its experts, so halving ep (twice the experts per GPU) cannot speed decode up
    k3 = get_config("k3")
    rates = {}
    for ep in (8, 4):
        p = plan(k3, "h200", Layout(tp=8, ep=ep, pp=2), Options(context=1_048_576))
        detail = p["stages"][0]["bandwidth"]["detail"]
        assert detail["expert_hit_fraction"] > 0 and detail["weights_routed_touched"] > 0
        rates[ep] = p["latency"]["tokens_per_s_bound"]
    assert rates[4] < rates[8]


def test_pipeline_boundaries_inside_a_node_use_nvlink():
    # 16 one-GPU stages on 8-GPU nodes: only the boundary between GPU 7 and GPU 8 crosses nodes
    p = plan(get_config("k3"), "h200", Layout(tp=1, pp=16), Options(context=8192))
    links = [s["communication"]["links"]["pp"] for s in p["stages"]]
    assert links == ["nvlink"] * 7 + ["network"] + ["nvlink"] * 7 + ["none"]


def test_gpipe_schedule_holds_every_micro_batch():
    """1F1B keeps pp - s micro-batches' activations on stage s; GPipe (what k3.parallel runs) keeps all m."""
    opts = dict(mode="train", context=256, batch=2, micro_batches=8)
    one = plan(TINY, "h100", Layout(pp=2, dp=2, ep=2), Options(**opts))["stages"]
    gp = plan(TINY, "h100", Layout(pp=2, dp=2, ep=2), Options(**opts, schedule="gpipe"))["stages"]
    for s, (a, b) in enumerate(zip(one, gp)):
        held = min(2 - s, 8)
        assert b["memory"]["activations_no_checkpointing"] == pytest.approx(
            a["memory"]["activations_no_checkpointing"] * 8 / held)
    with pytest.raises(ValueError, match="schedule"):
        Options(mode="train", schedule="zigzag").check()


def test_zero_stages_charge_their_gradient_and_weight_traffic():
    """Per step, n = 4 data-parallel ranks, m = 4 micro-batches: ZeRO-2 reduce-scatters each micro-batch's gradients
    as they are made (m (n-1)/n of their bytes) and gathers the updated weights once; ZeRO-3 also gathers the sharded
    weights before every micro-batch's forward and backward (2 m (n-1)/n of their bytes)."""
    opts = dict(mode="train", context=256, batch=1, micro_batches=4, grad_dtype="fp32")
    z = {k: plan(TINY, "h100", Layout(dp=4), Options(**opts, zero=k)) for k in (0, 2, 3)}
    grad_rs = z[0]["communication"]["dp_grad_reduce_bytes_per_step"] / 2
    weight_ag = 3 / 4 * z[0]["stages"][0]["memory"]["weights"]  # the unsharded compute copy under ZeRO-0
    assert z[2]["communication"]["dp_grad_reduce_bytes_per_step"] == pytest.approx(4 * grad_rs + weight_ag)
    assert z[3]["communication"]["dp_grad_reduce_bytes_per_step"] == pytest.approx(4 * grad_rs + 8 * weight_ag)


def test_data_parallel_traffic_prices_gradients_and_weights_at_their_own_dtypes():
    """ZeRO-0 all-reduces the gradients (2 (n-1)/n of their bytes); ZeRO-1 reduce-scatters them and gathers the
    updated compute weights instead ((n-1)/n of each), each at its own dtype."""
    opts = dict(mode="train", context=256, batch=1, micro_batches=2)
    lay = Layout(dp=4)  # no expert parallelism: every parameter's data-parallel group is dp
    z0 = plan(TINY, "h100", lay, Options(**opts, zero=0, grad_dtype="fp32"))
    z1 = plan(TINY, "h100", lay, Options(**opts, zero=1, grad_dtype="fp32"))
    z1_bf16 = plan(TINY, "h100", lay, Options(**opts, zero=1, grad_dtype="bf16"))
    key = "dp_grad_reduce_bytes_per_step"
    a0, a1, a1b = (p["communication"][key] for p in (z0, z1, z1_bf16))
    w = z1["stages"][0]["memory"]["weights"]  # the whole compute copy (bf16 matrices, fp32 vectors): pp = 1
    assert a1 == pytest.approx(a0 / 2 + 3 / 4 * w)  # half the all-reduce, then the weights' all-gather
    assert a1b == pytest.approx(a0 / 4 + 3 / 4 * w)  # bf16 gradients: half the bytes to reduce-scatter
    assert a1b < a1 < a0


def test_tied_embeddings_across_stages_are_refused_for_training_only():
    tied = get_config("tiny", tie_embeddings=True)
    with pytest.raises(ValueError, match="tied embeddings"):
        plan(tied, "h100", Layout(pp=2), Options(mode="train", context=256))
    plan(tied, "h100", Layout(pp=1), Options(mode="train", context=256))
    plan(tied, "h100", Layout(pp=2), Options(context=256))  # serving holds each stage's weights, nothing to sum


def test_a_tied_table_is_also_the_last_stages_head():
    """Serving with tied embeddings: the last stage holds the table as its head and reads it whole every decode
    step (the planner put it on the first stage only, and counted a lookup of B rows)."""
    untied, tied = get_config("tiny"), get_config("tiny", tie_embeddings=True)
    opts = Options(context=256, batch=2)
    a, b = plan(untied, "h100", Layout(pp=2), opts), plan(tied, "h100", Layout(pp=2), opts)
    table = untied.vocab_size * untied.d_model * 2  # bf16
    rows = 2 * untied.d_model * 2
    sa, sb = a["stages"][1], b["stages"][1]
    assert sb["memory"]["weights"] == sa["memory"]["weights"]  # the last stage: the head either way
    assert sb["bandwidth"]["bytes_read_per_decode_step"] == sa["bandwidth"]["bytes_read_per_decode_step"]
    # the first stage: the table, looked up
    assert b["stages"][0]["memory"]["weights"] == a["stages"][0]["memory"]["weights"]
    one = plan(tied, "h100", Layout(pp=1), opts)["stages"][0]
    both = plan(untied, "h100", Layout(pp=1), opts)["stages"][0]
    assert both["memory"]["weights"] - one["memory"]["weights"] == table  # one GPU: one matrix fewer
    assert (both["bandwidth"]["bytes_read_per_decode_step"] - one["bandwidth"]["bytes_read_per_decode_step"]
            == rows)  # ... and the same head read, less the lookup of the table it no longer has apart


def test_serving_plans_have_no_backward_and_price_chunked_prefill():
    r = plan(TINY, "h100", Layout(), Options(context=512, prefill_chunk=128))
    assert "flops_per_token_backward" not in r["compute"]
    explicit = sum(acc.forward_flops(TINY, 128, past=128 * k)["total"] for k in range(4))
    assert r["compute"]["prefill_flops"] == explicit
    one = plan(TINY, "h100", Layout(), Options(context=512, prefill_chunk=512))["compute"]["prefill_flops"]
    assert one == acc.forward_flops(TINY, 512)["total"] < explicit  # each chunk re-expands earlier latents
