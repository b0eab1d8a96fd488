"""Three domains with automatic checks, each with reasoning traces at three levels of detail.

  arith   sums of 2-5 digits ("sum 3+5+2+7"); answer the integer; exact match
  pyfunc  a small Python function from a one-line spec; scored by hidden cases in AgentENV's sandbox
  text    reverse an identifier from a shipped list (text_words.txt); exact match

A trace is a list of steps; `trace_text` keeps the longest prefix that fits the effort's thinking budget, so
training data never asks for more reasoning than the sampler allows. Problems are pure functions of a string
seed (the same on every machine); evaluation problems come from their own seed stream. The traces of each
effort, and why `text` evaluates on trained words unless `Text(held_out=True)`: docs/mopd.md ("Three domains").
"""
from __future__ import annotations

import functools
import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from k3.distill.effort import EFFORTS, THINKING_BUDGETS, build_prompt, check_effort, completion_ids

log = logging.getLogger(__name__)

HELD_OUT_FRACTION = 0.2


@dataclass(frozen=True)
class Problem:
    domain: str
    text: str       # what the user asks (without the effort token)
    answer: str     # the reference answer
    data: dict = field(default_factory=dict, compare=False)  # what the checker needs


class Domain:
    name = ""

    def sample(self, rng: random.Random, split: str = "train") -> Problem:
        raise NotImplementedError

    def trace(self, problem: Problem, effort: str) -> list[str]:
        """Reasoning steps at the detail of `effort` (before the budget cut)."""
        raise NotImplementedError

    def check(self, problems: Sequence[Problem], answers: Sequence[str]) -> list[float]:
        """1.0 per correct answer, else 0.0."""
        raise NotImplementedError


# ---------------------------------------------------------------------- arith
class Arith(Domain):
    name = "arith"

    def __init__(self, min_terms: int = 2, max_terms: int = 5):
        self.min_terms, self.max_terms = min_terms, max_terms

    def sample(self, rng, split="train"):
        xs = [rng.randint(1, 9) for _ in range(rng.randint(self.min_terms, self.max_terms))]
        return Problem(self.name, "sum " + "+".join(map(str, xs)), str(sum(xs)), {"terms": xs})

    def trace(self, problem, effort):
        xs = problem.data["terms"]
        sums = [sum(xs[:i + 1]) for i in range(1, len(xs))]
        if effort == "high":  # rewrite the sum with its first two terms added, until one number is left
            return ["+".join(map(str, [s] + xs[i + 2:])) for i, s in enumerate(sums)]
        if effort == "medium":
            return [str(s) for s in sums]
        return [str(s) for s in sums[1::2]] if len(sums) > 1 else [str(sums[0])]

    def check(self, problems, answers):
        return [float(a.strip() == p.answer) for p, a in zip(problems, answers)]


# ---------------------------------------------------------------------- pyfunc
_FILTERS = (("every", None), ("even", "x % 2 == 0"), ("odd", "x % 2 == 1"))
_REDUCERS = ("sum", "max", "list", "count")


def _pyfunc_ref(red: str, mapping: tuple[str, int], filt: tuple[str, int], xs: list[int]):
    """The reference function, in plain Python (the expectations never come from model text)."""
    fk, fv = filt
    keep = [x for x in xs if (fk == "every" or (fk == "even" and x % 2 == 0) or (fk == "odd" and x % 2 == 1)
                              or (fk == "over" and x > fv))]
    mk, mv = mapping
    ys = [x * x if mk == "square" else x * mv if mk == "times" else x + mv if mk == "plus" else x for x in keep]
    if red == "sum":
        return sum(ys)
    if red == "max":
        return max(ys, default=0)
    if red == "count":
        return len(keep)
    return ys


