"""Pipeline-parallel training (GPipe over the accum micro-batches, the AttnRes sources crossing stages)
against the single-process Trainer, on packed documents (each stage masks at their boundaries): 2 stages on 2 ranks, then a resume of that pp = 2 checkpoint on 4
ranks (2 stages x 2 data-parallel ranks, FSDP 2, EP 2), and `k3 train --nproc 2 --pp 2` end to end.

The comparison runs in float64, as test_parallel_fsdp does and for the same reason: in float32 the
distributed step sums gradients in another order (per stage, per rank, then the reductions), and AdamW's
first steps turn that rounding noise in near-zero gradient entries into updates of size lr, so the fp32
trajectories drift apart by rounding alone; in float64 that noise is ~1e-16 and a real mistake shows. The
final parameters are compared too: a missing sum of the AttnRes gradients over the stages moves the loss
by only ~2e-5 in these 8 steps (the queries start at zero and move slowly) but those parameters by ~2e-2.
"""
import json
import sys

import pytest
import torch
from test_parallel_fsdp import Tokens  # the tests' learnable token stream (same directory)

from k3.config import get_config
from k3.model.transformer import K3Model
from k3.parallel import cli as pcli
from k3.parallel.launch import run_local
from k3.parallel.pipeline import prune_to_stage
from k3.train.trainer import TrainConfig, Trainer

class Documents(Tokens):
    """The same stream cut into documents of 11 tokens: every window holds boundaries, so the stages must all
    mask at them (each stage's KDA, convolution and MLA) for the pipeline to equal one process."""

    def window_doc_ids(self, starts, seq_len):
        return (torch.as_tensor(starts).reshape(-1, 1) + torch.arange(seq_len)) // 11

    def get_batch(self, step, batch_size, seq_len, seed=0, docs=False):
        x, y = super().get_batch(step, batch_size, seq_len, seed)
        if not docs:
            return x, y
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)  # Tokens' window starts
        starts = torch.randint(0, self.n_tokens - seq_len, (batch_size,), generator=g)
        return x, y, self.window_doc_ids(starts, seq_len)


TC = dict(steps=8, batch_size=4, seq_len=16, accum=2, warmup_steps=2, measure_mfu=False, record_attnres=False)
TOL = 1e-4  # losses (each a float32 cross-entropy, so ~5e-7 is its resolution)
PARAM_TOL = 1e-6  # final parameters; measured ~5e-8


