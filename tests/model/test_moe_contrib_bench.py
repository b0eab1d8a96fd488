"""benchmarks/moe_contrib.py: removing a part of every MoE layer, and a --quick smoke run of the whole script."""
import json

import pytest
import torch

from k3.config import get_config
from k3.model.moe import MoE


@pytest.fixture(scope="module")
def contrib(load_training_benchmark):
    return load_training_benchmark("moe_contrib")


def _scaled_moe(moe: str) -> MoE:
    torch.manual_seed(0)
    layer = MoE(get_config("tiny", moe=moe))
    with torch.no_grad():  # large enough weights that both parts contribute visibly
        for p in layer.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return layer


@pytest.mark.parametrize("moe", ["latent", "standard"])
def test_removed_leaves_exactly_the_other_part(contrib, moe):
    layer = _scaled_moe(moe)
    x = torch.randn(2, 5, layer.d_model)
    full = layer(x)
    h = x.reshape(-1, layer.d_model)
    shared = layer.shared(h).view_as(full)
    with contrib.removed(layer, "routed"):
        torch.testing.assert_close(layer(x), shared)
    with contrib.removed(layer, "shared"):
        torch.testing.assert_close(layer(x), full - shared, rtol=1e-5, atol=1e-6)
    assert (full - shared).abs().max() > 1e-3 and shared.abs().max() > 1e-3  # neither part is trivially zero
    torch.testing.assert_close(layer(x), full)  # the hooks are gone after the block


def test_removed_rejects_unknown_or_missing_parts(contrib):
    layer = _scaled_moe("latent")
    with pytest.raises(ValueError, match="unknown"):
        with contrib.removed(layer, "router"):
            pass
    no_shared = MoE(get_config("tiny", n_shared_experts=0))
    with pytest.raises(ValueError, match="no MoE layer with a shared part"):
        with contrib.removed(no_shared, "shared"):
            pass


def test_quick_run_writes_paired_costs(contrib, tmp_path, capsys):
    out = tmp_path / "c.json"
    r = contrib.main(["--quick", "--json", "--seeds", "0,1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["seeds"] == [0, 1] and r["budget"]["steps"] == 4
    for part in ("routed", "shared"):
        per_seed = [run[f"no_{part}"] - run["full"] for run in r["runs"].values()]
        assert r[f"cost_no_{part}"]["per_seed"] == pytest.approx(per_seed)
        assert r[f"cost_no_{part}"]["mean"] == pytest.approx(sum(per_seed) / 2)
        assert r[f"{part}_rms_over_input"] >= 0
    with pytest.raises(SystemExit, match="--seeds"):
        contrib.main(["--quick", "--seeds", "0,0", "--out", str(out)])


def test_set_overrides_the_config_and_rejects_bad_fields(contrib, tmp_path):
    r = contrib.main(["--quick", "--seeds", "0", "--set", "n_shared_experts=0", "--out", str(tmp_path / "c.json")])
    assert r["config"]["n_shared_experts"] == 0
    assert "cost_no_shared" not in r and "no_shared" not in r["runs"]["0"]  # nothing to remove
    with pytest.raises(SystemExit, match="n_experts"):
        contrib.main(["--quick", "--set", "n_experts=x", "--out", str(tmp_path / "c.json")])
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        contrib.main(["--quick", "--set", "no_such_field=1", "--out", str(tmp_path / "c.json")])
