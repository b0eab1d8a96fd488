import numpy as np
import pytest
import torch

from k3.ablate.probe import (BLANK, SEP, RecallData, RecallTask, oracle_answers, probe_config, probe_patterns,
                             recall_accuracy)
from k3.ablate.suites import SCALES


def test_episodes_hold_every_needle_once_and_targets_are_the_oracle_answers():
    task = RecallTask(n_keys=5, n_values=3, n_filler=4)
    x, y = RecallData(task).get_batch(7, 6, 40, seed=1)
    assert x.shape == y.shape == (6, 40)
    assert torch.equal(oracle_answers(task, x), y)
    context = 40 - 1 - task.n_keys
    for b in range(6):
        pairs = [t for t in x[b, :context].tolist() if task.pair0 <= t < task.query0]
        assert sorted((t - task.pair0) // task.n_values for t in pairs) == list(range(5))
        assert x[b, context] == SEP
        assert sorted(x[b, context + 1:].tolist()) == list(range(task.query0, task.query0 + 5))
        assert (y[b, :context + 1] == BLANK).all() and (y[b, context + 1:] >= task.value0).all()
    assert int(x.max()) < task.vocab_size


def test_batches_are_a_pure_function_of_seed_and_step():
    data = RecallData(RecallTask())
    a, b = data.get_batch(3, 4, 32, seed=0), data.get_batch(3, 4, 32, seed=0)
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], data.get_batch(4, 4, 32, seed=0)[0])
    assert not torch.equal(a[0], data.get_batch(3, 4, 32, seed=1)[0])


class _Oracle(torch.nn.Module):
    def __init__(self, task, constant=None):
        super().__init__()
        self.task, self.constant = task, constant

    def forward(self, x):
        ans = oracle_answers(self.task, x) if self.constant is None else torch.full_like(x, self.constant)
        return torch.nn.functional.one_hot(ans, self.task.vocab_size).float()


def test_recall_accuracy_scores_an_oracle_one_and_a_constant_guess_at_chance():
    task = RecallTask(n_keys=8, n_values=4)
    assert recall_accuracy(_Oracle(task), task, 64, batches=2, batch_size=8) == 1.0
    acc = recall_accuracy(_Oracle(task, constant=task.value0), task, 64, batches=8, batch_size=16)
    assert 0.15 < acc < 0.35  # a quarter of the values are value 0


def test_short_lengths_are_rejected():
    # the lengths come in through the suite's plan; the episode generator trusts them
    import dataclasses

    from k3.ablate.runner import plan_runs

    quick = SCALES["quick"]
    short = dataclasses.replace(quick, probe=dataclasses.replace(quick.probe, n_keys=8, eval_lengths=(16, 64)))
    with pytest.raises(ValueError, match=r"probe lengths must be >= 17 \(the needles and their queries\)"):
        plan_runs(short, ["probe"], {})


def test_probe_models_differ_only_in_the_layer_pattern():
    p = SCALES["full"].probe
    pats = probe_patterns(p.n_layers)
    assert pats["3:1"].count("K") == 3 * pats["3:1"].count("M")
    cfgs = {k: probe_config(p, v).to_dict() for k, v in pats.items()}
    for c in cfgs.values():
        c.pop("layer_pattern")
    assert cfgs["all-KDA"] == cfgs["3:1"] == cfgs["all-MLA"]
    assert cfgs["3:1"]["max_context"] >= max(p.eval_lengths)
