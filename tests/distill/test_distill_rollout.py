import pytest
import torch
import torch.nn.functional as F

from k3.distill.effort import END_ID, END_THINK_ID
from k3.distill.rollout import merge_rollouts, sample
from k3.model.transformer import K3Model


class Biased(K3Model):
    """A K3Model whose logits get a fixed bias: makes a chosen token (nearly) certain."""

    def __init__(self, config, favourite: int | None = None):
        super().__init__(config)
        self.bias = torch.zeros(config.vocab_size)
        if favourite is not None:
            self.bias[favourite] = 50.0

    def forward(self, input_ids, cache=None):
        return super().forward(input_ids, cache) + self.bias


PROMPTS = [[1, 3, 300, 301, 302, 14], [1, 4, 310, 16], [1, 3, 300, 301, 303, 15], [1, 5, 311, 312, 313, 314, 315, 16]]


def test_logprobs_match_a_full_forward(small_config):
    """Prompts of three lengths, merged caches and rows leaving the batch: every sampled token's log-prob
    equals the one a plain forward over the finished sequence gives."""
    torch.manual_seed(0)
    model = K3Model(small_config)
    ro = sample(model, PROMPTS, [3, 5, 2, 4], max_answer_tokens=4, temperature=1.0,
                generator=torch.Generator().manual_seed(0))
    assert len({int(m.sum()) for m in ro.completion_mask}) > 1  # rows finished at different steps
    with torch.no_grad():
        lp = F.log_softmax(model(ro.ids).float(), -1)[:, :-1].gather(-1, ro.ids[:, 1:, None])[..., 0]
    mask = ro.completion_mask[:, 1:]
    torch.testing.assert_close(ro.logprobs[:, 1:][mask], lp[mask], atol=1e-5, rtol=1e-5)
    for i, p in enumerate(PROMPTS):
        assert ro.ids[i, :len(p)].tolist() == p and not ro.completion_mask[i, :len(p)].any()


def test_sampling_is_a_function_of_the_generator(small_config):
    model = K3Model(small_config)
    a = sample(model, PROMPTS, [4] * 4, 4, 1.0, torch.Generator().manual_seed(3))
    b = sample(model, PROMPTS, [4] * 4, 4, 1.0, torch.Generator().manual_seed(3))
    c = sample(model, PROMPTS, [4] * 4, 4, 1.0, torch.Generator().manual_seed(4))
    assert torch.equal(a.ids, b.ids) and not torch.equal(a.ids, c.ids)


def test_budget_forces_the_thinking_span_closed(small_config):
    """A model that never closes its reasoning is closed at exactly the budget, and its answer is capped."""
    model = Biased(small_config, favourite=300)
    ro = sample(model, PROMPTS, [2, 5, 3, 1], max_answer_tokens=3, temperature=1.0,
                generator=torch.Generator().manual_seed(0))
    for i, budget in enumerate([2, 5, 3, 1]):
        comp = ro.completion(i)
        assert ro.reasoning_tokens[i] == budget and comp[budget] == END_THINK_ID
        assert comp == [300] * budget + [END_THINK_ID] + [300] * 3 + [END_ID]
        assert ro.forced_close[i] and ro.closed[i] and ro.finish[i] == "length"
        sampled = ro.sampled_mask[i][ro.completion_mask[i]].tolist()
        assert sampled == [True] * budget + [False] + [True] * 3 + [False]  # forced tokens are not samples


def test_a_model_that_closes_itself_is_not_forced(small_config):
    model = Biased(small_config, favourite=END_THINK_ID)
    ro = sample(model, PROMPTS[:2], [4, 4], 3, 0.0)
    assert ro.reasoning_tokens == [0, 0] and ro.forced_close == [False, False] and all(ro.closed)


def test_merge_rollouts_reassembles_rows(small_config):
    model = K3Model(small_config)
    a = sample(model, [PROMPTS[0], PROMPTS[2]], [2, 2], 2, 0.0)
    b = sample(model, [PROMPTS[1]], [3], 2, 0.0)
    m = merge_rollouts([([0, 2], a), ([1], b)], 3)
    assert m.completion(0) == a.completion(0) and m.completion(2) == a.completion(1)
    assert m.completion(1) == b.completion(0)
    with pytest.raises(AssertionError, match="once each"):  # its one caller, TeacherMatrix.sample, covers every row
        merge_rollouts([([0], a)], 3)


def test_bad_sampling_inputs(small_config):
    model = K3Model(small_config)
    with pytest.raises(ValueError, match="one budget per prompt"):
        sample(model, PROMPTS, [1], 2)
    with pytest.raises(ValueError, match="max_context"):
        sample(model, [[1] * 150], [8], 40)
