"""The learnable task family, the harness settings, and demonstrations as tokens."""
import pytest

from k3.agentenv.dialects import ARG_ALIASES, CANONICAL, DIALECTS, TOOL_ALIASES, make_dialect
from k3.agentenv.policies import make_policy
from k3.agentenv.rollout import run_episode
from k3.rl.demos import DemoPolicy, collect_demos, episode_tokens
from k3.rl.family import ITEMS, KINDS, WORDS, task_spec
from k3.rl.harness import UNSEEN_ARGS, UNSEEN_TOOLS, _camel, episode_config, unseen_variant, variant_of
from k3.data.chat import render


def test_tasks_are_verified_by_their_checks(rl_tasks, sandbox_ok):
    """Every kind: untouched scores 0, the reference solution 1 (in the sandbox, through a dialect)."""
    for i, task in enumerate(rl_tasks["train"] + rl_tasks["heldout"]):
        assert task.checksum and task.max_steps == 4
        assert run_episode(task, make_policy({"kind": "noop"}, task), seed=i)["reward"] == 0.0
        assert run_episode(task, make_policy({"kind": "reference"}, task), seed=i)["reward"] == 1.0


def test_number_answers_are_graded_by_value_not_by_bytes(rl_tasks, sandbox_ok):
    """"write the number": with or without a newline, padded or CRLF, the right number passes; a wrong one,
    or none, does not."""
    from k3.agentenv import ScriptedPolicy
    from k3.agentenv.actions import Action

    task = next(t for t in rl_tasks["train"] if "-calc-" in t.id)
    a, b = (int(x) for x in (task.root / "workspace" / "expr.txt").read_text().split("*"))
    value = a * b
    for text, reward in [(f"{value}", 1.0), (f" {value}\n", 1.0), (f"{value}\r\n", 1.0), (f"{value}\n\n", 1.0),
                         (f"{value + 1}\n", 0.0), ("", 0.0)]:
        steps = [Action("write", {"path": "answer.txt", "content": text})] if text else []
        r = run_episode(task, ScriptedPolicy(steps), seed=0)
        assert r["reward"] == reward, (repr(text), r["verifier"])


def test_splits_do_not_overlap():
    assert not set(WORDS["train"]) & set(WORDS["heldout"]) and not set(ITEMS["train"]) & set(ITEMS["heldout"])
    def facts(split):
        return {str(sorted(task_spec(k, split, i)["workspace"].items())) for k in KINDS for i in range(40)}
    assert not facts("train") & facts("heldout") and len(facts("train")) > 100
    assert task_spec("calc", "train", 3) == task_spec("calc", "train", 3)  # a pure function
    with pytest.raises(ValueError, match="unknown task kind"):
        task_spec("fixbug", "train", 0)
    with pytest.raises(ValueError, match="split"):
        task_spec("calc", "test", 0)


def test_unseen_names_never_occur_in_training_harnesses():
    seen_tools = {n for names in TOOL_ALIASES.values() for n in names}
    seen_tools |= {_camel(n) for n in seen_tools} | {t for d in CANONICAL.values() for t, _ in d.values()}
    seen_args = {n for names in ARG_ALIASES.values() for n in names}
    seen_args |= {a for d in CANONICAL.values() for _, args in d.values() for a in args.values()}
    unseen_tools = {n for names in UNSEEN_TOOLS.values() for n in names}
    assert not (unseen_tools | {_camel(n) for n in unseen_tools}) & seen_tools
    assert not {n for names in UNSEEN_ARGS.values() for n in names} & seen_args
    variants = [unseen_variant(s) for s in range(40)]
    assert {v.dialect for v in variants} == set(DIALECTS)
    for v in variants:
        assert v == unseen_variant(variants.index(v))
        names = [n for n, _ in v.tools.values()]
        assert len(set(names)) == len(names)
        make_dialect(v).system_prompt()  # renders


def test_harness_settings():
    fixed = episode_config("fixed", "claude")
    assert {variant_of(fixed, s).dialect for s in range(10)} == {"claude"}
    assert not any(variant_of(fixed, s).augmented for s in range(10))
    swap = episode_config("swap")
    assert len({variant_of(swap, s).dialect for s in range(40)}) == 4
    with pytest.raises(ValueError, match="unknown harness"):
        episode_config("random")
    with pytest.raises(ValueError, match="fixed dialect"):
        episode_config("fixed", "vim")


def test_demonstrations_verify_and_mask_only_the_policy(rl_tasks, rl_tokenizer, sandbox_ok):
    tasks = rl_tasks["train"]
    demos = collect_demos(tasks, [11, 12, 13], episode_config("swap"), workers=3)
    assert len(demos) == 3 and all(d["reward"] == 1.0 for d in demos)
    for d in demos:
        t = d["transcript"]
        n_calls = len([a for a in d["actions"]])
        assert n_calls == len(tasks[[x.id for x in tasks].index(d["task_id"])].solution)
        ids, mask = episode_tokens(t, rl_tokenizer)
        assert ids == render(t, rl_tokenizer, add_generation_prompt=False)  # per-message = whole conversation
        sampled = [i for i, m in zip(ids, mask) if m]
        replies = [m["content"] for m in t if m["role"] == "assistant"]
        end = rl_tokenizer.special_id("end")
        want = [tok for r in replies for tok in rl_tokenizer.encode(r, allow_special=False) + [end]]
        assert sampled == want
    with pytest.raises(ValueError, match="no reference solution"):
        DemoPolicy(type("T", (), {"id": "x", "solution": ()})())


def test_task_directories_of_another_version_are_rebuilt(tmp_path, monkeypatch):
    """A built task is reused only when every part of its spec (and the step limit) is what the family makes now;
    a changed step limit used to leave the old directories in place."""
    import os

    import k3.rl.family as family

    first = family.build_tasks(tmp_path, "train", 1)
    stamp = {t.id: os.stat(tmp_path / "train" / t.id / "task.json").st_mtime_ns for t in first}
    again = family.build_tasks(tmp_path, "train", 1)  # the same: reused, untouched
    assert {t.id: os.stat(tmp_path / "train" / t.id / "task.json").st_mtime_ns for t in again} == stamp
    monkeypatch.setattr(family, "MAX_STEPS", family.MAX_STEPS + 2)
    assert [t.max_steps for t in family.build_tasks(tmp_path, "train", 1)] == [family.MAX_STEPS] * 3


def test_pad_batch_refuses_masks_that_do_not_match():
    import pytest

    from k3.rl.demos import pad_batch
    with pytest.raises(AssertionError, match="3 sequences but 2 masks"):  # its callers build both from one list
        pad_batch([[1], [2], [3]], [[True], [True]], 0)
