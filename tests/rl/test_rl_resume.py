"""Exact resume of GRPO: N steps == N/2 steps, resume, N/2 steps (losses, rewards and weights bitwise)."""
import pytest
import torch

from k3.distill.loop import LoopConfig
from k3.rl.train import GRPOConfig, run_grpo
from test_rl_rollout import fake_episode


def _reward(task, seed, texts):
    """Something the policy's samples decide, so advantages (and gradients) are not zero."""
    return float(len(texts[0]) % 3 == 0)


def _run(model_factory, tok, tasks, out, steps, resume=False, mu=1):
    model = model_factory()
    ref = model_factory().eval().requires_grad_(False)
    g = GRPOConfig(groups_per_step=2, group_size=3, max_tokens=6, updates_per_batch=mu, beta=0.05)
    lc = LoopConfig(steps=steps, lr=3e-3, warmup_steps=1, ckpt_every=2, keep_last=5, seed=3)
    recs = run_grpo(model, tok, tasks, g, lc, out, init="test", ref_model=ref, resume=resume, overwrite=not resume,
                    episode_fn=fake_episode(_reward))
    return model, [r for r in recs if r["kind"] == "train"]


@pytest.mark.parametrize("mu", [2])
def test_resume_is_exact(tmp_path, tiny_rl_model, rl_tokenizer, rl_tasks, mu):
    state = {k: v.clone() for k, v in tiny_rl_model.state_dict().items()}
    cfg = tiny_rl_model.config

    def factory():
        from k3.model.transformer import K3Model
        m = K3Model(cfg)
        m.load_state_dict(state)
        return m

    tasks = rl_tasks["train"]
    full, full_recs = _run(factory, rl_tokenizer, tasks, tmp_path / "full", 4, mu=mu)
    _, first = _run(factory, rl_tokenizer, tasks, tmp_path / "split", 2, mu=mu)
    # the second half: a fresh process would rebuild everything; here only the loop's length changes
    split, second = _run(factory, rl_tokenizer, tasks, tmp_path / "split", 4, resume=True, mu=mu)
    keys = ("loss", "reward_mean", "grad_norm", "trained_episodes", "kl", "clip_frac")
    assert [[r.get(k) for k in keys] for r in full_recs] == [[r.get(k) for k in keys] for r in first + second]
    assert any(r["trained_episodes"] > 0 for r in full_recs) and any(r["grad_norm"] > 0 for r in full_recs)
    if mu == 2:  # the second update of a batch reuses its rollouts, and the ratio has moved off 1
        assert [r["fresh_rollouts"] for r in full_recs] == [True, False, True, False]
    for (k, a), b in zip(full.state_dict().items(), split.state_dict().values()):
        assert torch.equal(a, b), k


def test_resume_off_a_batch_boundary_is_refused(tmp_path, tiny_rl_model, rl_tokenizer, rl_tasks):
    g = GRPOConfig(groups_per_step=1, group_size=2, max_tokens=4, updates_per_batch=2)
    with pytest.raises(ValueError, match="multiples of --updates-per-batch"):
        run_grpo(tiny_rl_model, rl_tokenizer, rl_tasks["train"], g, LoopConfig(steps=4, ckpt_every=3), tmp_path,
                 init="x", episode_fn=fake_episode(_reward))


def _parity_reward(task, seed, texts):
    return float(sum(map(ord, "".join(texts))) % 2)


