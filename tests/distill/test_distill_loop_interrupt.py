"""A Ctrl-C inside a StepLoop step (k3 rl, k3 distill) says which checkpoint is left and how to continue."""
import pytest
import torch

from k3.cli import main
from k3.config import get_config
from k3.distill.loop import LoopConfig, StepLoop
from k3.model.transformer import K3Model
from k3.train import checkpoint as ckpt


def _loop(tmp_path):
    torch.manual_seed(0)
    model = K3Model(get_config("tiny", n_layers=2))
    x = torch.randint(0, model.config.vocab_size, (1, 8))
    return StepLoop(model, LoopConfig(steps=6, ckpt_every=2, warmup_steps=0), tmp_path / "run"), x


def test_ctrl_c_names_the_last_checkpoint_and_resume(tmp_path, monkeypatch, capsys):
    loop, x = _loop(tmp_path)

    def step(i):
        if i == 3:  # the fourth step: steps 1-3 done, a checkpoint after step 2
            raise KeyboardInterrupt
        return {"loss": loop.model(x).float().logsumexp(-1).mean()}

    with pytest.raises(KeyboardInterrupt) as ex:
        loop.fit(step)
    msg = str(ex.value)
    assert "stopped in step 4" in msg and "step_000002" in msg and "--resume (and without --overwrite) continues from step 2" in msg
    assert "(step 3 is trained again)" in msg
    assert ex.value.where.startswith("stopped in step 4; the last checkpoint is") and "--resume" not in ex.value.where
    fresh, _ = _loop(tmp_path / "other")
    with pytest.raises(KeyboardInterrupt, match="no checkpoint was saved yet, so the same command starts over"):
        fresh.fit(lambda i: (_ for _ in ()).throw(KeyboardInterrupt))
    # the command-line handler prints it after "interrupted" and exits 130

    def cmd(args):
        raise KeyboardInterrupt(msg)

    monkeypatch.setattr("k3.model.cli.cmd_params", cmd)
    code = main(["params", "--preset", "tiny"])
    err = capsys.readouterr().err
    assert code == 130 and f"k3 params: interrupted: {msg}" in err, err


def _signalling_step(loop, x, at: dict):
    """A step that sends the signals listed for its 0-based index to this process while it runs."""
    import os

    def step(i):
        for sig in at.get(i, ()):
            os.kill(os.getpid(), sig)  # the graceful handler only records the first
        return {"loss": loop.model(x).float().logsumexp(-1).mean()}
    return step


