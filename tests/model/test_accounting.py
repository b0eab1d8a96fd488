import json
import subprocess
import sys

import pytest

from k3.config import get_config
from k3.model.accounting import build_meta, count_params
from k3.model.moe import MoE


@pytest.fixture(scope="module")
def k3_counts():
    model = build_meta(get_config("k3"))
    return model, count_params(model)


def test_k3_matches_reported_totals(k3_counts):
    _, c = k3_counts
    # the release's own figures: 2.78T total, 104.2B active, which leaves out the input embedding (a lookup, no
    # matmul); the released config counts 2,779,484,393,568 and 105,363,935,328 with it
    assert c["total"] == 2_779_484_393_568 and abs(c["total"] / 2.78e12 - 1) < 0.0005, c["total"]
    emb = c["by_component"]["embedding"]["active"]
    assert abs((c["active"] - emb) / 104.2e9 - 1) < 0.0005, c["active"]
    assert c["layers"] == {"total": 93, "kda": 69, "mla": 24}
    assert (c["d_model"], c["latent_dim"], c["experts"], c["active_experts"]) == (7168, 3584, 896, 16)
    assert c["attnres_sources"] == 9 and c["max_context"] == 1048576


def test_kimi_linear_48b_matches_its_safetensors():
    # moonshotai/Kimi-Linear-48B-A3B's safetensors hold 49,122,681,728 values: the parameters plus the routers'
    # e_score_correction_bias (256 per MoE layer, 26 layers), a buffer here
    c = count_params(build_meta(get_config("kimi-linear-48b")))
    assert c["total"] + 26 * 256 == 49_122_681_728
    assert c["layers"] == {"total": 27, "kda": 20, "mla": 7}


def test_counts_come_from_the_modules(k3_counts):
    model, c = k3_counts
    assert c["total"] == sum(p.numel() for p in model.parameters())
    assert sum(v["total"] for v in c["by_component"].values()) == c["total"]
    routed = sum(m.experts.w1.numel() + m.experts.w2.numel() + m.experts.w3.numel()
                 if hasattr(m.experts, "w1") else sum(p.numel() for p in m.experts.parameters())
                 for m in model.moe_layers())
    assert c["by_component"]["moe_routed"]["total"] == routed
    assert c["by_component"]["moe_routed"]["active"] == round(routed * 16 / 896)
    n_moe = sum(isinstance(b.ffn, MoE) for b in model.layers)
    assert n_moe == 92
    # inactive share is exactly the routed experts not chosen
    assert c["total"] - c["active"] == routed - round(routed * 16 / 896)


@pytest.mark.parametrize("preset,lo,hi", [("tiny", 0, 2e6), ("mini", 20e6, 60e6)])
def test_small_presets_sizes(preset, lo, hi):
    c = count_params(build_meta(get_config(preset)))
    assert lo < c["total"] < hi


def test_standard_moe_has_no_latent_projection():
    c = count_params(build_meta(get_config("tiny", moe="standard")))
    assert "moe_latent_proj" not in c["by_component"]
    lat = count_params(build_meta(get_config("tiny")))
    assert lat["by_component"]["moe_latent_proj"]["total"] > 0


def test_cli_params_json():
    r = subprocess.run([sys.executable, "-m", "k3.cli", "params", "--preset", "k3", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("total", "active", "d_model", "latent_dim", "layers", "attnres_sources", "experts",
                "active_experts", "max_context", "by_component"):
        assert key in d
    assert set(d["layers"]) >= {"kda", "mla"}