@pytest.mark.parametrize("agg,beta", [("token", 0.05), ("sequence", 0.0)])
def test_micro_batches_give_the_whole_batch_gradient(tiny_rl_model, rl_tokenizer, rl_tasks, agg, beta):
    """--micro-batch: one forward/backward per chunk of episodes, weighted by its share, accumulates the
    gradient (and the loss and statistics) of the whole batch in one pass."""
    from k3.model.transformer import K3Model
    from k3.rl.train import GRPOTrainer

    state = {k: v.clone() for k, v in tiny_rl_model.state_dict().items()}

    def fresh():
        m = K3Model(tiny_rl_model.config)
        m.load_state_dict(state)
        return m

    results = []
    for micro in (0, 2):
        model, ref = fresh(), fresh().eval().requires_grad_(False)
        g = GRPOConfig(groups_per_step=2, group_size=3, max_tokens=6, beta=beta, agg=agg, micro_batch=micro)
        trainer = GRPOTrainer(model, rl_tokenizer, rl_tasks["train"], g, seed=3, ref_model=ref,
                              episode_fn=fake_episode(_parity_reward))
        out = trainer.step_fn(0)
        assert out["backward_done"]
        sizes = [c["ids"].shape[0] for c in trainer._batch["chunks"]]
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, sizes))
    (whole, g_whole, s_whole), (micro, g_micro, s_micro) = results
    assert len(s_whole) == 1 and len(s_micro) > 1 and max(s_micro) <= 2 and sum(s_micro) == s_whole[0]
    assert whole["tokens"] == micro["tokens"] > 0
    torch.testing.assert_close(micro["loss"], whole["loss"], rtol=1e-5, atol=1e-6)
    for k in ("clip_frac", "ratio_mean") + (("kl",) if beta else ()):
        assert micro[k] == pytest.approx(whole[k], rel=1e-5, abs=1e-7)
    assert g_whole.keys() == g_micro.keys() and any(g.abs().sum() > 0 for g in g_whole.values())
    for n in g_whole:
        torch.testing.assert_close(g_micro[n], g_whole[n], rtol=1e-4, atol=1e-6, msg=n)


def test_micro_batch_must_be_a_count():
    with pytest.raises(ValueError, match="micro_batch"):
        GRPOConfig(micro_batch=-1).validate()


def test_nucleus_sampling_is_refused_because_it_would_be_off_policy():
    with pytest.raises(ValueError, match="top_p = 0.9.*off-policy"):
        GRPOConfig(top_p=0.9).validate()
    GRPOConfig(top_p=1.0).validate()


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_zero_advantage_episodes_still_count_in_the_normalisation(tiny_rl_model, rl_tokenizer, rl_tasks, agg):
    """Without a KL term, zero-advantage episodes (a tied group) skip the forward, but the loss is still the mean
    over every counted episode: the gradient equals that of a run that forwards them all (a KL weight of 1e-12
    against an identical reference keeps every row in and adds a zero gradient)."""
    from k3.model.transformer import K3Model
    from k3.rl.train import GRPOTrainer

    state = {k: v.clone() for k, v in tiny_rl_model.state_dict().items()}

    def fresh():
        m = K3Model(tiny_rl_model.config)
        m.load_state_dict(state)
        return m

    def reward(task, seed, texts):  # one group tied at 1 whatever it samples, the other decided by its samples
        return 1.0 if seed % 2 else float(len(texts[0]) % 2 == 0)

    grads, rows = [], []
    for beta in (0.0, 1e-12):
        model, ref = fresh(), fresh().eval().requires_grad_(False)
        g = GRPOConfig(groups_per_step=4, group_size=3, max_tokens=6, beta=beta, agg=agg)
        trainer = GRPOTrainer(model, rl_tokenizer, rl_tasks["train"], g, seed=3, ref_model=ref,
                              episode_fn=fake_episode(reward))
        assert trainer.step_fn(0)["backward_done"]
        rows.append(len(trainer._batch["rows"]))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert rows[0] < rows[1]  # some episodes really were left out of the forward
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-7, msg=n)


