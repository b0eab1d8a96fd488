import json
import math

import pytest
import torch
from safetensors.torch import load_file

from k3.config import get_config
from k3.train import checkpoint as ckpt
from k3.train.metrics import read_metrics
from k3.train.trainer import TrainConfig, Trainer

TINY = dict(steps=6, batch_size=2, seq_len=16, eval_batches=2, warmup_steps=1)


class Stop(Exception):
    pass


@pytest.mark.parametrize("opt", ["adamw", "muon"])
def test_resume_is_bitwise_exact(tmp_path, fake_data, opt):
    """2N steps straight == N steps, a crash, and a resume for the rest (losses and weights, bitwise)."""
    cfg, data = get_config("tiny"), fake_data()
    tc = dict(TINY, optimizer=opt, ckpt_every=3, eval_every=3)
    a = Trainer(cfg, TrainConfig(**tc), data, data, tmp_path / "a")
    ra = a.fit()
    assert len(ra.losses) == 6

    def crash_at_4(rec):
        if rec["step"] == 4:  # after the step-3 checkpoint, before the next one
            raise Stop

    b = Trainer(cfg, TrainConfig(**tc), data, data, tmp_path / "b")
    with pytest.raises(Stop):
        b.fit(on_step=crash_at_4)
    first = list(read_metrics(tmp_path / "b" / "metrics.jsonl"))
    b2 = Trainer(cfg, TrainConfig(**tc), data, data, tmp_path / "b")  # a new process would start like this
    rb = b2.fit(resume=True)
    losses_b = [r["loss"] for r in first if r["kind"] == "train"][:3] + rb.losses
    assert losses_b == ra.losses  # exact float equality, not approx
    for (n, x), (_, y) in zip(a.model.state_dict().items(), b2.model.state_dict().items()):
        assert torch.equal(x, y), n
    assert [v["val_loss"] for v in rb.val] == [v["val_loss"] for v in ra.val[1:]]
    steps = [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]  # the step-4 record of the crashed run was dropped on resume
    # the router balancing biases moved and travel with the checkpoint
    bias = b2.model.moe_layers()[0].router.bias
    assert bias.abs().sum() > 0
    latest = ckpt.latest_checkpoint(tmp_path / "b" / "checkpoint")
    m = json.loads((latest / "manifest.json").read_text())
    assert m["step"] == 6 and m["data"]["next_step"] == 6
    saved = load_file(str(latest / "model.safetensors"))
    assert torch.equal(saved["layers.1.ffn.router.bias"], b2.model.layers[1].ffn.router.bias)


def test_resume_refuses_a_different_data_order(tmp_path, fake_data):
    cfg, data = get_config("tiny"), fake_data()
    Trainer(cfg, TrainConfig(**dict(TINY, steps=2)), data, None, tmp_path).fit()
    t = Trainer(cfg, TrainConfig(**dict(TINY, steps=4, seq_len=8)), data, None, tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="seq_len"):
        t.fit(resume=True)
    t = Trainer(cfg, TrainConfig(**dict(TINY, steps=4)), data, None, tmp_path)
    with pytest.raises(ValueError, match="--resume"):
        t.fit()  # a fresh run would silently mix with the old checkpoint


def test_resume_refuses_another_learning_rate_schedule(tmp_path, fake_data):
    """`k3 train --resume` without the run's --lr trained on at the default lr: no longer an exact resume."""
    cfg, data = get_config("tiny"), fake_data()
    Trainer(cfg, TrainConfig(**dict(TINY, steps=2, lr=1e-3)), data, None, tmp_path).fit()
    for change, msg in (({}, "lr is 0.001 in the checkpoint but 0.003 now; resume with --lr 0.001"),
                        ({"lr": 1e-3, "warmup_steps": None}, "warmup_steps is 1 .* resume with --warmup-steps 1"),
                        ({"lr": 1e-3, "weight_decay": 0.0}, r"resume with TrainConfig\(weight_decay=0.1\)"),
                        ({"lr": 1e-3, "betas": (0.9, 0.99)}, "betas")):
        t = Trainer(cfg, TrainConfig(**{**TINY, "steps": 4, **change}), data, None, tmp_path)
        with pytest.raises(ckpt.CheckpointError, match=msg):
            t.fit(resume=True)
    ok = Trainer(cfg, TrainConfig(**dict(TINY, steps=4, lr=1e-3)), data, None, tmp_path)  # more steps: fine
    assert ok.fit(resume=True).steps_done == 4


