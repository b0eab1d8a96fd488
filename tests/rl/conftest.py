"""Fixtures for the RL tests: tasks of the learnable family, a small tokenizer, tiny models."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread for every test here (tests/conftest.py)."""


@pytest.fixture(scope="session")
def rl_tasks(tmp_path_factory):
    """One training task of each kind (calc, count, update) and one held-out task of each."""
    from k3.rl.family import build_tasks

    root = tmp_path_factory.mktemp("rl_tasks")
    return {"train": build_tasks(root, "train", 1), "heldout": build_tasks(root, "heldout", 1), "root": root}


@pytest.fixture(scope="session")
def rl_tokenizer(tmp_path_factory):
    """A 400-token BPE on a few system prompts and tool calls (about a second)."""
    from k3.agentenv.dialects import choose_variant, make_dialect
    from k3.data.tokenizer import train_tokenizer

    texts = [make_dialect(choose_variant(s)).system_prompt() for s in range(8)]
    texts += ["Compute 12 * 34 with the shell and write the result to answer.txt.", "exit code: 0\n408\n"] * 4
    return train_tokenizer(texts, 400, path=tmp_path_factory.mktemp("rl_tok") / "tokenizer.json", allow_short=True)


@pytest.fixture
def tiny_rl_model(rl_tokenizer):
    """`tiny` with the test tokenizer's vocabulary; 2 layers (one KDA, one Gated MLA) to stay fast."""
    from k3.config import get_config
    from k3.model.transformer import K3Model

    torch.manual_seed(0)
    return K3Model(get_config("tiny", n_layers=2, vocab_size=rl_tokenizer.vocab_size, max_context=2048))


@pytest.fixture(scope="session")
def sandbox_ok():
    """Fails (never skips) when the bubblewrap sandbox cannot run here."""
    from k3.agentenv.sandbox import SandboxUnavailable, check_sandbox

    try:
        check_sandbox()
    except SandboxUnavailable as e:
        pytest.fail(f"the RL tests need a working bubblewrap sandbox: {e}", pytrace=False)
