"""Supervised fine-tuning on (prompt, completion) token sequences, the loss masked to the completion.

Generic over where examples come from: `examples(step) -> list[(prompt_ids, completion_ids)]` must be a
pure function of the step (so resume is exact), e.g. worked examples from `domains.sft_example` or
samples drawn from a teacher. Sequences are right-padded: the model is causal (KDA's recurrence and MLA's
causal mask), so padding after a sequence never changes the logits of the tokens before it.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from k3.data.tokenizer import SPECIAL_TOKENS
from k3.distill.loop import LoopConfig, StepLoop
from k3.model.moe import balancing_token_mask

log = logging.getLogger(__name__)

PAD_ID = SPECIAL_TOKENS.index("<|pad|>")
Example = tuple[Sequence[int], Sequence[int]]


def collate(examples: Sequence[Example], pad_id: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ids [B, T] prompt + completion right-padded, loss_mask [B, T] True at completion tokens)."""
    if not examples:
        raise ValueError("collate needs at least one example")
    seqs, masks = [], []
    for i, (prompt, completion) in enumerate(examples):
        if not len(completion):
            raise ValueError(f"example {i} has an empty completion; there is nothing to train on")
        seqs.append(list(prompt) + list(completion))
        masks.append([False] * len(prompt) + [True] * len(completion))
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(m)] = torch.tensor(m)
    return ids, mask


def masked_ce(logits: torch.Tensor, ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy over the masked tokens. logits [B, T, V] from ids [B, T]; position t
    predicts ids[:, t + 1], so the target mask is loss_mask[:, 1:]. -> (loss, number of tokens)."""
    target = loss_mask[:, 1:]
    n = int(target.sum())
    if n == 0:
        raise ValueError("no completion tokens to train on")
    lp = F.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(lp * target).sum() / n, n


def sft_step_fn(model: torch.nn.Module, examples: Callable[[int], Sequence[Example]]) -> Callable[[int], dict]:
    def step_fn(step: int) -> dict:
        ids, mask = collate(examples(step))
        model.train()
        with balancing_token_mask(model, ids != PAD_ID):  # padding does not steer the routers' balance
            logits = model(ids)
        loss, n = masked_ce(logits, ids, mask)
        aux = model.aux_loss() if hasattr(model, "aux_loss") else 0.0
        return {"loss": loss + aux, "ce": float(loss.detach()), "tokens": n}
    return step_fn


def run_sft(model: torch.nn.Module, examples: Callable[[int], Sequence[Example]], config: LoopConfig,
            out_dir: str | os.PathLike | None, *, resume: bool = False, overwrite: bool = False,
            manifest_extra: dict | None = None, resume_fields: dict | None = None,
            on_record: Callable[[dict], None] | None = None, graceful_interrupt: bool = False) -> list[dict]:
    """SFT `model` in place; checkpoints and metrics under `out_dir` (see StepLoop; `graceful_interrupt`: see
    `StepLoop.fit`)."""
    loop = StepLoop(model, config, out_dir, {"kind": "sft", **(manifest_extra or {})}, resume_fields)
    return loop.fit(sft_step_fn(model, examples), resume=resume, overwrite=overwrite, on_record=on_record,
                    graceful_interrupt=graceful_interrupt)
