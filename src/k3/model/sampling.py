"""Sampling: per-request parameters and the one implementation of next-token selection.

Order of the logit transforms (as in HF transformers' logits processors and vLLM's sampler):
repetition penalty (CTRL, Keskar et al., arXiv 1909.05858: a seen token's logit is divided by the penalty
when positive, multiplied when negative), OpenAI's frequency and presence penalties
(logit -= count * frequency_penalty + [count > 0] * presence_penalty, over the generated tokens only, as vLLM
counts them: a chat prompt holds an end-of-turn token per message, and counting those would push the reply's
own end of turn down), then temperature (0 = greedy),
top-k, and top-p (nucleus sampling, Holtzman et al., arXiv 1904.09751: the smallest set of most likely
tokens whose probability reaches top_p).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MAX_STOP_SEQUENCES = 4  # OpenAI's limit


@dataclass
class SamplingParams:
    """What one request asks of the sampler; `validate()` names the bad field and the allowed range."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()  # strings, matched on the decoded text; the match is cut from the output
    stop_token_ids: tuple[int, ...] = ()  # besides <|eos|>; the token ends the output and is not shown
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = False
    extra: dict = field(default_factory=dict)  # caller's bookkeeping, never read by the engine

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        def bad(name: str, value, want: str) -> None:
            raise SamplingError(name, f"{name} = {value!r} is invalid: {want}")

        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            try:
                fv = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
            except OverflowError:  # an integer too large for a float
                fv = math.nan
            if not math.isfinite(fv) or fv < lo or fv > hi or (lo_open and fv == lo):
                bad(name, v, f"must be a number in {'(' if lo_open else '['}{lo}, {hi}]")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        number("temperature", 0.0, 1e4)
        number("top_p", 0.0, 1.0, lo_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "must be an integer >= 0 (0 turns top-k off)")
        number("repetition_penalty", 0.0, 1e4, lo_open=True)
        number("frequency_penalty", -2.0, 2.0)
        number("presence_penalty", -2.0, 2.0)
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if len(self.stop) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", list(self.stop), f"must be up to {MAX_STOP_SEQUENCES} non-empty strings")
        self.stop_token_ids = tuple(self.stop_token_ids)
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bad("stop_token_ids", list(self.stop_token_ids), f"must be token ids in [0, {vocab_size})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", self.seed, "must be an integer or null")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class SamplingError(ValueError):
    """A sampling parameter out of range; `param` names it (the OpenAI error's `param` field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, params: SamplingParams,
                    output_counts: torch.Tensor | None = None) -> torch.Tensor:
    """logits [V], counts [V] (how often each token occurred in prompt + output; the repetition penalty's) and
    output_counts [V] (in the output alone; the frequency and presence penalties', `counts` when not given)
    -> penalised logits [V]."""
    if not params.penalised:
        return logits
    logits = logits.float().clone()
    if params.repetition_penalty != 1.0:
        p = params.repetition_penalty
        logits = torch.where(counts > 0, torch.where(logits > 0, logits / p, logits * p), logits)
    if params.frequency_penalty or params.presence_penalty:
        out = counts if output_counts is None else output_counts
        logits = (logits - out.to(logits.dtype) * params.frequency_penalty
                  - (out > 0).to(logits.dtype) * params.presence_penalty)
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                generator: torch.Generator | None = None, top_k: int = 0) -> torch.Tensor:
    """logits [B, V] -> next ids [B, 1]; temperature 0 is greedy; top_k then top_p restrict the candidates."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    # shifted so the best logit is 0 (and +-inf from extreme penalties clamped first): a tiny temperature then
    # gives 0 and -inf, a near-greedy distribution, never inf / inf = NaN
    logits = logits.float().clamp(-torch.finfo(torch.float32).max, torch.finfo(torch.float32).max)
    logits = logits - logits.max(-1, keepdim=True).values
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # a temperature under float32's smallest normal would become 0 in the division (0 / 0 = NaN at the best
    # logit); at that size any temperature is greedy in effect
    probs = torch.softmax(logits / max(temperature, torch.finfo(torch.float32).tiny), dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the nucleus: mass before a token is still short of top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return torch.multinomial(probs, 1, generator=generator)


def sample_row(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None = None,
               generator: torch.Generator | None = None, output_counts: torch.Tensor | None = None) -> int:
    """One request's next token: logits [V] with its own parameters, token counts [V] (prompt + output, and the
    output's alone) and generator."""
    if counts is not None:
        logits = apply_penalties(logits, counts, params, output_counts)
    return int(sample_next(logits[None], params.temperature, params.top_p, generator, params.top_k))