def test_resume_refuses_other_data(tmp_path, fake_data):
    """Same shapes, other tokens or tokenizer: the resumed steps would train on something else."""
    cfg, data = get_config("tiny"), fake_data()
    info = {"data_dir": "/data/a", "tokenizer_hash": "aaa", "train_tokens": len(data)}
    Trainer(cfg, TrainConfig(**dict(TINY, steps=2)), data, None, tmp_path, data_info=info).fit()
    for k, v in (("tokenizer_hash", "bbb"), ("train_tokens", len(data) + 1)):
        t = Trainer(cfg, TrainConfig(**dict(TINY, steps=4)), data, None, tmp_path, data_info={**info, k: v})
        with pytest.raises(ckpt.CheckpointError, match=f"{k}.*resume with --data /data/a"):
            t.fit(resume=True)
    moved = Trainer(cfg, TrainConfig(**dict(TINY, steps=3)), data, None, tmp_path,
                    data_info={**info, "data_dir": "/elsewhere"})  # the same data, moved: fine
    assert moved.fit(resume=True).steps_done == 3 and moved.step == 3  # one more step, after the two


def test_resume_leaves_the_rng_where_an_uninterrupted_run_has_it(tmp_path, fake_data):
    """The MFU peak measurement (run once per process, at the start of fit) draws its own random matrices: the
    global RNG that a resume restores must not move."""
    from k3.train import metrics

    cfg, data = get_config("tiny"), fake_data()
    Trainer(cfg, TrainConfig(**dict(TINY, steps=2, measure_mfu=False)), data, None, tmp_path).fit()
    metrics._PEAK.clear()  # as in a fresh process
    t = Trainer(cfg, TrainConfig(**dict(TINY, steps=2)), data, None, tmp_path)
    t.resume()
    state = torch.get_rng_state()
    metrics.measured_peak_flops("cpu", n=64)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_non_finite_gradient_is_never_applied_or_saved(tmp_path, fake_data):
    cfg, data = get_config("tiny"), fake_data()
    t = Trainer(cfg, TrainConfig(**dict(TINY, steps=4, ckpt_every=1)), data, None, tmp_path)
    blow_up = t.model.head.weight.register_hook(lambda g: g * float("inf") if t.step == 1 else g)
    # the advice says how (a resume under another --lr is refused)
    with pytest.raises(ValueError, match="gradient norm is (inf|nan) at step 2 \\(not applied, not saved\\); lower "
                                         "--lr or check the data \\(a run with another --lr starts over: --overwrite"):
        t.fit()
    blow_up.remove()
    assert ckpt.latest_checkpoint(tmp_path / "checkpoint").name == "step_000001"
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


