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
    (dict(kda_heads=3), "kda_heads", "dividing d_model"),
    (dict(mla_heads=5), "mla_heads", "dividing d_model"),
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
