import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread for every test here (tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory):
    """A real `k3 tokenize` directory: 512-token BPE on ~300 KB per split of the standard library (~1 s)."""
    from k3.data import prepare_data

    out = tmp_path_factory.mktemp("data")
    prepare_data(out, vocab_size=512, max_bytes=300_000)
    return out
