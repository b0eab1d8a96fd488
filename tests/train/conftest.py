import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread for every test here (tests/conftest.py)."""


class FakeData:
    """An in-memory token stream with the dataset interface the trainer uses: get_batch(step, B, T, seed)
    is a pure function of (seed, step). The stream is learnable (a noisy arithmetic pattern)."""

    def __init__(self, n_tokens: int = 8192, vocab_size: int = 512, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        i = torch.arange(n_tokens)
        noise = (torch.rand(n_tokens, generator=g) < 0.1) * torch.randint(0, vocab_size, (n_tokens,), generator=g)
        self.tokens = ((i * 7) % 61 + noise) % vocab_size
        self.vocab_size = vocab_size
        self.n_tokens = n_tokens

    def __len__(self):
        return self.n_tokens

    def get_batch(self, step, batch_size, seq_len, seed=0):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, self.n_tokens - seq_len, (batch_size,), generator=g)
        w = torch.stack([self.tokens[s:s + seq_len + 1] for s in starts.tolist()])
        return w[:, :-1].clone(), w[:, 1:].clone()


@pytest.fixture
def fake_data():
    return FakeData


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory):
    """A real `k3 tokenize` directory: 512-token BPE on ~300 KB per split of the standard library (~1 s)."""
    from k3.data import prepare_data

    out = tmp_path_factory.mktemp("data")
    prepare_data(out, vocab_size=512, max_bytes=300_000)
    return out
