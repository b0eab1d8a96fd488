import json
import subprocess
import sys

import pytest

from k3.config import PRESETS, K3Config, K3ConfigError, get_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate(name):
    cfg = get_config(name)
    assert cfg.n_kda_layers + cfg.n_mla_layers == cfg.n_layers
    assert K3Config.from_dict(json.loads(cfg.to_json())) == cfg


def test_k3_layer_pattern_is_3_to_1_plus_final_mla():
    cfg = get_config("k3")
    assert (cfg.n_layers, cfg.n_kda_layers, cfg.n_mla_layers) == (93, 69, 24)
    assert cfg.pattern[:8] == "KKKMKKKM" and cfg.pattern[-2:] == "MM"
    assert cfg.attnres_sources == 9 and cfg.attnres_block_size == 12
    assert cfg.latent_dim == cfg.d_model // 2


BAD = [
    # (override, field the message must name, word of the fix)
    (dict(n_active_experts=9, n_experts=8), "n_active_experts", "lower"),
    (dict(moe_latent_dim=48), "moe_latent_dim", "divide"),
    (dict(layer_pattern="KKM"), "layer_pattern", "one letter"),
    (dict(layer_pattern="KKXM"), "layer_pattern", "K and M"),
    (dict(attnres_sources=6), "attnres_sources", "fewer sources"),
    (dict(attnres_sources=1), "attnres_sources", ">= 2"),
    (dict(attnres_sources=0), "attnres_sources", ">= 2"),  # not ">= 1", which 1 then fails
    (dict(attnres_sources=0, attnres="none"), "attnres_sources", ">= 2"),
    (dict(attnres_sources=4), "attnres_sources", "attnres_sources = 3"),
    # forms that cannot go together, or values no form has
    (dict(gate_lower_bound=0.0), "gate_lower_bound", "null"),
    (dict(gate_lower_bound=2.5), "gate_lower_bound", "-5.0"),
    (dict(gate_lower_bound=float("-inf")), "gate_lower_bound", "finite"),
    (dict(gate_lower_bound="low"), "gate_lower_bound", "a number or null"),
    (dict(situ_beta=0.0), "situ_beta", "> 0"),
    (dict(situ_linear_beta=-25.0), "situ_linear_beta", "> 0"),
    (dict(hidden_act="gelu"), "hidden_act", "situ"),
    (dict(qk_rope_head_dim=-1), "qk_rope_head_dim", ">= 0"),
    (dict(kda_gate_bias=True), "kda_gate_bias", "use_full_rank_gate"),
    (dict(quantile_estimator="guess"), "quantile_estimator", "histogram"),
    (dict(quantile_bins=1), "quantile_bins", "1000"),
    (dict(attn_res_block_size=1), "attnres_sources", "attnres_sources = 5"),
    (dict(max_context=0), "max_context", "positive"),
    (dict(max_context=-5), "max_context", "positive"),
    (dict(d_model=0), "d_model", "positive"),
    (dict(attnres="sometimes"), "attnres", "block | full | none"),
    (dict(moe="huge"), "moe", "latent | standard"),
    (dict(balancing="magic"), "balancing", "pick one"),
    (dict(n_dense_layers=9), "n_dense_layers", "lower"),
    (dict(n_shared_experts=-1), "n_shared_experts", ">= 0"),
    (dict(qat={"expert_weights": "int3"}), "qat", "mxfp4"),
    # wrong types (as `--set` or a config file can give them) and out-of-range floats
    (dict(qat="mxfp4"), "qat", "JSON object"),
    (dict(mla_q_lora_rank="x"), "mla_q_lora_rank", "an integer"),
    (dict(moe_latent_dim="x"), "moe_latent_dim", "an integer"),
    (dict(n_dense_layers=1.5), "n_dense_layers", "an integer"),
    (dict(layer_pattern=3), "layer_pattern", "a string"),
    (dict(tie_embeddings=1), "tie_embeddings", "true or false"),
    (dict(n_experts=True), "n_experts", "an integer"),
    (dict(routed_scale=-1.0), "routed_scale", "> 0"),
    (dict(norm_eps=0.0), "norm_eps", "> 0"),
    (dict(kda_norm_eps=-1e-4), "kda_norm_eps", "> 0"),
    (dict(bias_update_rate=-0.1), "bias_update_rate", "0 to disable"),
    (dict(routed_scale=float("inf")), "routed_scale", "finite"),  # `--set routed_scale=Infinity` parses
    (dict(init_std=float("nan")), "init_std", "finite"),
    (dict(bias_update_rate=float("inf")), "bias_update_rate", "finite"),
    # sizes torch cannot build (an overflow traceback from `k3 params` before)
    (dict(vocab_size=10 ** 30), "vocab_size", "typo"),
    (dict(max_context=2 ** 31), "max_context", "typo"),
    (dict(n_experts=2 ** 31 - 1, expert_ffn=2 ** 31 - 1, n_active_experts=1), "n_experts", "lower these sizes"),
]


