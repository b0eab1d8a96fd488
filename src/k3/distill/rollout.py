"""Batched sampling of completions under a thinking budget, graph-free, with per-token log-probs.

Prompts of equal length are prefilled together; the per-group caches are stacked with
`HybridCache.merge` (KDA states stack, MLA latents get a key mask) and every row then decodes one token
per step; finished rows leave the batch (`HybridCache.select`). Each row's reply first reasons: once it
has spent its budget of reasoning tokens without closing the span, the sampler writes `<|/think|>`
itself (budget forcing); once the answer reaches `max_answer_tokens` it writes `<|end|>`. Forced tokens
are part of the completion (`completion_mask`) but were not drawn from the policy (`sampled_mask`).

Randomness comes only from the `generator` argument, so a rollout is a pure function of the weights,
the prompts and the generator's seed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from k3.distill.effort import END_ID, END_THINK_ID, EOS_ID, split_completion
from k3.distill.sft import PAD_ID
from k3.model.cache import HybridCache
from k3.model.sampling import sample_next

STOP_IDS = (END_ID, EOS_ID)


@dataclass
class Rollout:
    ids: torch.Tensor              # [B, T] prompt + completion, right-padded with <|pad|>
    prompt_lens: list[int]
    completion_mask: torch.Tensor  # [B, T] True at completion tokens (sampled or forced)
    sampled_mask: torch.Tensor     # [B, T] True at completion tokens the policy sampled
    logprobs: torch.Tensor         # [B, T] log-prob of each completion token under the sampling distribution
    reasoning_tokens: list[int]    # tokens in each reasoning span
    closed: list[bool]             # the reasoning span was closed (by the policy or by force)
    forced_close: list[bool]       # the sampler closed it at the budget
    finish: list[str] = field(default_factory=list)  # stop (<|end|>/<|eos|>) | length (forced <|end|>)

    def completion(self, i: int) -> list[int]:
        return self.ids[i][self.completion_mask[i]].tolist()

    def answers(self, tokenizer) -> list[str]:
        """The answer text of each row (empty when the reasoning span never closed)."""
        return [tokenizer.decode(split_completion(self.completion(i))[1]) for i in range(len(self.prompt_lens))]

    @property
    def n_completion_tokens(self) -> int:
        return int(self.completion_mask.sum())


@torch.no_grad()
def sample(model: torch.nn.Module, prompts: Sequence[Sequence[int]], budgets: Sequence[int],
           max_answer_tokens: int = 40, temperature: float = 1.0, generator: torch.Generator | None = None) -> Rollout:
    """Sample one completion per prompt. budgets[i]: most reasoning tokens for row i; temperature 0 is
    greedy (log-probs are then those of the model's distribution at temperature 1)."""
    B = len(prompts)
    if B == 0 or len(budgets) != B:
        raise ValueError(f"sample needs prompts and one budget per prompt (got {B} prompts, {len(budgets)} budgets)")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("sample: every prompt needs at least one token")
    if max_answer_tokens < 1:
        raise ValueError(f"max_answer_tokens = {max_answer_tokens} must be >= 1")
    longest = max(map(len, prompts)) + max(budgets) + max_answer_tokens + 2
    if longest > model.config.max_context:
        raise ValueError(f"prompts plus budget and answer need {longest} tokens, more than max_context = "
                         f"{model.config.max_context}; shorten them or raise max_context")
    was_training = model.training
    model.eval()
    try:
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        order, caches, first = [], [], []
        for _, rows in sorted(by_len.items()):
            cache = model.new_cache()
            first.append(model(torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long), cache)[:, -1])
            caches.append(cache)
            order.extend(rows)
        cache = caches[0] if len(caches) == 1 else HybridCache.merge(caches)
        logits = torch.cat(first)
        out = [[] for _ in range(B)]
        logps = [[] for _ in range(B)]
        forced = [[] for _ in range(B)]
        n_reason, answering, forced_close, finish = [0] * B, [False] * B, [False] * B, [""] * B
        n_answer = [0] * B
        active = list(order)  # the request held by each cache row
        while active:
            nxt = sample_next(logits, temperature, 1.0, generator)[:, 0]
            lp_all = F.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)
            keep_rows, feed = [], []
            for r, i in enumerate(active):
                tok, was_forced = int(nxt[r]), False
                if not answering[i]:
                    if tok not in STOP_IDS and tok != END_THINK_ID and n_reason[i] >= budgets[i]:
                        tok, was_forced, forced_close[i] = END_THINK_ID, True, True
                    if tok == END_THINK_ID:
                        answering[i] = True
                    elif tok not in STOP_IDS:
                        n_reason[i] += 1
                elif tok not in STOP_IDS:
                    if n_answer[i] >= max_answer_tokens:
                        tok, was_forced = END_ID, True
                    else:
                        n_answer[i] += 1
                out[i].append(tok)
                logps[i].append(float(lp_all[r, tok]))
                forced[i].append(was_forced)
                if tok in STOP_IDS:
                    finish[i] = "length" if was_forced else "stop"
                else:
                    keep_rows.append(r)
                    feed.append(tok)
            if not keep_rows:
                break
            if len(keep_rows) < len(active):
                cache = cache.select(keep_rows)
                active = [active[r] for r in keep_rows]
            logits = model(torch.tensor(feed, dtype=torch.long)[:, None], cache)[:, -1]
    finally:
        model.train(was_training)
    T = max(len(p) + len(o) for p, o in zip(prompts, out))
    ids = torch.full((B, T), PAD_ID, dtype=torch.long)
    cmask = torch.zeros(B, T, dtype=torch.bool)
    smask = torch.zeros(B, T, dtype=torch.bool)
    lps = torch.zeros(B, T)
    for i, (p, o) in enumerate(zip(prompts, out)):
        P, n = len(p), len(o)
        ids[i, :P] = torch.tensor(list(p))
        ids[i, P:P + n] = torch.tensor(o)
        cmask[i, P:P + n] = True
        smask[i, P:P + n] = ~torch.tensor(forced[i], dtype=torch.bool)
        lps[i, P:P + n] = torch.tensor(logps[i])
    return Rollout(ids, [len(p) for p in prompts], cmask, smask, lps, n_reason,
                   [a for a in answering], forced_close, finish)