def test_metrics_fields(tmp_path, fake_data):
    cfg, data = get_config("tiny"), fake_data()
    tr = Trainer(cfg, TrainConfig(**dict(TINY, steps=3, optimizer="muon", eval_every=2)), data, data, tmp_path,
                 bytes_per_token=2.0)
    tr.fit()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    train = [r for r in recs if r["kind"] == "train"]
    val = [r for r in recs if r["kind"] == "val"]
    assert [r["step"] for r in train] == [1, 2, 3] and [r["step"] for r in val] == [2, 3]
    n_moe = cfg.n_layers - cfg.n_dense_layers
    for r in train:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "max_logit"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), key
        assert 0 < r["mfu"] < 1
        assert len(r["expert_load_max_mean"]) == n_moe and all(x >= 1.0 for x in r["expert_load_max_mean"])
        assert all(len(s) == cfg.n_experts and abs(sum(s) - 1) < 1e-3 for s in r["expert_load"])
        assert len(r["attnres_entropy"]) == 2 * cfg.n_layers + 1
        for j, e in enumerate(r["attnres_entropy"]):
            assert -1e-6 <= e <= math.log(tr.model.attnres.n_sources(j)) + 1e-4
    assert train[0]["tokens"] == 2 * 16 and train[2]["tokens"] == 3 * 2 * 16
    assert val[-1]["val_bpb"] == pytest.approx(val[-1]["val_loss"] / math.log(2) / 2.0)
    assert train[-1]["lr"] < train[0]["lr"] or TINY["warmup_steps"] == 0  # WSD decays at the end


def test_activation_checkpointing_matches(fake_data):
    cfg, data = get_config("tiny"), fake_data()
    runs, router_calls = [], []
    for ac in (False, True):
        tr = Trainer(cfg, TrainConfig(**dict(TINY, steps=3, activation_checkpointing=ac, measure_mfu=False)), data)
        calls = [0]
        for m in tr.model.moe_layers():
            m.router.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        runs.append((tr.fit().losses, [m.router.bias.clone() for m in tr.model.moe_layers()]))
        router_calls.append(calls[0])
    assert router_calls[1] == 2 * router_calls[0] > 0  # the checkpointed run really recomputed in backward
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-5, atol=1e-6)
    for b0, b1 in zip(runs[0][1], runs[1][1]):
        assert torch.equal(b0, b1)  # the recompute did not double-count router statistics


def test_time_budget_stops_and_saves(tmp_path, fake_data):
    cfg, data = get_config("tiny"), fake_data()
    tr = Trainer(cfg, TrainConfig(**dict(TINY, steps=10_000, max_minutes=0.01, eval_every=1)), data, data, tmp_path)
    res = tr.fit()  # eval_every=1: the stop always comes right after a periodic eval
    assert res.stopped_early and 0 < res.steps_done < 10_000
    assert res.elapsed_s < 0.01 * 60 + 5
    assert ckpt.latest_checkpoint(tmp_path / "checkpoint").name == f"step_{res.steps_done:06d}"
    assert res.val  # evaluated before stopping
    assert len({v["step"] for v in res.val}) == len(res.val)  # once per step, even right after a periodic eval
    # a resume whose budget is spent before its first step: no evaluation past the budget (it evaluated the step it
    # resumed, again, and wrote that record a second time)
    again = Trainer(cfg, TrainConfig(**dict(TINY, steps=10_000, max_minutes=1e-9, eval_every=1)), data, data, tmp_path)
    res2 = again.fit(resume=True)
    assert res2.stopped_early and not res2.losses and not res2.val and res2.steps_done == res.steps_done


def test_time_budget_counts_a_final_eval_that_has_not_run_yet(fake_data):
    """With no periodic eval, the final one is estimated from the last step: an eval batch is one micro-batch
    forward, at most half a training step's forward and backward."""
    cfg, data = get_config("tiny"), fake_data()
    tr = Trainer(cfg, TrainConfig(**dict(TINY, eval_batches=40, accum=2)), data, data)
    assert tr.tail_seconds() == 0.0  # nothing measured yet
    tr._step_s = 0.1
    assert tr.tail_seconds() == pytest.approx(40 * 0.1 / (2 * 2))
    tr._eval_s = 0.5  # once measured, the measurement
    assert tr.tail_seconds() == 0.5
    assert Trainer(cfg, TrainConfig(**TINY), data, None).tail_seconds() == 0.0  # no validation data


