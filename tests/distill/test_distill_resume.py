import pytest
import torch

from k3.distill.domains import make_domains, problem_rng, sft_example
from k3.distill.loop import LoopConfig
from k3.distill.mopd import MOPDConfig, TeacherMatrix, run_mopd
from k3.distill.sft import collate, masked_ce, run_sft
from k3.model.transformer import K3Model
from k3.train.metrics import read_metrics

BUDGETS = {"low": 2, "medium": 3, "high": 4}
CELLS = (("arith", "low"), ("text", "high"))


def _model(config, seed):
    torch.manual_seed(seed)
    return K3Model(config)


def _mopd(config, tok, out, steps, resume=False, mode="on-policy"):
    student = _model(config, 0)
    teachers = TeacherMatrix({CELLS[0]: _model(config, 1), CELLS[1]: _model(config, 2)}, {c: str(c) for c in CELLS})
    mc = MOPDConfig(mode=mode, per_cell=1, cells=CELLS, max_answer_tokens=3, budgets=BUDGETS, eval_n=0)
    lc = LoopConfig(steps=steps, lr=3e-3, warmup_steps=1, seed=5)
    recs = run_mopd(student, teachers, tok, make_domains(), mc, lc, out, resume=resume)
    return student, [r["loss"] for r in recs if r["kind"] == "train"]


def test_mopd_resume_is_exact(tmp_path, small_config, domain_tokenizer):
    """2 steps in one go == 1 step, a restart from the checkpoint, 1 more: same losses, same weights."""
    whole, losses = _mopd(small_config, domain_tokenizer, tmp_path / "a", 2)
    _, first = _mopd(small_config, domain_tokenizer, tmp_path / "b", 1)
    resumed, second = _mopd(small_config, domain_tokenizer, tmp_path / "b", 2, resume=True)
    assert len(losses) == 2 and first + second == losses
    for (name, p), q in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(p, q), name
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [1, 2]
    assert losses[0] != losses[1]  # the steps did change the student
    with pytest.raises(ValueError, match="--resume"):
        _mopd(small_config, domain_tokenizer, tmp_path / "b", 2)  # a run that exists is not silently replaced
    # a run whose teachers are recorded by their weights: a resume with other weights for the same cells is refused
    def run(out, sha, steps, resume=False):
        teachers = TeacherMatrix({CELLS[0]: _model(small_config, 1), CELLS[1]: _model(small_config, 2)},
                                 {c: str(c) for c in CELLS},
                                 {c: {"source": str(c), "step": 9, "weights_sha256": sha} for c in CELLS})
        mc = MOPDConfig(per_cell=1, cells=CELLS, max_answer_tokens=3, budgets=BUDGETS, eval_n=0)
        return run_mopd(_model(small_config, 0), teachers, domain_tokenizer, make_domains(), mc,
                        LoopConfig(steps=steps, lr=3e-3, warmup_steps=1, seed=5), out, resume=resume)
    run(tmp_path / "c", "e" * 64, 1)
    with pytest.raises(ValueError, match="'teachers'"):
        run(tmp_path / "c", "f" * 64, 2, resume=True)
    assert [r["step"] for r in run(tmp_path / "c", "e" * 64, 2, resume=True) if r["kind"] == "train"] == [2]
    # a run recorded with teacher names only (as before the weights were recorded) still resumes by name
    assert [r["step"] for r in run(tmp_path / "b", "e" * 64, 3, resume=True) if r["kind"] == "train"] == [3]


def test_off_policy_baseline_learns_teacher_samples_to_a_token_budget(tmp_path, small_config, domain_tokenizer):
    student = _model(small_config, 0)
    teachers = TeacherMatrix({CELLS[0]: _model(small_config, 1), CELLS[1]: _model(small_config, 2)})
    mc = MOPDConfig(mode="off-policy", per_cell=1, cells=CELLS, max_answer_tokens=3, budgets=BUDGETS, eval_n=0)
    recs = run_mopd(student, teachers, domain_tokenizer, make_domains(), mc,
                    LoopConfig(steps=50, warmup_steps=0, token_budget=20), tmp_path)
    train = [r for r in recs if r["kind"] == "train"]
    assert train[-1]["tokens"] >= 20 and all(r["tokens"] < 20 for r in train[:-1])
    assert len(train) < 50 and all("ce" in r for r in train)


def test_sft_masks_the_prompt_and_resumes_exactly(tmp_path, small_config, domain_tokenizer):
    ids, mask = collate([([1, 2, 3], [4, 5]), ([1, 2], [6])])
    assert ids.tolist() == [[1, 2, 3, 4, 5], [1, 2, 6, 2, 2]] and mask.tolist() == [
        [False, False, False, True, True], [False, False, True, False, False]]
    logits = torch.randn(2, 5, 8)
    logits[:, :, :] = 0
    loss, n = masked_ce(logits, ids.clamp(max=7), mask)
    assert n == 3 and float(loss) == pytest.approx(float(torch.log(torch.tensor(8.0))))

    dom = make_domains()["arith"]

    def examples(step):
        return [sft_example(dom, dom.sample(problem_rng("t", step, j)), "medium", domain_tokenizer, BUDGETS)
                for j in range(3)]

    def run(out, steps, resume=False):
        m = _model(small_config, 0)
        recs = run_sft(m, examples, LoopConfig(steps=steps, warmup_steps=1), out, resume=resume)
        return m, [r["loss"] for r in recs if r["kind"] == "train"]

    whole, losses = run(tmp_path / "a", 4)
    run(tmp_path / "b", 2)
    resumed, second = run(tmp_path / "b", 4, resume=True)
    assert second == losses[2:] and losses[-1] < losses[0]
    assert all(torch.equal(p, q) for p, q in zip(whole.state_dict().values(), resumed.state_dict().values()))


def test_sampled_kl_with_verifier_reward_runs(tmp_path, small_config, domain_tokenizer):
    student = _model(small_config, 0)
    teachers = TeacherMatrix({CELLS[0]: _model(small_config, 1), CELLS[1]: _model(small_config, 2)})
    mc = MOPDConfig(kl="sampled", reward_coef=1.0, per_cell=2, cells=CELLS, max_answer_tokens=3, budgets=BUDGETS,
                    eval_n=0)
    recs = run_mopd(student, teachers, domain_tokenizer, make_domains(), mc, LoopConfig(steps=1, warmup_steps=0), None)
    rec = recs[0]
    assert rec["reward"] == 0.0 and set(rec["reverse_kl_by_cell"]) == {"arith/low", "text/high"}
    assert rec["reasoning_tokens"]["low"] <= 2 and rec["reasoning_tokens"]["high"] <= 4


def test_loop_config_refuses_a_decay_past_the_run_and_a_nan_clip():
    """decay_frac outside [0, 1] was clamped silently for library callers; grad_clip NaN passed `< 0`; inf, like 0,
    means no clipping and is accepted."""
    import math

    import pytest

    for bad in (2.0, -0.5):
        with pytest.raises(ValueError, match="decay_frac"):
            LoopConfig(steps=10, decay_frac=bad).validate()
    with pytest.raises(ValueError, match="grad_clip"):
        LoopConfig(steps=10, grad_clip=math.nan).validate()
    LoopConfig(steps=10, grad_clip=math.inf, decay_frac=1.0).validate()