def merge_rollouts(parts: Sequence[tuple[Sequence[int], Rollout]], batch_size: int) -> Rollout:
    """One Rollout of `batch_size` rows from parts that each sampled some rows: [(row indices, rollout)]."""
    rows: dict[int, tuple[Rollout, int]] = {}
    for idx, ro in parts:
        for j, i in enumerate(idx):
            rows[int(i)] = (ro, j)
    assert sorted(rows) == list(range(batch_size)), \
        f"merge_rollouts: the parts cover rows {sorted(rows)}, not 0..{batch_size - 1} once each"
    T = max(ro.ids.shape[1] for _, ro in parts)

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return F.pad(t, (0, T - t.shape[0]), value=value)

    take = [rows[i] for i in range(batch_size)]
    return Rollout(
        ids=torch.stack([pad(ro.ids[j], PAD_ID) for ro, j in take]),
        prompt_lens=[ro.prompt_lens[j] for ro, j in take],
        completion_mask=torch.stack([pad(ro.completion_mask[j], False) for ro, j in take]),
        sampled_mask=torch.stack([pad(ro.sampled_mask[j], False) for ro, j in take]),
        logprobs=torch.stack([pad(ro.logprobs[j], 0.0) for ro, j in take]),
        reasoning_tokens=[ro.reasoning_tokens[j] for ro, j in take],
        closed=[ro.closed[j] for ro, j in take],
        forced_close=[ro.forced_close[j] for ro, j in take],
        finish=[ro.finish[j] for ro, j in take])
