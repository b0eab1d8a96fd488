"""Inference effort: the effort token a prompt carries, its thinking budget, and the prompt format.

A prompt is the chat template's generation prompt for one user turn (k3.data.chat.render), which ends
in the effort token, followed by `<|think|>`, so the reply opens the reasoning span:

    <|bos|><|user|>{problem}<|end|><|assistant|><|effort:E|><|think|>   <- prompt
    {reasoning, at most budget(E) tokens}<|/think|>{answer}<|end|>      <- completion

The thinking budget is the most reasoning tokens (between `<|think|>` and `<|/think|>`, exclusive) a
reply may spend before its answer; the sampler closes the span itself when a reply reaches it (the
"budget forcing" of s1, Muennighoff et al., arXiv 2501.19393). Budgets are k3's choice, sized for the
small domains in `domains.py` (whose high-effort traces stay under 32 tokens): low 8, medium 16, high 32.
"""
from __future__ import annotations

import re
from typing import Sequence

from k3.data.tokenizer import SPECIAL_TOKENS

EFFORTS: tuple[str, ...] = ("low", "medium", "high")
THINKING_BUDGETS: dict[str, int] = {"low": 8, "medium": 16, "high": 32}
EFFORT_TOKENS: dict[str, str] = {e: f"<|effort:{e}|>" for e in EFFORTS}
THINK, END_THINK, END, EOS, BOS = "<|think|>", "<|/think|>", "<|end|>", "<|eos|>", "<|bos|>"
_EFFORT_RE = re.compile(r"<\|effort:([^|>]*)\|>")


def _id(token: str) -> int:
    return SPECIAL_TOKENS.index(token)


THINK_ID, END_THINK_ID, END_ID, EOS_ID, BOS_ID = map(_id, (THINK, END_THINK, END, EOS, BOS))
EFFORT_IDS: dict[int, str] = {_id(t): e for e, t in EFFORT_TOKENS.items()}


def check_effort(effort: str) -> str:
    if effort not in EFFORTS:
        raise ValueError(f"unknown effort {effort!r}; use one of {', '.join(EFFORTS)} "
                         f"(prompt tokens {', '.join(EFFORT_TOKENS.values())})")
    return effort


def thinking_budget(effort: str, budgets: dict[str, int] | None = None) -> int:
    """Most reasoning tokens allowed at `effort`."""
    return (budgets or THINKING_BUDGETS)[check_effort(effort)]


def check_budgets(budgets: dict[str, int]) -> dict[str, int]:
    """Budgets for every effort, positive and strictly increasing low < medium < high."""
    missing = [e for e in EFFORTS if e not in budgets]
    if missing or set(budgets) - set(EFFORTS):
        raise ValueError(f"thinking budgets {budgets} must name exactly {', '.join(EFFORTS)}")
    vals = [budgets[e] for e in EFFORTS]
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in vals) or vals != sorted(set(vals)):
        raise ValueError(f"thinking budgets {budgets} must be positive integers with low < medium < high")
    return {e: budgets[e] for e in EFFORTS}


def effort_of_text(text: str) -> str:
    """The effort named by the one effort token in `text` (e.g. a prompt typed with "<|effort:high|>")."""
    found = _EFFORT_RE.findall(text)
    if not found:
        raise ValueError(f"prompt {text[:60]!r} has no effort token; start it with one of "
                         f"{', '.join(EFFORT_TOKENS.values())}")
    for name in found:
        check_effort(name)
    if len(set(found)) > 1:
        raise ValueError(f"prompt {text[:60]!r} has conflicting effort tokens {sorted(set(found))}; give one")
    return found[0]


def strip_effort(text: str) -> str:
    return _EFFORT_RE.sub("", text).strip()


def effort_of_ids(ids: Sequence[int]) -> str:
    """The effort of a tokenized prompt: exactly one effort token must appear (an effort token the model
    does not know cannot be a token id, so it is caught in `effort_of_text`)."""
    found = {EFFORT_IDS[int(i)] for i in ids if int(i) in EFFORT_IDS}
    if not found:
        raise ValueError("prompt has no effort token; build prompts with k3.distill.effort.build_prompt(text, "
                         f"effort) or add one of {', '.join(EFFORT_TOKENS.values())}")
    if len(found) > 1:
        raise ValueError(f"prompt has conflicting effort tokens {sorted(found)}; give one")
    return found.pop()


def build_prompt(text: str, effort: str, tokenizer) -> list[int]:
    """Token ids of the prompt for problem `text` at `effort` (see the module docstring)."""
    from k3.data.chat import render

    check_effort(effort)
    if _EFFORT_RE.search(text):
        raise ValueError(f"problem text {text[:60]!r} already holds an effort token; pass the effort separately "
                         "(or use prompt_from_text)")
    return [BOS_ID] + render([{"role": "user", "content": text}], tokenizer, reasoning_effort=effort) + [THINK_ID]


def prompt_from_text(text: str, tokenizer) -> tuple[list[int], str]:
    """(prompt ids, effort) for a prompt typed with its effort token, e.g. "<|effort:low|> sum 3+4"."""
    effort = effort_of_text(text)
    return build_prompt(strip_effort(text), effort, tokenizer), effort


def completion_ids(reasoning: str, answer: str, tokenizer) -> list[int]:
    """Ids of a whole completion: reasoning, `<|/think|>`, answer, `<|end|>` (text encoded as plain text)."""
    enc = lambda s: tokenizer.encode(s, allow_special=False) if s else []  # noqa: E731
    return enc(reasoning) + [END_THINK_ID] + enc(answer) + [END_ID]


def split_completion(ids: Sequence[int]) -> tuple[list[int], list[int], bool]:
    """(reasoning ids, answer ids, closed) of a sampled completion; the answer stops at `<|end|>`/`<|eos|>`.
    `closed` is False when the reasoning span never closed (the reply has no answer)."""
    ids = [int(i) for i in ids]
    if END_THINK_ID not in ids:
        return [i for i in ids if i not in (END_ID, EOS_ID)], [], False
    k = ids.index(END_THINK_ID)
    answer = []
    for i in ids[k + 1:]:
        if i in (END_ID, EOS_ID):
            break
        answer.append(i)
    return ids[:k], answer, True
