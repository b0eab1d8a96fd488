"""FSDP2 + MoonEP training on local gloo ranks against the single-process Trainer, and distributed
checkpoints: save on 2 ranks, resume on 2 and on 4 (a different EP / FSDP layout), and a rank that dies
inside a save, which fails the job loudly and leaves the previous checkpoint complete.

The comparison runs in float64. In float32 the 2-rank trajectory drifts from the single-process one by
rounding alone (the gradient sums run in another order, and AdamW's first steps turn noise in near-zero
gradient entries into updates of size lr): measured at a few 1e-6 over the first 8 steps and up to
~4e-4 by step 20. In float64 that noise is ~1e-16, so a real mistake (a missing 1/dp, a wrong split, a
replica not reduced) still shows up at 1e-4 while rounding does not.
"""
import json

import pytest
import torch

from k3.config import get_config
from k3.parallel.launch import LocalJobError, run_local
from k3.train.trainer import TrainConfig, Trainer

TC = dict(steps=20, batch_size=4, seq_len=16, warmup_steps=2, measure_mfu=False, record_attnres=False)
TOL = 1e-4


class Tokens:
    """A learnable in-memory token stream; get_batch(step, B, T, seed) is a pure function of its arguments."""

    def __init__(self, n_tokens: int = 8192, vocab_size: int = 512):
        g = torch.Generator().manual_seed(0)
        i = torch.arange(n_tokens)
        noise = (torch.rand(n_tokens, generator=g) < 0.1) * torch.randint(0, vocab_size, (n_tokens,), generator=g)
        self.tokens = ((i * 7) % 61 + noise) % vocab_size
        self.n_tokens, self.vocab_size = n_tokens, vocab_size

    def __len__(self):
        return self.n_tokens

    def get_batch(self, step, batch_size, seq_len, seed=0):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, self.n_tokens - seq_len, (batch_size,), generator=g)
        w = torch.stack([self.tokens[s:s + seq_len + 1] for s in starts.tolist()])
        return w[:, :-1].clone(), w[:, 1:].clone()


def _train(rank, world, ep, fsdp, out, resume=None, ckpt_every=10, die_in_save_of=None, redundant=0):
    import os

    from k3.parallel import checkpoint as pckpt
    from k3.parallel.mesh import ParallelDims, build_context
    from k3.parallel.train import ParallelTrainer, placements_from_loads

    torch.set_default_dtype(torch.float64)
    ctx = build_context(ParallelDims(world, ep=ep, fsdp=fsdp))
    placements = None
    if redundant:  # EPLB at restart: place experts from the loads the checkpoint observed
        placements = placements_from_loads(pckpt.read_meta(resume)["expert_loads"], ep, redundant)
        assert all(not p.is_contiguous for p in placements.values())
    t = ParallelTrainer(get_config("tiny"), TrainConfig(**TC, ckpt_every=ckpt_every), Tokens(), ctx, out_dir=out,
                        placements=placements)
    if die_in_save_of is not None and rank == 1:
        real_save = pckpt.dcp.save

        def dying_save(state, checkpoint_id=None, **kw):
            if f"step_{die_in_save_of:06d}" in str(checkpoint_id):
                os._exit(3)  # no exception, no cleanup: the process is simply gone
            return real_save(state, checkpoint_id=checkpoint_id, **kw)

        pckpt.dcp.save = dying_save
    return t.fit(resume=resume or False).losses


@pytest.fixture(scope="module")
def reference_trainer():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: extra threads only spin, and the ranks need the cores
    torch.set_default_dtype(torch.float64)
    try:
        trainer = Trainer(get_config("tiny"), TrainConfig(**TC), Tokens(), None)
        trainer.losses = trainer.fit().losses
        return trainer
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(reference_trainer):
    return reference_trainer.losses


def _close(a, b):
    assert len(a) == len(b) and len(a) > 0
    diff = max(abs(x - y) for x, y in zip(a, b))
    assert diff <= TOL, (diff, a, b)
    return diff


