"""Synthetic demonstrations for the supervised warm start, and the token view of an episode.

A demonstration is a real AgentENV episode: `DemoPolicy` plays the task's reference solution one call per
turn, written in the episode's dialect (harness and tool names drawn from the episode seed: every dialect
with the `canonical` demo harness, renamed variants too with `swap`); the sandbox answers, and the verifier scores
it. Only episodes the verifier scored 1 are kept, so no demonstration teaches a wrong answer, and the
tool outputs the model learns to read are the sandbox's own.

`episode_tokens` turns a transcript into the chat template's token ids and marks the tokens the policy
wrote (assistant text and its `<|end|>`); everything else (system prompt, instruction, tool outputs)
is context without loss.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
from typing import Sequence

import torch

from k3.agentenv.actions import action_from_json
from k3.agentenv.policies import EpisodeInfo, Policy, PolicyError
from k3.agentenv.rollout import EpisodeConfig, run_episode
from k3.data.chat import render

log = logging.getLogger(__name__)


class DemoPolicy(Policy):
    """The task's reference solution, one call per turn, and nothing but the call."""

    name = "demo"

    def __init__(self, task):
        if not task.solution:
            raise ValueError(f"task {task.id} has no reference solution to demonstrate")
        self.actions = [action_from_json(a) for a in task.solution]
        self._dialect, self._i = None, 0

    def begin_episode(self, info: EpisodeInfo) -> None:
        self._dialect, self._i = info.dialect, 0

    def act(self, transcript):
        if self._dialect is None:
            raise PolicyError("DemoPolicy.act called before begin_episode")
        a = self.actions[min(self._i, len(self.actions) - 1)]
        self._i += 1
        return self._dialect.render_call(a)


def collect_demos(tasks: Sequence, seeds: Sequence[int], config: EpisodeConfig, workers: int = 4) -> list[dict]:
    """One demonstration episode per (task, seed) pair, zipped; returns the records that scored 1.
    Episodes wait on their sandboxes, so threads overlap them."""
    assert len(tasks) == len(seeds), f"collect_demos needs one seed per task ({len(tasks)} tasks, {len(seeds)} seeds)"

    def one(i: int) -> dict:
        return run_episode(tasks[i], DemoPolicy(tasks[i]), seeds[i], config)

    with cf.ThreadPoolExecutor(max(1, workers)) as pool:
        records = list(pool.map(one, range(len(tasks))))
    kept = [r for r in records if r["status"] == "finished" and r["reward"] == 1.0]
    if len(kept) < len(records):
        log.warning("%d of %d demonstration episodes did not verify and were dropped",
                    len(records) - len(kept), len(records))
    return kept


def episode_tokens(transcript: Sequence[dict], tokenizer) -> tuple[list[int], list[bool]]:
    """(ids, policy_mask) of a whole transcript: each message rendered by the chat template on its own
    (their concatenation is the template's rendering of the conversation); policy_mask is True at the
    assistant's text and its closing `<|end|>`, the tokens a policy samples."""
    ids: list[int] = []
    mask: list[bool] = []
    for m in transcript:
        part = render([m], tokenizer, add_generation_prompt=False)
        ids += part
        if m["role"] == "assistant":
            mask += [False] + [True] * (len(part) - 1)  # the role token belongs to the generation prompt
        else:
            mask += [False] * len(part)
    return ids, mask


def pad_batch(seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[bool]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad -> (ids [B, T], mask [B, T]); the model is causal, so padding after a sequence changes
    nothing before it."""
    assert seqs, "pad_batch needs at least one sequence"
    assert len(seqs) == len(masks), f"pad_batch got {len(seqs)} sequences but {len(masks)} masks"
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        assert len(s) == len(m), f"sequence {i}: {len(s)} ids but {len(m)} mask entries"
        ids[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, :len(m)] = torch.tensor(list(m), dtype=torch.bool)
    return ids, mask
