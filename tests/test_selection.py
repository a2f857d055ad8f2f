"""Choosing the backend and the device: env vars, set_backend, use_backend,
backend=, array types, and lazy imports."""

import subprocess
import sys
import threading

import numpy as np
import pytest

import attention_multi as am
from attention_multi import backends, config
from conftest import load_backend


def test_default_is_numpy(monkeypatch):
    assert am.get_backend().name == "numpy"
    monkeypatch.setenv("ATTENTION_MULTI_BACKEND", "")
    assert am.get_backend().name == "numpy"


def test_env_var_picks_the_default(monkeypatch, backend):
    monkeypatch.setenv("ATTENTION_MULTI_BACKEND", f" {backend.name.upper()} ")
    assert am.get_backend() is backend


def test_env_var_unknown_name_lists_choices(monkeypatch):
    monkeypatch.setenv("ATTENTION_MULTI_BACKEND", "cntk")
    with pytest.raises(
        ValueError,
        match=r"ATTENTION_MULTI_BACKEND='cntk'.*"
        r"numpy, torch, jax, mxnet",
    ):
        am.get_backend()


@pytest.mark.parametrize("bad", ["cntk", "", "torch2"])
def test_unknown_names_everywhere(bad):
    for call in (
        am.set_backend,
        am.get_backend,
        lambda n: am.DotProductAttention(0.0, backend=n),
    ):
        with pytest.raises(ValueError, match=f"unknown backend {bad!r}"):
            call(bad)
    with pytest.raises(ValueError, match="valid choices"):
        with am.use_backend(bad):
            pass


def test_aliases():
    pytest.importorskip("torch")
    assert am.get_backend("pytorch") is am.get_backend("torch")
    assert am.get_backend("PyTorch").name == "torch"


def test_uninstalled_backend_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)  # makes `import jax` fail
    monkeypatch.delitem(backends._loaded, "jax", raising=False)
    monkeypatch.delitem(sys.modules, "attention_multi.backends.jax", raising=False)
    with pytest.raises(ImportError, match=r"pip install '\.\[jax\]'"):
        am.set_backend("jax")


def test_set_backend_and_nested_use_backend(backend):
    numpy_backend = am.get_backend("numpy")
    am.set_backend(backend.name)
    assert am.get_backend() is backend
    with am.use_backend("numpy") as inner:
        assert inner is numpy_backend and am.get_backend() is numpy_backend
        with am.use_backend(backend.name):
            assert am.get_backend() is backend
        assert am.get_backend() is numpy_backend
    assert am.get_backend() is backend


def test_use_backend_restores_on_error_and_is_thread_local(backend):
    seen = []
    with pytest.raises(RuntimeError):
        with am.use_backend(backend.name):
            thread = threading.Thread(target=lambda: seen.append(am.get_backend().name))
            thread.start()
            thread.join()
            raise RuntimeError
    assert seen == ["numpy"]
    assert am.get_backend().name == "numpy"


def test_backend_keyword_and_array_type_win(backend):
    with am.use_backend("numpy"):
        module = am.DotProductAttention(0.0, backend=backend.name)
        assert module.backend is backend
        x = backend.asarray(np.zeros((1, 2, 2), np.float32))
        assert backend.is_array(am.masked_softmax(x, None))
    with am.use_backend(backend.name):
        assert isinstance(am.masked_softmax(np.zeros((1, 2, 2)), None), np.ndarray)


def test_get_backend_of_arrays(backend):
    assert am.get_backend(backend.asarray([1.0])) is backend
    with pytest.raises(TypeError, match="cannot tell which backend.*bytes"):
        am.get_backend(b"x")


def test_am_get_backend_takes_a_name_a_backend_or_an_array(backend):
    """am.get_backend(name or array or Backend) is that backend, the one the
    library's layer below loads (backends.load, backends.backend_of_array);
    with no argument it is the current default."""
    for given in (backend.name, backend.name.upper(), backend, backend.asarray([1.0])):
        assert am.get_backend(given) is backend
    assert backends.load(backend.name) is backends.backend_of_array(backend.asarray([1.0]))
    assert backends.load(backend.name) is backend
    with am.use_backend(backend.name):
        assert am.get_backend() is backend
    with pytest.raises(ValueError, match="unknown backend 'cntk'"):
        am.get_backend("cntk")


