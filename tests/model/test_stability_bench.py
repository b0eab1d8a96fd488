"""benchmarks/stability.py: --vary parsing, the paired summary, and a --quick smoke run of the whole script."""
import json

import pytest


@pytest.fixture(scope="module")
def stab(load_training_benchmark):
    return load_training_benchmark("stability")


def test_parse_vary(stab):
    assert stab.parse_vary("kda_norm_eps=1e-6,1e-4") == ("kda_norm_eps", [1e-6, 1e-4])
    assert stab.parse_vary("balancing=bias,quantile") == ("balancing", ["bias", "quantile"])
    for bad, msg in [("kda_norm_eps=1e-6", "two or more"), ("kda_norm_eps", "two or more"),
                     ("no_such_field=1,2", "FIELD=VALUE"), ("n_experts=4,4", "must differ")]:
        with pytest.raises(SystemExit, match=msg):
            stab.parse_vary(bad)


def _run(losses, gnorms, val):
    return {"steps": [{"loss": l, "grad_norm": g, "load_max_mean": 2.0} for l, g in zip(losses, gnorms)],
            "val_loss": val}


def test_summary_is_paired_by_seed(stab):
    class A:
        window, spike = 2, 10.0
    ref = {"0": _run([5, 4, 3, 2], [1, 50, 1, 1], 4.0), "1": _run([6, 5, 4, 3], [1, 1, 1, 1], 5.0)}
    new = {"0": _run([4, 3, 2, 1], [1, 2, 3, 11], 3.5), "1": _run([5, 4, 3, 2], [1, 1, 1, 1], 5.25)}
    s = stab.summarize_value(new, ref, A)
    assert s["minus_reference"]["per_seed"] == {"0": -0.5, "1": 0.25}
    assert s["minus_reference"]["mean"] == pytest.approx(-0.125)
    assert s["val_loss_mean"] == pytest.approx(4.375)
    assert s["spike_steps"] == {"0": 1, "1": 0} and s["spike_steps_total"] == 1 and s["max_grad_norm"] == 11
    assert s["window_loss_mean"] == pytest.approx([(3.5 + 4.5) / 2, (1.5 + 2.5) / 2])
    assert "minus_reference" not in stab.summarize_value(ref, None, A)


def test_quick_run_traces_every_step_and_merges(stab, tmp_path, capsys, monkeypatch):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    common = ["--quick", "--vary", "kda_norm_eps=1e-6,1e-4"]
    ra = stab.main(common + ["--seeds", "0", "--out", str(a)])
    assert ra["seeds"] == [0] and set(ra["runs"]) == {"1e-06", "0.0001"}
    assert all(len(r["0"]["steps"]) == 4 for r in ra["runs"].values())
    assert (tmp_path / "a.png").exists()
    assert [ra["summary"][k]["value"] for k in ("v0", "v1")] == [1e-6, 1e-4]
    assert "minus_reference" not in ra["summary"]["v0"] and "minus_reference" in ra["summary"]["v1"]
    # the two values really build different models: the traces differ
    assert ra["runs"]["1e-06"]["0"]["steps"][-1]["loss"] != ra["runs"]["0.0001"]["0"]["steps"][-1]["loss"]
    capsys.readouterr()
    rb = stab.main(common + ["--seeds", "1", "--json", "--merge", str(a), "--out", str(b)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["seeds"] == [0, 1]
    assert rb["runs"]["1e-06"]["0"] == ra["runs"]["1e-06"]["0"]
    assert set(rb["summary"]["v1"]["minus_reference"]["per_seed"]) == {"0", "1"}
    # every run already in the merged files: nothing is trained again, the summary is rebuilt
    def no_training(*a, **k):
        raise AssertionError("a merged run was trained again")
    monkeypatch.setattr(stab, "trace_run", no_training)
    rc = stab.main(common + ["--seeds", "0,1", "--merge", str(b), "--out", str(tmp_path / "all.json")])
    assert rc["summary"] == rb["summary"] and rc["plot"] == "all.png"
    with pytest.raises(SystemExit, match="another experiment"):
        stab.main(["--quick", "--vary", "kda_norm_eps=1e-6,1e-5", "--seeds", "2", "--merge", str(a),
                   "--out", str(tmp_path / "c.json")])