def test_fit_steps_to_budget_plans_the_decay(fake_data):
    cfg, data = get_config("tiny"), fake_data()
    tr = Trainer(cfg, TrainConfig(**dict(TINY, steps=10_000, max_minutes=0.05, fit_steps_to_budget=True,
                                         measure_mfu=False)), data)
    res = tr.fit()
    assert tr.tc.steps < 10_000 and tr.schedule.total_steps == tr.tc.steps  # the run was re-planned
    # the re-planned schedule ends its decay at the last planned step
    assert tr.schedule.factor(tr.tc.steps - 1) == pytest.approx(tr.tc.min_lr_ratio)
    # on a loaded machine step times drift after the plan, so the time guard may still stop the run;
    # otherwise it must have finished exactly the planned steps
    if not res.stopped_early:
        assert res.steps_done == tr.tc.steps


def test_bad_inputs_fail_before_training(tmp_path, fake_data):
    cfg = get_config("tiny")
    with pytest.raises(ValueError, match="vocabulary of 1024 .* vocab_size = 512"):
        Trainer(cfg, TrainConfig(**TINY), fake_data(vocab_size=1024), None, tmp_path / "x")
    with pytest.raises(ValueError, match="fewer than one batch"):
        Trainer(cfg, TrainConfig(**dict(TINY, batch_size=8, seq_len=64)), fake_data(n_tokens=300), None)
    with pytest.raises(ValueError, match=r"validation data has 40 tokens, fewer than one window needs \(65 = seq_len"
                                         r" \+ 1\); give more text, a larger share of it for validation \(`k3 "
                                         r"tokenize --val-fraction`\), or lower --seq-len"):
        Trainer(cfg, TrainConfig(**dict(TINY, batch_size=4, seq_len=64)), fake_data(), fake_data(n_tokens=40))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not writable"):
        Trainer(cfg, TrainConfig(**TINY), fake_data(), None, tmp_path / "file" / "out")
    with pytest.raises(ValueError, match="max_context"):
        Trainer(cfg.replace(max_context=8), TrainConfig(**TINY), fake_data(), None)
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(optimizer="sgd").validate()
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0).validate()
    from k3.train.cli import set_threads

    with pytest.raises(ValueError, match="--threads -1: give a positive number"):
        set_threads(-1)
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_activation_checkpointing_counts_router_tokens_once():
    # Doubling every count would leave sign-based and quantile updates unchanged, so count directly.
    from k3.model.transformer import K3Model
    from k3.train.trainer import apply_activation_checkpointing

    cfg = get_config("tiny")
    model = K3Model(cfg).train()
    apply_activation_checkpointing(model)
    calls = []
    for m in model.moe_layers():
        m.router.register_forward_hook(lambda mod, *a: calls.append(mod))
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    model(ids).float().pow(2).mean().backward()
    for m in model.moe_layers():
        assert calls.count(m.router) == 2  # routed in the forward and again in the backward's recompute ...
        assert int(m.router._load_acc.sum()) == 2 * 16 * cfg.n_active_experts  # ... and counted once


def test_balancing_stats_paused_restores_switch():
    from k3.model.moe import balancing_stats_paused
    from k3.model.transformer import K3Model

    model = K3Model(get_config("tiny")).train()
    routers = [m.router for m in model.moe_layers()]
    with balancing_stats_paused(model):
        assert not any(r.collect_stats for r in routers)
        model(torch.randint(0, 512, (1, 8)))
    assert all(r.collect_stats for r in routers)
    assert all(int(r._load_acc.sum()) == 0 for r in routers)


def test_compile_matches_eager(fake_data):
    # aot_eager runs dynamo's trace and AOT autograd without inductor's C++ code generation (minutes on CPU)
    cfg, data = get_config("tiny"), fake_data()
    runs = []
    for backend in ("", "aot_eager"):
        tr = Trainer(cfg, TrainConfig(**dict(TINY, steps=2, compile=backend, measure_mfu=False)), data)
        assert (tr.forward is tr.model) == (not backend)  # the second run is compiled, not eager again
        runs.append(tr.fit().losses)
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-6)


