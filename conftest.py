"""Test fixtures: ``backend`` and ``device``, parametrized over what is installed,
and the tiers of the suite (issue 63).

Backends that are not installed skip with a reason, unless they are named in
ATTENTION_MULTI_REQUIRE (e.g. ``numpy,torch,jax,mxnet``): then they fail (and
``test_backends.py::test_required_backend_loads`` fails for each, whatever the tier).
The ``cuda`` device is collected only where a CUDA driver is present
(``/proc/driver/nvidia``, or ``ATTENTION_MULTI_CUDA=1``), and skips with a
reason where it then cannot be used.

Tiers (``--matrix``, default ``ATTENTION_MULTI_MATRIX`` or ``fast``; ``--stack``,
default ``first``), by marker, so that a new test file needs no list here:

- ``--matrix=full``: every row of every test on every backend (``make test-all``).
- ``--matrix=fast`` (``make test``):
  ``@pytest.mark.core``: a fact the core decides (argument checks, editions,
  messages): every row on NumPy, the first row of the test on each other
  backend (its smoke). ``@pytest.mark.grid(rows=...)``: a path x form x dtype
  grid: every row on NumPy, torch and MXNet (cheap); on JAX (each new program
  compiles) the rows whose parameters match ``rows`` (default float32), and
  the ``grid_paths`` fixture gives it the paths JAX takes by itself (fused,
  full) instead of all four.
- ``--stack=second`` (the modern stack in ``make test``): what differs there:
  every NumPy row, the first row of each test on every other backend, the
  tests marked ``second_stack`` (numpy 2's files and oracle, ONNX, the
  newest JAX's own features) or ``integration`` (``tests/test_integrations_*.py``
  are marked so by their name); a test that has no backend parameter and no
  such marker runs on the first stack only.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from attention_multi import backends
from attention_multi.backends.capabilities import opt

# Idle OpenMP threads sleep instead of spinning (read when torch loads, later):
# the suite's workers share the cores (in CI, two stacks of two workers on two),
# and a torch thread that spins after each parallel region takes the time of
# the process beside it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Inductor compiles in the test's own process, not in a pool of workers that
# each import torch first (one torch.compile of flex with its backward, cold
# cache: 24 s against 27 s; the same kernels).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


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


MARKERS = {
    "core": "a fact the core decides: --matrix=fast runs every row on NumPy and "
    "the test's first row on each other backend",
    "grid(rows=None, jax_paths=None)": "a path x form x dtype grid: --matrix=fast runs "
    "on JAX only the rows matching rows (default dtype float32), over grid_paths",
    "integration": "a framework integration (transformers, flax, ONNX): runs on the "
    "second stack too",
    "second_stack": "what it proves differs on the second (modern) stack: runs there in make test",
    "slow": "takes more than about 10 s of one core (shown, not skipped: make test runs it)",
}


def pytest_addoption(parser):
    group = parser.getgroup("attention-multi tiers")
    group.addoption(
        "--matrix",
        choices=("fast", "full"),
        default=os.environ.get("ATTENTION_MULTI_MATRIX", "fast"),
        help="fast: each core fact on NumPy plus a smoke per backend, JAX grids "
        "cut to their own paths; full: every row everywhere (default: "
        "$ATTENTION_MULTI_MATRIX or fast)",
    )
    group.addoption(
        "--stack",
        choices=("first", "second"),
        default=os.environ.get("ATTENTION_MULTI_STACK", "first"),
        help="second: only what differs on a second stack (see conftest.py)",
    )


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def _full(config):
    return config.getoption("matrix") == "full"


def _backend_of(item):
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("backend_name") or params.get("am_backend_name")


# The files that take longest (measured, legacy stack: 30-90 s of one worker
# each), sent to the workers first (``--dist loadfile`` hands out files in
# collection order): a long file started last would keep one worker busy
# while the other waits. Only the order changes, never what runs; under -x
# (``make mutants``) the order is the collection's.
FIRST = (
    "test_docs.py",
    "test_flex.py",
    "test_determinism.py",
    "test_graphs.py",
    "test_report.py",
    "test_paths.py",
    "test_conform.py",
    "test_mods.py",
    "test_distributed.py",
    "test_properties.py",
    "test_tensorflow.py",  # (modern stack: 30-40 s with TF's import)
    "test_cli_files.py",
    "test_testing.py",
    "test_conform_compiled.py",
    "test_jit_gradients.py",
    "test_flex_api.py",
    "test_empty.py",
)

GRID_ROWS = {"dtype": "float32"}  # JAX's rows of a grid in the fast matrix
JAX_PATHS = ("fused", "full")  # the paths JAX takes by itself ("auto": full or fused)


def _matches(item, rows):
    params = item.callspec.params
    return all(params.get(k, v) in (v if isinstance(v, tuple) else (v,)) for k, v in rows.items())


def pytest_collection_modifyitems(config, items):
    for item in items:  # (named by their file: a new one needs no marker of its own)
        if item.path.name.startswith("test_integrations_"):
            item.add_marker(pytest.mark.integration)
    if config.getoption("maxfail") != 1:  # (under -x: the first failure soonest)
        rank = {name: i for i, name in enumerate(FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # (stable)
    if _full(config):
        return
    second = config.getoption("stack") == "second"
    keep, dropped, smoked = [], [], set()
    for item in items:
        name = _backend_of(item)
        func = (item.path, item.originalname)
        if name is None:
            ok = not second or any(
                item.get_closest_marker(m) for m in ("second_stack", "integration")
            )
        elif name.startswith("numpy"):  # (and its flipped variants)
            ok = True
        elif second and not any(
            item.get_closest_marker(m) for m in ("second_stack", "integration")
        ):
            ok = (func, name) not in smoked
        elif item.get_closest_marker("core"):
            ok = (func, name) not in smoked
        elif item.get_closest_marker("grid") and name == "jax":
            marker = item.get_closest_marker("grid")
            ok = _matches(item, marker.kwargs.get("rows") or GRID_ROWS)
        else:
            ok = True
        if name is not None and ok:
            smoked.add((func, name))
        (keep if ok else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture
def grid_paths(request, backend):
    """``grid_paths(PATHS)``: the paths a grid test loops over: all of them in
    the full matrix and on every backend but JAX; on JAX in the fast matrix the
    ones it takes by itself (``grid(jax_paths=...)``, default fused and full)."""
    marker = request.node.get_closest_marker("grid")
    own = (marker.kwargs.get("jax_paths") if marker else None) or JAX_PATHS

    def paths(every):
        if _full(request.config) or backend.name != "jax":
            return tuple(every)
        return tuple(p for p in every if p in own)

    return paths


def pytest_unconfigure(config):
    if _made_jax_cache is not None:
        shutil.rmtree(_made_jax_cache, ignore_errors=True)


REQUIRED = {
    n.strip() for n in os.environ.get("ATTENTION_MULTI_REQUIRE", "").split(",") if n.strip()
}
# CUDA rows are collected only where a driver is (ATTENTION_MULTI_CUDA=1 or 0 decides)
_CUDA = os.environ.get("ATTENTION_MULTI_CUDA", "")
HAS_CUDA = os.path.exists("/proc/driver/nvidia") if not _CUDA else _CUDA != "0"
DEVICES = ("cpu", "cuda") if HAS_CUDA else ("cpu",)


FLIPPED = ("numpy-adding", "numpy-lengths", "numpy-select")  # tests/flipped.py


def load_backend(name):
    """The backend, or skip (fail if required) when it cannot be imported."""
    from attention_multi import get_backend

    if name in FLIPPED:
        from tests import flipped

        return flipped.make(name)

    try:
        B = get_backend(name)
    except ImportError as exc:
        if name in REQUIRED:
            pytest.fail(f"required backend {name!r} is unavailable: {exc}", pytrace=False)
        pytest.skip(f"backend {name!r} is not installed: {exc}")
    opt(B).enable_float64()  # float64 rows need it (JAX); explicit dtypes keep float32
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


# The backends of the per-backend grids: tensorflow has its own file instead
# (tests/test_tensorflow.py: each TF op is a few times a NumPy one's cost)
GRID_BACKENDS = tuple(s for s in backends.BACKENDS if s.name != "tensorflow")


def pytest_generate_tests(metafunc):
    names = metafunc.fixturenames
    # a grid's rows run on NumPy with other frameworks' flags too (tests/flipped.py)
    flipped = FLIPPED if metafunc.definition.get_closest_marker("grid") else ()
    if "backend_name" in names and "device_name" in names:  # numpy is CPU only
        pairs = [(s.name, d) for s in GRID_BACKENDS for d in DEVICES if s.cuda or d == "cpu"]
        pairs += [(n, "cpu") for n in flipped]
        metafunc.parametrize("backend_name, device_name", pairs, ids=[f"{b}-{d}" for b, d in pairs])
    elif "backend_name" in names:
        metafunc.parametrize("backend_name", [*(s.name for s in GRID_BACKENDS), *flipped])


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
