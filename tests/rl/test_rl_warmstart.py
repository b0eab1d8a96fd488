"""The warm start's loss: the policy's tokens, and optionally the context at its own weight."""
import random

import pytest
import torch
import torch.nn.functional as F

from k3.rl.train import _seed, sft_step_fn


class Bigram(torch.nn.Module):
    def __init__(self, V=11):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(V, V))

    def forward(self, ids):
        return self.table[ids]


def _manual(model, ex, w):
    ce_p, ce_c, n_p, n_c = 0.0, 0.0, 0, 0
    for ids, mask in ex:
        logp = F.log_softmax(model(torch.tensor(ids)), -1)
        for t in range(1, len(ids)):
            if mask[t]:
                ce_p, n_p = ce_p - logp[t - 1, ids[t]], n_p + 1
            else:
                ce_c, n_c = ce_c - logp[t - 1, ids[t]], n_c + 1
    return ce_p / n_p + w * ce_c / n_c


@pytest.mark.parametrize("w", [0.0, 0.5])
def test_policy_and_context_losses(w):
    torch.manual_seed(0)
    model = Bigram()
    ex = [([3, 4, 5, 6, 7], [False, False, True, True, False]), ([8, 9, 10], [False, True, True])]
    out = sft_step_fn(model, ex, batch_size=2, seed=0, context_loss_weight=w)(0)
    # the step draws its examples with an RNG that is a function of (seed, step): draw them the same way
    rng = random.Random(_seed("k3-rl-sft", 0, 0))
    drawn = [ex[rng.randrange(2)] for _ in range(2)]
    torch.testing.assert_close(out["loss"], _manual(model, drawn, w))
    assert out["tokens"] == sum(sum(m[1:]) for _, m in drawn) and ("ce_context" in out) == (w > 0)
    with pytest.raises(ValueError, match="context_loss_weight"):
        sft_step_fn(model, ex, 2, 0, context_loss_weight=-1.0)
    with pytest.raises(ValueError, match="no demonstrations"):
        sft_step_fn(model, [], 2, 0)


def test_short_prompt_curriculum_switches_pools():
    """The first N steps (0-based, as StepLoop counts) draw from the short episodes, later steps from the full ones; the short episode of a demo is
    its transcript without the system message."""
    from k3.rl.train import without_system_prompt
    torch.manual_seed(0)
    model = Bigram()
    full = [([3, 4, 5, 6, 7], [False, False, True, True, False])]
    short = [([8, 9, 10, 4], [False, False, True, True])]
    fn = sft_step_fn(model, full, batch_size=2, seed=0, short_examples=short, short_prompt_steps=3)
    for step, pool in ((0, short), (2, short), (3, full)):
        torch.testing.assert_close(fn(step)["loss"], _manual(model, [pool[0]] * 2, 0.0))
    with pytest.raises(ValueError, match="short_prompt_steps"):
        sft_step_fn(model, full, 2, 0, short_prompt_steps=5)
    tr = [{"role": "system", "content": "tools"}, {"role": "user", "content": "task"},
          {"role": "assistant", "content": "call"}]
    assert without_system_prompt(tr) == tr[1:]


def test_a_context_too_short_for_every_demonstration_says_to_raise_it(tmp_path, rl_tokenizer):
    """Not "no demonstrations; collect some first": there are some, and --max-context leaves them all out."""
    from k3.config import get_config
    from k3.distill.loop import LoopConfig
    from k3.model.transformer import K3Model
    from k3.rl.train import run_warmstart
    transcript = [{"role": "system", "content": "You have a shell."}, {"role": "user", "content": "Compute 12 * 34."},
                  {"role": "assistant", "content": "exit code: 0\n408\n"}]
    model = K3Model(get_config("tiny", n_layers=2, vocab_size=rl_tokenizer.vocab_size, max_context=8))
    with pytest.raises(ValueError, match=r"all 2 demonstrations are longer than the model's max_context \(8 tokens\); "
                                         r"raise --max-context to at least \d+"):
        run_warmstart(model, rl_tokenizer, [{"transcript": transcript}] * 2, LoopConfig(steps=1), tmp_path / "w")
    assert not (tmp_path / "w").exists()
