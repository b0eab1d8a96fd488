"""`k3 rl`: the stages end to end at toy size, and bad input as one-line errors."""
import json

from k3.cli import main


def test_rl_stages_end_to_end(tmp_path, capsys, sandbox_ok):
    root = str(tmp_path / "exp")
    common = ["--root", root, "-q", "--threads", "1"]
    assert main(["rl", "warmstart", *common, "--tasks-per-kind", "1", "--demos-per-task", "1", "--steps", "2",
                 "--batch", "1", "--vocab-size", "600", "--ckpt-every", "0", "--workers", "3", "--n-layers", "2",
                 "--tokenizer-prompts", "40", "--json"]) == 0
    warm = json.loads(capsys.readouterr().out)
    assert warm["steps"] == 2 and warm["demos"] == 3
    assert main(["rl", "train", *common, "--tasks-per-kind", "1", "--steps", "2", "--groups", "1",
                 "--group-size", "2", "--max-tokens", "6", "--ckpt-every", "1", "--name", "fixed", "--harness",
                 "fixed", "--max-turns", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 2 and 0.0 <= out["reward_last"] <= 1.0
    metrics = [json.loads(x) for x in (tmp_path / "exp/fixed/metrics.jsonl").read_text().splitlines()]
    train = [r for r in metrics if r["kind"] == "train"]
    assert len(train) == 2 and {e["dialect"] for r in train for e in r["episode_log"]} == {"react"}
    assert main(["rl", "eval", "--root", root, "--models", "warmstart,fixed", "--harness", "unseen", "--n-per-kind",
                 "1", "--variants", "1", "--max-tokens", "4", "--max-turns", "2", "--threads", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["models"]) == {"warmstart", "fixed"} and report["tasks"] == 3
    assert report["models"]["fixed"]["unseen"]["episodes"] == 3
    assert main(["rl", "intent", "--root", root, "--models", "warmstart", "--n", "3", "--threads", "1", "--json"]) == 0
    intent = json.loads(capsys.readouterr().out)
    assert intent["models"]["warmstart"]["demos"] + intent["models"]["warmstart"]["skipped"] == 3
    assert (tmp_path / "exp/intent.json").is_file()
    assert main(["rl", "plot", "--root", root, "--runs", "fixed", "--json"]) == 0
    assert (tmp_path / "exp/reward.png").stat().st_size > 0
    before = (tmp_path / "exp/reward.png").read_bytes()
    assert main(["rl", "plot", "--root", root, "--runs", "nosuch"]) == 2  # not an empty plot over the real one
    assert "no training metrics for run(s) nosuch" in capsys.readouterr().err
    assert (tmp_path / "exp/reward.png").read_bytes() == before
    # resuming a finished run is allowed; starting over on top of it needs --overwrite
    assert main(["rl", "train", *common, "--tasks-per-kind", "1", "--steps", "2", "--groups", "1",
                 "--group-size", "2", "--max-tokens", "6", "--name", "fixed", "--harness", "fixed"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    # the experiment's tokenizer is reused only with the settings that built it
    warm2 = ["rl", "warmstart", *common, "--tasks-per-kind", "1", "--demos-per-task", "1", "--steps", "2",
             "--batch", "1", "--ckpt-every", "0", "--workers", "3", "--n-layers", "2", "--tokenizer-prompts", "40"]
    tok_bytes = (tmp_path / "exp/tokenizer.json").read_bytes()
    assert main([*warm2, "--vocab-size", "500", "--resume"]) == 2  # not silently the 600-token one
    assert "vocab_size 600 (asked: 500)" in capsys.readouterr().err
    assert (tmp_path / "exp/tokenizer.json").read_bytes() == tok_bytes
    assert main([*warm2, "--vocab-size", "600", "--resume"]) == 0  # the same settings reuse it
    assert (tmp_path / "exp/tokenizer.json").read_bytes() == tok_bytes
    capsys.readouterr()
    assert main([*warm2, "--vocab-size", "500", "--overwrite"]) == 0  # rebuilt, and the warm start retrained
    assert "tokenizer 500 tokens" in capsys.readouterr().err
    assert main(["rl", "eval", "--root", root, "--models", "fixed", "--n-per-kind", "1", "--variants", "1",
                 "--max-tokens", "4", "--max-turns", "2", "--threads", "1"]) == 2  # trained with the old one
    assert "another tokenizer" in capsys.readouterr().err


def test_rl_bad_input(tmp_path, capsys):
    import pytest

    from k3.rl.train import GRPOConfig
    with pytest.raises(ValueError, match="--max-turns 0 must be a positive integer"):
        GRPOConfig(max_turns=0).validate()
    root = str(tmp_path / "none")
    assert main(["rl", "train", "--root", root]) == 2
    assert "k3 rl warmstart" in capsys.readouterr().err
    assert main(["rl", "eval", "--root", root]) == 2
    capsys.readouterr()
    (tmp_path / "none").mkdir()
    from k3.data.tokenizer import train_tokenizer
    train_tokenizer(["a b c d e f"] * 50, 300, path=tmp_path / "none" / "tokenizer.json", allow_short=True)
    assert main(["rl", "train", "--root", root, "--group-size", "1"]) == 2
    assert "at least 2 rollouts" in capsys.readouterr().err
    assert main(["rl", "train", "--root", root, "--fixed-dialect", "vim", "--harness", "fixed"]) == 2
    assert "fixed dialect" in capsys.readouterr().err
    assert main(["rl", "train", "--root", root]) == 2
    assert "train 'warmstart' first" in capsys.readouterr().err
    assert main(["rl"]) == 2
