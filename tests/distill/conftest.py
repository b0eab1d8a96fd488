import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread for every test here (tests/conftest.py)."""


@pytest.fixture(scope="session")
def domain_tokenizer(tmp_path_factory):
    """A 320-token BPE trained on a little of every domain's text (about a second)."""
    from k3.data.tokenizer import train_tokenizer
    from k3.distill.domains import make_domains, tokenizer_texts

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_tokenizer(tokenizer_texts(make_domains(), n_per_domain=200), 320, path=path, allow_short=True)


@pytest.fixture
def small_config(domain_tokenizer):
    """Two layers (one KDA, one Gated MLA), every other feature of `tiny`."""
    from k3.config import get_config

    return get_config("tiny", n_layers=2, vocab_size=domain_tokenizer.vocab_size, max_context=160)
