"""A Ctrl-C inside a StepLoop step (k3 rl, k3 distill) says which checkpoint is left and how to continue."""
import pytest
import torch

from k3.cli import main
from k3.config import get_config
from k3.distill.loop import LoopConfig, StepLoop
from k3.model.transformer import K3Model


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
