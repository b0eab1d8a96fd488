import json
import math
from pathlib import Path

import pytest

from k3.cli import main
from k3.train.metrics import read_metrics

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "2", "-q"]


def test_train_resume_eval_sample(tiny_data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--data", str(tiny_data_dir), "--out", str(out), "--steps", "3",
                 "--eval-every", "2", "--optimizer", "muon"]) == 0
    for name in ("metrics.jsonl", "loss.png", "experts.png", "attnres.png"):
        assert (out / name).is_file(), name
    assert (out / "loss.png").read_bytes()[:8] == PNG
    assert (out / "checkpoint" / "latest").read_text().strip() == "step_000003"
    assert "checkpoint" in capsys.readouterr().out

    # a second invocation with more steps continues the run
    assert main(["train", *SMALL, "--data", str(tiny_data_dir), "--out", str(out), "--steps", "5",
                 "--eval-every", "2", "--optimizer", "muon", "--resume"]) == 0
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5]
    assert "trained to step 5 (2 in this run, from step 3)" in capsys.readouterr().out
    # resuming a run that is already there trains nothing and says so, naming the checkpoint it holds
    assert main(["train", *SMALL, "--data", str(tiny_data_dir), "--out", str(out), "--steps", "5",
                 "--eval-every", "2", "--optimizer", "muon", "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "already at step 5" in printed and f"checkpoint {out / 'checkpoint' / 'step_000005'}" in printed
    assert main(["train", *SMALL, "--data", str(tiny_data_dir), "--out", str(tmp_path / "budget"), "--steps", "5",
                 "--max-minutes", "0.000001"]) == 0  # a budget that ends before the first step says so
    assert "time budget (1e-06 min) ended before the first step" in capsys.readouterr().out
    for flag in ("--max-batches", "--batch-size", "--seq-len"):
        assert main(["eval", "--ckpt", str(out / "checkpoint"), flag, "0"]) == 2
        assert f"{flag} 0 must be >= 1" in capsys.readouterr().err
    # data or a tokenizer of the same size but another tokenizer: other ids, wrong figures and text; refused
    from k3.data import prepare_data
    other = prepare_data(tmp_path / "other", vocab_size=512, max_bytes=150_000)
    from k3.data import load_tokenizer
    trained = load_tokenizer(tiny_data_dir / "tokenizer.json")
    assert other.tokenizer.vocab_size == trained.vocab_size and other.tokenizer.fingerprint != trained.fingerprint
    assert main(["eval", "--ckpt", str(out / "checkpoint"), "--data", str(tmp_path / "other")]) == 2
    assert "tokenized with another tokenizer than the model's training data" in capsys.readouterr().err
    assert main(["sample", "--ckpt", str(out / "checkpoint"), "--tokenizer", str(tmp_path / "other" / "tokenizer.json"),
                 "--prompt", "x", "--max-new-tokens", "2"]) == 2
    assert "is not the one the model's training data was tokenized with" in capsys.readouterr().err

    assert main(["eval", "--ckpt", str(out / "checkpoint"), "--batch-size", "2", "--max-batches", "3",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["step"] == 5 and res["seq_len"] == 16
    assert res["perplexity"] == pytest.approx(math.exp(res["val_loss"]))
    assert res["bits_per_byte"] == pytest.approx(res["val_loss"] / math.log(2) / res["bytes_per_token"])

    assert main(["sample", "--ckpt", str(out / "checkpoint"), "--prompt", "def ", "--max-new-tokens", "6",
                 "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("def ")
    main(["sample", "--ckpt", str(out / "checkpoint"), "--prompt", "def ", "--max-new-tokens", "6", "--seed", "1"])
    assert capsys.readouterr().out == first  # seeded sampling is reproducible


@pytest.mark.parametrize("case", ["missing", "empty", "vocab", "qat", "unwritable", "exists", "raw", "both", "decay"])
def test_train_bad_input_is_one_clear_line(case, tiny_data_dir, tmp_path, capsys):
    data, out, extra = str(tiny_data_dir), str(tmp_path / "out"), []
    if case == "missing":
        data, want = str(tmp_path / "nope"), "does not exist"
    elif case == "empty":
        (tmp_path / "empty").mkdir()
        data, want = str(tmp_path / "empty"), "is empty"
    elif case == "raw":
        (tmp_path / "raw").mkdir()
        (tmp_path / "raw" / "a.txt").write_text("hello")
        data, want = str(tmp_path / "raw"), "k3 tokenize --data"
    elif case == "vocab":
        extra, want = ["--set", "vocab_size=1024"], "vocabulary of 512"
    elif case == "qat":
        extra, want = ["--qat", "bogus=1"], "KEY=FORMAT"
    elif case == "both":
        extra, want = ["--resume", "--overwrite"], "give one of them"
    elif case == "decay":
        extra, want = ["--decay-frac", "1.5"], "--decay-frac 1.5 must be a fraction of the steps"
    elif case == "unwritable":
        (tmp_path / "f").write_text("")
        out, want = str(tmp_path / "f" / "out"), "not writable"
    else:
        assert main(["train", *SMALL, "--data", data, "--out", out, "--steps", "1"]) == 0
        capsys.readouterr()
        want = "--resume"
    rc = main(["train", *SMALL, "--data", data, "--out", out, "--steps", "1", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and want in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    if case not in ("exists", "unwritable"):
        assert not (tmp_path / "out" / "metrics.jsonl").exists()  # nothing trained


def test_demo_small(tiny_data_dir, tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(["demo", "--preset", "tiny", "--data", str(tiny_data_dir), "--max-bytes", "300000", "--out", str(out),
               "--minutes", "0.15", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "2",
               "--sample-tokens", "4", "--decay-frac", "0.5"])
    assert rc == 0
    cap = capsys.readouterr()
    text = cap.out
    assert "bits per byte" in text and "unigram" in text
    # the threads and the precision, each with why (the test session's cached probe: bf16 slower, so fp32)
    assert "CPU thread(s): " in cap.err and "precision fp32: bf16 measured no faster" in cap.err
    for name in ("metrics.jsonl", "loss.png", "experts.png", "attnres.png", "samples.txt", "summary.json"):
        assert (out / name).is_file(), name
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] > 1 and s["val_bpb_end"] < s["val_bpb_start"]
    assert 0 < s["unigram_bpb"] < s["val_bpb_start"]  # an untrained model is worse than unigram
    assert s["checkpoint"].endswith(f"step_{s['steps']:06d}")
    manifest = json.loads((Path(s["checkpoint"]) / "manifest.json").read_text())
    assert manifest["extra"]["train"]["decay_frac"] == 0.5  # the schedule's flags reach the run
    assert s["total_minutes"] < 0.15 + 0.2
    assert s["val_tokens_scored"] == 2 * 2 * 16  # counted over the windows the baseline and the model scored
    assert s["precision"] == "fp32" and s["precision_reason"] and s["threads"] >= 1 and s["threads_reason"]
    assert (out / ".k3-demo").is_file()


def test_demo_whose_budget_ends_before_a_step_says_so(tiny_data_dir, tmp_path, capsys, monkeypatch):
    """A budget that fits no step printed a summary with checkpoint None and `next:` commands that fail, exit 0."""
    from k3.train.trainer import Trainer, TrainResult

    monkeypatch.setattr(Trainer, "fit", lambda self, **k: TrainResult(steps_done=0, stopped_early=True))
    out = tmp_path / "demo"
    rc = main(["demo", "--preset", "tiny", "--data", str(tiny_data_dir), "--max-bytes", "300000", "--out", str(out),
               "--minutes", "0.15", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "2"])
    cap = capsys.readouterr()
    assert rc == 2 and "ended before the first training step" in cap.err and "raise --minutes" in cap.err
    assert "next:" not in cap.out and not (out / "summary.json").exists()


def test_demo_checks_sample_tokens_before_training(tiny_data_dir, tmp_path, capsys):
    """--sample-tokens that leaves no room for the sample prompts is refused before any training step."""
    from k3.config import get_config

    ctx = get_config("tiny").max_context
    for n, want in [(0, "--sample-tokens 0 must be >= 1"), (ctx, "leaves no room"), (ctx - 2, "longest sample prompt")]:
        out = tmp_path / f"demo{n}"
        rc = main(["demo", "--preset", "tiny", "--data", str(tiny_data_dir), "--max-bytes", "300000", "--out",
                   str(out), "--minutes", "0.15", "--batch-size", "2", "--seq-len", "16", "--sample-tokens", str(n)])
        err = capsys.readouterr().err
        assert rc == 2 and want in err, err[-500:]
        assert not (out / "metrics.jsonl").exists()  # nothing trained


def test_demo_refuses_directories_that_hold_something_else(tiny_data_dir, tmp_path, capsys):
    demo = ["demo", "--preset", "tiny", "--max-bytes", "300000", "--minutes", "0.1", "--batch-size", "2",
            "--seq-len", "16", "--eval-batches", "2"]
    # a `k3 train` run in --out: the demo would start over there and delete its checkpoint
    run = tmp_path / "run"
    assert main(["train", *SMALL, "--data", str(tiny_data_dir), "--out", str(run), "--steps", "1"]) == 0
    capsys.readouterr()
    assert main([*demo, "--data", str(tiny_data_dir), "--out", str(run)]) == 2
    assert "holds a run that is not a demo's" in capsys.readouterr().err
    assert (run / "checkpoint" / "step_000001").is_dir()
    # data tokenized from another corpus in --data: the demo would re-tokenize the standard library over it
    text = tmp_path / "text"
    text.mkdir()
    for i in range(60):
        (text / f"{i}.txt").write_text(f"document {i}: " + " ".join(str(i * j) for j in range(200)) + "\n")
    assert main(["tokenize", "--data", str(text), "--out", str(tmp_path / "mine"), "--vocab-size", "300",
                 "--val-fraction", "0.1", "-q"]) == 0
    capsys.readouterr()
    assert main([*demo, "--data", str(tmp_path / "mine"), "--out", str(tmp_path / "d")]) == 2
    assert "holds data tokenized from directory" in capsys.readouterr().err
    assert json.loads((tmp_path / "mine" / "data.json").read_text())["request"]["source"].startswith("directory")
    # run flags are checked before any data work
    assert main([*demo, "--data", str(tmp_path / "new"), "--out", str(tmp_path / "d"), "--eval-batches", "0"]) == 2
    assert "--eval-batches 0 must be" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_demo_dir_check_treats_a_damaged_data_manifest_as_rebuildable(tmp_path):
    from k3.train.cli import _check_demo_dirs

    for source in (5, ["x"], None):
        d = tmp_path / f"data{source!r}"
        d.mkdir()
        (d / "data.json").write_text(json.dumps({"request": {"source": source}}))
        _check_demo_dirs(d, tmp_path / "out")  # prepare_data rebuilds it; no crash here


def test_ctrl_c_saves_the_step_in_progress_and_resume_continues(tiny_data_dir, tmp_path):
    """The first Ctrl-C stops `k3 train` after the step in progress and saves it (exit 130); --resume continues
    from that step. Without it, a run with --ckpt-every 0 lost every step on Ctrl-C."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "k3.cli", "train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out",
           str(out), "--batch-size", "2", "--seq-len", "32", "--eval-every", "0", "--threads", "1", "-q"]
    # SIGINT as a terminal delivers it, even where this test runs with SIGINT ignored (a background job)
    p = subprocess.Popen([*cmd, "--steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            if metrics.is_file() and metrics.read_text().count('"kind": "train"') >= 3:
                break
            time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, stderr[-2000:]
    assert "interrupt" in stderr and "Traceback" not in stderr
    step = int(stdout.split("trained to step ")[1].split()[0].rstrip(","))
    assert step >= 3 and f"step_{step:06d}" in stdout
    assert (out / "checkpoint" / "latest").read_text().strip() == f"step_{step:06d}"
    r = subprocess.run([*cmd, "--steps", str(step + 2), "--resume"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"trained to step {step + 2} (2 in this run, from step {step})" in r.stdout, \
        r.stdout + r.stderr[-2000:]


def test_sample_leaves_special_tokens_out_unless_asked(tiny_data_dir):
    """k3 sample printed <|tool_call|> and the like where the server's completions (skip_special_tokens by
    default) did not: the same checkpoint and prompt gave two texts."""
    import torch

    from k3.config import get_config
    from k3.data import load_data
    from k3.train.cli import generate_text

    tok = load_data(tiny_data_dir).tokenizer
    special = tok.token_to_id("<|tool_call|>")
    word = tok.encode("x", allow_special=False)

    class Fixed(torch.nn.Module):  # writes a fixed continuation: a token, a special token, the token again
        config = get_config("tiny", vocab_size=tok.vocab_size)

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def generate(self, ids, n, **kw):
            return torch.cat([ids, torch.tensor([word + [special] + word])], 1)

    assert generate_text(Fixed(), tok, "a", 3, 0.8, 0.95, 0) == "axx"
    assert generate_text(Fixed(), tok, "a", 3, 0.8, 0.95, 0, skip_special=False) == "ax<|tool_call|>x"


def test_train_stopped_by_a_signal_labels_an_earlier_validation(tiny_data_dir, tmp_path, capsys, monkeypatch,
                                                                 default_signals):
    """Stopped after step 3 with evaluations every 2 steps, the summary's validation loss is step 2's and says so
    (it read as the loss of the saved step 3)."""
    import os
    import signal

    from k3.train.trainer import Trainer
    real = Trainer.train_step

    def train_step(self):
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # during step 3
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    assert main(["train", *SMALL, "--data", str(tiny_data_dir), "--out", str(tmp_path / "run"), "--steps", "10",
                 "--eval-every", "2"]) == 130
    out = capsys.readouterr().out
    assert "trained to step 3" in out and "(at step 2)" in out.split("validation loss")[1].splitlines()[0], out
