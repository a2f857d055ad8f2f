"""attention_multi.testing: ``assert_close`` across frameworks, and the pytest
plugin (run in subprocesses on small temporary test files)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attention_multi as am
from attention_multi import backends
from attention_multi.testing import assert_close, default_tolerances
from tests.test_selection import _imported_after

REPO = Path(__file__).resolve().parents[1]
PLUGIN = "attention_multi.testing.plugin"


# ---- assert_close ----


def test_close_arrays_of_any_backend_pass(backend):
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    assert_close(am.asarray(x, backend=backend), x)
    assert_close(x, am.asarray(x + 5e-6, backend=backend))  # float32: atol 1e-5
    assert_close(am.asarray(x, backend=backend), am.asarray(x, backend=backend))
    assert_close(x.tolist(), am.asarray(x, backend=backend))
    y = x.copy()
    y[1, 2] += 1e-3
    with pytest.raises(AssertionError, match="1 of 12 elements differ"):
        assert_close(am.asarray(y, backend=backend), x)


def test_message_shows_where_they_differ(backend):
    expected = np.zeros((2, 3, 4))
    actual = expected.copy()
    actual[1, 2, 0], actual[0, 0, 1] = 0.5, -0.01
    with pytest.raises(AssertionError) as info:
        assert_close(
            am.asarray(actual, dtype="float32", backend=backend),
            expected,
            rtol=0,
            atol=1e-3,
            msg="decoder output",
        )
    lines = str(info.value).splitlines()
    assert lines == [
        "decoder output: arrays are not close (rtol=0, atol=0.001): 2 of 24 elements "
        "differ (8.33%)",
        "worst at index (1, 2, 0): actual 0.5, expected 0.0 (abs diff 0.5, allowed 0.001)",
        "max abs diff 0.5, max rel diff 0",
        f"actual: {backend.name} float32 (2, 3, 4); expected: numpy float64 (2, 3, 4)",
    ]


def test_relative_tolerance_and_relative_difference():
    expected = np.array([100.0, 1.0])
    assert_close(expected * (1 + 1e-6), expected, rtol=2e-6, atol=0)
    with pytest.raises(AssertionError) as info:
        assert_close([100.0, 1.01], expected, rtol=1e-3, atol=0)
    msg = str(info.value)
    assert "1 of 2 elements differ (50%)" in msg
    assert "worst at index (1,): actual 1.01, expected 1.0" in msg
    assert "max rel diff 0.01" in msg
    assert "actual: numpy" not in msg  # same framework and dtype: no such line


def test_shapes_and_dtypes_are_named():
    with pytest.raises(
        AssertionError,
        match=r"^shapes differ: actual \(2, 3\), expected "
        r"\(3, 2\)\nactual: numpy float32 \(2, 3\); "
        r"expected: numpy float32 \(3, 2\)$",
    ):
        assert_close(np.zeros((2, 3), "float32"), np.zeros((3, 2), "float32"))
    assert_close(np.zeros(3, "float32"), np.zeros(3, "float64"))
    with pytest.raises(AssertionError, match="dtypes differ: actual float32, expected float64"):
        assert_close(np.zeros(3, "float32"), np.zeros(3, "float64"), check_dtype=True)
    with pytest.raises(TypeError, match="cannot tell which backend"):
        assert_close(object(), [1.0])


def test_nan_and_infinity():
    assert_close([np.inf, -np.inf, 1.0], [np.inf, -np.inf, 1.0])
    with pytest.raises(AssertionError, match=r"worst at index \(0,\): actual inf, expected -inf"):
        assert_close([np.inf], [-np.inf])
    with pytest.raises(AssertionError) as info:
        assert_close([1.0, np.nan, 3.0], [1.0, np.nan, 3.5])
    msg = str(info.value)
    assert "2 of 3 elements differ" in msg
    assert "worst at index (1,): actual nan, expected nan" in msg  # NaN ranks first
    assert "max abs diff 0.5, max rel diff 0.143; 1 NaN or infinite differences" in msg
    assert_close([1.0, np.nan], [1.0, np.nan], equal_nan=True)


def test_default_tolerances_follow_the_least_precise_dtype():
    assert default_tolerances("float32", "float64") == (1.3e-6, 1e-5)
    assert default_tolerances("float64") == (1e-7, 1e-7)
    assert default_tolerances("float16", "float32") == (1e-3, 1e-5)
    assert default_tolerances("bfloat16", "float16") == (1.6e-2, 1e-5)
    assert default_tolerances("int64", "bool") == (0.0, 0.0)
    assert_close(np.float16(1.0), 1.0005)
    with pytest.raises(AssertionError, match=r"rtol=0, atol=0\)"):
        assert_close([1, 2], [1, 3])  # integers: exact
    assert_close(np.float32(1.0), 1.0 + 1e-6)


def test_bfloat16_is_compared_as_float32():
    torch = pytest.importorskip("torch")
    x = torch.tensor([1.0, 2.5], dtype=torch.bfloat16)
    assert_close(x, [1.0, 2.5], check_dtype=False)
    with pytest.raises(
        AssertionError,
        match=r"rtol=0.016, atol=1e-05\).*\n.*\n.*\n"
        r"actual: torch bfloat16 \(2,\)",
    ):
        assert_close(x, [1.0, 2.6])


def test_importing_testing_and_plugin_imports_no_framework():
    code = "import attention_multi.testing, attention_multi.testing.plugin, attention_multi.port"
    assert _imported_after(code) == ""


# ---- the pytest plugin ----

USER_TESTS = """
import pytest
import attention_multi as am
from attention_multi.testing import assert_close

