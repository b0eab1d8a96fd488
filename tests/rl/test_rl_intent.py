"""command_choice: the teacher-forced probe of whether a policy reads the instruction."""
import pytest
import torch

from k3.agentenv.actions import action_from_json
from k3.agentenv.dialects import make_dialect, make_variant
from k3.rl.demos import episode_tokens
from k3.rl.family import COMMANDS, KINDS, task_spec
from k3.rl.train import command_choice, command_position


def _demo(kind: str, dialect: str) -> dict:
    spec = task_spec(kind, "train", 0)
    d = make_dialect(make_variant(dialect))
    return {"task_id": spec["id"], "transcript": [
        {"role": "system", "content": d.system_prompt()},
        {"role": "user", "content": spec["instruction"]},
        {"role": "assistant", "content": d.render_call(action_from_json(spec["solution"][0]))},
    ]}


def test_command_position_finds_the_policys_command(rl_tokenizer):
    for kind in KINDS:
        ids, mask = episode_tokens(_demo(kind, "react")["transcript"], rl_tokenizer)
        pos = command_position(ids, mask, rl_tokenizer, kind)
        assert pos is not None and mask[pos]
        assert rl_tokenizer.decode(ids[pos:]).startswith(COMMANDS[kind].split()[0])
        other = next(k for k in KINDS if k != kind)
        assert command_position(ids, mask, rl_tokenizer, other) is None


def test_command_choice_matches_a_full_forward(rl_tokenizer, tiny_rl_model):
    demos = [_demo(k, dl) for k in KINDS for dl in ("react", "claude")]
    out = command_choice(tiny_rl_model, rl_tokenizer, demos)
    assert out["demos"] == 6 and out["skipped"] == 0 and set(out["p"]) == set(KINDS)
    # reference: one forward over the whole episode, the logits just before the command (the model is causal)
    first = {k: rl_tokenizer.encode(c)[0] for k, c in COMMANDS.items()}
    with torch.no_grad():
        for kind in KINDS:
            ref = dict.fromkeys(KINDS, 0.0)
            for d in [x for x in demos if x["task_id"].split("-")[1] == kind]:
                ids, mask = episode_tokens(d["transcript"], rl_tokenizer)
                pos = command_position(ids, mask, rl_tokenizer, kind)
                p = torch.softmax(tiny_rl_model(torch.tensor([ids]))[0, pos - 1], -1)
                for k in KINDS:
                    ref[k] += float(p[first[k]]) / 2
            assert out["p"][kind] == pytest.approx(ref, abs=1e-5)


def test_command_choice_skips_demos_without_the_command(rl_tokenizer, tiny_rl_model):
    d = _demo("calc", "react")
    d["transcript"][-1]["content"] = "Thought: nothing to do."
    out = command_choice(tiny_rl_model, rl_tokenizer, [d, _demo("count", "react")])
    assert out["skipped"] == 1 and out["demos"] == 1 and set(out["p"]) == {"count"}
