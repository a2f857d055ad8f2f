"""Test fixtures: ``backend`` and ``device``, parametrized over what is installed.

Backends that are not installed skip with a reason, unless they are named in
ATTENTION_MULTI_REQUIRE (e.g. ``numpy,torch,jax,mxnet``): then they fail.
The ``cuda`` device skips with a reason where no GPU is present.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from attention_multi import backends

# Idle OpenMP threads sleep instead of spinning (read when torch loads, later):
# the suite's workers share the cores (in CI, two stacks of two workers on two),
# and a torch thread that spins after each parallel region takes the time of
# the process beside it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _fast_xla_compiles():
    """XLA's CPU compiler set for many small programs: eager JAX compiles each
    operation at each new shape (tests/test_mods.py alone: about 2,500), so
    most of the suite's JAX time is compiling. Without the newer fusion
    emitters (``--xla_cpu_use_fusion_emitters=false``: the same bits; JAX
    0.10, test_mods and test_forms 147 s -> 111 s) and without LLVM's
    optimizations (``--xla_backend_optimization_level=0``: test_mods,
    test_forms and test_paths on JAX 179 s -> 144 s on JAX 0.10, 170 s -> 125
    s on 0.6.2). XLA's graph passes still run and neither allows fast math;
    the second rounds differently (at most about one unit in the last place:
    float32 9e-8, float64 2e-16 relative, far inside every tolerance here).
    A flag the caller sets in XLA_FLAGS stands (the default build's rounding:
    ``XLA_FLAGS=--xla_backend_optimization_level=2``). Kept only where this XLA
    knows the flags (an unknown one aborts at start-up), checked once in a
    subprocess."""
    wanted = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0")
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("ATTENTION_MULTI_XLA_PROBED") or importlib.util.find_spec("jax") is None:
        return
    os.environ["ATTENTION_MULTI_XLA_PROBED"] = "1"  # (once: the workers inherit the answer)
    probe = [sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"]
    for flag in wanted:
        if flag.split("=")[0] in flags:  # (the caller's own setting stands)
            continue
        env = dict(os.environ, XLA_FLAGS=f"{flags} {flag}".strip(), JAX_PLATFORMS="cpu")
        if subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0:
            flags = os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]


_fast_xla_compiles()

# One JAX compilation cache for the whole run, made by the first process (the
# xdist controller) and inherited through the environment: the workers and the
# tests' subprocesses reuse what another process compiled. Removed at the end.
JAX_CACHE = "JAX_COMPILATION_CACHE_DIR"
_made_jax_cache = None
if JAX_CACHE not in os.environ:
    _made_jax_cache = os.environ[JAX_CACHE] = tempfile.mkdtemp(prefix="attention-multi-jax-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


# The cost of a kernel call is the idle one: "auto"'s choices, which tests
# assert, do not follow the load of the machine that runs them (a suite beside
# another is busy). tests/test_selection.py checks the measured cost itself.
os.environ.setdefault("ATTENTION_MULTI_CALL_COST", "idle")


def pytest_unconfigure(config):
    if _made_jax_cache is not None:
        shutil.rmtree(_made_jax_cache, ignore_errors=True)


REQUIRED = {
    n.strip() for n in os.environ.get("ATTENTION_MULTI_REQUIRE", "").split(",") if n.strip()
}
DEVICES = ("cpu", "cuda")


def load_backend(name):
    """The backend, or skip (fail if required) when it cannot be imported."""
    from attention_multi import get_backend

    try:
        B = get_backend(name)
    except ImportError as exc:
        if name in REQUIRED:
            pytest.fail(f"required backend {name!r} is unavailable: {exc}", pytrace=False)
        pytest.skip(f"backend {name!r} is not installed: {exc}")
    B.enable_float64()  # float64 rows need it (JAX); explicit dtypes keep float32
    return B


def import_or_skip(module):
    """``module`` imported, or the test module skipped (failed where
    ATTENTION_MULTI_REQUIRE names it: the integrations' transformers, flax)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if module in REQUIRED:
            pytest.fail(f"required package {module!r} is unavailable: {exc}", pytrace=False)
        pytest.skip(f"{module!r} is not installed: {exc}", allow_module_level=True)


def pytest_generate_tests(metafunc):
    names = metafunc.fixturenames
    if "backend_name" in names and "device_name" in names:  # numpy is CPU only
        pairs = [(s.name, d) for s in backends.BACKENDS for d in DEVICES if s.cuda or d == "cpu"]
        metafunc.parametrize("backend_name, device_name", pairs, ids=[f"{b}-{d}" for b, d in pairs])
    elif "backend_name" in names:
        metafunc.parametrize("backend_name", backends.BACKEND_NAMES)


@pytest.fixture
def backend(backend_name):
    return load_backend(backend_name)


@pytest.fixture
def device(backend, device_name):
    """A device name usable with ``backend``; skips if absent."""
    from attention_multi.config import native_device

    if device_name != "cpu":
        try:
            native_device(backend, device_name)
        except ValueError as exc:
            pytest.skip(f"no {device_name} device here: {exc}")
    return device_name


@pytest.fixture(autouse=True)
def _fresh_selection(monkeypatch):
    """Each test starts with no set_backend choice and no env-var overrides."""
    from attention_multi import config

    monkeypatch.setitem(config._state, "backend", None)
    monkeypatch.delenv(config.BACKEND_ENV, raising=False)
    monkeypatch.delenv(config.DEVICE_ENV, raising=False)
