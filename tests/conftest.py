import pytest

from logprob_registry import environment


@pytest.fixture
def fake_env():
    """Install a fake environment for the test; the real one is detected again afterwards."""
    def install(env):
        environment.set_environment(env)
        return env

    yield install
    environment.set_environment(None)