def test_two_rank_fsdp_ep_training_matches_single_process_then_resumes(reference, reference_trainer, tmp_path):
    # 2 ranks: FSDP2 over both for the non-expert weights, experts split 4 + 4 (EP = 2)
    a = run_local(_train, 2, 2, 2, str(tmp_path / "a"), timeout_s=240)
    _close(a[0], reference)
    assert a[0] == a[1]  # every rank reports the same (all-reduced) loss
    step10 = tmp_path / "a" / "checkpoint" / "step_000010"
    assert json.loads((step10 / "k3.json").read_text())["step"] == 10

    # resume on the same rank count from step 10; rank 1 dies inside the save of step 14
    with pytest.raises(LocalJobError, match="rank 1 exited with code 3"):
        run_local(_train, 2, 2, 2, str(tmp_path / "b"), str(step10), 2, 14, timeout_s=240)
    ck = tmp_path / "b" / "checkpoint"
    assert (ck / "latest").read_text().strip() == "step_000012"  # the last complete checkpoint ...
    assert not (ck / "step_000014").exists()  # ... and the torn one never got a name
    logged = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    _close([r["loss"] for r in logged if r["step"] <= 12], reference[10:12])

    # resume the survivor's last checkpoint on 4 ranks: EP 2 x 2 copies, FSDP 2 x 2 replicas (HSDP), and
    # experts re-placed from the observed loads with one redundant slot per EP rank (replicated hot experts)
    c = run_local(_train, 4, 2, 2, str(tmp_path / "c"), str(ck), 10, None, 1, timeout_s=240)
    _close(c[0], reference[12:])
    loads = json.loads((tmp_path / "c" / "checkpoint" / "step_000020" / "k3.json").read_text())["expert_loads"]
    cfg = get_config("tiny")
    # observed over steps 13..20: every token-slot of every MoE layer counted once over the world
    assert [sum(layer) for layer in loads] == [8 * 4 * 16 * cfg.n_active_experts] * (cfg.n_layers - cfg.n_dense_layers)

    # the same checkpoint (4 ranks, replicated experts) read whole into one process, as k3 eval / sample / export
    # read it, holds the single-process run's weights
    from k3.io.trained import load_trained_model

    torch.set_default_dtype(torch.float64)
    try:
        model, manifest = load_trained_model(tmp_path / "c" / "checkpoint")
    finally:
        torch.set_default_dtype(torch.float32)
    assert manifest["step"] == 20 and manifest["extra"]["tokens"] == 20 * 4 * 16
    want = reference_trainer.model.state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert diff <= 1e-6, diff


def test_latest_falls_back_to_the_newest_complete_step(tmp_path, caplog):
    """`latest` names a step whose rewrite was cut short (its directory gone): resume from the newest complete
    step, as the single-process loader does, rather than finding no checkpoint at all."""
    from k3.parallel.checkpoint import LATEST, META, latest

    for n in (2, 10, 4):
        (tmp_path / f"step_{n:06d}").mkdir()
        (tmp_path / f"step_{n:06d}" / META).write_text(json.dumps({"step": n}))
    (tmp_path / "step_000012").mkdir()  # no meta: not complete
    (tmp_path / LATEST).write_text("step_000010\n")
    assert latest(tmp_path).name == "step_000010"
    (tmp_path / LATEST).write_text("step_000014\n")
    assert latest(tmp_path).name == "step_000010"
    assert latest(tmp_path / "step_000004").name == "step_000004"
    assert latest(tmp_path / "empty") is None
    # a single-process checkpoint root has a `latest` file too: not a distributed checkpoint, and no warning
    from k3.model.transformer import K3Model
    from k3.train import checkpoint as ckpt

    m = K3Model(get_config("tiny"))
    ckpt.save_checkpoint(tmp_path / "single", 8, m, None, m.config)
    caplog.clear()
    assert latest(tmp_path / "single") is None and not caplog.records
