"""benchmarks/qat.py: the per-seed statistics and verdict, and a --quick smoke run of the whole script."""
import json

import pytest


@pytest.fixture(scope="module")
def qat_bench(load_training_benchmark):
    return load_training_benchmark("qat")


def test_summarize_means_and_verdicts(qat_bench):
    s = qat_bench.summarize([0.10, 0.12, 0.11], [0.01, 0.00, 0.02], spread=0.05)
    assert s["ptq_degradation"] == pytest.approx(0.11) and s["qat_gap"] == pytest.approx(0.01)
    assert s["ptq_degradation_std"] == pytest.approx(0.01)
    assert s["ptq_degradation_sem"] == pytest.approx(0.01 / 3 ** 0.5)
    assert s["recovery"] == pytest.approx(0.10 / 0.11) and s["verdict"].startswith("met: recovery 0.91, 0.80 to")
    assert s["recovery_low"] == pytest.approx((0.10 - 2 * 0.01 / 3 ** 0.5) / 0.11)
    assert s["ptq_degradation_over_seed_spread"] == pytest.approx(2.2)
    # large recovery but a degradation within 2 standard errors of 0: not met
    noisy = qat_bench.summarize([0.02, -0.01, 0.005], [-0.05, 0.0, 0.01], spread=0.05)
    assert noisy["recovery"] > 0.8 and noisy["verdict"].startswith("inconclusive")
    assert "standard error" in noisy["verdict"]
    # clear degradation, too little recovered
    low = qat_bench.summarize([0.10, 0.12, 0.14], [0.05, 0.06, 0.07], spread=0.05)
    assert low["recovery"] == pytest.approx(0.5) and low["verdict"].startswith("not met: recovery 0.50")
    # a mean above the target whose QAT gap is too noisy to say (it was "met" on the mean alone)
    wide = qat_bench.summarize([0.10, 0.12, 0.14], [-0.05, 0.0, 0.08], spread=0.05)
    assert wide["recovery"] > 0.8 and wide["verdict"].startswith("inconclusive") and "straddles" in wide["verdict"]
    assert wide["recovery_low"] < 0.8 < wide["recovery_high"]
    assert "one seed" in qat_bench.summarize([0.1], [0.0], None)["verdict"]
    better = qat_bench.summarize([-0.01, -0.012, -0.011], [0.0, 0.01, 0.02], None)  # quantizing helped: no ratio
    assert better["verdict"].startswith("inconclusive: PTQ degradation") and "2 standard errors" in better["verdict"]
    assert "verdict" not in qat_bench.summarize([0.1, 0.2], None, None)  # PTQ-only setting


def test_quick_run_writes_paired_per_seed_records(qat_bench, tmp_path, capsys):
    out = tmp_path / "qat.json"
    r = qat_bench.main(["--quick", "--json", "--seeds", "0,1", "--settings", "k3,harshest_head",
                        "--ptq-only", "harsh", "--out", str(out)])
    assert json.loads(out.read_text())["settings"].keys() == r["settings"].keys() == {"k3", "harshest_head", "harsh"}
    assert r["seeds"] == [0, 1] and set(r["runs"]) == {"0", "1"}
    for name in ("k3", "harshest_head"):
        s = r["settings"][name]
        per_seed = [r["runs"][k][f"ptq_{name}"]["val_loss"] - r["runs"][k]["fp32"]["val_loss"] for k in ("0", "1")]
        assert s["ptq_degradation_per_seed"] == pytest.approx(per_seed)
        assert s["ptq_degradation"] == pytest.approx(sum(per_seed) / 2) and "verdict" in s
    assert "qat_harsh" not in r["runs"]["0"] and "verdict" not in r["settings"]["harsh"]
    fp32 = [r["runs"][k]["fp32"]["val_loss"] for k in ("0", "1")]
    assert fp32[0] != fp32[1] and r["seed_spread"] == pytest.approx(abs(fp32[0] - fp32[1]))
    assert r["settings"]["harshest_head"]["head"] == "mxfp4" and r["settings"]["k3"]["head"] is None
    assert json.loads(capsys.readouterr().out)["benchmark"] == "qat"


