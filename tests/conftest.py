import os

import pytest

# A developer's prebuilt kernels (`logprob-registry warmup`) would stand in for the compiled
# backend's torch.compile path, whose compiles and failures tests count: none are loaded, here or
# in the tests' subprocesses, except from the folders tests/test_warmup.py builds.
os.environ["LOGPROB_REGISTRY_KERNEL_CACHE"] = "off"
# No measured ranking either: a developer's tuning file (`logprob-registry tune`) would reorder the
# backends that tests expect priority to order. The process-wide registry reads its ranking source
# (the tuning file in force) at every selection and the tests' subprocesses inherit the variable,
# so this holds in both, from before the package's import; registries a test makes take none
# (make_registry(ranking=None), below). A test of tuning asks for one: make_registry(ranking=Tuning(...)),
# or monkeypatch.setenv("LOGPROB_REGISTRY_TUNING", path) for the process-wide registry.
os.environ["LOGPROB_REGISTRY_TUNING"] = "off"

from logprob_registry import environment  # noqa: E402 - after the variables above


@pytest.fixture
def fake_env():
    """Install a fake environment for the test; the real one is detected again afterwards."""
    def install(env):
        environment.set_environment(env)
        return env

    yield install
    environment.set_environment(None)


@pytest.fixture
def make_registry():
    """``make_registry(*plugins, builtins=(), environment=None, ranking=None)``: a fresh registry
    that touches no global: the ONE place the tests construct registries.

    - ``plugins``, registered in order: plugin objects (named ``plugin-<i>``, ``i`` their position),
      ``(name, plugin)`` pairs, or ``lr.Backend`` records (all of them registered by one plugin
      named ``plugin``, at the first one's position);
    - ``builtins``: the built-in plugin modules to load (none by default; ``"all"``: every built-in);
      entry points are never loaded;
    - ``environment``: an ``Environment`` (``Environment.fake(...)``), a function returning one, or
      None for the detected environment (``fake_env`` replaces that one);
    - ``ranking``: the tuning ranking it follows (None: priority decides).

    The registry's ``install_env(env)`` replaces its environment (the caches follow it)."""
    from logprob_registry import hookimpl
    from logprob_registry.backend import Backend
    from logprob_registry.environment import Environment, get_environment
    from logprob_registry.registry import BUILTIN_PLUGINS, Registry

    def make(*plugins, builtins=(), environment=None, ranking=None):
        source = [environment]

        def current():
            env = source[0]
            if env is None:
                return get_environment()
            return env if isinstance(env, Environment) else env()

        reg = Registry(builtins=BUILTIN_PLUGINS if builtins == "all" else tuple(builtins), entry_points=False,
                       environment=current, ranking=ranking)
        backends = [p for p in plugins if isinstance(p, Backend)]

        class BackendsPlugin:
            @hookimpl
            def register_backends(self, register):
                for backend in backends:
                    register(backend)

        for i, plugin in enumerate(plugins):
            if isinstance(plugin, Backend):
                if plugin is backends[0]:
                    reg.add_plugin(BackendsPlugin(), name="plugin")
            elif isinstance(plugin, tuple):
                reg.add_plugin(plugin[1], name=plugin[0])
            else:
                reg.add_plugin(plugin, name=f"plugin-{i}")

        def install(env):
            source[0] = env
            return env

        reg.install_env = install
        return reg

    return make


@pytest.fixture
def plug():
    """``plug(plugin, name)`` adds a plugin to the process-wide registry for the test and returns
    the registry; every plugin added is removed afterwards (the last added first)."""
    from logprob_registry.registry import get_registry

    reg, names = get_registry(), []

    def add(plugin, name):
        reg.add_plugin(plugin, name=name)
        names.append(name)
        return reg

    yield add
    for name in reversed(names):
        reg.remove_plugin(name)


@pytest.fixture(scope="module")
def world():
    """This process alone in a gloo group (the same path as a larger group), for a module's tests."""
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    path = tempfile.mktemp(prefix="logprob-test-")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# This project's own run of the conformance suite (tests/test_conformance.py) covers every
# eligible backend. Tests of an op or promise a backend does not declare are deselected here,
# where that is known before they run, so that a skip in this project's run always names missing
# hardware; the terminal summary says what was deselected and why.
_undeclared: dict = {}


def pytest_collection_modifyitems(config, items):
    from logprob_registry.registry import get_registry
    from logprob_registry.testing.suite import BackendConformance, not_declared

    keep, drop = [], []
    for item in items:
        cls = getattr(item, "cls", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        name = params.get("conformance_backend") or getattr(cls, "backend", None)
        reason = None
        if cls is not None and issubclass(cls, BackendConformance) and name:
            reason = not_declared(get_registry().get(name), item.originalname, params, cls)
        if reason is None:
            keep.append(item)
        else:
            drop.append(item)
            _undeclared[reason] = _undeclared.get(reason, 0) + 1
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter):
    if _undeclared:
        terminalreporter.write_sep("-", "conformance tests deselected: not declared by the backend")
        for reason, count in sorted(_undeclared.items()):
            terminalreporter.write_line(f"{count:4d}  {reason}")
