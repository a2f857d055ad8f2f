"""pytest plugin: a ``backend`` fixture that runs a test on every installed backend.

Installed attention-multi registers it (entry point ``pytest11``); without
the entry point, load it with ``pytest -p attention_multi.testing.plugin``.

    def test_port_matches(backend):          # one test per backend
        x = am.asarray(data, backend=backend)
        ...

``backend`` is a ``backends.Backend`` (``backend.name`` is ``"torch"``...).
``--am-backends=torch,jax`` chooses the backends; by default every installed
one runs, and one that is installed but cannot be imported skips with the
reason (a backend named in ``--am-backends`` fails instead). JAX computes in
float32 unless ``opt(backend).enable_float64()`` is called.

Your own ``backend`` fixture (e.g. in conftest.py), or a test that
parametrizes ``backend`` itself, takes precedence: this plugin then
parametrizes nothing, so it never multiplies a suite's own cases.
"""

from __future__ import annotations

import pytest

from attention_multi import backends
from attention_multi.backends import Backend

from ..config import get_backend

_CHOSEN = pytest.StashKey[tuple[list[str], bool]]()
_PARAM = "am_backend_name"  # what this plugin parametrizes


def pytest_addoption(parser: pytest.Parser) -> None:
    """Adds ``--am-backends=NAMES``."""
    group = parser.getgroup("attention-multi")
    group.addoption(
        "--am-backends",
        metavar="NAMES",
        default=None,
        help="comma-separated backends for the `backend` fixture of "
        f"attention_multi.testing ({', '.join(backends.BACKEND_NAMES)}); "
        "default: every installed one",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Resolves the chosen backends (a UsageError names an unknown one)."""
    text = config.getoption("am_backends")
    if text is None:
        config.stash[_CHOSEN] = (backends.available_backends(), False)
        return
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            name = backends.canonical_name(part)
        except ValueError as exc:
            raise pytest.UsageError(f"--am-backends={text}: {exc}") from None
        if name not in names:
            names.append(name)
    config.stash[_CHOSEN] = (names, True)


def _parametrized_by_test(metafunc: pytest.Metafunc, name: str) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        argnames = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
        if isinstance(argnames, str):
            argnames = [a.strip() for a in argnames.split(",")]
        if name in argnames:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrizes the tests that use the ``backend`` fixture, one case per backend."""
    # _PARAM is in the closure only where this plugin's `backend` fixture is used.
    if _PARAM in metafunc.fixturenames and not (
        _parametrized_by_test(metafunc, "backend") or _parametrized_by_test(metafunc, _PARAM)
    ):
        names = metafunc.config.stash[_CHOSEN][0]
        metafunc.parametrize(_PARAM, names, ids=names)


@pytest.fixture
def backend(request: pytest.FixtureRequest, am_backend_name: str) -> Backend:
    """The ``backends.Backend`` this test runs on, one per chosen backend."""
    try:
        return get_backend(am_backend_name)
    except ImportError as exc:
        reason = str(exc)
    if request.config.stash[_CHOSEN][1]:
        pytest.fail(
            f"--am-backends asks for {am_backend_name!r}, which cannot be used: {reason}",
            pytrace=False,
        )
    pytest.skip(f"backend {am_backend_name!r} cannot be used: {reason}")
