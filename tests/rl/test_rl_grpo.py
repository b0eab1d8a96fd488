"""GRPO: the loss against a token-by-token reference, group advantages, clipping, and the tool-output mask."""
import math

import pytest
import torch

from k3.rl.demos import episode_tokens, pad_batch
from k3.rl.grpo import group_advantages, grpo_loss, grpo_loss_reference, token_logprobs


def _inputs(seed=0, B=4, L=7):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, L, generator=g) * 3).requires_grad_(True)
    old = logp.detach() + torch.randn(B, L, generator=g) * 0.4   # ratios well inside and outside the clip range
    ref = logp.detach() + torch.randn(B, L, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, L, generator=g) > 0.35
    mask[0, 0] = True
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("agg", ["token", "sequence"])
@pytest.mark.parametrize("beta,eps_high", [(0.0, None), (0.1, 0.28)])
def test_loss_matches_reference_value_and_gradient(agg, beta, eps_high):
    logp, old, ref, adv, mask = _inputs()
    mask[2] = False  # an episode without sampled tokens must not count in either aggregation
    kw = dict(eps_low=0.2, eps_high=eps_high, ref_logp=ref, beta=beta, agg=agg)
    fast, stats = grpo_loss(logp, old, adv, mask, **kw)
    (g_fast,) = torch.autograd.grad(fast, logp)
    slow = grpo_loss_reference(logp, old, adv, mask, **kw)
    (g_slow,) = torch.autograd.grad(slow, logp)
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_fast, g_slow, rtol=1e-6, atol=1e-7)
    assert 0 < stats["clip_frac"] < 1 and stats["tokens"] == int(mask.sum())
    assert stats["kl"] >= 0


def test_on_policy_gradient_is_the_policy_gradient():
    """With old = current (one update per batch), the ratio is 1 and the gradient is -A / N per token."""
    logp, _, _, adv, mask = _inputs(1)
    loss, stats = grpo_loss(logp, logp.detach(), adv, mask)
    (g,) = torch.autograd.grad(loss, logp)
    want = -(adv[:, None] * mask) / mask.sum()
    torch.testing.assert_close(g, want)
    assert stats["clip_frac"] == 0 and stats["ratio_mean"] == pytest.approx(1.0)


def test_clipping_stops_the_gradient_where_the_ratio_left_the_trust_region():
    logp = torch.zeros(2, 1, requires_grad=True)
    old = torch.tensor([[math.log(0.5)], [math.log(2.0)]])  # ratios 2 (A > 0: clipped) and 0.5 (A < 0: clipped)
    adv = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(logp, old, adv, torch.ones(2, 1, dtype=torch.bool), eps_low=0.2, eps_high=0.2)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.all(g == 0) and stats["clip_frac"] == 1.0
    # the other sides are not clipped: a ratio below 1 - eps with A > 0 still pushes up
    loss, _ = grpo_loss(logp, old.flip(0), adv, torch.ones(2, 1, dtype=torch.bool))
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.all(g != 0)


def test_group_advantages():
    adv = group_advantages([1, 0, 0, 1, 1, 1, 0.5], ["a", "a", "a", "a", "b", "b", "c"])
    assert adv[:4] == pytest.approx([1, -1, -1, 1], abs=1e-5)   # mean 0.5, population std 0.5
    assert adv[4:6] == [0.0, 0.0]                               # a tied group teaches nothing
    assert adv[6] == 0.0                                        # a group of one has no baseline but itself
    assert group_advantages([1, 0, 0], [0, 0, 0], scale=False) == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    with pytest.raises(AssertionError, match="group ids"):  # GRPOTrainer pairs every reward with its group
        group_advantages([1, 0], [0])


def test_bad_settings_are_errors(tiny_rl_model, rl_tokenizer, rl_tasks):
    # the settings come in through GRPOConfig (the flags of `k3 rl train`) and GRPOTrainer; grpo_loss trusts them
    from k3.rl.train import GRPOConfig, GRPOTrainer

    with pytest.raises(ValueError, match="eps_low"):
        GRPOConfig(eps_low=1.5).validate()
    with pytest.raises(ValueError, match="agg"):
        GRPOConfig(agg="mean").validate()
    with pytest.raises(ValueError, match="beta > 0 needs a reference model"):
        GRPOTrainer(tiny_rl_model, rl_tokenizer, rl_tasks["train"], GRPOConfig(beta=0.1))
    logp, old, ref, adv, mask = _inputs()
    with pytest.raises(AssertionError, match="no sampled tokens"):  # the trainer forwards only episodes with some
        grpo_loss(logp, old, adv, torch.zeros_like(mask))


def test_tool_output_tokens_get_no_gradient(rl_tokenizer):
    """Through the real chat-template tokens of an episode: the gradient w.r.t. the logits is exactly zero at
    every position whose target is not a sampled token (system prompt, instruction, tool output)."""
    transcript = [{"role": "system", "content": "Use the tools."},
                  {"role": "user", "content": "Compute 12 * 34 and save it."},
                  {"role": "assistant", "content": "Action: run\nAction Input: {\"command\": \"echo $((12*34))\"}"},
                  {"role": "user", "content": "Observation: exit code: 0\n408\n"},
                  {"role": "assistant", "content": "Action: finish\nAction Input: {}"}]
    ids, mask = episode_tokens(transcript, rl_tokenizer)
    ids_t, mask_t = pad_batch([ids, ids[:40]], [mask, mask[:40]], rl_tokenizer.pad_id)
    V = rl_tokenizer.vocab_size
    logits = torch.randn(2, ids_t.shape[1], V, requires_grad=True)
    logp = token_logprobs(logits, ids_t)
    loss, _ = grpo_loss(logp, logp.detach(), torch.tensor([1.0, -0.5]), mask_t[:, 1:])
    (g,) = torch.autograd.grad(loss, logits)
    target_sampled = torch.zeros_like(mask_t)
    target_sampled[:, :-1] = mask_t[:, 1:]
    assert torch.all(g[~target_sampled] == 0)
    assert torch.all(g[target_sampled].abs().sum(-1) > 0)
    # the tool output really is in the sequence, and none of its tokens is a target
    obs = rl_tokenizer.encode("408", allow_special=False)
    at = [i for i in range(len(ids) - len(obs)) if ids[i:i + len(obs)] == obs]
    assert at and not any(mask[i] for i in range(at[-1], at[-1] + len(obs)))


def test_wilson_interval_contains_the_rate():
    """Also at 0/n and n/n, where rounding once put the bound a hair past the rate (a negative error bar)."""
    from k3.rl.train import wilson

    for n in (1, 3, 7, 48, 49, 100):
        for k in range(n + 1):
            lo, hi = wilson(k, n)
            assert 0.0 <= lo <= k / n <= hi <= 1.0, (k, n, lo, hi)
    assert wilson(0, 0) is None  # no usable episode: no interval (it was NaN, which strict JSON refuses)
    lo, hi = wilson(0, 48)
    assert lo == 0.0 and hi == pytest.approx(0.0741, abs=1e-4)
