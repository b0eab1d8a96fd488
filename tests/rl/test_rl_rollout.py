"""Rollouts through the engine: well-formed trajectories from real sandboxes, and bad input that is recorded,
counted and excluded — never turned into reward."""
import pytest

from k3.agentenv.dialects import choose_variant, make_dialect
from k3.agentenv.policies import EpisodeInfo
from k3.rl.rollout import Job, classify, run_jobs, success_table, valid_reward
from k3.rl.harness import episode_config
from k3.rl.train import GRPOConfig, GRPOTrainer


def fake_episode(reward_of):
    """An episode without a sandbox: two policy turns on a fixed transcript; reward_of(task, seed, texts)."""
    def run(task, policy, seed, config):
        policy.begin_episode(EpisodeInfo(task.id, task.family, seed, make_dialect(choose_variant(seed))))
        transcript = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": task.instruction}]
        texts = []
        for obs in ("Observation: exit code: 0\n42\n", None):
            text = policy.act([dict(m) for m in transcript])
            texts.append(text)
            transcript.append({"role": "assistant", "content": text})
            if obs:
                transcript.append({"role": "user", "content": obs})
        return {"task_id": task.id, "status": "finished", "dialect": "react", "steps": 2, "parse_errors": 0,
                "reward": reward_of(task, seed, texts), "transcript": transcript}
    return run


def test_real_episodes_are_well_formed(tiny_rl_model, rl_tokenizer, rl_tasks, sandbox_ok):
    """An untrained model in real sandboxes: no crash, reward 0, and the sampled-token mask covers exactly the
    assistant replies (what the policy wrote), never the tool outputs."""
    jobs = [Job(t, seed=s, sample_seed=s, group=s) for s, t in enumerate(rl_tasks["train"][:2])]
    trajs = run_jobs(tiny_rl_model, rl_tokenizer, jobs, episode_config("swap", max_steps=2), temperature=1.0,
                     max_tokens=6)
    assert [t.task_id for t in trajs] == [j.task.id for j in jobs]
    end = rl_tokenizer.special_id("end")
    for t in trajs:
        assert t.excluded is None and t.reward == 0.0 and t.steps == 2 and t.status == "max_steps"
        assert len(t.ids) == len(t.policy_mask) <= tiny_rl_model.config.max_context
        replies = [m["content"] for m in t.record["transcript"] if m["role"] == "assistant"]
        runs, cur = [], []
        for tok, m in zip(t.ids, t.policy_mask):
            if m:
                cur.append(tok)
            elif cur:
                runs.append(cur)
                cur = []
        runs += [cur] if cur else []
        assert len(runs) == len(replies) == 2
        for run, text in zip(runs, replies):  # each sampled run decodes to the reply (its stop token aside)
            body = run[:-1] if run[-1] in (end, rl_tokenizer.eos_id) or run[-1] < 17 and len(run) < 6 else run
            assert rl_tokenizer.decode(body) == text or rl_tokenizer.decode(run).startswith(text)
    table = success_table(trajs)
    assert table["all"]["usable"] == 2 and table["all"]["success"] == 0.0


def test_lockstep_rollouts_are_reproducible(tiny_rl_model, rl_tokenizer, rl_tasks):
    jobs = [Job(t, seed=7, sample_seed=k, group=0) for k, t in enumerate(rl_tasks["train"] * 2)]
    ep = fake_episode(lambda task, seed, texts: 0.0)
    a = run_jobs(tiny_rl_model, rl_tokenizer, jobs, episode_config("swap"), max_tokens=8, episode_fn=ep)
    b = run_jobs(tiny_rl_model, rl_tokenizer, jobs, episode_config("swap"), max_tokens=8, episode_fn=ep)
    assert [t.ids for t in a] == [t.ids for t in b]
    assert len({tuple(t.ids) for t in a}) > 1  # different sampling seeds sample differently


@pytest.mark.parametrize("bad", ["1.0", None, float("nan"), float("inf"), True, [1]])
def test_non_numeric_rewards_are_excluded(bad):
    class P:
        context_exceeded, failure = False, None
    assert not valid_reward(bad)
    assert classify({"status": "finished", "reward": bad}, P())[0] == "reward"
    assert classify({"status": "finished", "reward": 1}, P()) == (None, None)


def test_bad_input_is_recorded_counted_and_excluded(tiny_rl_model, rl_tokenizer, rl_tasks):
    """A GRPO step whose groups hold a non-numeric reward, a crashing episode, a rollout beyond the context and
    a sandbox failure: all recorded in the step's episode log, counted, and left out of the advantages."""
    tasks = rl_tasks["train"]

    def episode(task, policy, seed, config):
        k = policy.seed
        if k % 4 == 1:
            raise RuntimeError("the episode crashed")
        if k % 4 == 2:
            policy.max_context = 10  # the conversation cannot fit: the policy refuses to generate
        rec = fake_episode(lambda *a: float(k % 2))(task, policy, seed, config)
        if k % 4 == 3:
            rec["reward"] = "1.0"
        if k % 8 == 0 and seed % 2:  # a sandbox that could not start: AgentENV labels it excluded
            rec.update(status="sandbox_error", scoring="excluded", exclusion="sandbox_start")
        return rec

    trainer = GRPOTrainer(tiny_rl_model, rl_tokenizer, tasks, GRPOConfig(groups_per_step=3, group_size=4, max_tokens=4),
                          seed=0, episode_fn=episode)
    # sample seeds are hashes; give each job its index so the failure pattern is known
    real_jobs = trainer.jobs

    def indexed(step):
        return [Job(j.task, j.seed, i, j.group) for i, j in enumerate(real_jobs(step))]
    trainer.jobs = indexed
    out = trainer.step_fn(0)
    log = out["episode_log"]
    assert len(log) == 12
    assert out["excluded_crashed"] == sum(e["excluded"] == "crashed" for e in log) >= 3
    assert out["excluded_context"] == 3 and out["excluded_reward"] == 3
    for e in log:
        if e["excluded"] == "reward" or e["excluded"] == "crashed":
            assert e["reward"] in (None, 0.0) and e["error"]
        if e["excluded"] == "context":
            assert e["sampled_tokens"] == 0
    usable = [e for e in log if e["excluded"] is None]
    assert out["usable"] == len(usable) and all(e["reward"] == 0.0 for e in usable)
    # only index 0 (k % 4 == 0, reward 0) survives per group: groups of one are dropped, nothing is trained
    assert out["trained_episodes"] == 0 and out["dropped_groups"] == 3
    assert out["loss"].item() == 0.0


