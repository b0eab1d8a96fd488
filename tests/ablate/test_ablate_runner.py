import json

import pytest

import k3.ablate.runner as runner
from k3.ablate.report import aggregate, write_report
from k3.ablate.runner import RunSpec, _trainer, data_fingerprint, execute, plan_runs, run_dir, run_plan
from k3.ablate.suites import ProbeSettings, Scale
from k3.cli import main

PNG = b"\x89PNG\r\n\x1a\n"
VERDICTS = {"supported", "contradicted", "inconclusive"}

SMOKE = Scale("smoke", "tiny", dict(vocab_size=512), steps=3, batch_size=2, seq_len=16, eval_batches=2,
              seeds=(0, 1),
              probe=ProbeSettings(d_model=32, n_layers=2, n_keys=2, n_values=2, n_filler=4, train_len=8,
                                  eval_lengths=(8, 16), steps=3, batch_size=2, eval_batches=1, eval_batch_size=4))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread for every test here (tests/conftest.py)."""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from k3.data import prepare_data

    out = tmp_path_factory.mktemp("data")
    return out, prepare_data(out, vocab_size=512, max_bytes=300_000)


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = runner.execute

    def wrapped(spec, *a, **k):
        calls.append(spec.kind)
        return real(spec, *a, **k)

    monkeypatch.setattr(runner, "execute", wrapped)
    return calls


def test_suite_runs_caches_and_reports(data, tmp_path, counted):
    data_dir, files = data
    names = ["precision", "probe"]
    plan = plan_runs(SMOKE, names, data_fingerprint(files))
    if runner.qat_status(SMOKE.base_config()) is not None:
        pytest.skip("config.qat has no effect in this tree (k3.quant missing): the precision group skips")
    assert not plan.skipped, plan.skipped  # config.qat changes the forward: PTQ and QAT are real runs
    results = run_plan(plan, tmp_path, str(data_dir), jobs=1, progress=False)
    assert sorted(counted) == sorted(["train"] * 2 * 2 + ["ptq"] * 2 + ["probe"] * 3 * 2)
    by = {(e.group, e.variant, e.seed): results[e.spec.key] for e in plan.entries}
    for seed in (0, 1):
        fp32, ptq = by[("precision", "fp32", seed)], by[("precision", "ptq", seed)]
        assert ptq["val_loss"] > 0 and ptq["active_params"] == fp32["active_params"]
        assert (run_dir(tmp_path, fp32["key"]) / runner.WEIGHTS).is_file()
        assert not (run_dir(tmp_path, fp32["key"]) / "checkpoint").exists()
        assert len(by[("precision", "qat", seed)]["train_loss"]) == SMOKE.steps
        assert set(by[("probe", "3:1", seed)]["accuracy"]) == {"8", "16"}

    summary = aggregate(plan, results)
    claims = summary["groups"]["precision"]["claims"] + summary["probe"]["claims"]
    assert {c["verdict"] for c in claims} <= VERDICTS
    row = summary["groups"]["precision"]["variants"]["qat"]
    assert row["val_loss"]["mean"] == pytest.approx(sum(row["val_loss"]["values"]) / 2)
    paths = write_report(summary, tmp_path, "## smoke\n")
    md = paths["markdown"].read_text()
    assert "### precision" in md and "### probe" in md and "| ptq |" in md
    assert json.loads(paths["json"].read_text())["groups"]["precision"]["baseline"] == "fp32"
    assert {p.name for p in paths["plots"]} == {"precision.png", "probe.png"}
    assert all(p.read_bytes()[:8] == PNG for p in paths["plots"])

    counted.clear()
    again = run_plan(plan_runs(SMOKE, names, data_fingerprint(files)), tmp_path, str(data_dir), progress=False)
    assert counted == [] and again == results  # everything cached


def test_variants_equal_to_the_base_share_one_run(data):
    plan = plan_runs(SMOKE, ["depth", "balancing", "precision"], data_fingerprint(data[1]))
    by = {(e.group, e.variant, e.seed): e.spec.key for e in plan.entries}
    assert by[("depth", "block", 0)] == by[("balancing", "bias", 0)] == by[("precision", "fp32", 0)]
    assert by[("depth", "block", 0)] != by[("depth", "block", 1)]
    assert len(plan.unique_specs()) == 2 * (1 + 2 + 3 + 2)  # base, 2 depth, 3 balancing, ptq + qat


def test_precision_group_skips_while_qat_has_no_effect(data, monkeypatch):
    monkeypatch.setattr(runner, "qat_status", lambda base: "needs QAT (k3.quant): test")
    plan = plan_runs(SMOKE, ["precision"], data_fingerprint(data[1]))
    assert plan.entries == [] and "needs QAT" in plan.skipped["precision"]
    md = aggregate(plan, {})
    assert md["groups"]["precision"]["skipped"].startswith("needs QAT")


def test_cache_key_covers_config_training_seed_and_data():
    base = dict(kind="train", config=SMOKE.base_config().to_dict(), train=SMOKE.train_settings(0), seed=0,
                data={"tokens": 1})
    key = RunSpec(**base).key
    assert RunSpec(**base).key == key
    assert RunSpec(**{**base, "seed": 1}).key != key
    assert RunSpec(**{**base, "data": {"tokens": 2}}).key != key
    assert RunSpec(**{**base, "train": {**base["train"], "steps": 4}}).key != key
    assert RunSpec(**{**base, "config": {**base["config"], "attnres": "none"}}).key != key


def test_an_interrupted_run_resumes_to_the_same_result(data, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "MIN_CKPT_INTERVAL", 1)
    data_dir, files = data
    spec = RunSpec("train", SMOKE.replace(steps=4).base_config().to_dict(), SMOKE.replace(steps=4).train_settings(0),
                   0, data_fingerprint(files))
    whole = execute(spec, tmp_path / "a", str(data_dir))
    # the same run interrupted during step 3 (checkpoints every step here), then started again
    d = run_dir(tmp_path / "b", spec.key)
    trainer, resume = _trainer(spec, files.train, d)
    assert not resume

    def stop(rec):
        if rec["step"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        trainer.fit(on_step=stop)
    assert (d / "checkpoint").is_dir() and not (d / runner.RESULT).exists()
    resumed = execute(spec, tmp_path / "b", str(data_dir))
    assert resumed["val_loss"] == whole["val_loss"] and resumed["train_loss"] == whole["train_loss"]


@pytest.mark.parametrize("argv, want", [
    (["--only", "depth,attention"], ["'attention'", "depth, seq, moe, balancing, precision, probe"]),
    (["--suite", "huge"], ["valid suites: core"]),
    (["--only", "depth", "--set", "attnres=full"], ["incompatible combination", "attnres"]),
    (["--only", "moe", "--set", "n_experts=9"], ["incompatible combination"]),
    # every run failed inside, after the data step, and the report said a rerun would retry them
    (["--only", "depth", "--set", "max_context=32"], ["sequences of 64 tokens, more than max_context = 32"]),
    (["--set", "colour=blue"], ["FIELD one of"]),
    (["--seeds", "0"], ["--seeds 0"]),
])
def test_bad_input_is_one_clear_line(argv, want, tmp_path, capsys):
    assert main(["ablate", *argv, "--quick", "--out", str(tmp_path / "o"), "--data", str(tmp_path / "d"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3 ablate: error:") and len(err.strip().splitlines()) == 1
    for w in want:
        assert w in err


def test_a_failed_run_is_reported_and_the_suite_goes_on(data, tmp_path, monkeypatch):
    data_dir, files = data
    plan = plan_runs(SMOKE, ["depth"], data_fingerprint(files))
    doomed = next(e.spec.key for e in plan.entries if e.variant == "none" and e.seed == 1)
    real = runner.execute

    def execute(spec, *a, **k):
        if spec.key == doomed:
            raise ValueError("training diverged: gradient norm is nan at step 1")
        return real(spec, *a, **k)

    monkeypatch.setattr(runner, "execute", execute)
    failures = {}
    results = run_plan(plan, tmp_path, str(data_dir), progress=False, failures=failures)
    assert set(failures) == {doomed} and failures[doomed]["run"] == "depth/none s1"
    assert "diverged" in failures[doomed]["error"]
    assert doomed not in results and len(results) == len(plan.unique_specs()) - 1
    assert not (run_dir(tmp_path, doomed) / runner.RESULT).exists()  # not cached: the next call retries it
    summary = aggregate(plan, results)
    summary["failed"] = list(failures.values())
    row = summary["groups"]["depth"]["variants"]["none"]
    assert row["seeds"] == [0] and row["val_loss_vs_baseline"]["n"] == 1
    paths = write_report(summary, tmp_path, "")
    assert "1 run(s) failed" in paths["markdown"].read_text() and "depth/none s1" in paths["markdown"].read_text()


def test_non_finite_metrics_are_left_out_of_tables_and_plots(data, tmp_path):
    data_dir, files = data
    plan = plan_runs(SMOKE, ["depth"], data_fingerprint(files))
    results = run_plan(plan, tmp_path, str(data_dir), progress=False)
    key = next(e.spec.key for e in plan.entries if e.variant == "none" and e.seed == 0)
    results = {**results, key: {**results[key], "val_loss": float("nan")}}
    summary = aggregate(plan, results)
    assert len(summary["groups"]["depth"]["variants"]["none"]["val_loss"]["values"]) == 1
    paths = write_report(summary, tmp_path, "")  # the plot's axis limits stay finite
    assert all(p.read_bytes()[:8] == PNG for p in paths["plots"])


def test_a_group_whose_every_run_failed_still_plots(tmp_path):
    """No variant with a metric: one Axes from plt.subplots (it was indexed as a list: TypeError after the
    tables were written, and the failed-run list never printed)."""
    from k3.ablate.report import plot_all

    summary = {"groups": {"seq": {"title": "seq", "baseline": "a", "variants": {"a": {}, "b": {}}}}}
    paths = plot_all(summary, tmp_path)
    assert [p.name for p in paths] == ["seq.png"] and paths[0].read_bytes()[:8] == PNG


def test_a_cached_result_of_other_trainer_settings_is_rerun(data, tmp_path):
    data_dir, files = data
    plan = plan_runs(SMOKE, ["depth"], data_fingerprint(files))
    spec = plan.entries[0].spec
    res = execute(spec, tmp_path, str(data_dir))
    assert res["trainer"]["grad_clip"] == 1.0 and runner.cached_result(tmp_path, spec) == res
    # a result trained when a trainer default was different (the spec, and so the key, do not name grad_clip)
    path = run_dir(tmp_path, spec.key) / runner.RESULT
    path.write_text(json.dumps({**res, "trainer": {**res["trainer"], "grad_clip": 0.5}}))
    assert runner.cached_result(tmp_path, spec) is None
    path.write_text(json.dumps({k: v for k, v in res.items() if k != "trainer"}))  # results of older k3: kept
    assert runner.cached_result(tmp_path, spec) is not None


def test_a_rerun_trained_run_reruns_its_ptq(data, tmp_path, counted):
    data_dir, files = data
    plan = plan_runs(SMOKE, ["precision"], data_fingerprint(files))
    if plan.skipped:
        pytest.skip("config.qat has no effect in this tree")
    run_plan(plan, tmp_path, str(data_dir), progress=False)
    fp32 = next(e.spec for e in plan.entries if e.variant == "fp32" and e.seed == 0)
    path = run_dir(tmp_path, fp32.key) / runner.RESULT
    res = json.loads(path.read_text())
    path.write_text(json.dumps({**res, "trainer": {**res["trainer"], "grad_clip": 0.5}}))  # stale settings
    counted.clear()
    run_plan(plan, tmp_path, str(data_dir), progress=False)
    assert sorted(counted) == ["ptq", "train"]  # the PTQ of the retrained weights, not of the old ones


def test_another_vocabulary_gets_a_data_directory_of_its_own(tmp_path, monkeypatch):
    """--set vocab_size=N tokenizes into DATA-vN: rebuilding --data in place would replace the data that
    k3 demo and the benchmarks read (and strand their checkpoints)."""
    import k3.data
    from k3.cli import main

    seen = []

    class Stop(Exception):
        pass

    def fake_prepare(out, *a, **kw):
        seen.append((str(out), kw.get("vocab_size")))
        raise Stop
    monkeypatch.setattr(k3.data, "prepare_data", fake_prepare)
    data = str(tmp_path / "data")
    for extra, want in (([], (data, k3.data.DEFAULT_VOCAB_SIZE)), (["--set", "vocab_size=4096"],
                                                                  (f"{data}-v4096", 4096))):
        try:
            main(["ablate", "--quick", "--only", "depth", "--seeds", "1", "--data", data, "--out", str(tmp_path / "o"),
                  *extra])
        except Stop:
            pass
        assert seen[-1] == want


def test_results_json_is_strict_json_with_one_seed(tmp_path):
    """One seed gives a CI of [-inf, +inf]: results.json (and --json) hold null there, not `Infinity`."""
    from k3.ablate.report import json_safe

    one = SMOKE.replace(seeds=(0,))
    plan = plan_runs(one, ["probe"], {})
    summary = aggregate(plan, run_plan(plan, tmp_path, None, progress=False))
    assert any(c["ci95"] == [float("-inf"), float("inf")] for c in summary["probe"]["claims"])
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "seq.png").write_bytes(PNG)  # an earlier, wider run's group: not this run's result
    paths = write_report(summary, tmp_path, "")
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(p.name for p in paths["plots"])

    def strict(constant):
        raise AssertionError(f"results.json holds {constant}, which is not JSON")

    written = json.loads(paths["json"].read_text(), parse_constant=strict)
    assert all(c["ci95"] == [None, None] for c in written["probe"]["claims"])
    assert "CI needs ≥ 2 seeds" in paths["markdown"].read_text()  # the markdown still says why
    assert json_safe({"a": [1.0, float("nan")], "b": (float("inf"), "x", 2)}) == {"a": [1.0, None], "b": [None, "x", 2]}


def test_list_prints_nothing_before_an_error_and_only_must_name_something(tmp_path, capsys):
    assert main(["ablate", "--list", "--quick", "--set", "attnres=full"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "incompatible combination" in out.err
    for empty in (",", "", " , "):
        assert main(["ablate", "--quick", "--only", empty, "--out", str(tmp_path / "o"), "--data",
                     str(tmp_path / "d"), "-q"]) == 2
        err = capsys.readouterr().err
        assert ("--only is empty" if empty == "" else "names no ablation") in err, err
    assert not (tmp_path / "d").exists()


def test_out_is_checked_before_any_data_work(tmp_path, capsys):
    """A file as --out failed only after the data was built; another tool's folder got results written into it."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "teachers").mkdir()
    (tmp_path / "teachers" / "teachers.json").write_text("{}")
    for out, says in ((tmp_path / "afile", "is a file; give a directory"),
                      (tmp_path / "teachers", "holds files k3 ablate did not write (teachers.json)")):
        assert main(["ablate", "--quick", "--only", "depth", "--out", str(out), "--data", str(tmp_path / "d"),
                     "-q"]) == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # refused before the data was built
