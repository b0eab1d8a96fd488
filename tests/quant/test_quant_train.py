"""QAT through the trainer: it learns, and N steps straight equal N/2 + resume + N/2 bitwise."""
import pytest
import torch

from k3.config import get_config
from k3.train import checkpoint as ckpt
from k3.train.metrics import read_metrics
from k3.train.trainer import TrainConfig, Trainer

QAT = {"expert_weights": "mxfp4", "activations": "mxfp8", "linears": "mxfp4"}
TINY = dict(steps=6, batch_size=2, seq_len=16, eval_batches=2, warmup_steps=1, ckpt_every=3, eval_every=3)


class Tokens:
    """get_batch(step, B, T, seed): a pure function of (seed, step) over a learnable noisy pattern."""

    def __init__(self, n=4096, vocab=512):
        g = torch.Generator().manual_seed(0)
        i = torch.arange(n)
        self.tokens = ((i * 7) % 61 + (torch.rand(n, generator=g) < 0.1) * torch.randint(0, vocab, (n,), generator=g)) % vocab
        self.vocab_size, self.n_tokens = vocab, n

    def __len__(self):
        return self.n_tokens

    def get_batch(self, step, batch_size, seq_len, seed=0):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, self.n_tokens - seq_len, (batch_size,), generator=g).tolist()
        w = torch.stack([self.tokens[s:s + seq_len + 1] for s in starts])
        return w[:, :-1].clone(), w[:, 1:].clone()


class Stop(Exception):
    pass


@pytest.mark.parametrize("opt", ["adamw", "muon"])
def test_qat_resume_is_bitwise_exact(tmp_path, opt):
    cfg, data = get_config("tiny", qat=QAT), Tokens()
    tc = dict(TINY, optimizer=opt)
    a = Trainer(cfg, TrainConfig(**tc), data, data, tmp_path / "a")
    assert a.model.moe_layers()[0].experts.weight_format == "mxfp4"
    ra = a.fit()

    def crash_at_4(rec):
        if rec["step"] == 4:
            raise Stop

    b = Trainer(cfg, TrainConfig(**tc), data, data, tmp_path / "b")
    with pytest.raises(Stop):
        b.fit(on_step=crash_at_4)
    first = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if r["kind"] == "train"][:3]
    b2 = Trainer(cfg, TrainConfig(**tc), data, data, tmp_path / "b")
    rb = b2.fit(resume=True)
    assert first + rb.losses == ra.losses  # exact float equality
    for (n, x), (_, y) in zip(a.model.state_dict().items(), b2.model.state_dict().items()):
        assert torch.equal(x, y), n
    assert [v["val_loss"] for v in rb.val] == [v["val_loss"] for v in ra.val[1:]]

    # resuming with a different qat setting is refused, naming the field
    other = Trainer(get_config("tiny", qat={"expert_weights": "mxfp4"}), TrainConfig(**dict(tc, steps=8)), data,
                    data, tmp_path / "b")
    with pytest.raises(ckpt.CheckpointError, match="qat"):
        other.fit(resume=True)


def test_qat_learns_and_differs_from_fp32(tmp_path):
    data = Tokens()
    tc = TrainConfig(**dict(TINY, steps=8, ckpt_every=0, eval_every=0))
    plain = Trainer(get_config("tiny"), tc, data, data).fit()
    tc = TrainConfig(**dict(TINY, steps=8, ckpt_every=0, eval_every=0))
    qat = Trainer(get_config("tiny", qat=QAT), tc, data, data).fit()
    assert qat.losses[-1] < qat.losses[0] - 0.5
    assert qat.losses[0] == pytest.approx(plain.losses[0], rel=0.05) and qat.losses != plain.losses
