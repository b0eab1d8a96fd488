import json
import shutil

import pytest

from k3.cli import main
from k3.train.metrics import read_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def test_teachers_mopd_eval_generate(tmp_path, domain_tokenizer, capsys):
    """The whole pipeline on one cell at toy scale; then the bad inputs the issue names."""
    t, m = tmp_path / "teachers", tmp_path / "student"
    assert main(["distill", "teachers", "--preset", "tiny", "--set", "n_layers=2", "--tokenizer",
                 str(domain_tokenizer.path), "--out", str(t), "--cells", "arith/low", "--base-steps", "2",
                 "--steps", "1",
                 "--batch-size", "2", "--max-context", "128", "--budgets", "low=2,medium=3,high=4", "-q"]) == 0
    info = json.loads((t / "teachers.json").read_text())
    assert info["teachers"] == {"arith/low": "arith-low"} and info["tokenizer_sha256"] == domain_tokenizer.fingerprint
    assert (t / "base" / "checkpoint" / "latest").read_text().strip() == "step_000002"
    capsys.readouterr()
    # a second call with the same flags finds the stages trained and does not redo them
    again = ["distill", "teachers", "--preset", "tiny", "--set", "n_layers=2", "--out", str(t), "--cells",
             "arith/low", "--base-steps", "2", "--steps", "1", "--max-context", "128",
             "--budgets", "low=2,medium=3,high=4", "-q"]
    assert main(again + ["--batch-size", "2"]) == 0
    assert "already trained" in capsys.readouterr().out
    assert main(again) == 2  # another batch size: not silently the stage trained with batch 2
    assert "batch_size 2 (now 16)" in capsys.readouterr().err

    # an answer length that leaves no room for a prompt in max_context (128): refused before any step, by its flag
    assert main(["distill", "mopd", "--teachers", str(t), "--out", str(m), "--cells", "arith/low", "--steps", "2",
                 "--max-answer-tokens", "130", "-q"]) == 2
    assert "--max-answer-tokens 130 with the teachers' largest thinking budget (4) leaves no room" in \
        capsys.readouterr().err and not m.exists()
    assert main(["distill", "mopd", "--teachers", str(t), "--out", str(m), "--cells", "arith/low", "--steps", "2",
                 "--per-cell", "2", "--eval-every", "1", "--eval-n", "1", "--max-answer-tokens", "3", "-q"]) == 0
    recs = read_metrics(m / "metrics.jsonl")
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2] and set(evals[0]["gap"]) == {"arith/low"}
    assert (m / "gap.png").read_bytes()[:8] == PNG
    assert main(["distill", "plot", str(m), "--out", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").read_bytes()[:8] == PNG
    capsys.readouterr()

    assert main(["distill", "eval", "--teachers", str(t), "--model", f"mopd={m}", "--cells", "arith/low", "--n", "2",
                 "--max-answer-tokens", "3", "--json", "--out", str(tmp_path / "eval.json"), "-q"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [list(r) for r in rep["cells"]] == [["cell", "teacher", "base", "mopd"]]
    assert set(rep["reasoning_tokens"]["mopd"]) == {"low"} and rep["details"]["mopd"]["arith/low"]["n"] == 2
    assert json.loads((tmp_path / "eval.json").read_text())["mean"] == rep["mean"]

    assert main(["distill", "generate", "--model", str(m), "--teachers", str(t), "--prompt",
                 "<|effort:low|> sum 1+2+3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["effort"] == "low" and out["reasoning_tokens"] <= 2 and out["closed"]

    # bad input: no effort token, an unknown one, a model trained with another tokenizer
    assert main(["distill", "generate", "--model", str(m), "--teachers", str(t), "--prompt", "sum 1+2"]) == 2
    assert "has no effort token" in capsys.readouterr().err
    assert main(["distill", "generate", "--model", str(m), "--teachers", str(t), "--prompt",
                 "<|effort:extreme|> sum 1+2"]) == 2
    assert "unknown effort 'extreme'" in capsys.readouterr().err
    from k3.train.checkpoint import save_checkpoint
    from k3.io.trained import load_trained_model

    model, _ = load_trained_model(m / "checkpoint")
    save_checkpoint(tmp_path / "other" / "checkpoint", 1, model, config=model.config,
                    extra={"tokenizer_sha256": "f" * 64})
    assert main(["distill", "eval", "--teachers", str(t), "--model", f"other={tmp_path / 'other'}", "--cells",
                 "arith/low", "--n", "1", "-q"]) == 2
    assert "must share one tokenizer" in capsys.readouterr().err
    assert main(["distill", "mopd", "--teachers", str(t), "--student", str(tmp_path / "other"), "--out",
                 str(tmp_path / "x"), "--cells", "arith/low", "--steps", "1", "-q"]) == 2
    err = capsys.readouterr().err
    assert "student" in err and "must share one tokenizer" in err
    # resuming a finished run with more steps continues it
    assert main(["distill", "mopd", "--teachers", str(t), "--out", str(m), "--cells", "arith/low", "--steps", "3",
                 "--per-cell", "2", "--eval-every", "1", "--eval-n", "1", "--max-answer-tokens", "3", "-q",
                 "--resume"]) == 0
    assert [r["step"] for r in read_metrics(m / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3]
    capsys.readouterr()

    # the teachers' directory keeps one tokenizer and one set of budgets
    from k3.data.tokenizer import train_tokenizer
    from k3.distill.domains import make_domains, tokenizer_texts

    other = train_tokenizer(tokenizer_texts(make_domains(), n_per_domain=50), 300, path=tmp_path / "tok2.json",
                            allow_short=True)
    assert other.fingerprint != domain_tokenizer.fingerprint
    teach = ["distill", "teachers", "--preset", "tiny", "--set", "n_layers=2", "--out", str(t), "--cells", "arith/low",
             "--base-steps", "2", "--steps", "1", "--max-context", "128", "-q"]
    assert main(teach + ["--tokenizer", str(other.path), "--budgets", "low=2,medium=3,high=4"]) == 2
    assert "holds another tokenizer" in capsys.readouterr().err
    assert main(teach + ["--budgets", "low=2,medium=3,high=5"]) == 2
    assert "has budgets {'low': 2, 'medium': 3, 'high': 4}" in capsys.readouterr().err
    # a base trained further leaves its teachers stale: refused, not reused
    bs = ["--batch-size", "2", "--budgets", "low=2,medium=3,high=4"]
    further = teach[:teach.index("--base-steps") + 1] + ["4"] + teach[teach.index("--base-steps") + 2:]
    assert main([*further, *bs, "--resume"]) == 2
    assert "arith-low was trained with other settings: base" in capsys.readouterr().err
    (t / "tokenizer.json").write_text(other.path.read_text())  # swapped behind the teachers' back
    assert main(["distill", "eval", "--teachers", str(t), "--model", f"mopd={m}", "--cells", "arith/low", "--n", "1",
                 "-q"]) == 2
    assert "changed since the teachers were trained" in capsys.readouterr().err


def test_teachers_take_their_own_lr_and_checkpoint_every(tmp_path, domain_tokenizer, monkeypatch):
    """--teacher-lr sets the teachers' peak lr apart from the base's; --ckpt-every saves inside a stage."""
    from k3.distill.loop import StepLoop

    saves, real_save = [], StepLoop.save
    monkeypatch.setattr(StepLoop, "save", lambda self: saves.append((self.ckpt_dir.parent.name, self.step))
                        or real_save(self))
    t = tmp_path / "teachers"
    assert main(["distill", "teachers", "--preset", "tiny", "--set", "n_layers=2", "--tokenizer",
                 str(domain_tokenizer.path), "--out", str(t), "--cells", "arith/low", "--base-steps", "3",
                 "--steps", "3", "--lr", "3e-3", "--teacher-lr", "5e-4", "--warmup-steps", "0", "--ckpt-every", "2",
                 "--batch-size", "2", "--max-context", "128", "--budgets", "low=2,medium=3,high=4", "-q"]) == 0
    info = json.loads((t / "teachers.json").read_text())
    assert (info["lr"], info["teacher_lr"]) == (3e-3, 5e-4)
    lrs = {name: max(r["lr"] for r in read_metrics(t / name / "metrics.jsonl") if r["kind"] == "train")
           for name in ("base", "arith-low")}
    assert lrs["base"] == 3e-3 and lrs["arith-low"] == 5e-4
    assert saves == [("base", 2), ("base", 3), ("arith-low", 2), ("arith-low", 3)]


def test_cells_split_over_processes_keep_each_others_teachers(tmp_path, domain_tokenizer, monkeypatch):
    """Two `k3 distill teachers --cells ...` processes on one directory: a teacher another process lists in
    teachers.json while this one trains stays listed when this one writes the file."""
    import k3.distill.sft as sft

    t = tmp_path / "teachers"
    common = ["distill", "teachers", "--preset", "tiny", "--set", "n_layers=2", "--tokenizer",
              str(domain_tokenizer.path), "--out", str(t), "--base-steps", "2", "--steps", "1", "--batch-size", "2",
              "--max-context", "128", "--budgets", "low=2,medium=3,high=4", "-q"]
    assert main(common + ["--cells", "arith/low"]) == 0
    real = sft.run_sft

    def run_sft_while_another_process_finishes(model, examples, config, run, **kw):
        records = real(model, examples, config, run, **kw)
        if run.name == "text-high":  # meanwhile another process finishes pyfunc/low and lists it
            info = json.loads((t / "teachers.json").read_text())
            info["teachers"]["pyfunc/low"] = "pyfunc-low"
            (t / "teachers.json").write_text(json.dumps(info))
        return records

    monkeypatch.setattr(sft, "run_sft", run_sft_while_another_process_finishes)
    assert main(common + ["--cells", "text/high"]) == 0
    listed = json.loads((t / "teachers.json").read_text())["teachers"]
    assert listed == {"arith/low": "arith-low", "pyfunc/low": "pyfunc-low", "text/high": "text-high"}


def test_flags_that_would_be_ignored_are_refused(tmp_path, capsys):
    t = tmp_path / "teachers"
    teach = ["distill", "teachers", "--preset", "tiny", "--set", "n_layers=2", "--out", str(t), "--cells", "arith/low",
             "--base-steps", "1", "--steps", "1", "--batch-size", "2", "--max-context", "128", "-q"]
    assert main([*teach, "--vocab-size", "300"]) == 0
    assert main([*teach, "--vocab-size", "320"]) == 2  # the directory's tokenizer has 300: not silently that one
    assert "vocab_size 300 (asked: 320)" in capsys.readouterr().err
    assert main(["distill", "mopd", "--teachers", str(t), "--out", str(tmp_path / "m"), "--token-budget", "5",
                 "--match-tokens", str(tmp_path), "-q"]) == 2
    assert "give one" in capsys.readouterr().err
    assert main(["distill", "mopd", "--teachers", str(t), "--out", str(tmp_path / "m"), "--mode", "off-policy",
                 "--kl", "sampled", "-q"]) == 2
    assert "applies to on-policy" in capsys.readouterr().err
    assert main(["distill", "eval", "--teachers", str(t), "--plot", str(tmp_path / "g.png"), "-q"]) == 2
    assert "--gap-run" in capsys.readouterr().err


def test_single_teacher_gaps_are_to_each_cells_own_teacher(tmp_path, domain_tokenizer, capsys):
    """With --single-teacher, the teaching comes from one effort's teacher, but the evaluation gaps are to each
    cell's own teacher (as `k3 distill eval` reports them); a cell without its own teacher keeps the shared one,
    and the run says so for that cell only."""
    t = tmp_path / "teachers"
    teach = ["distill", "teachers", "--preset", "tiny", "--set", "n_layers=2", "--tokenizer",
             str(domain_tokenizer.path), "--out", str(t), "--base-steps", "1", "--steps", "1", "--batch-size", "2",
             "--max-context", "128", "--budgets", "low=2,medium=3,high=4", "-q"]
    assert main([*teach, "--cells", "arith/high"]) == 0
    mopd = ["distill", "mopd", "--teachers", str(t), "--cells", "arith/low,arith/medium,arith/high",
            "--single-teacher", "high", "--steps", "1", "--per-cell", "1", "--eval-every", "1", "--eval-n", "1",
            "--max-answer-tokens", "2", "-q"]

    def reference(run):
        return {c: v["source"] for c, v in json.loads((run / "teacher_eval.json").read_text())["key"]["teachers"].items()}

    capsys.readouterr()
    assert main([*mopd, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "gaps of arith/low are to the --single-teacher high teacher" in err and "of arith/medium" in err
    assert reference(tmp_path / "a") == {"arith/low": "arith/high", "arith/medium": "arith/high",
                                         "arith/high": "arith/high"}
    assert main([*teach, "--cells", "arith/low"]) == 0  # now one cell has its own teacher, one still lacks it
    assert main([*mopd, "--out", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "of arith/low" not in err and "of arith/medium" in err
    assert reference(tmp_path / "b") == {"arith/low": "arith/low", "arith/medium": "arith/high",
                                         "arith/high": "arith/high"}


# ---------------------------------------------------------------------- bad input, refused before any work
@pytest.fixture(scope="module")
def trained_teachers(tmp_path_factory, domain_tokenizer):
    """A one-cell teacher matrix at toy scale, trained once for the tests below (copy it before changing it)."""
    t = tmp_path_factory.mktemp("teachers") / "t"
    assert main(["distill", "teachers", "--preset", "tiny", "--set", "n_layers=2", "--tokenizer",
                 str(domain_tokenizer.path), "--out", str(t), "--cells", "arith/low", "--base-steps", "1", "--steps",
                 "1", "--batch-size", "2", "--max-context", "128", "--budgets", "low=2,medium=3,high=4", "--threads",
                 "1", "-q"]) == 0
    return t


def _copy(src, tmp_path):
    dst = tmp_path / "teachers"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("content, says", [
    ("[]", "holds a JSON list"),
    ("{", "is not valid JSON"),
    ("drop budgets", "has no 'budgets'"),
    ("teachers int", "has 'teachers' = {'arith/low': 5}"),
    ("teachers bad cell", "lists a teacher for 'arith/extreme'"),
    ("drop tokenizer", "has no 'tokenizer'"),
])
def test_malformed_teachers_json_is_named_with_its_fix(tmp_path, capsys, content, says):
    """teachers.json is checked where it is read: a list, a missing key or a wrong type is a one-line error naming
    the file and `k3 distill teachers`, not an AttributeError, KeyError or TypeError."""
    from k3.distill.mopd import TEACHERS_FORMAT

    t = tmp_path / "t"
    t.mkdir()
    good = {"format": TEACHERS_FORMAT, "tokenizer": "tokenizer.json", "tokenizer_sha256": "0" * 64, "base": "base",
            "budgets": {"low": 2, "medium": 3, "high": 4}, "teachers": {"arith/low": "arith-low"}}
    edits = {"drop budgets": lambda d: d.pop("budgets"), "drop tokenizer": lambda d: d.pop("tokenizer"),
             "teachers int": lambda d: d.update(teachers={"arith/low": 5}),
             "teachers bad cell": lambda d: d.update(teachers={"arith/extreme": "x"})}
    if content in edits:
        edits[content](good)
        content = json.dumps(good)
    (t / "teachers.json").write_text(content)
    for cmd in (["distill", "mopd", "--teachers", str(t), "--out", str(tmp_path / "m"), "-q"],
                ["distill", "eval", "--teachers", str(t), "-q"],
                ["distill", "generate", "--teachers", str(t), "--model", str(t), "--prompt", "<|effort:low|> 1"]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert says in err and str(t / "teachers.json") in err and "k3 distill teachers" in err
        assert err.count("\n") == 1 and "Traceback" not in err


def test_distill_flags_are_checked_before_any_work(tmp_path, capsys, monkeypatch):
    """Each bad flag is named in one line, before a tokenizer is trained or a model loaded (the teachers directory
    here does not exist: reading it would be a different error)."""
    import k3.data.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "train_tokenizer", lambda *a, **k: pytest.fail("trained a tokenizer"))
    nowhere, dirpath = str(tmp_path / "nowhere"), tmp_path / "adir"
    dirpath.mkdir()
    teach = ["distill", "teachers", "--preset", "tiny", "--out", str(tmp_path / "t"), "-q"]
    mopd = ["distill", "mopd", "--teachers", nowhere, "--out", str(tmp_path / "m"), "-q"]
    ev = ["distill", "eval", "--teachers", nowhere, "-q"]
    gen = ["distill", "generate", "--model", nowhere, "--teachers", nowhere, "--prompt", "<|effort:low|> 1"]
    cases = [
        (teach + ["--steps", "-1"], "--steps -1 must be a positive integer"),
        (teach + ["--base-steps", "0"], "--base-steps 0 must be a positive integer"),
        (teach + ["--teacher-lr", "-1"], "--teacher-lr -1.0 must be a positive number"),
        (teach + ["--lr", "nan"], "--lr nan must be a positive number"),
        (teach + ["--warmup", "-1"], "--warmup -1 must be an integer >= 0"),  # --warmup-steps' other spelling
        (teach + ["--ckpt-every", "-1"], "--ckpt-every -1 must be an integer >= 0"),
        (teach + ["--batch-size", "0"], "--batch-size 0 must be a positive integer"),
        (teach + ["--max-context", "0"], "--max-context 0 must be a positive integer"),
        (teach + ["--vocab-size", "256"], "use --vocab-size >= 273"),
        (teach + ["--resume", "--overwrite"], "give one"),
        (mopd + ["--temperature", "nan"], "--temperature nan must be a finite number > 0"),
        (mopd + ["--temperature", "inf"], "--temperature inf must be a finite number > 0"),
        (mopd + ["--eval-n", "-1"], "--eval-n -1 must be an integer >= 0"),
        (mopd + ["--resume", "--overwrite"], "--resume continues the run and --overwrite starts it over; give one"),
        (mopd + ["--match-tokens", nowhere], f"--match-tokens {nowhere}: no {nowhere}/metrics.jsonl; give the --out"),
        (mopd + ["--reward-coef", "nan"], "--reward-coef nan must be a number >= 0"),
        (mopd + ["--max-answer-tokens", "0"], "--max-answer-tokens 0 must be a positive integer"),
        (mopd + ["--per-cell", "0"], "--per-cell 0 must be a positive integer"),
        # the loop's settings, named by their flags (they read "lr = 0.0 must be ...") and checked before the
        # teachers are read
        (mopd + ["--lr", "0"], "--lr 0.0 must be a positive number"),
        (mopd + ["--eval-every", "-1"], "--eval-every -1 must be an integer >= 0"),
        (mopd + ["--warmup-steps", "-1"], "--warmup-steps -1 must be an integer >= 0"),
        (mopd + ["--token-budget", "0"], "--token-budget 0 must be a positive number of tokens"),
        (["distill", "mopd", "--teachers", nowhere, "--out", str(dirpath / "f"), "-q"], "is a file; give a directory"),
        (teach[:-3] + ["--out", str(dirpath / "f"), "-q"], "is a file; give a directory"),
        (ev + ["--n", "0"], "--n 0 must be a positive integer"),
        (ev + ["--n", "-1"], "--n -1 must be a positive integer"),
        (ev + ["--gap-run", nowhere], f"--gap-run {nowhere}: no {nowhere}/metrics.jsonl"),
        (ev + ["--out", str(dirpath)], f"--out {dirpath} is a directory; give a file path"),
        (ev + ["--markdown", str(dirpath)], f"--markdown {dirpath} is a directory; give a file path"),
        (ev + ["--model", "teacher=x"], "the name 'teacher' names the teachers' column"),
        (ev + ["--gap-run", str(dirpath)], "has no evaluation records with teacher gaps (it was trained with --eval-n 0)"),
        (ev + ["--model", "base=x"], "names the shared base's column (pass --no-base to use it)"),
        (ev + ["--model", "a=x", "--model", "a=y"], "the name 'a' is given twice"),
        (gen + ["--temperature", "nan"], "--temperature nan must be a finite number >= 0"),
        (gen + ["--temperature", "inf"], "--temperature inf must be a finite number >= 0"),
        (gen + ["--temperature", "-1"], "--temperature -1.0 must be a finite number >= 0"),
    ]
    (dirpath / "f").write_text("mine")
    (dirpath / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0}\n')  # a run without evaluations
    for argv, says in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "t").exists()  # nothing made before the flags were checked


def test_distill_errors_name_the_distill_fix(tmp_path, capsys, trained_teachers, domain_tokenizer):
    """A missing base or teacher and a corrupt tokenizer of a teacher matrix point at `k3 distill teachers`;
    generate with another tokenizer says so in its own terms (no teacher and student there)."""
    from k3.data.tokenizer import train_tokenizer

    other = train_tokenizer(["a b c d e f"] * 50, 300, path=tmp_path / "other.json", allow_short=True)
    assert main(["distill", "generate", "--model", str(trained_teachers / "base"), "--tokenizer", str(other.path),
                 "--prompt", "<|effort:low|> sum 1+2"]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {other.path}" in err and "pass the tokenizer it was trained with" in err
    assert "reverse KL" not in err and "student" not in err

    t = _copy(trained_teachers, tmp_path)
    mopd = ["distill", "mopd", "--teachers", str(t), "--out", str(tmp_path / "m"), "--cells", "arith/low", "--steps",
            "1", "--eval-n", "0", "-q"]
    before = sorted(p.name for p in t.iterdir())
    assert main([*mopd[:5], str(t), *mopd[6:]]) == 2  # --out the matrix itself
    assert "is a teacher matrix (it holds teachers.json)" in capsys.readouterr().err
    assert sorted(p.name for p in t.iterdir()) == before
    base = sorted(p.name for p in (t / "base").rglob("*"))
    for inside in ("base", "arith-low"):  # the shared base (replaced with --overwrite, as the error then said)
        for extra in ([], ["--overwrite"]):
            assert main([*mopd[:5], str(t / inside), *mopd[6:], *extra]) == 2
            assert "is inside the teacher matrix" in capsys.readouterr().err
    assert sorted(p.name for p in (t / "base").rglob("*")) == base  # not even teacher_eval.json was written
    shutil.rmtree(t / "arith-low")
    assert main(mopd) == 2
    err = capsys.readouterr().err
    assert "teacher arith/low" in err and "k3 distill teachers" in err and "`k3 train" not in err
    shutil.rmtree(t / "base")
    for argv in (mopd, ["distill", "eval", "--teachers", str(t), "--cells", "arith/low", "--n", "1", "-q"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{t / 'base'} does not exist" in err and "k3 distill teachers" in err and "`k3 train" not in err
    (t / "tokenizer.json").write_text("{not json")
    assert main(mopd) == 2
    err = capsys.readouterr().err
    assert "is not a valid k3 tokenizer" in err and "k3 distill teachers" in err and "`k3 tokenize" not in err



def test_rerun_teachers_with_other_schedule_or_fewer_steps_is_refused(tmp_path, capsys, domain_tokenizer):
    """A rerun with another --lr / --teacher-lr, or fewer steps than a stage was trained for, reported every stage
    "already trained" and wrote the new values into teachers.json."""
    t = tmp_path / "t"
    argv = ["distill", "teachers", "--preset", "tiny", "--set", "n_layers=2", "--tokenizer", str(domain_tokenizer.path),
            "--out", str(t), "--cells", "arith/low", "--batch-size", "2", "--max-context", "128",
            "--budgets", "low=2,medium=3,high=4", "--threads", "1", "-q"]
    assert main(argv + ["--base-steps", "2", "--steps", "1"]) == 0
    info = json.loads((t / "teachers.json").read_text())
    capsys.readouterr()
    for extra, says in ((["--base-steps", "2", "--steps", "1", "--lr", "1e-2"], "lr"),
                        (["--base-steps", "2", "--steps", "1", "--teacher-lr", "1e-4"], "lr"),
                        (["--base-steps", "1", "--steps", "1"], "steps 2 (now 1)")):
        assert main(argv + extra) == 2, extra
        err = capsys.readouterr().err
        assert "was trained with other settings" in err and says in err, err
    assert json.loads((t / "teachers.json").read_text()) == info
    assert main(argv + ["--base-steps", "2", "--steps", "1"]) == 0  # the same flags: every stage already trained
    assert "already trained" in capsys.readouterr().out


def test_overwrite_keeps_teachers_of_the_same_base_and_stale_ones_are_refused(tmp_path, domain_tokenizer, capsys):
    """`teachers --overwrite --cells X` retrains the base (to the same weights) and X, and keeps listing the other
    cells' teachers fine-tuned from that base (it dropped them: mopd then found no teacher for them). A teacher whose
    base has since changed is refused by mopd / eval (it was used silently, the student starting from another
    base), and an --overwrite to another base drops it from the listing."""
    from k3.distill.mopd import load_teacher_matrix

    t = tmp_path / "teachers"
    common = ["distill", "teachers", "--preset", "tiny", "--set", "n_layers=2", "--tokenizer",
              str(domain_tokenizer.path), "--out", str(t), "--steps", "1", "--batch-size", "2",
              "--max-context", "128", "--budgets", "low=2,medium=3,high=4", "-q"]
    assert main(common + ["--base-steps", "2", "--cells", "arith/low"]) == 0
    assert main(common + ["--base-steps", "2", "--cells", "text/high", "--overwrite"]) == 0
    listed = json.loads((t / "teachers.json").read_text())["teachers"]
    assert listed == {"arith/low": "arith-low", "text/high": "text-high"}
    load_teacher_matrix(t, domain_tokenizer.fingerprint, domain_tokenizer.vocab_size, cells=[("arith", "low")])
    # the base trained on: its teachers are stale (the stage refuses to resume them; mopd refuses to use them)
    assert main(common + ["--base-steps", "3", "--cells", "arith/low", "--resume"]) == 2
    assert "arith-low was trained with other settings: base" in capsys.readouterr().err
    with pytest.raises(ValueError, match="teacher arith/low .* fine-tuned from the base at step 2, but the matrix's "
                                         "base has changed since \\(now step 3"):
        load_teacher_matrix(t, domain_tokenizer.fingerprint, domain_tokenizer.vocab_size, cells=[("arith", "low")])
    assert main(common + ["--base-steps", "3", "--cells", "text/high", "--overwrite"]) == 0
    assert json.loads((t / "teachers.json").read_text())["teachers"] == {"text/high": "text-high"}