def test_context_overflow_is_not_a_reward(tiny_rl_model, rl_tokenizer, rl_tasks, sandbox_ok):
    trajs = run_jobs(tiny_rl_model, rl_tokenizer, [Job(rl_tasks["train"][0], 0, 0)], episode_config("swap"),
                     max_tokens=tiny_rl_model.config.max_context)  # no prompt leaves room for that reply
    (t,) = trajs
    assert t.excluded == "context" and t.status == "policy_error" and "context" in t.error
    assert t.n_sampled == 0 and t.reward == 0.0  # the episode's own record says 0; the sample is still excluded
    assert success_table(trajs)["all"]["usable"] == 0 and success_table(trajs)["all"]["success"] is None


def test_a_broken_verifier_is_a_crash_and_a_broken_answer_a_reward_of_0(rl_tasks, sandbox_ok, monkeypatch):
    """Fail closed: a verification that fails on the answer's workspace (its code can kill, hang or flood the
    verifier) is a 0 that counts and is trained on. Only when the same checks fail on the task's clean workspace too
    (the control: our verifier is broken) is the episode excluded as crashed."""
    import k3.agentenv.verify as verify
    from k3.agentenv.rollout import run_episode
    from k3.agentenv.sandbox import SandboxError, SandboxTimeout
    from k3.rl.demos import DemoPolicy

    class P:
        context_exceeded, failure = False, None

    task, cfg = rl_tasks["train"][0], episode_config("canonical")
    good = run_episode(task, DemoPolicy(task), 5, cfg)
    assert good["reward"] == 1.0 and good["scoring"] == "counted" and classify(good, P()) == (None, None)
    real = verify.run_probe

    for error in (SandboxError("sandbox exited without answering"), SandboxTimeout("sandbox did not answer within 60.0s")):
        calls = []

        def first_fails(payload, *args, **kwargs):  # the answer's verification fails, the control's runs
            calls.append(payload)
            if len(calls) == 1:
                if kwargs.get("probe") is not None:
                    kwargs["probe"].close()
                raise error
            return real(payload, *args, **kwargs)
        monkeypatch.setattr(verify, "run_probe", first_fails)
        rec = run_episode(task, DemoPolicy(task), 5, cfg)
        assert len(calls) == 2 and rec["status"] == "finished" and rec["reward"] == 0.0
        assert rec["scoring"] == "counted" and rec["verifier"]["control"].startswith("clean")
        assert classify(rec, P()) == (None, None)

        def broken(*args, **kwargs):
            raise error
        monkeypatch.setattr(verify, "run_probe", broken)
        rec = run_episode(task, DemoPolicy(task), 5, cfg)
        assert rec["reward"] == 0.0 and rec["scoring"] == "excluded" and rec["exclusion"] == "verifier_bug"
        assert classify(rec, P()) == ("crashed", f"verifier_bug: verifier: {error}")


def test_classify_reads_agentenv_labels():
    class P:
        context_exceeded, failure = False, None

    counted = {"status": "sandbox_error", "reward": 0.0, "error": "sandbox exited without answering",
               "scoring": "counted", "exclusion": None}
    assert classify(counted, P()) == (None, "sandbox exited without answering")  # the agent broke it: a 0
    excluded = dict(counted, error="could not start bubblewrap", scoring="excluded", exclusion="sandbox_start")
    assert classify(excluded, P()) == ("crashed", "sandbox_start: could not start bubblewrap")
    assert classify({"status": "worker_error", "reward": 0.0, "error": "BrokenProcessPool"}, P())[0] == "crashed"


def test_an_interrupt_stops_the_episode_threads_before_it_propagates(tiny_rl_model, rl_tokenizer, rl_tasks):
    """A Ctrl-C in the thread that runs the rollouts closes the lockstep engine and waits for the episode threads:
    a daemon thread still inside the model when the interpreter exits aborted the process (exit 134)."""
    import signal
    import threading

    started, main = threading.Event(), threading.main_thread().ident

    def ep(task, policy, seed, config):
        if seed == 0:  # a real SIGINT, as a terminal sends it: it wakes the main thread blocked in join()
            started.wait(10)
            signal.pthread_kill(main, signal.SIGINT)
        started.set()
        for _ in range(10_000):  # bounded; the engine's close ends it long before (its generate raises)
            policy.act([{"role": "user", "content": task.instruction}])

    jobs = [Job(t, seed=k, sample_seed=k) for k, t in enumerate(rl_tasks["train"][:3])]
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # also where pytest runs with SIGINT ignored
    try:
        with pytest.raises(KeyboardInterrupt):
            run_jobs(tiny_rl_model, rl_tokenizer, jobs, episode_config("swap"), max_tokens=2, episode_fn=ep)
    finally:
        signal.signal(signal.SIGINT, before)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("k3-rl-episode-")]