def test_log_probs_are_those_of_the_sampling_temperature(tiny_rl_model, rl_tokenizer, rl_tasks):
    """Rollouts sampled at temperature T: the ratio's log-probs are of softmax(logits / T), not of T = 1."""
    from k3.rl.grpo import token_logprobs
    from k3.rl.train import GRPOTrainer

    g = GRPOConfig(groups_per_step=2, group_size=3, max_tokens=6, temperature=2.0)
    trainer = GRPOTrainer(tiny_rl_model, rl_tokenizer, rl_tasks["train"], g, seed=3,
                          episode_fn=fake_episode(_parity_reward))
    trainer.step_fn(0)
    tiny_rl_model.zero_grad(set_to_none=True)
    c = trainer._batch["chunks"][0]
    with torch.no_grad():
        want = token_logprobs(tiny_rl_model(c["ids"]) / 2.0, c["ids"])
    torch.testing.assert_close(c["old_logp"], want)


def test_a_step_with_nothing_to_learn_leaves_the_weights_alone(tmp_path, tiny_rl_model, rl_tokenizer, rl_tasks):
    """Step 1 learns (its rewards depend on the samples); from step 2 on every episode scores 0, so every group
    is tied. Those steps make no optimizer step: AdamW's momentum from step 1 must not move the weights."""
    calls = {"n": 0}

    def reward(task, seed, texts):
        calls["n"] += 1
        return float(sum(map(ord, "".join(texts))) % 2) if calls["n"] <= 6 else 0.0  # step 1: the samples decide

    snaps, lrs = {}, {}

    def on_record(r):
        if r.get("kind") == "train":
            snaps[r["step"]] = {k: v.clone() for k, v in tiny_rl_model.state_dict().items()}
            lrs[r["step"]] = r["lr"]
            if r["step"] == 1:
                assert r["trained_episodes"] > 0 and r["grad_norm"] > 0
            else:
                assert r["trained_episodes"] == 0 and r["grad_norm"] == 0.0
            assert "backward_done" not in r and "skip_update" not in r  # the loop's own flags stay out of metrics

    g = GRPOConfig(groups_per_step=2, group_size=3, max_tokens=6)
    lc = LoopConfig(steps=3, lr=1e-2, warmup_steps=2, ckpt_every=0, seed=0)
    initial = {k: v.clone() for k, v in tiny_rl_model.state_dict().items()}
    run_grpo(tiny_rl_model, rl_tokenizer, rl_tasks["train"], g, lc, tmp_path / "run", init="test",
             episode_fn=fake_episode(reward), on_record=on_record)
    assert calls["n"] == 18
    assert any(not torch.equal(initial[k], snaps[1][k]) for k in initial)  # step 1 did learn (momentum exists)
    for k in snaps[1]:
        assert torch.equal(snaps[1][k], snaps[2][k]) and torch.equal(snaps[2][k], snaps[3][k]), k
    assert lrs[1] < lrs[2]  # the schedule still moves on (warmup)


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_the_balance_loss_is_not_scaled_down_by_tied_groups(tiny_rl_model, rl_tokenizer, rl_tasks, agg):
    """The routers' aux loss enters as a mean over the forwarded chunks: its weights sum to 1 even when a tied
    group is left out of the forward (a probe parameter stands in for the aux loss and reads the weight)."""
    from k3.rl.train import GRPOTrainer

    probe = torch.nn.Parameter(torch.zeros(()))
    tiny_rl_model.register_parameter("probe", probe)
    tiny_rl_model.aux_loss = lambda: probe * 1.0

    def reward(task, seed, texts):  # one group tied at 1, the other decided by its samples
        return 1.0 if seed % 2 else float(len(texts[0]) % 2 == 0)

    g = GRPOConfig(groups_per_step=4, group_size=3, max_tokens=6, agg=agg, micro_batch=1)
    trainer = GRPOTrainer(tiny_rl_model, rl_tokenizer, rl_tasks["train"], g, seed=3, episode_fn=fake_episode(reward))
    assert trainer.step_fn(0)["backward_done"]
    b = trainer._batch
    assert len(b["rows"]) < sum(1 for t in b["trajs"] if t.excluded is None)  # some episodes were left out
    assert len(b["chunks"]) > 1
    torch.testing.assert_close(probe.grad, torch.tensor(1.0))