def test_sigterm_or_ctrl_c_saves_the_step_in_progress_and_resume_matches(tmp_path, default_signals):
    """`k3 rl` / `k3 distill` (graceful_interrupt): SIGTERM (a supervisor, a preemption) or Ctrl-C ends the run after
    the step in progress, saves that step and says how to go on; before, SIGTERM killed the run and Ctrl-C lost
    every step since the last save. Resuming gives the weights an uninterrupted run ends with, bit for bit."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop, x = _loop(tmp_path / sig.name)
        with pytest.raises(KeyboardInterrupt) as ex:
            loop.fit(_signalling_step(loop, x, {2: [sig]}), graceful_interrupt=True)
        msg = str(ex.value)
        assert msg.startswith("stopped after step 3, saved as ") and "step_000003" in msg, msg
        assert "--resume (and without --overwrite) continues from step 3" in msg
        assert ex.value.where.startswith("stopped after step 3") and "--resume" not in ex.value.where
        assert ckpt.latest_checkpoint(tmp_path / sig.name / "run" / "checkpoint").name == "step_000003"
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        again, x2 = _loop(tmp_path / sig.name)
        again.fit(_signalling_step(again, x2, {}), resume=True)
        assert again.step == 6
    straight, x3 = _loop(tmp_path / "straight")
    straight.fit(_signalling_step(straight, x3, {}))
    for a, b in zip(again.model.state_dict().values(), straight.model.state_dict().values()):
        assert torch.equal(a, b)
    # a signal during the last step: the run completes and is saved, and the caller still learns of the stop
    # (k3 distill teachers went on into its next stage, ignoring a supervisor's SIGTERM)
    last, x4 = _loop(tmp_path / "last")
    with pytest.raises(KeyboardInterrupt, match="stopped after step 6, the last of this run, saved as .*step_000006"):
        last.fit(_signalling_step(last, x4, {5: [signal.SIGTERM]}), graceful_interrupt=True)
    assert last.step == 6 and ckpt.latest_checkpoint(tmp_path / "last" / "run" / "checkpoint").name == "step_000006"
    # a second signal stops at once: the step in progress is lost, the last checkpoint (step 2) stands
    twice, x5 = _loop(tmp_path / "twice")
    with pytest.raises(KeyboardInterrupt, match="stopped in step 4; the last checkpoint is .*step_000002"):
        twice.fit(_signalling_step(twice, x5, {3: [signal.SIGTERM, signal.SIGTERM]}), graceful_interrupt=True)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    # without graceful_interrupt nothing is installed: SIGTERM keeps its default
    plain, _ = _loop(tmp_path / "plain")
    plain.fit(lambda i: (signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or pytest.fail("handler installed"))
              and {"loss": plain.model(x).float().logsumexp(-1).mean()})


def test_a_signal_outside_the_steps_stops_where_it_came(tmp_path, default_signals, monkeypatch):
    """A signal during the first evaluation stops before step 1 (it trained and saved a whole step first); a second
    signal while a checkpoint is saved names the checkpoint left (it raised a blank KeyboardInterrupt)."""
    import os
    import signal

    loop, x = _loop(tmp_path / "first")

    def evaluate(step):
        if step == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"score": 0.0}

    with pytest.raises(KeyboardInterrupt, match="stopped before step 1; no checkpoint was saved yet") as ex:
        loop.fit(_signalling_step(loop, x, {}), evaluate=evaluate, graceful_interrupt=True)
    assert loop.step == 0 and ex.value.where == "stopped before step 1"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    saving, x2 = _loop(tmp_path / "saving")
    real_save = StepLoop.save

    def save(self):
        if self.step == 4:  # the save after step 4 (ckpt_every 2), a first and a second signal during it
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(self)

    monkeypatch.setattr(StepLoop, "save", save)
    with pytest.raises(KeyboardInterrupt, match=r"stopped while saving step 4; the last checkpoint is .*step_000002.*"
                                                r"continues from step 2 \(steps 3-4 are trained again\)"):
        saving.fit(_signalling_step(saving, x2, {}), graceful_interrupt=True)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_step_failed_after_the_signal_is_an_interruption(tmp_path, default_signals):
    """A Ctrl-C from the terminal also reaches helper processes; a step that fails because one died is reported as
    the interruption (with the error as its cause), not as the error. Without a signal the error is itself."""
    import os
    import signal

    loop, x = _loop(tmp_path)

    def step(i):
        if i == 3:
            os.kill(os.getpid(), signal.SIGINT)
            raise RuntimeError("a helper died")
        return {"loss": loop.model(x).float().logsumexp(-1).mean()}

    with pytest.raises(KeyboardInterrupt, match="stopped in step 4; the last checkpoint is .*step_000002") as ex:
        loop.fit(step, graceful_interrupt=True)
    assert isinstance(ex.value.__cause__, RuntimeError)
    other, _ = _loop(tmp_path / "other")
    with pytest.raises(RuntimeError, match="a helper died"):
        other.fit(lambda i: (_ for _ in ()).throw(RuntimeError("a helper died")), graceful_interrupt=True)


def test_the_commands_stop_gracefully_and_the_rl_demo_does_not(tmp_path, domain_tokenizer, monkeypatch, capsys,
                                                              default_signals):
    """`k3 distill teachers` end to end: SIGTERM in its first stage saves that stage's step and exits 130 naming it;
    the same command with --resume finishes. `k3 distill mopd`, `k3 rl warmstart` and `k3 rl train` ask their loop
    for the graceful stop, `k3 rl --demo` (no --resume) does not."""
    import argparse
    import os
    import signal

    from k3.distill import loop as loop_mod

    real_step = loop_mod.StepLoop.train_step

    def train_step(self):
        if self.step == 1 and not getattr(self, "_signalled", False):
            self._signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self)

    monkeypatch.setattr(loop_mod.StepLoop, "train_step", train_step)
    t = tmp_path / "teachers"
    argv = ["distill", "teachers", "--preset", "tiny", "--set", "n_layers=2", "--tokenizer",
            str(domain_tokenizer.path), "--out", str(t), "--cells", "arith/low", "--base-steps", "3",
            "--steps", "1", "--batch-size", "2", "--max-context", "128", "--budgets", "low=2,medium=3,high=4", "-q"]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "interrupted: stopped after step 2, saved as" in err and "continues from step 2" in err, err
    assert (t / "base" / "checkpoint" / "latest").read_text().strip() == "step_000002"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    monkeypatch.setattr(loop_mod.StepLoop, "train_step", real_step)
    assert main(argv + ["--resume"]) == 0
    assert (t / "base" / "checkpoint" / "latest").read_text().strip() == "step_000003"

    asked = {}
    real_fit = loop_mod.StepLoop.fit

    def fit(self, step_fn, **kw):
        asked[self.manifest_extra.get("kind")] = kw.get("graceful_interrupt")
        return real_fit(self, step_fn, **kw)

    monkeypatch.setattr(loop_mod.StepLoop, "fit", fit)
    assert main(["distill", "mopd", "--teachers", str(t), "--out", str(tmp_path / "m"), "--cells", "arith/low",
                 "--steps", "1", "--per-cell", "2", "--eval-n", "0", "--max-answer-tokens", "3", "-q"]) == 0
    assert asked == {"mopd-on-policy": True}

    import k3.rl.cli as rl_cli

    parser = argparse.ArgumentParser()
    rl_cli.register(parser.add_subparsers(dest="command"))
    for argv in (["rl", "warmstart"], ["rl", "train"]):  # what cmd_warmstart / cmd_train pass to their loop
        assert parser.parse_args(argv).graceful is True
    seen = {}

    def stage(name, ret):
        def fn(args):
            seen[name] = args.graceful
            return ret
        return fn

    monkeypatch.setattr(rl_cli, "cmd_warmstart", stage("warm", {}))
    monkeypatch.setattr(rl_cli, "cmd_train", stage("train", {}))
    monkeypatch.setattr(rl_cli, "cmd_eval", lambda a: {"harnesses": ["canonical"],
                                                      "models": {"warmstart": {"canonical": {"success": 0.0}}}})
    monkeypatch.setattr(rl_cli, "cmd_plot", lambda a: {"plot": "x"})
    rl_cli.cmd_demo(argparse.Namespace(root=str(tmp_path / "demo"), threads=1, seed=0, quiet=True))
    assert seen == {"warm": False, "train": False}