def test_bad_seeds_are_refused(qat_bench, tmp_path):
    with pytest.raises(SystemExit, match="--seeds"):
        qat_bench.main(["--quick", "--seeds", "0,x", "--out", str(tmp_path / "q.json")])
    with pytest.raises(SystemExit, match="--settings"):
        qat_bench.main(["--quick", "--settings", "k4", "--out", str(tmp_path / "q.json")])


def test_quantize_head_shares_the_weight_and_quantizes(qat_bench):
    import torch

    from k3.config import get_config
    from k3.model.transformer import K3Model
    from k3.model.qat import QATLinear

    torch.manual_seed(0)
    model = K3Model(get_config("tiny"))
    w, x = model.head.weight, torch.randint(0, 100, (1, 8))
    ref = model(x)
    assert qat_bench.quantize_head(model, "harshest") is model and type(model.head) is torch.nn.Linear
    qat_bench.quantize_head(model, "harshest_head")
    assert isinstance(model.head, QATLinear) and model.head.weight is w and model.head.act_format == "mxfp4"
    assert not torch.allclose(model(x), ref, atol=1e-4)



def test_qat_hand_over_continues_the_fp32_run_exactly(qat_bench, tiny_data_dir):
    """--qat-start: QAT takes over the fp32 run's state mid-way. Continued with no quantization, that hand-over
    must reproduce the fp32 run bit for bit (weights, optimizer moments, balancing bias, step, data order);
    continued with a setting, it must differ."""
    import argparse

    from k3.config import get_config
    from k3.data import prepare_data

    files = prepare_data(tiny_data_dir, vocab_size=512, max_bytes=300_000)  # reuses the fixture's data
    config = get_config("tiny", vocab_size=512)
    args = argparse.Namespace(steps=6, batch_size=2, seq_len=32, lr=3e-3, warmup_steps=2, eval_batches=2,
                              qat_lr_scale=1.0)
    _, fp32, snap = qat_bench.train_run(config, files, args, "fp32", 0, snapshot_at=4)
    assert snap["step"] == 4 and len(snap["losses"]) == 4
    same = qat_bench.continue_run(config, files, args, "fp32 again", 0, snap, None)
    assert same["val_loss"] == fp32["val_loss"] and same["train_loss_last10"] == fp32["train_loss_last10"]
    assert same["tokens"] == fp32["tokens"] and same["qat_from_step"] == 4
    qat = qat_bench.continue_run(config, files, args, "qat", 0, snap, "harshest")
    assert qat["val_loss"] != fp32["val_loss"] and qat["tokens"] == fp32["tokens"]
    # the snapshot is not consumed: a later hand-over starts from the same state (the optimizer moments of the
    # runs before it, which have seen the batches after the snapshot, must not leak into it)
    again = qat_bench.continue_run(config, files, args, "fp32 once more", 0, snap, None)
    assert again["val_loss"] == fp32["val_loss"] and again["train_loss_last10"] == fp32["train_loss_last10"]


def test_qat_lr_scale_scales_the_qat_phase_only(qat_bench, tiny_data_dir, monkeypatch, tmp_path):
    """--qat-lr-scale multiplies the learning rate the optimizer uses in the continued (QAT) steps, and
    nothing before them."""
    import argparse

    from k3.config import get_config
    from k3.data import prepare_data
    from k3.train.schedule import WSDSchedule

    files = prepare_data(tiny_data_dir, vocab_size=512, max_bytes=300_000)
    config = get_config("tiny", vocab_size=512)
    used: list[tuple[int, float]] = []
    real_apply = WSDSchedule.apply

    def apply(self, optimizer, step):
        f = real_apply(self, optimizer, step)
        used.append((step, optimizer.param_groups[0]["lr"]))
        return f

    monkeypatch.setattr(WSDSchedule, "apply", apply)
    args = argparse.Namespace(steps=6, batch_size=2, seq_len=32, lr=3e-3, warmup_steps=2, eval_batches=2,
                              qat_lr_scale=1.0)
    _, _, snap = qat_bench.train_run(config, files, args, "fp32", 0, snapshot_at=4)
    fp32_lrs = dict(used)
    used.clear()
    args.qat_lr_scale = 0.25
    qat_bench.continue_run(config, files, args, "qat", 0, snap, "harsh")
    assert [s for s, _ in used] == [4, 5] and all(fp32_lrs[s] > 0 for s, _ in used)
    for step, lr in used:
        assert lr == pytest.approx(0.25 * fp32_lrs[step], rel=1e-12)
    for bad in (["--qat-lr-scale", "0"], ["--qat-lr-scale", "0.5"]):  # 0; a scale without a QAT phase
        with pytest.raises(SystemExit, match="--qat-lr-scale"):
            qat_bench.main(["--quick", *bad, "--out", str(tmp_path / "q.json")])