def test_available_backends_lists_installed_ones():
    names = am.available_backends()
    assert names[0] == "numpy" and set(names) <= set(backends.BACKEND_NAMES)


@pytest.mark.parametrize(
    "name, parsed",
    [
        ("cpu", ("cpu", 0)),
        ("cuda", ("cuda", 0)),
        ("cuda:1", ("cuda", 1)),
        ("gpu", ("cuda", 0)),
        ("GPU:2", ("cuda", 2)),
        (" cpu ", ("cpu", 0)),
    ],
)
def test_device_names(name, parsed):
    assert config.parse_device(name) == parsed


@pytest.mark.parametrize("bad", ["tpu", "cuda:x", "cpu:1", "cuda:-1"])
def test_unknown_device_names(bad):
    with pytest.raises(ValueError, match=f"unknown device {bad!r}"):
        config.parse_device(bad)


def test_device_env_var(monkeypatch, backend):
    monkeypatch.setenv("ATTENTION_MULTI_DEVICE", "cuda:5")
    assert config.parse_device() == ("cuda", 5)
    with pytest.raises(ValueError, match="cuda:5 is not available"):
        am.DotProductAttention(0.0, backend=backend)
    monkeypatch.setenv("ATTENTION_MULTI_DEVICE", "")
    assert am.DotProductAttention(0.0, backend=backend).backend is backend


def test_absent_device_is_named(backend):
    with pytest.raises(ValueError, match="cuda:3"):
        am.MultiHeadAttention(4, 4, 4, 4, 2, 0.0, backend=backend, device="cuda:3")


def _imported_after(code):
    script = (
        f"import sys\n{code}\n"
        "print(','.join(m for m in ('torch', 'jax', 'mxnet') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_import_with_numpy_imports_no_framework():
    code = (
        "import numpy as np, attention_multi as am\n"
        "am.available_backends()\n"
        "x = np.ones((1, 2, 3))\n"
        "assert am.get_backend(x).name == 'numpy'\n"
        "am.DotProductAttention(0.0)(x, x, x, np.array([1])).sum()"
    )
    assert _imported_after(code) == ""


def test_mxnet_imports_after_the_mxnet_backend():
    """The guide's promise, as a user writes it: on numpy 1.24-1.26 (where
    numpy.bool is gone) mxnet imports after the MXNet backend loaded."""
    load_backend("mxnet")  # skips (or fails where required) without MXNet
    code = (
        "import attention_multi as am\nam.get_backend('mxnet')\n"
        "from mxnet import np\nprint(np.ones((2,)).sum())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "2.0"


IMPORT_CHANGES = """
import sys, numpy
before = (list(sys.meta_path), dict(vars(numpy)), list(sys.path_hooks))
import attention_multi, attention_multi.functional, attention_multi.modules
after = (list(sys.meta_path), dict(vars(numpy)), list(sys.path_hooks))
print(before[0] == after[0], before[1].keys() == after[1].keys(), before[2] == after[2])
"""


def test_importing_the_library_changes_nothing_outside_it():
    """No finder on sys.meta_path, no alias set in NumPy's namespace: only the
    MXNet backend, when it loads MXNet, sets ``numpy.bool`` (numpy 1.24-1.26)."""
    out = subprocess.run([sys.executable, "-c", IMPORT_CHANGES], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True"]


def test_a_backend_imports_only_its_framework(backend):
    code = f"import attention_multi as am\nam.set_backend({backend.name!r})"
    assert _imported_after(code) == ("" if backend.name == "numpy" else backend.name)


@pytest.mark.parametrize("required, outcome", [("jax", "1 error"), ("", "1 skipped")])
def test_require_turns_a_missing_backend_into_a_failure(tmp_path, required, outcome):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['jax'] = None\n")
    env = {
        **__import__("os").environ,
        "PYTHONPATH": str(tmp_path),
        "ATTENTION_MULTI_REQUIRE": required,
    }
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_backends.py::test_is_a_backend_with_its_name[jax]",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert outcome in result.stdout, result.stdout
