"""Multi-turn rollouts: the k3 policy acts in AgentENV sandboxes through one shared generation engine.

Every episode runs `k3.agentenv.rollout.run_episode` in its own thread, with its own sandbox and a
`K3EnginePolicy` whose replies come from a `LockstepEngine`: a round of generation starts once every
episode still running waits for a reply, and submits their prompts to one `Engine` in episode order.
So the episodes of a step are decoded as one continuous batch while their sandboxes work in parallel,
and which requests share a batch depends only on the episodes, never on thread timing: a rollout is a
pure function of the weights, the tasks and the seeds (exact resume relies on it).

Each episode becomes a `Trajectory`: the exact token ids the policy saw and sampled, the mask of
sampled tokens (tool outputs, instructions and system prompts are context, never trained on), the
verified reward, and, when the sample cannot be used, why. `classify` is the one place that decides:

- `context`: the conversation outgrew the model's context (the policy refused to generate);
- `crashed`: the episode raised, the engine failed, or AgentENV labelled the record `excluded`: a failure
  the agent cannot cause (a sandbox that did not start, a host out of resources, a verifier bug that a
  clean-workspace control reproduced);
- `reward`: the reward is not a finite number (a bool, a string, NaN, None ...).

Such trajectories are recorded and counted but excluded from the loss; none is ever turned into a
reward of 0. A policy that merely answers badly (no tool call, an empty reply, out of steps) is a
valid sample with the reward its verified outcome earned, and so is one whose code broke the sandbox or the
verifier (killed it, hung it, overflowed it, forged its report: AgentENV labels those `counted`, reward 0),
or the policy would learn that crashing verification beats failing it.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from k3.agentenv.policies import K3EnginePolicy
from k3.agentenv.rollout import EpisodeConfig, run_episode
from k3.serve.engine import Engine

log = logging.getLogger(__name__)

EXCLUDE_REASONS = ("context", "crashed", "reward")


class LockstepEngine:
    """One Engine shared by `n` episode threads; a generation round runs when every live episode waits.

    `client(i)` is episode i's `generate(prompt_ids, params) -> (output_ids, text, finish_reason)`;
    `leave(i)` must be called when episode i ends (finished, failed or crashed)."""

    def __init__(self, engine: Engine, n: int):
        self.engine = engine
        self.live = set(range(n))
        self.pending: dict[int, tuple] = {}
        self.results: dict[int, tuple] = {}
        self.rounds = 0
        self.closed = False
        self._cond = threading.Condition()

    def client(self, i: int) -> Callable:
        return lambda prompt_ids, params: self._generate(i, prompt_ids, params)

    def _generate(self, i: int, prompt_ids, params):
        with self._cond:
            if i not in self.live:
                raise RuntimeError(f"episode {i} already left the lockstep engine")
            if self.closed:
                raise RuntimeError("the lockstep engine was closed (the run was interrupted)")
            self.pending[i] = (list(prompt_ids), params)
            self._maybe_run()
            while i not in self.results:
                self._cond.wait()
            out = self.results.pop(i)
        if isinstance(out, BaseException):
            raise out
        return out

    def leave(self, i: int) -> None:
        with self._cond:
            self.live.discard(i)
            self.pending.pop(i, None)
            self._maybe_run()

    def close(self) -> None:
        """No more rounds: every waiting and later `generate` raises, so the episode threads end. A round in
        progress finishes first (it holds the lock)."""
        with self._cond:
            self.closed = True
            for k in list(self.pending):
                self.results[k] = RuntimeError("the lockstep engine was closed (the run was interrupted)")
            self.pending.clear()
            self._cond.notify_all()

    def _maybe_run(self) -> None:
        """With the lock held: run a round if everyone alive is waiting."""
        if self.closed or not self.pending or len(self.pending) < len(self.live):
            return
        keys = sorted(self.pending)
        jobs = [self.pending.pop(k) for k in keys]
        self.rounds += 1
        try:
            reqs = self.engine.generate([j[0] for j in jobs], [j[1] for j in jobs])
            for k, r in zip(keys, reqs):
                self.results[k] = ((r.output_ids, r.text, r.finish_reason) if r.finish_reason != "error"
                                   else RuntimeError(r.error or "the engine failed this request"))
        except Exception as e:  # every waiting episode gets the error; the policies record it as a crash
            for k in keys:
                self.results[k] = e
        self._cond.notify_all()


@dataclass
class Job:
    """One episode: `seed` picks the harness variant (shared by a group); `sample_seed` the policy's sampling."""

    task: object
    seed: int
    sample_seed: int
    group: int = 0