def _train(rank, world, pp, ep, fsdp, out, resume=None, ckpt_every=4):
    from k3.parallel.mesh import ParallelDims, build_context
    from k3.parallel.train import ParallelTrainer

    torch.set_default_dtype(torch.float64)
    ctx = build_context(ParallelDims(world, ep=ep, fsdp=fsdp, pp=pp))
    t = ParallelTrainer(get_config("tiny"), TrainConfig(**TC, ckpt_every=ckpt_every), Documents(), ctx, out_dir=out)
    norms = []
    losses = t.fit(resume=resume or False, on_step=lambda r: norms.append(r["grad_norm"])).losses
    params = {}
    for name, p in t.model.named_parameters():  # collectives: every rank gathers every parameter it holds
        params[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    from k3.parallel.expert import expert_modules, gather_experts

    for m in expert_modules(t.model):
        prefix = next(n for n, mod in t.model.named_modules() if mod is m)
        for w, full in zip(("w1", "w3", "w2"), gather_experts(m)):
            params[f"{prefix}.{w}"] = full
    return {"losses": losses, "norms": norms, "params": params, "pp_rank": ctx.pp_rank}


@pytest.fixture(scope="module")
def reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    try:
        norms = []
        t = Trainer(get_config("tiny"), TrainConfig(**TC), Documents(), None)
        assert t.doc_mask
        losses = t.fit(on_step=lambda r: norms.append(r["grad_norm"])).losses
        return {"losses": losses, "norms": norms,
                "params": {n: p.detach().clone() for n, p in t.model.named_parameters()}}
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_num_threads(threads)


def _check(results, ref, first_step=0):
    """Every rank's losses and grad norms equal the reference's from `first_step`; the stages' parameters
    together are exactly the whole model's, each equal to the reference's."""
    want = ref["losses"][first_step:]
    for r in results:
        assert len(r["losses"]) == len(want)
        diff = max(abs(a - b) for a, b in zip(r["losses"], want))
        assert diff <= TOL, (diff, r["losses"], want)
        assert r["losses"] == results[0]["losses"]  # the last stage's loss reached every rank
        rel = max(abs(a - b) / b for a, b in zip(r["norms"], ref["norms"][first_step:]))
        assert rel <= 1e-8, (rel, r["norms"], ref["norms"][first_step:])  # the global norm, over stages (fp64)
    held = {}
    for r in results:
        for name, p in r["params"].items():
            err = float((p - ref["params"][name]).abs().max())
            assert err <= PARAM_TOL, (name, r["pp_rank"], err)
            held.setdefault(name, set()).add(r["pp_rank"])
    assert set(held) == set(ref["params"])
    stages = {r["pp_rank"] for r in results}
    shared = {n for n, s in held.items() if len(s) > 1}
    assert all(n.startswith("attnres.") for n in shared) and held["embed.weight"] == {0}  # stages hold their own
    assert all(held[n] == stages for n in shared)


def test_prune_to_stage_keeps_whole_model_names():
    cfg = get_config("tiny")
    full = {n for n, _ in K3Model(cfg).named_parameters()}
    names = []
    for s in range(2):
        m = K3Model(cfg)
        held = prune_to_stage(m, s, 2)
        names.append({n for n, _ in m.named_parameters()})
        assert [b.layer_idx for b in m.layers] == list(held)
    assert names[0] | names[1] == full
    assert {n.split(".")[0] for n in names[0] ^ names[1]} == {"embed", "layers", "norm", "head"}
    # what pipeline stages cannot split is refused before a model is pruned (the launcher, every rank's Trainer)
    from k3.parallel.mesh import ParallelDims
    from k3.parallel.train import check_parallel_settings

    with pytest.raises(ValueError, match="tie_embeddings"):
        check_parallel_settings(cfg.replace(tie_embeddings=True), TrainConfig(), ParallelDims(2, pp=2))
    with pytest.raises(ValueError, match="cannot split 4 layers"):
        check_parallel_settings(cfg, TrainConfig(), ParallelDims(5, pp=5))


def test_two_stages_match_single_process_then_resume_on_stages_times_data_parallel(reference, tmp_path):
    # 2 ranks = 2 stages (layers 0-1 | 2-3), GPipe over the 2 micro-batches of each step
    a = run_local(_train, 2, 2, 1, 0, str(tmp_path / "a"), timeout_s=240)
    _check(a, reference)
    logged = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged] == a[0]["losses"]  # rank 0 (stage 0) wrote the last stage's loss
    step4 = tmp_path / "a" / "checkpoint" / "step_000004"
    meta = json.loads((step4 / "k3.json").read_text())
    assert meta["dims"]["pp"] == 2 and len(meta["expert_loads"]) == 3  # MoE layers of both stages

    # resume that pp = 2 checkpoint on 4 ranks: 2 stages x 2 dp ranks, FSDP over 2, experts 4 + 4 (EP 2)
    c = run_local(_train, 4, 2, 2, 2, str(tmp_path / "c"), str(step4), timeout_s=240)
    _check(c, reference, first_step=4)