def test_parity(backend):
    x = am.asarray([[1.0, 2.0]], dtype="float32", backend=backend)
    assert_close(x, [[1.0, 2.0]])
    assert backend.name in ("numpy", "torch", "jax", "mxnet")

@pytest.mark.parametrize("backend", ["mine"])
def test_parametrizes_backend_itself(backend):
    assert backend == "mine"

def test_without_backend():
    pass
"""

# A suite with its own `backend` fixture and parametrization, as this
# repository's conftest.py has: the plugin must not multiply its cases.
OWN_CONFTEST = """
import pytest
import attention_multi as am

def pytest_generate_tests(metafunc):
    if "backend_name" in metafunc.fixturenames:
        metafunc.parametrize("backend_name", ["numpy", "torch"])

@pytest.fixture
def backend(backend_name):
    return am.get_backend(backend_name)
"""
OWN_TESTS = """
def test_own(backend):
    assert backend.name in ("numpy", "torch")
"""


def run_pytest(folder, *args, pythonpath=()):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, pythonpath), str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p]
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            PLUGIN,
            "-v",
            "-rs",
            "-W",
            "ignore::DeprecationWarning",
            *args,
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    outcomes = {}  # from the -v lines: "test_user.py::test_parity[jax] SKIPPED (...)"
    for line in result.stdout.splitlines():
        words = line.split()
        if (
            len(words) >= 2
            and "::" in words[0]
            and words[1] in ("PASSED", "FAILED", "SKIPPED", "ERROR")
        ):
            outcomes[words[0]] = words[1]
    return result, outcomes


@pytest.fixture
def user_suite(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "conftest.py").write_text(OWN_CONFTEST)
    (tmp_path / "own" / "test_own.py").write_text(OWN_TESTS)
    return tmp_path


def test_plugin_runs_each_test_on_every_installed_backend(user_suite):
    pytest.importorskip("torch")  # the suite's own conftest uses it
    result, outcomes = run_pytest(user_suite)
    installed = backends.available_backends()
    want = {f"test_user.py::test_parity[{n}]": "PASSED" for n in installed}
    want.update(
        {
            "test_user.py::test_parametrizes_backend_itself[mine]": "PASSED",
            "test_user.py::test_without_backend": "PASSED",
            "own/test_own.py::test_own[numpy]": "PASSED",
            "own/test_own.py::test_own[torch]": "PASSED",
        }
    )
    assert outcomes == want, result.stdout + result.stderr
    assert result.returncode == 0


def test_plugin_option_chooses_backends(user_suite):
    pytest.importorskip("torch")
    result, outcomes = run_pytest(user_suite, "--am-backends=numpy, pytorch,numpy")
    assert outcomes == {
        "test_user.py::test_parity[numpy]": "PASSED",
        "test_user.py::test_parity[torch]": "PASSED",
        "test_user.py::test_parametrizes_backend_itself[mine]": "PASSED",
        "test_user.py::test_without_backend": "PASSED",
        "own/test_own.py::test_own[numpy]": "PASSED",  # the suite's own fixture wins
        "own/test_own.py::test_own[torch]": "PASSED",
    }, result.stdout + result.stderr
    assert "--am-backends=NAMES" in run_pytest(user_suite, "--help")[0].stdout


def test_plugin_unusable_backend_skips_unless_asked_for(tmp_path):
    """A jax that is found but fails to import: skipped by default, a failure
    when --am-backends names it."""
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    (tmp_path / "fake" / "jax").mkdir(parents=True)
    (tmp_path / "fake" / "jax" / "__init__.py").write_text(
        "raise ImportError('broken on purpose')\n"
    )
    fake = [tmp_path / "fake"]
    result, outcomes = run_pytest(tmp_path, "-k", "test_parity", pythonpath=fake)
    assert outcomes["test_user.py::test_parity[jax]"] == "SKIPPED", result.stdout
    assert "backend 'jax' cannot be used" in result.stdout and "broken on purpose" in result.stdout
    assert result.returncode == 0
    result, outcomes = run_pytest(
        tmp_path, "-k", "test_parity", "--am-backends=numpy,jax", pythonpath=fake
    )
    assert outcomes == {
        "test_user.py::test_parity[numpy]": "PASSED",
        "test_user.py::test_parity[jax]": "ERROR",
    }, result.stdout
    assert "--am-backends asks for 'jax', which cannot be used" in result.stdout
    assert result.returncode == 1


def test_plugin_rejects_unknown_backend_names(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    result, _ = run_pytest(tmp_path, "--am-backends=torch,cntk")
    assert result.returncode == 4  # pytest's usage error
    assert (
        "--am-backends=torch,cntk: unknown backend 'cntk'; valid choices: "
        "numpy, torch, jax, mxnet, tensorflow"
    ) in result.stderr


def test_plugin_entry_point_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {PLUGIN: PLUGIN}
    import importlib

    module = importlib.import_module(PLUGIN)
    assert callable(module.pytest_addoption) and hasattr(module, "backend")


def test_integers_are_compared_exactly():
    big = np.array([2**53, 2**62], np.int64)
    assert_close(big, big.copy())
    with pytest.raises(AssertionError, match=r"1 of 2 elements differ"):
        assert_close(big, big + np.array([0, 1]))
    with pytest.raises(AssertionError, match=r"worst at index \(0,\)"):
        assert_close(np.array([2**53 + 1]), np.array([2**53]))
    assert_close(np.array([2**63 - 1], np.int64), np.array([2**63 - 1], np.uint64))
    assert_close(np.array([5]), np.array([7]), atol=2)


def test_complex_values_compare_both_parts():
    assert_close(np.array([1 + 2j]), np.array([1 + 2j]))
    with pytest.raises(AssertionError, match="1 of 1 elements differ"):
        assert_close(np.array([1 + 2j]), np.array([1 - 2j]))
    with pytest.raises(AssertionError):
        assert_close(np.array([1 + 1j], np.complex64), np.array([1.0]), atol=0.5, rtol=0)
    assert_close(np.array([1 + 1e-9j]), np.array([1.0]))
    assert_close(np.array([complex(np.nan, 1)]), np.array([complex(np.nan, 1)]), equal_nan=True)