@dataclass
class Trajectory:
    task_id: str
    kind: str
    group: int
    seed: int
    sample_seed: int
    dialect: str | None
    status: str
    reward: float | None            # the verified reward; None when the record had no usable number
    ids: list[int] = field(default_factory=list, repr=False)
    policy_mask: list[bool] = field(default_factory=list, repr=False)
    excluded: str | None = None     # one of EXCLUDE_REASONS, or None for a usable sample
    error: str | None = None
    steps: int = 0
    parse_errors: int = 0
    record: dict | None = field(default=None, repr=False)

    @property
    def n_sampled(self) -> int:
        return sum(self.policy_mask)

    def summary(self) -> dict:
        """JSON-ready, without the token ids or the transcript."""
        return {"task_id": self.task_id, "kind": self.kind, "group": self.group, "seed": self.seed,
                "sample_seed": self.sample_seed, "dialect": self.dialect, "status": self.status,
                "reward": self.reward, "excluded": self.excluded, "error": self.error, "steps": self.steps,
                "parse_errors": self.parse_errors, "tokens": len(self.ids), "sampled_tokens": self.n_sampled}


def task_kind(task) -> str:
    parts = task.id.split("-")
    return parts[1] if len(parts) > 2 and parts[0] == "rl" else task.family


def valid_reward(r) -> bool:
    return isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)


def classify(record: dict | None, policy: K3EnginePolicy, error: str | None = None) -> tuple[str | None, str | None]:
    """(excluded reason or None, error text) of an episode; see the module docstring."""
    if policy.context_exceeded:
        return "context", (record or {}).get("error") or error or policy.failure
    if record is None:
        return "crashed", error or "the episode raised"
    if policy.failure is not None:
        return "crashed", record.get("error") or policy.failure
    if record.get("scoring") == "excluded":  # AgentENV's label: a failure the agent cannot have caused
        verifier = record.get("verifier") or {}
        why = f"verifier: {verifier['error']}" if verifier.get("error") else record.get("error")
        return "crashed", f"{record.get('exclusion')}: {why or 'episode status ' + str(record.get('status'))}"
    if record.get("scoring") is None and record.get("status") == "worker_error":  # a record without the label
        return "crashed", record.get("error") or "episode status worker_error"
    if not valid_reward(record.get("reward")):
        return "reward", f"reward {record.get('reward')!r} is not a finite number"
    return None, record.get("error")