def test_compile_backend_unknown():
    with pytest.raises(ValueError, match="torch.compile backend"):
        TrainConfig(**dict(TINY, compile="no_such_backend")).validate()


def test_distributed_guards_that_need_no_collective(tmp_path, fake_data):
    """A non-finite step is refused before the update, --max-minutes is refused (ranks would have to agree on
    the stop), and the single-process Trainer recognises a distributed checkpoint instead of clobbering it."""
    import math
    from types import SimpleNamespace

    import pytest
    import torch

    from k3.config import get_config
    from k3.parallel.train import ParallelTrainer
    from k3.train.trainer import TrainConfig, Trainer

    from k3.train.loop import Loop

    # the one loop refuses a non-finite loss or gradient norm before the update, in every context
    for loss, grad in ((1.0, float("inf")), (float("nan"), 1.0)):
        model = torch.nn.Linear(2, 1)

        def step(i, loss=loss, grad=grad, model=model):
            for p in model.parameters():
                p.grad = torch.full_like(p, grad if i == 2 else math.pi)
            return {"loss": loss if i == 2 else 1.0, "backward_done": True}

        loop = Loop(model, TrainConfig(steps=4, warmup_steps=0), step)
        loop.train_step(), loop.train_step()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match="at step 3 \\(not applied, not saved\\)"):
            loop.train_step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    ctx = SimpleNamespace(dims=SimpleNamespace(pp=1, dp=1, world=1), rank=0, device=torch.device("cpu"))
    tc = TrainConfig(steps=2, batch_size=2, seq_len=16, max_minutes=1.0)
    with pytest.raises(ValueError, match="--max-minutes is not wired"):
        ParallelTrainer(get_config("tiny"), tc, fake_data(), ctx)
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "k3.json").write_text("{}")  # what a distributed run leaves
    t = Trainer(get_config("tiny"), TrainConfig(steps=2, batch_size=2, seq_len=16), fake_data(), None, tmp_path)
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        t.fit()
    with pytest.raises(ValueError, match="distributed \\(DCP\\) checkpoint.*k3 train --resume"):
        t.fit(resume=True)


def test_eval_batch_count_is_what_eval_batches_yields(tiny_data_dir):
    """`k3 eval`'s progress bar total: the count of eval_batches' batches, capped or not."""
    from k3.data import load_data
    from k3.train.batches import eval_batch_count, eval_batches

    val = load_data(tiny_data_dir).val
    for bs, t, cap in [(8, 64, None), (8, 64, 3), (3, 100, 7), (5, 32, 10_000), (1, 512, 2)]:
        assert eval_batch_count(val, bs, t, cap) == sum(1 for _ in eval_batches(val, bs, t, cap)), (bs, t, cap)


def _signal_in(monkeypatch, trainer, method: str, at_step: int, *signals, then: Exception | None = None):
    """Make trainer.<method>, when called at trainer.step == at_step, send `signals` to this process (the graceful
    handler records the first; a second stops at once) and then raise `then` if given, else run as usual."""
    import os

    real = getattr(trainer, method)

    def wrapped(*args, **kwargs):
        if trainer.step == at_step:
            for sig in signals:
                os.kill(os.getpid(), sig)
            if then is not None:
                raise then
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, method, wrapped)