def test_cli_trains_two_stages(tmp_path, monkeypatch, capfd):
    from k3.cli import main
    from k3.data import prepare_data

    data, out = tmp_path / "data", tmp_path / "out"
    prepare_data(data, vocab_size=512, max_bytes=60_000)
    argv = ["train", "--preset", "tiny", "--data", str(data), "--out", str(out), "--nproc", "2", "--pp", "2",
            "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--accum", "2", "-q"]
    monkeypatch.setattr(sys, "argv", ["k3", *argv])  # the --nproc re-launch reads the command line
    run = pcli.run_forwarding_signals  # a hung job fails the test instead of blocking it (the group is killed)
    monkeypatch.setattr(pcli, "run_forwarding_signals", lambda cmd: run(cmd, timeout=240))
    assert main(argv) == 0, capfd.readouterr().err[-3000:]
    printed = capfd.readouterr().out
    assert "trained to step 2" in printed and "pp 2 x dp 1" in printed, printed
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and all(r["loss"] > 0 for r in logged)
    meta = json.loads((out / "checkpoint" / "step_000002" / "k3.json").read_text())
    assert meta["dims"]["pp"] == 2
    assert meta["data"]["data_dir"] == str(data.resolve()) and meta["data"]["train_tokens"] > 0

    # k3 eval reads the distributed checkpoint as it is, in one process
    assert main(["eval", "--ckpt", str(out / "checkpoint"), "--max-batches", "1", "--json"]) == 0
    report = json.loads(capfd.readouterr().out)
    assert report["step"] == 2 and 0 < report["val_loss"] < 10
    assert report["seq_len"] == 16  # the trained length, read from the checkpoint as for a single-process one

    # a resume (here in a world of one) on other data is refused before anything is loaded
    other = tmp_path / "other"
    prepare_data(other, vocab_size=512, max_bytes=40_000)
    resume = ["train", "--preset", "tiny", "--data", str(other), "--out", str(out), "--resume", "--steps", "3",
              "--batch-size", "2", "--seq-len", "16", "--accum", "2", "-q"]
    assert main(resume) == 2
    err = capfd.readouterr().err
    assert "the checkpoint was trained on data with" in err and f"--data {data.resolve()}" in err, err


def test_cli_new_run_with_redundant_expert_slots_and_overwrite(tmp_path, monkeypatch, capfd):
    """3 experts over 2 EP ranks: a new run places them from uniform loads with a spare slot per rank (the
    replicas), and --overwrite starts it over (every rank sees the old checkpoint before rank 0 deletes it)."""
    from k3.cli import main
    from k3.data import prepare_data

    data, out = tmp_path / "data", tmp_path / "out"
    prepare_data(data, vocab_size=512, max_bytes=40_000)
    argv = ["train", "--preset", "tiny", "--set", "n_experts=3", "--data", str(data), "--out", str(out),
            "--nproc", "2", "--ep", "2", "--ep-redundant", "1", "--steps", "2", "--batch-size", "2",
            "--seq-len", "16", "-q"]
    monkeypatch.setattr(sys, "argv", ["k3", *argv])
    run = pcli.run_forwarding_signals
    monkeypatch.setattr(pcli, "run_forwarding_signals", lambda cmd: run(cmd, timeout=240))
    assert main(argv) == 0, capfd.readouterr().err[-3000:]
    assert "trained to step 2" in capfd.readouterr().out
    def losses():
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = losses()
    argv = [*argv, "--overwrite"]
    monkeypatch.setattr(sys, "argv", ["k3", *argv])
    assert main(argv) == 0, capfd.readouterr().err[-3000:]
    assert losses() == first and len(first) == 2  # started over: the same run again
    # data of another vocabulary fails on every rank with the single-process message, before a model is built
    argv = [*argv[:3], "--set", "vocab_size=1024", *argv[3:]]
    monkeypatch.setattr(sys, "argv", ["k3", *argv])
    assert main(argv) != 0
    assert "tokenized with a vocabulary of 512 tokens but the model has vocab_size = 1024" in capfd.readouterr().err
    assert sorted(p.name for p in (out / "checkpoint").iterdir() if p.name.startswith("step_")) == ["step_000002"]
