"""Fixtures for the serving tests: a small tokenizer, a tiny model and a checkpoint of it, made in seconds."""
import pytest
import torch

from k3.config import get_config
from k3.model.transformer import K3Model


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread for every test here (tests/conftest.py)."""


def make_tiny_model(seed: int = 0, **overrides) -> K3Model:
    """`tiny` with weights larger than the training init, so attention is far from uniform and a wrong
    cache, mask or batch row changes the greedy tokens instead of hiding under near-equal logits."""
    torch.manual_seed(seed)
    model = K3Model(get_config("tiny", **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "attnres" not in name:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    return model


@pytest.fixture
def tiny_model_factory():
    """`make_tiny_model` for tests that need their own variant (test modules cannot import a conftest)."""
    return make_tiny_model


@pytest.fixture(scope="session")
def serve_tokenizer(tmp_path_factory):
    """512-token byte-level BPE (tiny's vocab_size) on ~150 KB of the standard library (about a second)."""
    from k3.data.corpus import open_corpus
    from k3.data.tokenizer import train_tokenizer

    texts = [t for _, t in open_corpus().documents("train", max_bytes=150_000)]
    return train_tokenizer(texts, 512, path=tmp_path_factory.mktemp("serve_tok"))


@pytest.fixture(scope="session")
def tiny_model():
    """Shared read-only: tests must not change its weights or modes."""
    return make_tiny_model()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_model, serve_tokenizer):
    """A checkpoint root (as `k3 train` writes it) that names its tokenizer in the manifest."""
    from k3.train.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("serve_ckpt") / "checkpoint"
    save_checkpoint(root, 1, tiny_model, config=tiny_model.config,
                    data_state={"tokenizer": str(serve_tokenizer.path)})
    return root
