"""`k3 rl`: the stages end to end at toy size, and bad input as one-line errors."""
import json

from k3.cli import main


def test_rl_stages_end_to_end(tmp_path, capsys, sandbox_ok, monkeypatch):
    from k3.distill.loop import StepLoop

    graceful, real_fit = {}, StepLoop.fit

    def fit(self, step_fn, **kw):  # both stages ask their loop to stop gracefully on SIGINT / SIGTERM
        graceful[self.manifest_extra["kind"]] = kw.get("graceful_interrupt")
        return real_fit(self, step_fn, **kw)

    monkeypatch.setattr(StepLoop, "fit", fit)
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
    assert graceful == {"rl-warmstart": True, "rl-grpo": True}
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
    assert main(["rl", "plot", "--root", root, "--runs", "warmstart"]) == 2  # SFT records only: no curve to draw
    assert "run(s) warmstart under" in capsys.readouterr().err
    assert (tmp_path / "exp/reward.png").read_bytes() == before
    # a --max-tokens no prompt fits beside, or a model folder a killed first save left without a checkpoint:
    # refused before any episode (every episode was excluded, the figures null or NaN; warmstart was evaluated,
    # then the empty folder failed naming `k3 train`)
    (tmp_path / "exp/empty/checkpoint").mkdir(parents=True)
    for argv, says in (
            (["rl", "eval", "--root", root, "--models", "warmstart", "--max-tokens", "5000"],
             "--max-tokens 5000 does not fit warmstart's context"),
            (["rl", "train", *common, "--name", "long", "--max-tokens", "5000"],
             "--max-tokens 5000 does not fit warmstart's context"),
            (["rl", "eval", "--root", root, "--models", "warmstart,empty"], "no checkpoint for empty under")):
        assert main(argv) == 2, argv
        assert says in capsys.readouterr().err
    assert not (tmp_path / "exp/long").exists()
    # resuming a finished run is allowed; starting over on top of it needs --overwrite
    assert main(["rl", "train", *common, "--tasks-per-kind", "1", "--steps", "2", "--groups", "1",
                 "--group-size", "2", "--max-tokens", "6", "--name", "fixed", "--harness", "fixed"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    # a resume that has nothing left to train says so (it printed only null figures)
    assert main(["rl", "train", *common, "--tasks-per-kind", "1", "--steps", "1", "--groups", "1",
                 "--group-size", "2", "--max-tokens", "6", "--name", "fixed", "--harness", "fixed", "--max-turns", "2",
                 "--resume"]) == 0
    assert "fixed is already at step 2: nothing to train; raise --steps above 2" in capsys.readouterr().err
    # the experiment's tokenizer is reused only with the settings that built it
    warm2 = ["rl", "warmstart", *common, "--tasks-per-kind", "1", "--demos-per-task", "1", "--steps", "2",
             "--batch", "1", "--ckpt-every", "0", "--workers", "3", "--n-layers", "2", "--tokenizer-prompts", "40"]
    tok_bytes = (tmp_path / "exp/tokenizer.json").read_bytes()
    assert main([*warm2, "--vocab-size", "500", "--resume"]) == 2  # not silently the 600-token one
    assert "vocab_size 600 (asked: 500)" in capsys.readouterr().err
    assert (tmp_path / "exp/tokenizer.json").read_bytes() == tok_bytes
    assert main([*warm2, "--vocab-size", "600", "--resume"]) == 0  # the same settings reuse it
    assert (tmp_path / "exp/tokenizer.json").read_bytes() == tok_bytes
    # the warm start trained on: a GRPO run from it without a KL term still resumes (it was refused: "'init' is
    # 'warmstart@2' in the checkpoint but 'warmstart@3' now"); with beta 0 the init model is not used on a resume
    w3 = [*warm2[:warm2.index("--steps") + 1], "3", *warm2[warm2.index("--steps") + 2:]]
    assert main([*w3, "--vocab-size", "600", "--resume"]) == 0
    capsys.readouterr()
    assert main(["rl", "train", *common, "--tasks-per-kind", "1", "--steps", "3", "--groups", "1",
                 "--group-size", "2", "--max-tokens", "6", "--name", "fixed", "--harness", "fixed", "--max-turns", "2",
                 "--resume", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["steps"] == 3
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


def test_rl_flags_are_checked_before_any_work(tmp_path, capsys, monkeypatch):
    """Each bad flag is named in one line before demonstrations are collected, a tokenizer built or a model loaded."""
    import pytest

    import k3.rl.train as rl_train
    monkeypatch.setattr(rl_train, "demo_pool", lambda *a, **k: pytest.fail("collected demonstrations"))
    root = tmp_path / "exp"
    warm = ["rl", "warmstart", "--root", str(root), "-q"]
    train = ["rl", "train", "--root", str(root), "-q"]
    cases = [
        (warm + ["--workers", "0"], "--workers 0 must be a positive integer"),
        (warm + ["--workers", "-1"], "--workers -1 must be a positive integer"),
        (warm + ["--decay-frac", "2"], "--decay-frac 2.0 must be a fraction of the steps, in [0, 1]"),
        (warm + ["--decay-frac", "-0.5"], "--decay-frac -0.5 must be a fraction"),
        (warm + ["--n-layers", "0"], "--n-layers 0 must be a positive integer"),
        (warm + ["--steps", "0"], "--steps 0 must be a positive integer"),
        (warm + ["--batch", "0"], "--batch 0 must be a positive integer"),
        (warm + ["--demos-per-task", "0"], "--demos-per-task 0 must be a positive integer"),
        (warm + ["--vocab-size", "100"], "use --vocab-size >= 273"),
        (warm + ["--grad-clip", "nan"], "--grad-clip nan must be a number >= 0"),
        # --warmup, k3 rl's spelling of --warmup-steps: both are taken, and the error names the one typed
        (warm + ["--warmup", "-1"], "--warmup -1 must be an integer >= 0"),
        (train + ["--warmup-steps", "-1"], "--warmup-steps -1 must be an integer >= 0"),
        (warm + ["--preset", "bogus"], "--preset 'bogus' is not a preset; choose one of"),
        (warm + ["--resume", "--overwrite"], "--resume continues the run and --overwrite starts it over; give one"),
        (warm + ["--resume"], "--resume: no checkpoint in"),
        (train + ["--resume", "--overwrite"], "give one"),
        (train + ["--name", "/abs"], "--name '/abs' must be a plain directory name under --root"),
        (train + ["--name", "../escape"], "--name '../escape' must be a plain directory name"),
        (train + ["--name", ""], "--name is empty (an unset shell variable?)"),
        (train + ["--name", "tasks"], "--name tasks is one of the experiment's own files or stages"),
        (train + ["--name", "warmstart", "--init", "warmstart"], "--name warmstart is one of the experiment's own"),
        (train + ["--name", ".."], "--name '..' must be a plain directory name"),
        (train + ["--init", "../warmstart"], "--init '../warmstart' must be a plain directory name"),
        (train + ["--init", "g1", "--name", "g1"], "--init g1 and --name g1 are the same run"),
        (train + ["--decay-frac", "2"], "--decay-frac 2.0 must be a fraction"),
        (train + ["--eps-low", "1.5"], "--eps-low 1.5 must be in (0, 1)"),
        (train + ["--beta", "-1"], "--beta -1.0 must be >= 0"),
        (train + ["--group-size", "1"], "--group-size 1: group-relative advantages need at least 2"),
        (train + ["--groups", "0"], "--groups 0 must be a positive integer"),
        (train + ["--micro-batch", "-1"], "--micro-batch -1 must be an integer >= 0"),
    ]
    for argv, says in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, (argv, err)
    assert not root.exists()

    # another tool's directory as --root: nothing written into it (a teachers matrix's tokenizer was replaced)
    from k3.data.tokenizer import SETTINGS_FILE, train_tokenizer
    teachers = tmp_path / "teachers"
    teachers.mkdir()
    (teachers / "teachers.json").write_text("{}")
    for argv in (["rl", "warmstart", "--root", str(teachers), "-q"], ["rl", "train", "--root", str(teachers), "-q"]):
        assert main(argv) == 2
        assert "holds teachers.json: it is a `k3 distill teachers` matrix" in capsys.readouterr().err
    assert sorted(p.name for p in teachers.iterdir()) == ["teachers.json"]
    # a tokenizer built with other settings is refused before the demonstrations are collected (they replaced
    # ROOT/demos.jsonl, and the refusal came after)
    exp = tmp_path / "exp2"
    exp.mkdir()
    train_tokenizer(["a b c d e f"] * 50, 300, path=exp / "tokenizer.json", allow_short=True)
    (exp / SETTINGS_FILE).write_text('{"vocab_size": 300}')
    (exp / "demos.jsonl").write_text('{"kept": 1}\n')
    assert main(["rl", "warmstart", "--root", str(exp), "-q"]) == 2
    assert "was built with other settings" in capsys.readouterr().err
    assert (exp / "demos.jsonl").read_text() == '{"kept": 1}\n' and not (exp / "tasks").exists()


def test_damaged_demonstrations_name_their_file(tmp_path):
    import pytest

    from k3.rl.train import demo_pool, read_demos
    (tmp_path / "demos.jsonl").write_text('{"models": {"warmstart": {}}}')  # an intent report written over it
    with pytest.raises(ValueError, match="demos.jsonl does not hold k3 rl demonstrations; delete it"):
        read_demos(tmp_path / "demos.jsonl")
    (tmp_path / "demos.jsonl").write_text("{'x'\n")
    with pytest.raises(ValueError, match="demos.jsonl is damaged .*delete it"):
        demo_pool(tmp_path, 1, 1)


def test_rl_eval_intent_and_plot_refuse_bad_input(tmp_path, capsys):
    """An empty --models/--harness, --variants/--n-per-kind/--n below 1, an output path that is a directory:
    refused, and the experiment's eval.json is left alone; a run directory that holds a checkpoint names --name."""
    from k3.data.tokenizer import train_tokenizer
    root = tmp_path / "exp"
    root.mkdir()
    train_tokenizer(["a b c d e f"] * 50, 300, path=root / "tokenizer.json", allow_short=True)
    (root / "eval.json").write_text('{"models": {}, "kept": true, "harnesses": []}')  # an earlier eval report
    (root / "intent.json").write_text('{"models": {}, "dialect": null}')  # and an intent report
    (root / "adir").mkdir()
    ev = ["rl", "eval", "--root", str(root)]
    it = ["rl", "intent", "--root", str(root)]
    cases = [
        (ev + ["--models", ""], "--models is empty"),
        (ev + ["--models", " , "], "--models ' , ' names nothing"),
        (ev + ["--harness", ""], "--harness is empty"),
        (ev + ["--harness", "bogus"], "unknown harness 'bogus'"),
        (ev + ["--variants", "0"], "--variants 0 must be a positive integer"),
        (ev + ["--n-per-kind", "0"], "--n-per-kind 0 must be a positive integer"),
        (ev + ["--out", str(root / "adir")], f"--out {root / 'adir'} is a directory; give a file path"),
        (ev + ["--models", "warmstart,typo"], "no checkpoint for warmstart, typo under"),
        (it + ["--n", "-1"], "--n -1 must be a positive integer"),
        (it + ["--n", "0"], "--n 0 must be a positive integer"),
        (it + ["--models", ""], "--models is empty"),
        (it + ["--out", str(root / "adir")], "is a directory; give a file path"),
        # the experiment's own files, or a file that is not an earlier report, are never replaced by a report
        (it + ["--out", str(root / "demos.jsonl")], "is one of the experiment's own files"),
        (ev + ["--out", str(root / "tokenizer.json")], "is one of the experiment's own files"),
        (ev + ["--out", str(root / "mine.json")], "exists and is not an earlier k3 rl report"),
        # nor is one command's report replaced by the other's (`k3 rl plot` reads the eval report)
        (it + ["--out", str(root / "eval.json")], "holds a `k3 rl eval` report; this `k3 rl intent` report"),
        (ev + ["--out", str(root / "intent.json")], "holds a `k3 rl intent` report; this `k3 rl eval` report"),
    ]
    (root / "mine.json").write_text('{"mine": 1}')
    for argv, says in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, (argv, err)
    assert (root / "eval.json").read_text() == '{"models": {}, "kept": true, "harnesses": []}'
    assert (root / "mine.json").read_text() == '{"mine": 1}'

    # a run that holds a checkpoint: continued or replaced, and the flag that picks another is --name
    (root / "g1" / "checkpoint" / "step_000001").mkdir(parents=True)
    (root / "g1" / "checkpoint" / "step_000001" / "manifest.json").write_text("{}")
    assert main(["rl", "train", "--root", str(root), "--name", "g1", "-q"]) == 2
    err = capsys.readouterr().err
    assert "already holds a checkpoint" in err and "another --name" in err and "--out" not in err


def test_rl_plot_refuses_what_is_not_an_eval_report(tmp_path, capsys):
    root = tmp_path / "exp"
    (root / "g1").mkdir(parents=True)
    (root / "g1" / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "fresh_rollouts": True,
                                                           "reward_mean": 0.5}) + "\n")
    plot = ["rl", "plot", "--root", str(root), "--runs", "g1", "--eval"]
    report = {"tasks": 3, "variants": 1, "harnesses": ["unseen"],
              "models": {"warmstart": {"step": 2, "unseen": {"success": 0.5, "ci95": [0.1, 0.9]}}}}
    for content, says in (("{}", "is not a `k3 rl eval` report (no 'models')"),
                          ("[]", "is not a `k3 rl eval` report (no 'models')"),
                          ("", "is not JSON"), ("not json", "is not JSON"),
                          (json.dumps({**report, "harnesses": "unseen"}), "no 'harnesses' list"),
                          (json.dumps({**report, "models": {"warmstart": {"unseen": 0.5}}}), "model 'warmstart'"),
                          (json.dumps({**report, "models": {}}), "evaluates no model")):
        (tmp_path / "e.json").write_text(content)
        assert main([*plot, str(tmp_path / "e.json")]) == 2, content
        err = capsys.readouterr().err
        assert says in err and str(tmp_path / "e.json") in err and err.count("\n") == 1, (content, err)
    assert not (root / "reward.png").exists()
    (tmp_path / "e.json").write_text(json.dumps(report))
    assert main([*plot, str(tmp_path / "e.json")]) == 0
    assert (root / "reward.png").stat().st_size > 0
    (root / "adir").mkdir()
    assert main(["rl", "plot", "--root", str(root), "--runs", "g1", "--out", str(root / "adir")]) == 2
    assert "is a directory; give a file path" in capsys.readouterr().err


def test_demo_passes_every_flag_of_each_stage(monkeypatch, tmp_path):
    """`k3 rl --demo` calls the stages with Namespaces of its own: each must carry every flag the stage's parser
    defines (a missing one, e.g. --micro-batch, was an AttributeError after the warm start had run)."""
    import argparse

    import k3.rl.cli as rl_cli
    parser = argparse.ArgumentParser()
    rl_cli.register(parser.add_subparsers(dest="command"))
    seen = {}

    def stage(name, ret):
        def fn(args):
            seen[name] = vars(args)
            return ret
        return fn
    report = {"harnesses": ["canonical"], "models": {"warmstart": {"canonical": {"success": 0.0}}}}
    for name, ret in (("warmstart", {}), ("train", {}), ("eval", report), ("plot", {"plot": "x"})):
        monkeypatch.setattr(rl_cli, f"cmd_{name}", stage(name, ret))
    rl_cli.cmd_demo(argparse.Namespace(root=str(tmp_path), threads=1, seed=0, quiet=True))
    for name, argv in (("warmstart", ["rl", "warmstart"]), ("train", ["rl", "train"]), ("eval", ["rl", "eval"]),
                       ("plot", ["rl", "plot"])):
        # the flags of the stage's own parser (the `rl` parser's --threads, --seed, -q stay out of a plot's; not
        # k3.cli_checks' record of which flags set a config, which a namespace made by hand does without)
        flags = {k for k in vars(parser.parse_args(argv)) if not k.startswith("_")} - \
            set(vars(parser.parse_args(["rl"]))) | {"root"}
        assert flags <= set(seen[name]), (name, flags - set(seen[name]))


def test_ctrl_c_in_the_demo_does_not_advise_a_flag_it_lacks(tmp_path, monkeypatch, capsys):
    """The stages' advice is '--resume', which `k3 rl --demo` does not take: the demo says what it does instead."""
    import k3.rl.cli as rl_cli

    def stop(args):  # as StepLoop raises it
        e = KeyboardInterrupt("stopped in step 3; the last checkpoint is X: the same command with --resume")
        e.where = "stopped in step 3; the last checkpoint is X"
        raise e

    monkeypatch.setattr(rl_cli, "cmd_warmstart", stop)
    assert main(["rl", "--demo", "--root", str(tmp_path / "r")]) == 130
    err = capsys.readouterr().err
    assert "stopped in step 3" in err and "`k3 rl --demo` starts over when run again" in err
    assert "--resume" not in err  # the demo does not take it


def test_the_demo_does_not_start_over_an_experiment_it_did_not_make(tmp_path, monkeypatch, capsys):
    """`k3 rl --demo --root DIR` starts over, deleting DIR's checkpoints: DIR must be new, empty or an earlier demo's
    (it wiped a warm start and the GRPO runs of an experiment given there)."""
    import k3.rl.cli as rl_cli

    exp = tmp_path / "exp"
    (exp / "warmstart" / "checkpoint").mkdir(parents=True)
    (exp / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(rl_cli, "cmd_warmstart", lambda args: pytest.fail("started the demo"))
    assert main(["rl", "--demo", "--root", str(exp)]) == 2
    assert "did not make" in capsys.readouterr().err
    assert sorted(p.name for p in exp.iterdir()) == ["tokenizer.json", "warmstart"]

    def stop(args):
        raise KeyboardInterrupt("stopped")

    monkeypatch.setattr(rl_cli, "cmd_warmstart", stop)
    for root in (tmp_path / "new", tmp_path / "new"):  # a new root, then the demo's own again
        assert main(["rl", "--demo", "--root", str(root)]) == 130
        assert (root / rl_cli.DEMO_MARK).is_file()
