import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: intra-op threads only add synchronisation (and spinning on a shared machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory):
    """A real `k3 tokenize` directory: 512-token BPE on ~300 KB per split of the standard library (~1 s)."""
    from k3.data import prepare_data

    out = tmp_path_factory.mktemp("data")
    prepare_data(out, vocab_size=512, max_bytes=300_000)
    return out