@pytest.mark.parametrize("mode", ["full", "none"])
def test_attnres_sources_only_binds_block_mode(mode):
    # one source per sublayer (full) or none at all: the block count is not read, so it is not checked
    cfg = get_config("tiny", n_layers=1, attnres=mode)
    assert cfg.attnres_sources == 3 > cfg.n_layers + 1
    with pytest.raises(K3ConfigError, match="attnres_sources"):
        get_config("tiny", n_layers=1, attnres="block")


@pytest.mark.parametrize("override,field,fix", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_validate_rejects_with_field_and_fix(override, field, fix):
    with pytest.raises(K3ConfigError) as e:
        get_config("tiny", **override)
    msg = str(e.value)
    assert field in msg and fix in msg, msg


def test_saved_config_without_kda_norm_eps_keeps_the_eps_it_was_trained_with():
    """A complete config saved before the field existed gets norm_eps (what KDA's output norm used then);
    presets and partial overrides get the field's default, and an explicit value always wins."""
    saved = get_config("tiny").to_dict()
    del saved["kda_norm_eps"]
    assert K3Config.from_dict(saved).kda_norm_eps == saved["norm_eps"] == 1e-6
    assert get_config("tiny").kda_norm_eps == K3Config().kda_norm_eps == 1e-4
    assert get_config("tiny", norm_eps=1e-5).kda_norm_eps == 1e-4  # a partial dict is not a saved config
    assert K3Config.from_dict({**saved, "kda_norm_eps": 3e-5}).kda_norm_eps == 3e-5


def test_k3_preset_is_the_released_text_config():
    """Every value of moonshotai/Kimi-K3's text_config that k3 expresses (docs/architecture.md has the sources)."""
    c = get_config("k3")
    assert (c.vocab_size, c.d_model, c.n_layers, c.max_context, c.norm_eps) == (163840, 7168, 93, 1048576, 1e-5)
    assert (c.kda_heads, c.kda_head_dim, c.kda_conv_size, c.gate_lower_bound, c.use_full_rank_gate) == (96, 128, 4, -5.0, True)
    assert (c.mla_heads, c.mla_q_lora_rank, c.mla_kv_lora_rank, c.mla_qk_head_dim, c.qk_rope_head_dim,
            c.mla_v_head_dim, c.mla_use_output_gate) == (96, 1536, 512, 128, 64, 128, True)
    assert (c.hidden_act, c.situ_beta, c.situ_linear_beta) == ("situ", 4.0, 25.0)
    assert (c.n_dense_layers, c.dense_ffn, c.moe_latent_dim, c.latent_moe_use_norm) == (1, 33792, 3584, True)
    assert (c.n_experts, c.n_active_experts, c.expert_ffn, c.n_shared_experts, c.routed_scale) == (896, 16, 3072, 2, 1.0)
    assert (c.attn_res_block_size, c.attnres_sources, c.init_std, c.tie_embeddings) == (12, 9, 0.02, False)
    assert c.mla_norm_eps == 1e-6  # q_a_layernorm / kv_a_layernorm: the modeling code's default, not rms_norm_eps
    mla = [i + 1 for i, k in enumerate(c.pattern) if k == "M"]  # 1-indexed, as full_attn_layers lists them
    assert mla == list(range(4, 93, 4)) + [93] and len(mla) == 24


def test_published_head_counts_need_not_divide_d_model():
    # 96 heads of 128 do not tile 7168 (= 56 x 128); head_dim is its own field
    assert get_config("tiny", kda_heads=3, mla_heads=5).kda_heads == 3


def test_saved_config_without_the_release_fields_keeps_its_earlier_forms():
    saved = get_config("tiny").to_dict()
    for k in ("gate_lower_bound", "use_full_rank_gate", "kda_gate_bias", "qk_rope_head_dim", "hidden_act",
              "latent_moe_use_norm", "quantile_estimator", "mla_use_output_gate"):
        del saved[k]
    old = K3Config.from_dict(saved)
    assert (old.gate_lower_bound, old.use_full_rank_gate, old.kda_gate_bias, old.qk_rope_head_dim, old.hidden_act,
            old.latent_moe_use_norm, old.quantile_estimator) == (None, False, True, 0, "silu", False, "exact")
    assert get_config("tiny").gate_lower_bound == -5.0  # a preset names the released forms


def test_kda_output_norm_uses_kda_norm_eps():
    from k3.model.kda import KimiDeltaAttention
    assert KimiDeltaAttention(get_config("tiny", kda_norm_eps=2e-5)).eps == 2e-5


def test_unknown_field_and_preset():
    with pytest.raises(K3ConfigError, match="unknown config field"):
        K3Config.from_dict({"d_modle": 3})
    with pytest.raises(K3ConfigError, match="unknown preset"):
        get_config("huge")


def test_cli_prints_config_error_without_traceback():
    r = subprocess.run([sys.executable, "-m", "k3.cli", "config", "--preset", "tiny", "--set", "n_active_experts=99"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "n_active_experts" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "k3.cli", "config", "--preset", "tiny", "--set", "qat=mxfp4"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "qat" in r.stderr and "JSON object" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "k3.cli", "config", "--preset", "tiny", "--set", "attnres=full"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout)["attnres"] == "full"


def test_config_files_and_string_fields_give_one_line_errors(tmp_path, capsys):
    from k3.cli import main

    for name, text, want in [("list.json", "[1, 2]", "holds a JSON list"), ("num.json", "5", "holds a JSON int"),
                             ("empty.json", "", "not valid JSON"), ("comma.json", '{"n_layers": 2,}', "not valid JSON")]:
        (tmp_path / name).write_text(text)
        assert main(["config", "--config", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err
        assert want in err and str(tmp_path / name) in err, err
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe")
    assert main(["config", "--config", str(tmp_path / "bin.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    # a string field takes the text as written; an empty name is refused
    assert main(["config", "--preset", "tiny", "--set", "name=123"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "123"
    assert main(["config", "--preset", "tiny", "--set", "name="]) == 2
    assert "name = '' is empty" in capsys.readouterr().err


def test_a_partial_config_file_is_laid_over_the_preset(tmp_path, capsys):
    """--config with some fields takes the rest from --preset (it used to take the dataclass defaults and
    ignore --preset); a complete config stands alone whatever --preset says."""
    from k3.cli import main
    from k3.config import get_config

    (tmp_path / "part.json").write_text('{"attnres": "full", "n_layers": 4}')
    assert main(["config", "--preset", "mini", "--config", str(tmp_path / "part.json")]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == {**get_config("mini").to_dict(), "attnres": "full", "n_layers": 4}
    (tmp_path / "full.json").write_text(get_config("tiny").to_json())
    assert main(["config", "--preset", "mini", "--config", str(tmp_path / "full.json")]) == 0
    assert json.loads(capsys.readouterr().out) == get_config("tiny").to_dict()
    old = get_config("tiny").to_dict()
    del old["kda_norm_eps"]  # a complete config saved before the field existed keeps its norm_eps there
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main(["config", "--preset", "mini", "--config", str(tmp_path / "old.json")]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["d_model"] == get_config("tiny").d_model and got["kda_norm_eps"] == old["norm_eps"]


def test_config_file_that_is_missing_or_a_directory(tmp_path, capsys):
    from k3.cli import main

    missing = tmp_path / "nonexist.json"
    assert main(["params", "--config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--config {missing}: no such file" in err and "Errno" not in err
    assert main(["params", "--config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--config {tmp_path}: is a directory" in err and "Errno" not in err


def test_params_columns_stay_apart_at_any_width(capsys):
    from k3.cli import main

    assert main(["params", "--preset", "tiny", "--set", "d_model=1048576", "--set", "moe_latent_dim=524288"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[1:lines.index(next(l for l in lines if l.startswith("all"))) + 1]
    for line in table:
        name, total, active = line.split()  # three columns, never run together
        assert int(total.replace(",", "")) >= int(active.replace(",", "")) > 0, line


def test_divisors_are_listed_without_counting_to_n():
    from k3.config import divisors

    assert [divisors(n) for n in (1, 6, 16, 17)] == [[1], [1, 2, 3, 6], [1, 2, 4, 8, 16], [1, 17]]
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 300))
    assert divisors(10 ** 12 + 1) == [1, 73, 137, 10001, 99990001, 7299270073, 13698630137, 10 ** 12 + 1]  # (counting
    # to n, as the layout errors did, takes hours here)