def test_a_step_failed_by_ctrl_c_is_an_interruption(tmp_path, fake_data, monkeypatch, default_signals):
    """A Ctrl-C also reaches helper processes (torch.compile's workers); a step that fails because they died
    ends the run as interrupted (KeyboardInterrupt, the CLI's exit 130), not with the step's error. Without a
    Ctrl-C the same error propagates as itself."""
    import signal

    cfg, data = get_config("tiny"), fake_data()
    t = Trainer(cfg, TrainConfig(**dict(TINY, steps=4, ckpt_every=1)), data, None, tmp_path)
    _signal_in(monkeypatch, t, "train_step", 2, signal.SIGINT, then=RuntimeError("a compile worker died"))
    with pytest.raises(KeyboardInterrupt, match="stopped in step 3; the last checkpoint is .*step_000002"):
        t.fit(graceful_interrupt=True)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    assert ckpt.latest_checkpoint(tmp_path / "checkpoint").name == "step_000002"  # the last whole step stays
    t2 = Trainer(cfg, TrainConfig(**dict(TINY, steps=4)), data, None, tmp_path / "b")
    _signal_in(monkeypatch, t2, "train_step", 0, then=RuntimeError("plain failure"))
    with pytest.raises(RuntimeError, match="plain failure"):
        t2.fit(graceful_interrupt=True)
    # after a Ctrl-C, an error outside the step (here the save of the finished step) is that error, not an
    # interruption: the user must not believe the step was saved
    t3 = Trainer(cfg, TrainConfig(**dict(TINY, steps=4, ckpt_every=1)), data, None, tmp_path / "c")
    _signal_in(monkeypatch, t3, "train_step", 1, signal.SIGINT)
    _signal_in(monkeypatch, t3, "save", 2, then=OSError(28, "disk full"))
    with pytest.raises(OSError, match="disk full"):
        t3.fit(graceful_interrupt=True)


def test_sigterm_saves_the_step_in_progress_like_ctrl_c(tmp_path, fake_data, monkeypatch, default_signals):
    """`kill PID`, a supervisor's stop or a scheduler's preemption (SIGTERM) ends a graceful run after the step in
    progress and saves it, as Ctrl-C does; it killed the run before, losing every step since the last save. A
    second signal stops at once. The handlers are restored afterwards."""
    import signal

    cfg, data = get_config("tiny"), fake_data()
    t = Trainer(cfg, TrainConfig(**dict(TINY, steps=6, ckpt_every=0)), data, None, tmp_path)
    _signal_in(monkeypatch, t, "train_step", 2, signal.SIGTERM)  # delivered while the step runs: it completes
    result = t.fit(graceful_interrupt=True)
    assert result.interrupted and result.steps_done == 3 and len(result.losses) == 3
    assert ckpt.latest_checkpoint(tmp_path / "checkpoint").name == "step_000003"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored

    t2 = Trainer(cfg, TrainConfig(**dict(TINY, steps=6, ckpt_every=0)), data, None, tmp_path / "b")
    _signal_in(monkeypatch, t2, "train_step", 1, signal.SIGTERM, signal.SIGTERM)  # the second: at once, no save
    with pytest.raises(KeyboardInterrupt):
        t2.fit(graceful_interrupt=True)
    assert ckpt.latest_checkpoint(tmp_path / "b" / "checkpoint") is None
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_signal_before_the_first_step_or_in_the_last_stops_the_caller(tmp_path, fake_data, monkeypatch,
                                                                       default_signals):
    """A SIGTERM during the first evaluation stops before step 1 (a whole step was trained and saved first); one
    during the last step completes and saves the run and still reports it interrupted, so `k3 demo` skips its
    samples and plots instead of running on after the signal."""
    import signal

    cfg, data = get_config("tiny"), fake_data()
    t = Trainer(cfg, TrainConfig(**dict(TINY, steps=3, ckpt_every=0, eval_at_start=True)), data, data, tmp_path)
    _signal_in(monkeypatch, t, "run_eval", 0, signal.SIGTERM)
    result = t.fit(graceful_interrupt=True)
    assert result.interrupted and result.steps_done == 0 and not result.losses and result.checkpoint is None
    assert ckpt.latest_checkpoint(tmp_path / "checkpoint") is None
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    t2 = Trainer(cfg, TrainConfig(**dict(TINY, steps=3, ckpt_every=0)), data, None, tmp_path / "b")
    _signal_in(monkeypatch, t2, "train_step", 2, signal.SIGTERM)  # during the last step
    result = t2.fit(graceful_interrupt=True)
    assert result.interrupted and result.steps_done == 3
    assert ckpt.latest_checkpoint(tmp_path / "b" / "checkpoint").name == "step_000003"


