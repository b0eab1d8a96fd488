import json
import math

import pytest
import torch

from k3.train import metrics
from k3.train.metrics import MetricsWriter, bits_per_byte, measured_peak_flops, read_metrics
from k3.train.plots import plot_all, plot_attnres, plot_experts, plot_loss

PNG = b"\x89PNG\r\n\x1a\n"


def _records(n=6, layers=2, experts=4):
    out = []
    for s in range(1, n + 1):
        share = [[(e + 1 + s) / sum(range(1 + s, experts + 1 + s)) for e in range(experts)] for _ in range(layers)]
        out.append({"kind": "train", "step": s, "loss": 5.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64 * s,
                    "tokens_per_s": 100.0, "expert_load": share,
                    "expert_load_max_mean": [max(x) * experts for x in share],
                    "attnres_entropy": [0.0, 0.69, 0.5], "attnres_weights": [[1.0], [0.5, 0.5], [0.2, 0.3, 0.5]]})
        if s % 3 == 0:
            out.append({"kind": "val", "step": s, "val_loss": 5.5 / s})
    return out


def test_writer_appends_flushes_and_truncates_on_resume(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as w:
        for r in _records():
            w.log(r)
        assert len(path.read_text().splitlines()) == 8  # flushed line by line, before close
    with open(path, "a") as f:
        f.write('{"kind": "train", "st')  # a torn last line from a crash
    assert len(read_metrics(path)) == 8
    MetricsWriter(path, resume_step=3).close()  # resuming at step 3 drops what came after it
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 3]
    MetricsWriter(path).close()  # a fresh run starts a fresh file
    assert read_metrics(path) == []


def test_peak_flops_measured_once():
    metrics._PEAK.clear()
    a = measured_peak_flops("cpu", torch.float32, n=256, repeats=1)
    assert a > 1e6
    metrics._PEAK[("cpu", None, torch.float32, 256)] = 123.0  # a cached value is reused, not re-measured
    assert measured_peak_flops("cpu", torch.float32, n=256) == 123.0
    metrics._PEAK.clear()


def test_bits_per_byte():
    assert bits_per_byte(math.log(2) * 3.0, 1.5) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 0.0)


def test_plots_are_written(tmp_path):
    recs = _records()
    for fn, name in ((plot_loss, "loss.png"), (plot_experts, "experts.png"), (plot_attnres, "attnres.png")):
        out = fn(recs, tmp_path / name)
        assert out.read_bytes()[:8] == PNG and out.stat().st_size > 2000
    # empty inputs still give a (placeholder) image rather than a crash
    assert plot_experts([], tmp_path / "e.png").read_bytes()[:8] == PNG
    import warnings

    with warnings.catch_warnings():  # no records (a run stopped before its first step): no empty-legend warning
        warnings.simplefilter("error")
        assert plot_loss([], tmp_path / "l.png").read_bytes()[:8] == PNG
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    paths = plot_all(tmp_path, baseline=4.0)
    assert set(paths) == {"loss", "experts", "attnres"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_component_timer_splits_a_step(fake_data):
    from k3.config import get_config
    from k3.train.profiling import ComponentTimer
    from k3.train.trainer import TrainConfig, Trainer

    tr = Trainer(get_config("tiny"), TrainConfig(steps=3, batch_size=2, seq_len=16, measure_mfu=False), fake_data())
    timer = ComponentTimer(tr.model)
    tr.train_step()  # disabled: nothing recorded
    assert not timer.forward and not timer.intervals
    timer.enabled = True
    rec = tr.train_step()
    parts = timer.split(rec["forward_s"], rec["backward_s"])
    # tiny = 3 KDA + 1 MLA layers, 1 dense + 3 MoE channel mixers: one backward interval per call + head
    labels = [label for _, _, label in timer.intervals]
    assert sorted(labels) == sorted(["kda"] * 3 + ["mla"] + ["dense_mlp"] + ["moe"] * 3 + ["embed_head"])
    for comp in ("kda", "mla", "moe", "dense_mlp", "attnres", "embed_head"):
        assert parts["forward"][comp] > 0 and parts["backward"][comp] > 0, comp
    # the hooks' intervals lie inside the step's forward; "other" is the rest, so the parts add up to it
    assert sum(v for k, v in parts["forward"].items() if k != "other") <= rec["forward_s"] * 1.01
    assert sum(parts["forward"].values()) == pytest.approx(rec["forward_s"], rel=1e-6)
    assert sum(v for k, v in parts["backward"].items() if k != "other") <= rec["backward_s"] * 1.01
    # intervals are disjoint (one thread runs the backward) and ordered last layer first
    iv = sorted(timer.intervals)
    assert all(a[1] <= b[0] for a, b in zip(iv, iv[1:]))
    assert iv[0][2] == "embed_head"