def run_jobs(model, tokenizer, jobs: Sequence[Job], config: EpisodeConfig, *, temperature: float = 1.0,
             top_p: float = 1.0, max_tokens: int = 64, prefill_chunk: int = 512,
             episode_fn: Callable = run_episode) -> list[Trajectory]:
    """Run `jobs` as concurrent episodes over one lockstep engine; trajectories in job order.
    `episode_fn(task, policy, seed, config) -> record` is AgentENV's `run_episode` (tests swap in
    broken ones)."""
    if not jobs:
        return []
    n = len(jobs)
    engine = Engine(model, tokenizer, max_batch=n, max_queue=n, prefill_chunk=prefill_chunk)
    lock = LockstepEngine(engine, n)
    out: list[Trajectory | None] = [None] * n
    policies = [K3EnginePolicy(model, tokenizer, generate=lock.client(i), temperature=temperature, top_p=top_p,
                               max_tokens=max_tokens, seed=job.sample_seed) for i, job in enumerate(jobs)]

    def one(i: int) -> None:
        job, policy = jobs[i], policies[i]
        record, err = None, None
        try:
            record = episode_fn(job.task, policy, job.seed, config)
        except Exception as e:  # noqa: BLE001 - a crashed episode is data, not a crashed step
            err = f"{type(e).__name__}: {e}"
            log.warning("episode %s (seed %d) crashed: %s", job.task.id, job.seed, err)
        finally:
            lock.leave(i)
        excluded, error = classify(record, policy, err)
        reward = record.get("reward") if record is not None else None
        out[i] = Trajectory(task_id=job.task.id, kind=task_kind(job.task), group=job.group, seed=job.seed,
                            sample_seed=job.sample_seed,
                            dialect=record.get("dialect") if record else None,
                            status=record.get("status", "crashed") if record else "crashed",
                            reward=float(reward) if valid_reward(reward) else None,
                            ids=list(policy.ids), policy_mask=list(policy.policy_mask), excluded=excluded,
                            error=error, steps=record.get("steps", 0) if record else 0,
                            parse_errors=record.get("parse_errors", 0) if record else 0, record=record)

    was_training = model.training
    t0 = time.perf_counter()
    entered = [threading.Event() for _ in range(n)]
    finished = [threading.Event() for _ in range(n)]

    def entry(i: int) -> None:
        entered[i].set()
        try:
            one(i)
        finally:
            finished[i].set()

    threads = [threading.Thread(target=entry, args=(i,), name=f"k3-rl-episode-{i}", daemon=True) for i in range(n)]
    starting = 0  # threads whose start() was called
    try:
        for t in threads:
            starting += 1
            t.start()
        # our events, not join(): a Ctrl-C inside join() of a live thread marks it stopped on CPython < 3.13
        # (bpo-45274's fix: later joins return at once while it still runs). Timed waits: a Ctrl-C is acted on
        # within 0.25 s (one run that waited untimed saw it only when the episodes had ended)
        for i in range(n):
            while not finished[i].wait(0.25):
                pass
        for t in threads:  # each is past its episode (out of the model): this only waits for it to exit
            t.join()
    except BaseException:
        # a Ctrl-C (or any error) in this thread: stop the episodes before leaving. A daemon thread still inside
        # the model's forward when the interpreter exits aborts the process ("terminate called without an
        # active exception", exit 134 instead of the interruption's 130).
        lock.close()
        deadline = time.monotonic() + 60
        for i, t in enumerate(threads[:starting]):
            # a Ctrl-C inside Thread.start() can leave a thread that runs but does not look started yet
            if entered[i].wait(min(2.0, max(0.0, deadline - time.monotonic()))):
                finished[i].wait(max(0.0, deadline - time.monotonic()))
                t.join(max(0.0, deadline - time.monotonic()))
        raise
    finally:
        model.train(was_training)
    log.debug("%d episodes in %.2fs, %d generation rounds", n, time.perf_counter() - t0, lock.rounds)
    return [t for t in out if t is not None]


def success_table(trajs: Sequence[Trajectory]) -> dict:
    """Success rate (mean verified reward over usable episodes) overall, per kind and per dialect, and
    the excluded counts."""
    groups: dict[str, list[Trajectory]] = {"all": list(trajs)}
    for t in trajs:
        groups.setdefault(f"kind:{t.kind}", []).append(t)
        groups.setdefault(f"dialect:{t.dialect}", []).append(t)
    table = {}
    for key, ts in groups.items():
        ok = [t for t in ts if t.excluded is None]
        table[key] = {"episodes": len(ts), "usable": len(ok),
                      "success": (sum(t.reward for t in ok) / len(ok)) if ok else None,
                      "excluded": {r: sum(t.excluded == r for t in ts) for r in EXCLUDE_REASONS},
                      "exclusion_rate": (len(ts) - len(ok)) / len(ts) if ts else 0.0}
    return table
