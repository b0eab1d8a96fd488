"""Shared fixtures for agentenv tests. Sandbox tests fail (never skip) when bubblewrap is missing."""
import pytest

from k3.agentenv.sandbox import SandboxUnavailable, check_sandbox, default_config


@pytest.fixture(scope="session")
def sandbox():
    """The default bwrap sandbox config; fails with the install hint when bwrap cannot run."""
    cfg = default_config()
    try:
        check_sandbox(cfg)
    except SandboxUnavailable as e:
        pytest.fail(f"agentenv tests need a working bubblewrap sandbox: {e}", pytrace=False)
    return cfg


@pytest.fixture(scope="session")
def fast_sandbox(sandbox):
    """Tight limits for tests that provoke timeouts."""
    from k3.agentenv.redteam import redteam_config
    return redteam_config()