class _Docs:
    """Random tokens cut into documents of 5, 7 and 9 tokens: every training window holds boundaries."""

    vocab_size = None

    def __init__(self, vocab_size: int, n_tokens: int = 4096):
        self.vocab_size = vocab_size
        self.tokens = torch.randint(0, vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(1))
        lengths = [5, 7, 9] * n_tokens
        self.doc_starts = torch.tensor([0] + lengths[:n_tokens // 7]).cumsum(0)
        self.n_tokens = n_tokens

    def window_doc_ids(self, starts, seq_len):
        pos = torch.as_tensor(starts).reshape(-1, 1) + torch.arange(seq_len)
        return torch.searchsorted(self.doc_starts, pos, right=True)

    def get_batch(self, step, batch_size, seq_len, seed=0, docs=False):
        starts = torch.arange(batch_size) * 37 + step * 101
        w = torch.stack([self.tokens[s:s + seq_len + 1] for s in starts.tolist()])
        out = (w[:, :-1].clone(), w[:, 1:].clone())
        return out + (self.window_doc_ids(starts, seq_len),) if docs else out


def test_doc_mask_trains_each_packed_document_on_its_own(tmp_path):
    """`k3 train` masks at document boundaries by default: the first step's loss is the mean cross-entropy of
    every document of the batch run alone through the same initial model; with doc_mask off it is the plain
    packed windows' (`--no-doc-mask`)."""
    import copy

    import torch.nn.functional as F

    cfg = get_config("tiny")
    data = _Docs(cfg.vocab_size)
    tc = dict(steps=2, batch_size=2, seq_len=24, warmup_steps=0, measure_mfu=False)
    masked = Trainer(cfg, TrainConfig(**tc), data, None)
    packed = Trainer(cfg, TrainConfig(**tc, doc_mask=False), data, None)
    assert masked.doc_mask and not packed.doc_mask
    model = copy.deepcopy(masked.model).eval()
    x, y, d = data.get_batch(0, 2, 24, docs=True)
    with torch.no_grad():
        whole = F.cross_entropy(model(x).reshape(-1, cfg.vocab_size), y.reshape(-1)).item()
        total, n = 0.0, 0
        for r in range(2):
            cut = [0] + [t for t in range(1, 24) if d[r, t] != d[r, t - 1]] + [24]
            assert len(cut) > 3  # several documents per window
            for s, e in zip(cut, cut[1:]):
                logits = model(x[r:r + 1, s:e])
                total += F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y[r, s:e], reduction="sum").item()
                n += e - s
    per_doc = total / n
    assert abs(per_doc - whole) > 1e-3  # the boundaries matter on this data
    assert masked.train_step()["loss"] == pytest.approx(per_doc, rel=1e-5)
    assert packed.train_step()["loss"] == pytest.approx(whole, rel=1e-5)


def test_auto_threads_count_the_cores_busy_now(monkeypatch):
    """The demo's threads come from the cores busy now (/proc/stat), not the lagging load average."""
    import os

    import torch

    import k3.train.cli as cli
    import k3.train.device as device

    before = torch.get_num_threads()
    try:
        busy = device.busy_cores(0.05)
        assert busy is None or 0 <= busy <= (os.cpu_count() or 1) + 1e-6
        monkeypatch.setattr(device, "busy_cores", lambda sample_s=0.5: float(os.cpu_count() or 1))
        n, why = cli.choose_threads(None, auto=True)
        assert n == 1 and "busy now" in why and "leaves 1 free" in why
        monkeypatch.setattr(device, "busy_cores", lambda sample_s=0.5: 0.0)
        torch.set_num_threads(os.cpu_count() or 1)
        n, why = cli.choose_threads(None, auto=True)
        assert n == (os.cpu_count() or 1) and "0.0 busy now" in why
        assert cli.choose_threads(1)[1] == "--threads 1 given"
    finally:
        torch.set_num_threads(before)