def test_bad_qat_start_is_refused(qat_bench, tmp_path):
    for bad in ("1.0", "-0.1"):
        with pytest.raises(SystemExit, match="--qat-start"):
            qat_bench.main(["--quick", "--qat-start", bad, "--out", str(tmp_path / "q.json")])


def test_resume_adds_seeds_and_equals_one_run(qat_bench, tmp_path, capsys):
    """--resume keeps the finished seeds of --out and runs only the new ones; the record is the one a single
    run over all seeds writes. A resume against a different experiment is refused, naming the difference."""
    common = ["--quick", "--json", "--settings", "harsh_head", "--ptq-only", "", "--qat-start", "0.5"]
    part = tmp_path / "part.json"
    qat_bench.main(common + ["--seeds", "0", "--no-seed-spread", "--out", str(part)])
    zero = tmp_path / "zero.json"
    zero.write_text(part.read_text())
    resumed = qat_bench.main(common + ["--seeds", "0,1", "--resume", "--out", str(part)])
    whole = qat_bench.main(common + ["--seeds", "0,1", "--out", str(tmp_path / "whole.json")])
    assert resumed["seeds_kept_from_earlier_run"] == [0] and whole["seeds_kept_from_earlier_run"] == []
    assert resumed["runs"]["0"]["qat_harsh_head"]["val_loss"] == whole["runs"]["0"]["qat_harsh_head"]["val_loss"]
    for key in ("ptq_degradation_per_seed", "qat_gap_per_seed", "recovery", "verdict"):
        assert resumed["settings"]["harsh_head"][key] == whole["settings"]["harsh_head"][key]
    with pytest.raises(SystemExit, match="differs in qat_from_step"):
        qat_bench.main(["--quick", "--settings", "harsh_head", "--ptq-only", "", "--qat-start", "0.25",
                        "--seeds", "0,1", "--resume", "--out", str(part)])
    # --merge: seed 1 run by a second process into its own file; merged, the record is the single run's again
    one = tmp_path / "one.json"
    qat_bench.main(common + ["--seeds", "1", "--no-seed-spread", "--out", str(one)])
    merged = qat_bench.main(common + ["--seeds", "0,1", "--merge", str(zero), str(one),
                                      "--out", str(tmp_path / "merged.json")])
    assert merged["seeds_kept_from_earlier_run"] == [0, 1] and merged["runs"].keys() == whole["runs"].keys()
    assert all(merged["runs"][s][k]["val_loss"] == whole["runs"][s][k]["val_loss"]
               for s in whole["runs"] for k in whole["runs"][s])
    for key in ("ptq_degradation_per_seed", "qat_gap_per_seed", "recovery", "verdict"):
        assert merged["settings"]["harsh_head"][key] == whole["settings"]["harsh_head"][key]
    with pytest.raises(SystemExit, match="--merge: .*differs in qat_from_step"):
        qat_bench.main(["--quick", "--settings", "harsh_head", "--ptq-only", "", "--qat-start", "0.25",
                        "--seeds", "0,1", "--merge", str(one), "--out", str(tmp_path / "m2.json")])
    # a file that also evaluated PTQ of another setting merges; that setting's figures are left out
    wider = tmp_path / "wider.json"
    qat_bench.main([*common[:4], "--ptq-only", "k3", *common[6:], "--seeds", "1", "--no-seed-spread",
                    "--out", str(wider)])
    assert "ptq_k3" in json.loads(wider.read_text())["runs"]["1"]
    merged = qat_bench.main(common + ["--seeds", "0,1", "--merge", str(zero), str(wider),
                                      "--out", str(tmp_path / "merged2.json")])
    assert merged["runs"]["1"].keys() == whole["runs"]["1"].keys() and "k3" not in merged["settings"]
    assert merged["settings"]["harsh_head"]["recovery"] == whole["settings"]["harsh_head"]["recovery"]
    with pytest.raises(SystemExit, match="--merge: .*differs in ptq_only"):  # a setting the file lacks
        qat_bench.main([*common[:4], "--ptq-only", "harsh", *common[6:], "--seeds", "0,1", "--merge",
                        str(wider), "--out", str(tmp_path / "m5.json")])
    bad = json.loads(one.read_text())
    bad["runs"]["1"]["fp32"]["val_loss"] += 0.5
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(SystemExit, match="--merge: seed 1 of .*differs"):
        qat_bench.main(common + ["--seeds", "0,1", "--merge", str(one), str(tmp_path / "bad.json"),
                                 "--out", str(tmp_path / "m4.json")])
    with pytest.raises(SystemExit, match="--merge: .*does not exist"):
        qat_bench.main(common + ["--seeds", "0", "--merge", str(tmp_path / "nope.json"),
                                 "--out", str(tmp_path / "m3.json")])
    capsys.readouterr()