@functools.lru_cache(maxsize=1)
def pyfunc_specs() -> tuple[tuple[str, tuple[str, int], tuple[str, int]], ...]:
    """Every (reducer, mapping, filter) the domain can ask for: 279, all different functions."""
    maps = [("same", 0), ("square", 0)] + [("times", k) for k in range(2, 5)] + [("plus", k) for k in range(1, 6)]
    filts = [("every", 0), ("even", 0), ("odd", 0)] + [("over", t) for t in range(6)]
    return tuple((r, m, f) for r in _REDUCERS for m in (maps if r != "count" else [("same", 0)]) for f in filts)


class PyFunc(Domain):
    name = "pyfunc"
    n_cases = 4       # random cases first, then more until no other spec passes them all
    max_cases = 12

    def __init__(self, sandbox_config=None):
        self.sandbox_config = sandbox_config

    def sample(self, rng, split="train"):
        red = rng.choice(_REDUCERS)
        mk = "same" if red == "count" else rng.choice(("same", "square", "times", "plus"))
        mapping = (mk, rng.randint(2, 4) if mk == "times" else rng.randint(1, 5) if mk == "plus" else 0)
        fk = rng.choice(("every", "even", "odd", "over"))
        filt = (fk, rng.randint(0, 5) if fk == "over" else 0)
        m_word = {"same": "x", "square": "square", "times": f"times {mapping[1]}", "plus": f"plus {mapping[1]}"}[mk]
        f_word = f"x over {filt[1]}" if fk == "over" else f"{fk} x"
        m_code = {"same": "x", "square": "x * x", "times": f"x * {mapping[1]}", "plus": f"x + {mapping[1]}"}[mk]
        f_code = {"every": "", "even": " if x % 2 == 0", "odd": " if x % 2 == 1", "over": f" if x > {filt[1]}"}[fk]
        body = {"sum": f"sum({m_code} for x in xs{f_code})",
                "max": f"max(({m_code} for x in xs{f_code}), default=0)",
                "list": f"[{m_code} for x in xs{f_code}]",
                "count": f"len([x for x in xs{f_code}])"}[red]
        code = f"def f(xs):\n    return {body}"
        cases = [[rng.randint(-5, 9) for _ in range(rng.randint(0, 6))] for _ in range(self.n_cases)]
        # the hidden cases must tell this spec from every other one the domain asks for: otherwise a wrong
        # function that agrees on a few short lists passes (4 random cases let 55 of 200 problems accept
        # another spec's function)
        spec = (red, mapping, filt)
        rivals = [s for s in pyfunc_specs() if s != spec]
        same = [s for s in rivals if all(_pyfunc_ref(*s, xs) == _pyfunc_ref(*spec, xs) for xs in cases)]
        for _ in range(1000):  # bounded; in practice a few draws
            if not same or len(cases) >= self.max_cases:
                break
            xs = [rng.randint(-5, 9) for _ in range(rng.randint(3, 8))]
            want = _pyfunc_ref(*spec, xs)
            if any(_pyfunc_ref(*s, xs) != want for s in same):
                cases.append(xs)
                same = [s for s in same if _pyfunc_ref(*s, xs) == want]
        expect = [_pyfunc_ref(red, mapping, filt, xs) for xs in cases]
        return Problem(self.name, f"f(xs): {red} of {m_word} for {f_word}", code,
                       {"cases": cases, "expect": expect, "steps": [(f_word, f_code.strip() or "all"),
                                                                     (m_word, m_code), (red, red)]})

    def trace(self, problem, effort):
        steps = problem.data["steps"]
        if effort == "high":
            return [f"{w}: {c};" for w, c in steps]
        if effort == "medium":
            return [f"{c};" for _, c in steps]
        return [steps[-1][1]]

    def check(self, problems, answers):
        """Run every answer's hidden cases in one fresh sandbox; an answer scores 1 if all its cases match.

        Each answer is alone: its file sits in a directory of its own, which the probe makes the whole
        workspace of that answer's cases, run in a process of their own. So an answer can neither import nor
        sabotage another (nor report for it), and one that kills its process or loops fails only itself.
        A sandbox takes as many answers as its time limit covers if every one of them ran out its own."""
        from k3.agentenv.sandbox import default_config

        lim = (self.sandbox_config or default_config()).limits
        # worst case per answer: its group's limit, a second to start, and the sandbox's own overhead (3 s in all;
        # the measurement behind it: docs/mopd.md, "Three domains")
        per = max(1, int(lim.verify_timeout_s // (lim.check_timeout_s + 3.0)))
        scores = []
        for k in range(0, len(problems), per):
            scores += self._run(problems[k:k + per], answers[k:k + per])
        return scores

    def _run(self, problems, answers) -> list[float]:
        from k3.agentenv.tasks import Task
        from k3.agentenv.verify import snapshot_from_files, verify

        files, checks = {}, []
        for i, (p, a) in enumerate(zip(problems, answers)):
            files[f"a{i:04d}/cand.py"] = (a.encode("utf-8", "replace") + b"\n", 0o644)
            for j, (xs, want) in enumerate(zip(p.data["cases"], p.data["expect"])):
                checks.append({"id": f"c{i}_{j}", "kind": "python", "label": "F2P", "timeout": 2,
                               "workspace": f"a{i:04d}", "code": f"from cand import f\nresult = f({xs!r})",
                               "expect": {"value": want}})
        task = Task(id="distill-pyfunc", family="pyfix", title="pyfunc answers", instruction="", root=Path("."),
                    manifest={}, checks=tuple(checks), solution=())
        res = verify(task, snapshot_from_files(files), self.sandbox_config)
        if res.error and res.scoring == "excluded":  # the sandbox itself is broken: nothing was measured
            raise ValueError(f"pyfunc checker: the verification sandbox failed ({res.error}); run "
                             "`k3 agentenv check`")
        if res.error and len(problems) > 1:  # an answer broke the shared sandbox (killed or hung it): each alone
            return [s for p, a in zip(problems, answers) for s in self._run([p], [a])]
        if res.error:  # this answer broke its own verification: a 0 that counts, as AgentENV labels it
            return [0.0]
        by_id = {c["id"]: c for c in res.checks}
        return [float(all(by_id[f"c{i}_{j}"]["ok"] for j in range(len(p.data["cases"]))))
                for i, p in enumerate(problems)]


# ---------------------------------------------------------------------- text
WORDS_FILE = Path(__file__).with_name("text_words.txt")


@functools.lru_cache(maxsize=1)
def corpus_words() -> tuple[str, ...]:
    """The text domain's identifiers: a list shipped with k3 (text_words.txt), the same on every machine.
    It was made by `stdlib_words()` from the standard library of Python 3.11.7; deriving it from whichever
    Python is installed changed most text problems between machines."""
    words = tuple(w for w in WORDS_FILE.read_text(encoding="utf-8").split() if w)
    if len(words) < 50:
        raise ValueError(f"{WORDS_FILE} holds only {len(words)} identifiers; reinstall k3")
    return words


def stdlib_words(max_bytes: int = 6_000_000) -> tuple[str, ...]:
    """Function names (4-8 characters of a-z and _) defined in the first `max_bytes` of the installed
    standard library: how text_words.txt was made."""
    from k3.data.corpus import iter_documents

    words = set()
    for _, text in iter_documents("stdlib", "all", max_bytes=max_bytes):
        words.update(re.findall(r"^\s*def ([a-z][a-z_]{3,7})\(", text, re.M))
    return tuple(sorted(w for w in words if not w.endswith("_") and "__" not in w))


def word_split(word: str) -> str:
    from k3.data.corpus import split_fraction

    return "eval" if split_fraction("distill-text:" + word) < HELD_OUT_FRACTION else "train"


class Text(Domain):
    name = "text"
    OPS = ("reverse", "upper")

    def __init__(self, words: Sequence[str] | None = None, op: str = "reverse", held_out: bool = False):
        if op not in self.OPS:
            raise ValueError(f"text op {op!r}: choose one of {', '.join(self.OPS)}")
        self._words = tuple(words) if words is not None else None
        self.op, self.held_out = op, held_out

    @functools.cached_property
    def pools(self) -> dict[str, tuple[str, ...]]:
        """Words to train and evaluate on: with `held_out`, disjoint by split hash; else one shared pool."""
        words = self._words if self._words is not None else corpus_words()
        if not self.held_out:
            return {"train": tuple(words), "eval": tuple(words)}
        pools = {s: tuple(w for w in words if word_split(w) == s) for s in ("train", "eval")}
        if not pools["train"] or not pools["eval"]:
            raise ValueError("the text domain needs identifiers on both sides of the train/eval split")
        return pools

    def _apply(self, w: str) -> str:
        return w[::-1] if self.op == "reverse" else w.upper()

    def sample(self, rng, split="train"):
        w = rng.choice(self.pools["eval" if split == "eval" else "train"])
        return Problem(self.name, f"{self.op} {w}", self._apply(w), {"word": w})

    def trace(self, problem, effort):
        w = problem.data["word"]
        out = list(self._apply(w))
        if effort == "high":
            return list(w) + ["|"] + out
        if effort == "medium":
            return out
        return out[:len(out) // 2]

    def check(self, problems, answers):
        return [float(a.strip() == p.answer) for p, a in zip(problems, answers)]


DOMAIN_NAMES: tuple[str, ...] = ("arith", "pyfunc", "text")
CELLS: tuple[tuple[str, str], ...] = tuple((d, e) for d in DOMAIN_NAMES for e in EFFORTS)


def make_domains(sandbox_config=None) -> dict[str, Domain]:
    return {"arith": Arith(), "pyfunc": PyFunc(sandbox_config), "text": Text()}


def cell_name(domain: str, effort: str) -> str:
    return f"{domain}/{effort}"


def parse_cell(name: str) -> tuple[str, str]:
    d, sep, e = name.partition("/")
    if not sep or d not in DOMAIN_NAMES:
        raise ValueError(f"cell {name!r} must be DOMAIN/EFFORT with DOMAIN one of {', '.join(DOMAIN_NAMES)}")
    return d, check_effort(e)


def problem_rng(*key) -> random.Random:
    return random.Random(":".join(map(str, key)))


def trace_text(domain: Domain, problem: Problem, effort: str, tokenizer, budgets: dict[str, int] | None = None) -> str:
    """The effort's trace, cut to the longest prefix of whole steps that fits the thinking budget."""
    budget = (budgets or THINKING_BUDGETS)[check_effort(effort)]
    steps = domain.trace(problem, effort)
    kept = ""
    for i in range(1, len(steps) + 1):
        text = " ".join(steps[:i])
        if len(tokenizer.encode(text, allow_special=False)) > budget:
            break
        kept = text
    return kept


def sft_example(domain: Domain, problem: Problem, effort: str, tokenizer,
                budgets: dict[str, int] | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a worked example at `effort`."""
    return (build_prompt(problem.text, effort, tokenizer),
            completion_ids(trace_text(domain, problem, effort, tokenizer, budgets), problem.answer, tokenizer))


def eval_problems(domains: dict[str, Domain], n: int, seed: int = 0) -> dict[tuple[str, str], list[Problem]]:
    """`n` evaluation problems per cell, from their own seed stream; the same problems for every effort of a
    domain (so effort levels are compared on equal problems)."""
    out = {}
    for d, e in CELLS:
        out[(d, e)] = [domains[d].sample(problem_rng("eval", d, seed, i), "eval") for i in range(n)]
    return out


def tokenizer_texts(domains: dict[str, Domain], n_per_domain: int = 3000, seed: int = 0) -> list[str]:
    """Domain text (problems, traces at every effort, answers) to train the domain tokenizer on."""
    out = []
    for d, dom in domains.items():
        for i in range(n_per_domain):
            p = dom.sample(problem_rng("tokenizer", d, seed, i))
            out.append(p.text)
            out.extend(" ".join(dom.trace(p, e)) for e in EFFORTS)
            out.append(p.answer)
    return out
