import pytest
import torch

from k3.distill import evaluate as ev
from k3.distill.domains import eval_problems, make_domains
from k3.distill.effort import completion_ids
from k3.distill.rollout import Rollout


def _fake_sampler(tokenizer, wrong_budget: int):
    """Stands in for the sampler: answers correctly except under the budget `wrong_budget`, reasoning
    `budget // 2` tokens. Problems are recovered from the prompt text."""
    def fake(model, prompts, budgets, max_answer_tokens, temperature=1.0, generator=None):
        comps = []
        for i, (p, b) in enumerate(zip(prompts, budgets)):
            text = tokenizer.decode(p).split("<|user|>")[1].split("<|end|>")[0]
            answer = model.answers[text] if b != wrong_budget else "nope"
            comps.append(completion_ids(" ".join(["7"] * (b // 2)), answer, tokenizer))
        B, T = len(prompts), max(len(p) + len(c) for p, c in zip(prompts, comps))
        ids = torch.zeros(B, T, dtype=torch.long)
        cm = torch.zeros(B, T, dtype=torch.bool)
        for i, (p, c) in enumerate(zip(prompts, comps)):
            ids[i, :len(p) + len(c)] = torch.tensor(list(p) + c)
            cm[i, len(p):len(p) + len(c)] = True
        return Rollout(ids, [len(p) for p in prompts], cm, cm.clone(), torch.zeros(B, T),
                       [len(tokenizer.encode(" ".join(["7"] * (b // 2)))) for b in budgets], [True] * B, [False] * B)
    return fake


class Oracle:
    def __init__(self, problems):
        self.answers = {p.text: p.answer for ps in problems.values() for p in ps}


def test_evaluate_cells_scores_and_lengths(monkeypatch, domain_tokenizer):
    domains = make_domains()
    problems = {c: ps for c, ps in eval_problems(domains, 4, seed=3).items() if c[0] != "pyfunc"}
    monkeypatch.setattr(ev, "sample", _fake_sampler(domain_tokenizer, wrong_budget=8))
    budgets = {"low": 4, "medium": 8, "high": 16}
    res = ev.evaluate_cells(Oracle(problems), problems, domains, domain_tokenizer, budgets, batch_size=5)
    assert {c: v["score"] for c, v in res.items()} == {"arith/low": 1.0, "arith/medium": 0.0, "arith/high": 1.0,
                                                       "text/low": 1.0, "text/medium": 0.0, "text/high": 1.0}
    assert all(v["n"] == 4 for v in res.values())
    lengths = ev.effort_lengths(res)
    assert lengths["low"] < lengths["medium"] < lengths["high"] and ev.ordered(lengths)


def test_table_markdown_and_gap_plot(tmp_path):
    teacher = {"arith/low": {"score": 0.5, "n": 4, "reasoning_tokens": 2.0},
               "arith/high": {"score": 1.0, "n": 4, "reasoning_tokens": 9.0}}
    student = {"arith/low": {"score": 0.25, "n": 4, "reasoning_tokens": 3.0},
               "arith/high": {"score": 0.75, "n": 4, "reasoning_tokens": 1.0}}
    rep = ev.table(teacher, {"mopd": student})
    assert rep["cells"] == [{"cell": "arith/low", "teacher": 0.5, "mopd": 0.25},
                            {"cell": "arith/high", "teacher": 1.0, "mopd": 0.75}]
    assert rep["mean"] == {"cell": "mean", "teacher": 0.75, "mopd": 0.5}
    assert rep["effort_ordered"] == {"teacher": True, "mopd": False}
    md = ev.markdown(rep)
    assert "| arith/high | 1.000 | 0.750 |" in md and "| mopd | 3.0 | - | 1.0 | no |" in md
    # one effort level has no order to judge: "-", not "no"
    one = ev.table({"arith/low": teacher["arith/low"]}, {"mopd": {"arith/low": student["arith/low"]}})
    assert one["effort_ordered"] == {"teacher": None, "mopd": None} and "| mopd | 3.0 | - | - | - |" in ev.markdown(one)
    recs = [{"kind": "eval", "step": s, "gap": {"arith/low": -0.5 + 0.1 * s, "arith/high": -0.2}} for s in (0, 2, 4)]
    path = ev.plot_gaps(recs, tmp_path / "gap.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recs += [{"kind": "train", "step": s, "reverse_kl_by_cell": {"arith/low": 1.0 / s}} for s in (1, 2, 3, 4)]
    assert ev.plot_gaps(recs, tmp_path / "gap2.png").stat().st_size > path.stat().st_size  # a second panel
    with pytest.raises(ValueError, match="no evaluation records"):
        ev.plot_gaps([{"kind": "train", "step": 1}], tmp_path / "x.png")


def test_reverse_kl_to_the_cells_teacher(small_config, domain_tokenizer):
    from k3.distill.mopd import TeacherMatrix
    from k3.model.transformer import K3Model

    domains = make_domains()
    cells = (("arith", "low"), ("text", "low"))
    problems = {c: ps for c, ps in eval_problems(domains, 2, seed=0).items() if c in cells}
    torch.manual_seed(0)
    student, other = K3Model(small_config), K3Model(small_config)
    budgets = {"low": 2, "medium": 3, "high": 4}
    same = ev.evaluate_cells(student, problems, domains, domain_tokenizer, budgets, 3,
                             teachers=TeacherMatrix({c: student for c in problems}))
    assert all(abs(v["reverse_kl"]) < 1e-5 for v in same.values())
    student.requires_grad_(True)
    diff = ev.evaluate_cells(student, problems, domains, domain_tokenizer, budgets, 3,
                             teachers=TeacherMatrix({("arith", "low"): student, ("text", "low"): other}))
    assert abs(diff["arith/low"]["reverse_kl"]) < 1e-5 < diff["text/low"]["reverse_kl"]
    rep = ev.table({c: {"score": 1.0, "n": 2, "reasoning_tokens": 1.0} for c in diff}, {"s": diff})
    assert rep["reverse_kl"][-1]["cell"] == "mean" and "reverse KL" in ev.markdown(rep)


def test_answers_longer_than_the_cap_are_named(domain_tokenizer):
    """With the 320-token test vocabulary some pyfunc answers need more tokens than a small cap allows: the
    warning counts them and names the cap that would fit them; a cap that fits them all gives none."""
    problems = eval_problems(make_domains(), 6, seed=0)
    need = max(len(domain_tokenizer.encode(p.answer, allow_special=False)) for ps in problems.values() for p in ps)
    msg = ev.long_answers(problems, domain_tokenizer, need - 1)
    assert msg is not None and f"up to {need})" in msg and f"--max-answer-tokens to {need}" in msg
    assert ev.long_answers(problems, domain_tokenizer, need) is None