def test_distill_objective_against_a_reference(qat_bench):
    """DistillTrainer.loss_fn: (1 - w) CE + w KL(teacher || student), KL summed over the vocabulary and averaged
    over tokens, computed from the teacher's logits on the same inputs."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    B, T, V = 2, 5, 11
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    s_logits, t_table = torch.randn(B, T, V), torch.randn(V, V)

    class Teacher(torch.nn.Module):
        def forward(self, ids):
            return t_table[ids]

    obj = object.__new__(qat_bench.DistillTrainer)  # only loss_fn is exercised: no model or data needed
    obj.teacher = Teacher()
    p_t = torch.softmax(t_table[x], -1)
    kl_ref = (p_t * (p_t.log() - torch.log_softmax(s_logits, -1))).sum(-1).mean()
    ce = F.cross_entropy(s_logits.reshape(-1, V), y.reshape(-1))
    for w in (1.0, 0.25):
        obj.kd_weight = w
        assert qat_bench.DistillTrainer.loss_fn(obj, s_logits, x, y).item() == pytest.approx(
            float((1 - w) * ce + w * kl_ref), rel=1e-5)
    obj.kd_weight = 1.0  # a student equal to its teacher has nothing to learn
    assert qat_bench.DistillTrainer.loss_fn(obj, t_table[x], x, y).item() == pytest.approx(0.0, abs=1e-6)


def test_kd_control_measures_qat_against_the_distilled_fp32_run(qat_bench):
    runs = {"0": {"fp32": {"val_loss": 4.00}, "fp32_kd": {"val_loss": 3.99}, "qat_x": {"val_loss": 4.001}},
            "1": {"fp32": {"val_loss": 4.10}, "fp32_kd": {"val_loss": 4.08}, "qat_x": {"val_loss": 4.083}}}
    k = qat_bench.kd_control(runs, ["0", "1"], "x", [0.010, 0.012])
    assert k["kd_control_gain_per_seed"] == pytest.approx([-0.01, -0.02])
    assert k["qat_gap_vs_kd_control"] == pytest.approx(0.007)  # (4.001 - 3.99 + 4.083 - 4.08) / 2
    assert k["recovery_vs_kd_control"] == pytest.approx((0.011 - 0.007) / 0.011)
    assert qat_bench.kd_control(runs, ["0", "1"], "x", [-0.001, 0.0005])["recovery_vs_kd_control"] is None


def test_qat_kd_runs_the_distillation_arm_and_its_control(qat_bench, tmp_path, capsys):
    r = qat_bench.main(["--quick", "--json", "--seeds", "0,1", "--settings", "harsh_head", "--ptq-only", "",
                        "--qat-start", "0.5", "--qat-kd", "0.5", "--out", str(tmp_path / "kd.json")])
    plain = qat_bench.main(["--quick", "--json", "--seeds", "0,1", "--settings", "harsh_head", "--ptq-only", "",
                            "--qat-start", "0.5", "--out", str(tmp_path / "plain.json")])
    assert r["budget"]["qat_kd"] == 0.5 and plain["budget"]["qat_kd"] == 0.0
    for s in ("0", "1"):
        assert r["runs"][s]["fp32"]["val_loss"] == plain["runs"][s]["fp32"]["val_loss"]  # same fp32 run
        assert r["runs"][s]["qat_harsh_head"]["val_loss"] != plain["runs"][s]["qat_harsh_head"]["val_loss"]
        assert r["runs"][s]["fp32_kd"]["objective"].startswith("0.5 x CE")
    h = r["settings"]["harsh_head"]
    own = [r["runs"][s]["fp32_kd"]["val_loss"] - r["runs"][s]["fp32"]["val_loss"] for s in ("0", "1")]
    assert h["kd_control_gain_per_seed"] == pytest.approx(own)
    gaps = [r["runs"][s]["qat_harsh_head"]["val_loss"] - r["runs"][s]["fp32_kd"]["val_loss"] for s in ("0", "1")]
    if h["ptq_degradation"] > 0:  # at 4 quick steps its sign is noise: a ratio over it only when it is positive
        assert h["recovery_vs_kd_control"] == pytest.approx(
            (h["ptq_degradation"] - sum(gaps) / 2) / h["ptq_degradation"])
    else:
        assert h["recovery_vs_kd_control"] is None and h["recovery"] is None
    assert "kd_control_gain" not in plain["settings"]["harsh_head"]
    for bad in (["--qat-kd", "0.5"], ["--qat-start", "0.5", "--qat-kd", "1.5"]):
        with pytest.raises(SystemExit, match="--qat-kd"):
            qat_bench.main(["--quick", "--settings", "harsh_head", "--out", str(tmp_path / "q.json")] + bad)
    capsys.readouterr()


def test_code_tracker_counts_changes_and_reverts(qat_bench):
    """--diagnose's CodeTracker against hand-worked MXFP4 values: one block [4, 1, 1, ...] has scale 1, so
    1.0 -> 1.6 changes its quantized value (to 1.5), 1.6 -> 1.0 changes it back (a revert), and 2.9 (-> 3)
    elsewhere is a change that is not one."""
    import torch

    from k3.model.qat import QATLinear

    lin = QATLinear(torch.nn.Linear(32, 2, bias=False), "mxfp4")
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.weight[:, 0] = 4.0
    tracker = qat_bench.CodeTracker(torch.nn.Sequential(lin))
    assert tracker.n == 64 and [n for n, _, _ in tracker.weights] == ["0.weight"]
    for row, col, value in ((0, 1, 1.6), (0, 1, 1.0), (1, 3, 2.9)):
        with torch.no_grad():
            lin.weight[row, col] = value
        tracker()
    assert tracker.changes == [1, 1, 1] and tracker.reverts == [0, 1, 0]
    s = tracker.summary()
    assert s["revert_share"] == pytest.approx(1 / 3) and s["changed_over_phase"] == pytest.approx(1 / 64)
    assert s["change_rate_first5"] == s["change_rate_last5"] == pytest.approx(1 / 64) and s["steps"] == 3


def test_quantized_weights_finds_every_fake_quantized_weight(qat_bench):
    import torch

    from k3.config import get_config
    from k3.model.transformer import K3Model

    model = qat_bench.quantize_head(K3Model(get_config("tiny", qat=qat_bench.SETTINGS["harsh_head"][0])),
                                    "harsh_head")
    names = {n for n, _, _ in qat_bench.quantized_weights(model)}
    params = dict(model.named_parameters())
    assert "head.weight" in names and any(n.endswith(".w2") for n in names) and names <= set(params)
    # every Linear (QATLinear is one) is quantized under harsh_head: none is left out
    linear = {f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    assert linear <= names


def test_diagnose_splits_the_qat_gap(qat_bench, tmp_path):
    """diagnosis(): latent_gap + own_quant_cost = the QAT gap, seed by seed; and --diagnose needs --qat-start."""
    runs = {s: {"fp32": {"val_loss": 4.0 + i}, "qat_x": {"val_loss": 4.03 + i, "diagnosis": {
        "latent_val_loss": 4.01 + i, "change_rate_first5": 0.04, "change_rate_last5": 0.01, "revert_share": 0.02,
        "changed_over_phase": 0.4}}} for i, s in enumerate(("0", "1"))}
    d = qat_bench.diagnosis(runs, ["0", "1"], "x")
    assert d["latent_gap_per_seed"] == pytest.approx([0.01, 0.01])
    assert d["own_quant_cost_per_seed"] == pytest.approx([0.02, 0.02])
    assert d["latent_gap"] + d["own_quant_cost"] == pytest.approx(0.03) and d["revert_share"] == 0.02
    with pytest.raises(SystemExit, match="--diagnose"):
        qat_bench.main(["--quick", "--diagnose", "--out", str(tmp_path / "q.json")])
    r = qat_bench.main(["--quick", "--seeds", "0,1", "--settings", "harsh_head", "--ptq-only", "", "--qat-start",
                        "0.5", "--diagnose", "--out", str(tmp_path / "d.json")])
    d = r["settings"]["harsh_head"]["diagnosis"]
    for i, s in enumerate(("0", "1")):
        run = r["runs"][s]
        assert d["latent_gap_per_seed"][i] + d["own_quant_cost_per_seed"][i] == pytest.approx(
            run["qat_harsh_head"]["val_loss"] - run["fp32"]["val_loss"])
        assert run["qat_harsh_head"]["diagnosis"]["steps"] == 2 and 0 < d["changed_over_phase"] < 1


def test_gptq_summary_formulas(qat_bench):
    runs = {s: {"fp32": {"val_loss": 4.0 + i},
                "ptq_x": {"val_loss": 4.010 + i, "gptq": {"val_loss": 4.004 + i, "output_error_ratio": 0.2}},
                "qat_x": {"val_loss": 4.006 + i, "gptq": {"val_loss": 4.002 + i + 0.001 * i,
                                                           "output_error_ratio": 0.3}}}
            for i, s in enumerate(("0", "1"))}
    g = qat_bench.gptq_summary(runs, ["0", "1"], "x", [0.010, 0.010], trained=True)
    assert g["ptq_degradation"] == pytest.approx(0.004) and g["ptq_recovery"] == pytest.approx(0.6)
    assert g["qat_gap"] == pytest.approx(0.0025)  # (0.002 + 0.003) / 2
    assert g["recovery_vs_rtn_ptq"] == pytest.approx(0.75)  # (0.010 - 0.0025) / 0.010
    assert g["recovery_vs_gptq_ptq"] == pytest.approx(0.375)  # (0.004 - 0.0025) / 0.004
    assert g["ptq_output_error_ratio"] == pytest.approx(0.2) and g["qat_output_error_ratio"] == pytest.approx(0.3)
    assert qat_bench.gptq_summary(runs, ["0", "1"], "x", [-0.001, 0.0], trained=True)["recovery_vs_rtn_ptq"] is None


def test_gptq_arm_evaluates_ptq_and_qat_with_gptq_rounding(qat_bench, tmp_path):
    out = tmp_path / "g.json"
    r = qat_bench.main(["--quick", "--seeds", "0,1", "--settings", "harsh_head", "--ptq-only", "k3", "--qat-start",
                        "0.5", "--gptq", "2", "--out", str(out)])
    assert r["budget"]["gptq"] == 2
    g = r["settings"]["harsh_head"]["gptq"]
    fp32 = [r["runs"][s]["fp32"]["val_loss"] for s in ("0", "1")]
    for i, s in enumerate(("0", "1")):
        run = r["runs"][s]
        assert run["ptq_harsh_head"]["gptq"]["calibration_tokens"] == 2 * 2 * 32  # 2 batches of 2 x 32
        assert g["ptq_degradation_per_seed"][i] == pytest.approx(run["ptq_harsh_head"]["gptq"]["val_loss"] - fp32[i])
        assert g["qat_gap_per_seed"][i] == pytest.approx(run["qat_harsh_head"]["gptq"]["val_loss"] - fp32[i])
        assert run["ptq_harsh_head"]["gptq"]["val_loss"] != run["ptq_harsh_head"]["val_loss"]
        assert "gptq" not in run["ptq_k3"]  # routed experts only: nothing for GPTQ to round
    rtn = r["settings"]["harsh_head"]["ptq_degradation"]
    if rtn > 0:  # at 4 quick steps its sign is noise (the formula itself: test_gptq_summary_formulas)
        assert g["recovery_vs_rtn_ptq"] == pytest.approx((rtn - g["qat_gap"]) / rtn)
    else:
        assert g["recovery_vs_rtn_ptq"] is None
    rule = qat_bench.summarize(r["settings"]["harsh_head"]["ptq_degradation_per_seed"], g["qat_gap_per_seed"], None)
    assert g["verdict_vs_rtn_ptq"] == rule["verdict"] and g["recovery_vs_rtn_ptq_low"] == rule["recovery_low"]
    assert 0 < g["ptq_output_error_ratio"] < 1 and "gptq" not in r["settings"]["k3"]
    with pytest.raises(SystemExit, match="differs in gptq"):
        qat_bench.main(["--quick", "--seeds", "0,1", "--settings", "harsh_head", "--ptq-only", "k3", "--qat-start",
                        "0.5", "--gptq", "1", "--resume", "--out", str(out)])
    for bad in ("-1", "5"):
        with pytest.raises(SystemExit, match="--gptq"):
            qat_bench.main(["--quick", "--gptq", bad, "--out", str(tmp_path / "b.json")])


def test_qat_gptq_trains_the_head_through_gptq_rounding(qat_bench, tmp_path):
    with pytest.raises(SystemExit, match="--qat-gptq: give --gptq"):
        qat_bench.main(["--quick", "--qat-gptq", "--out", str(tmp_path / "b.json")])
    common = ["--quick", "--seeds", "0,1", "--settings", "harsh_head", "--ptq-only", "", "--qat-start", "0.5",
              "--gptq", "2", "--gptq-scope", "head"]
    r = qat_bench.main([*common, "--qat-gptq", "--out", str(tmp_path / "g.json")])
    plain = qat_bench.main([*common, "--out", str(tmp_path / "p.json")])
    g = r["settings"]["harsh_head"]["gptq"]
    assert g["qat_through_gptq"] and r["budget"]["qat_gptq"] and r["budget"]["gptq_scope"] == "head"
    for s in ("0", "1"):
        assert "gptq" not in r["runs"][s]["qat_harsh_head"]  # its own val loss is the GPTQ-rounded model's
        # the same fp32 run and PTQ; a different QAT phase
        assert r["runs"][s]["fp32"]["val_loss"] == plain["runs"][s]["fp32"]["val_loss"]
        assert r["runs"][s]["ptq_harsh_head"]["gptq"]["val_loss"] == plain["runs"][s]["ptq_harsh_head"]["gptq"]["val_loss"]
        assert r["runs"][s]["qat_harsh_head"]["val_loss"] != plain["runs"][s]["qat_harsh_head"]["val_loss"]
    assert g["qat_gap_per_seed"] == pytest.approx([r["runs"][s]["qat_harsh_head"]["val_loss"]
                                                   - r["runs"][s]["fp32"]["val_loss"] for s in ("0", "1")])


def test_head_only_settings_quantize_what_they_name(qat_bench):
    """head_w4 / head_a8 split harsh_head's head in two: the head's weight alone in MXFP4, its input alone in MXFP8;
    nothing else is quantized, and only a quantized weight is tracked or GPTQ-rounded."""
    import torch
    import torch.nn.functional as F

    from k3.config import get_config
    from k3.model.transformer import K3Model
    from k3.ops.mx.fake import fake_quant
    from k3.quant.gptq import gptq_roundable

    x = torch.randn(3, 64)
    for name, wq, aq in (("head_w4", True, False), ("head_a8", False, True)):
        qat, _, _ = qat_bench.SETTINGS[name]
        model = qat_bench.quantize_head(K3Model(get_config("tiny", qat=qat)), name)
        head = model.head
        w = fake_quant(head.weight, "mxfp4", dim=1) if wq else head.weight
        xin = fake_quant(x, "mxfp8") if aq else x
        assert torch.equal(head(x), F.linear(xin, w, head.bias))
        assert not torch.equal(head(x), F.linear(x, head.weight, head.bias))  # something is quantized
        assert {n for n, _, _ in qat_bench.quantized_weights(model)} == ({"head.weight"} if wq else set())
        assert gptq_roundable(head) == wq
