"""Protocol conformance: every backend method, on CPU, across dtypes,
checked against NumPy float64 computed here."""

import os
from pathlib import Path

import numpy as np
import pytest

import attention_multi as am
from attention_multi import backends
from attention_multi.backends.capabilities import Autodiff, opt, supports, value_and_grad
from attention_multi.backends.protocol import Backend, NativeModule
from attention_multi.modules.base import native_class

REPO = Path(__file__).resolve().parents[1]

DTYPES = ("float16", "bfloat16", "float32", "float64")
TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}
rng = np.random.default_rng(0)


@pytest.fixture(params=DTYPES)
def dtype(request, backend):
    if request.param not in backend.float_dtypes:
        pytest.skip(f"{backend.name} has no {request.param}")
    return request.param


def put(backend, x, dtype=None):
    return backend.asarray(np.asarray(x), dtype)


def close(backend, got, want, dtype):
    got = backend.to_numpy(got).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype])


def rounded(x, dtype):
    """``x`` as stored in ``dtype`` (so the expected values see the same inputs)."""
    if dtype == "bfloat16":
        bits = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
        return bits.view(np.float32).astype(np.float64)
    return np.asarray(x).astype(dtype).astype(np.float64)


def test_is_a_backend_with_its_name(backend):
    assert isinstance(backend, Backend)
    assert backend.name in backends.BACKEND_NAMES


def test_its_row_of_the_table_agrees_with_its_class(backend):
    """backends.BACKENDS names each class and repeats what messages need
    without importing it (autodiff, CUDA): they must agree."""
    (spec,) = [s for s in backends.BACKENDS if s.name == backend.name]
    assert type(backend).__name__ == spec.class_name
    assert type(backend).__module__ == f"attention_multi.backends.{spec.module}"
    assert supports(backend, Autodiff) == spec.autodiff
    if not spec.cuda:
        with pytest.raises(ValueError, match="not available"):
            backend.device("cuda")
    for alias in spec.aliases:
        assert backends.load(alias) is backend


def test_names_and_messages_come_from_the_table():
    names = tuple(s.name for s in backends.BACKENDS)
    assert backends.BACKEND_NAMES == names and len(set(names)) == len(names)
    assert backends.listing(names) == "numpy, torch, jax, mxnet or tensorflow"
    with pytest.raises(
        ValueError, match=r"numpy, torch, jax, mxnet, tensorflow \(aliases: np, pytorch, mx, tf\)"
    ):
        backends.canonical_name("cntk")
    with pytest.raises(TypeError, match="a numpy, torch, jax, mxnet or tensorflow array"):
        backends.backend_of_array(b"x")


def test_every_list_of_frameworks_is_the_tables():
    """A new backend is one row: the extras, the conformance grid's frameworks,
    the conform command's adapters and the detection of a function's framework
    follow it."""
    import types

    import tomllib

    from attention_multi import flex
    from attention_multi.cli.conform.adapters import ADAPTERS
    from attention_multi.testing import frameworks

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    assert all(s.extra in extras for s in backends.BACKENDS if s.extra), extras
    assert frameworks.FRAMEWORKS == backends.BACKEND_NAMES
    assert {f"am-{n}" for n in backends.BACKEND_NAMES} <= set(ADAPTERS)
    for root, name in {**backends.ROOTS, "numpy": None, "jaxlib.xla": "jax"}.items():
        module = types.ModuleType(root)
        assert backends.framework_of(root) == name and flex._framework(module) == name
        scope = {"__name__": "t", "fw": module}
        exec("def f(): return fw", scope)  # noqa: S102
        assert frameworks.detect(scope["f"]) == (name or "numpy")


def test_the_required_protocol_is_small_and_capabilities_are_declared(backend):
    """At most 25 required members, which every backend has; every other
    member is in one small declared capability, which a backend has or lacks:
    the NumPy backend writes only ``Threads`` and has no member of any other
    (the core reads them through ``opt``, its generic defaults)."""
    from attention_multi.backends import capabilities as caps
    from attention_multi.backends.defaults import Generic
    from attention_multi.backends.required import REQUIRED, Required

    assert len(REQUIRED) <= 25 and isinstance(backend, Required)
    assert supports(backend, caps.Fused) == (backend.name not in ("numpy", "tensorflow"))
    assert supports(backend, caps.Distributed) == (backend.name in ("torch", "jax"))
    groups = {cap: caps.members(cap) for cap in caps.CAPABILITIES}
    named = [n for ms in groups.values() for n in ms]
    assert len(named) == len(set(named)) and not set(named) & set(REQUIRED)
    assert all(1 <= len(ms) <= 10 for ms in groups.values()), groups
    # every generic default is a member of one group (none undeclared)
    defaults = {n for n in vars(Generic) if not n.startswith("_")}
    assert defaults <= set(named), defaults - set(named)
    full = opt(backend)
    no_default = ("fused_attention", "ring_exchange", "gradients")  # (the capability itself)
    assert all(hasattr(full, n) for n in named if n not in no_default)
    if backend.name == "numpy":
        own = {cap.__name__ for cap in caps.CAPABILITIES if supports(backend, cap)}
        assert own == {"Threads"}
        assert [n for n in named if hasattr(backend, n)] == list(caps.members(caps.Threads))
        assert full.read_slice(np.arange(6), 2, 3, 0).tolist() == [2, 3, 4]  # (the default)
    source = REPO / "attention_multi" / "backends" / "numpy.py"
    assert len(source.read_text().splitlines()) <= 150


def test_asarray_to_numpy_round_trip(backend, dtype):
    x = rounded(rng.normal(size=(2, 3)), dtype)
    a = put(backend, x, dtype)
    assert backend.is_array(a) and not backend.is_array(x.tolist())
    assert backend.dtype_name(a) == dtype
    assert opt(backend).is_concrete(a)
    np.testing.assert_array_equal(backend.to_numpy(a).astype(np.float64), x)


def test_asarray_of_ml_dtypes_bfloat16(backend):
    """A NumPy array of ml_dtypes' bfloat16 (what JAX hands back) becomes a
    bfloat16 array where the backend has the dtype, exactly."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if "bfloat16" not in backend.float_dtypes:
        pytest.skip(f"the {backend.name} backend has no bfloat16")
    x = np.array([[1.5, -2.25], [3.0, 1e-3]]).astype(ml_dtypes.bfloat16)
    a = backend.asarray(x)
    assert backend.dtype_name(a) == "bfloat16"
    np.testing.assert_array_equal(backend.to_numpy(a).astype(np.float64), x.astype(np.float64))


def test_astype_and_arange(backend, dtype):
    a = backend.arange(5)
    assert backend.dtype_name(a) == "int32"
    np.testing.assert_array_equal(backend.to_numpy(a), np.arange(5))
    assert backend.dtype_name(backend.astype(a, dtype)) == dtype


def test_matmul_and_transpose_b(backend, dtype):
    a, b = rounded(rng.normal(size=(3, 2, 4)), dtype), rounded(rng.normal(size=(3, 4, 5)), dtype)
    close(backend, backend.matmul(put(backend, a, dtype), put(backend, b, dtype)), a @ b, dtype)
    bt = np.swapaxes(b, 1, 2).copy()
    got = backend.matmul(put(backend, a, dtype), put(backend, bt, dtype), transpose_b=True)
    close(backend, got, a @ b, dtype)
    square = rounded(rng.normal(size=(3, 4, 4)), dtype)  # (as many keys as features)
    got = backend.matmul(put(backend, a, dtype), put(backend, square, dtype), transpose_b=True)
    close(backend, got, a @ np.swapaxes(square, 1, 2), dtype)


def test_linear(backend, dtype):
    x = rounded(rng.normal(size=(2, 3, 4)), dtype)
    w, b = rounded(rng.normal(size=(5, 4)), dtype), rounded(rng.normal(size=(5,)), dtype)
    args = [put(backend, v, dtype) for v in (x, w, b)]
    close(backend, backend.linear(*args), x @ w.T + b, dtype)
    close(backend, backend.linear(args[0], args[1]), x @ w.T, dtype)


def test_softmax(backend, dtype):
    """Over the axis asked for (the protocol's: any axis, though the core asks for -1)."""
    x = rounded(rng.normal(size=(2, 3, 4)), dtype)
    for axis in (-1, -2, 0):
        e = np.exp(x - x.max(axis, keepdims=True))
        want = e / e.sum(axis, keepdims=True)
        close(backend, backend.softmax(put(backend, x, dtype), axis), want, dtype)


def test_where_with_arrays_and_scalars(backend, dtype):
    x, y = rounded(rng.normal(size=(2, 3)), dtype), rounded(rng.normal(size=(2, 3)), dtype)
    cond = backend.arange(3).reshape((1, 3)) < put(backend, [[1], [2]], "int32")
    want_cond = np.arange(3)[None, :] < np.array([[1], [2]])
    close(
        backend,
        backend.where(cond, put(backend, x, dtype), put(backend, y, dtype)),
        np.where(want_cond, x, y),
        dtype,
    )
    got = backend.where(cond, put(backend, x, dtype), 0.0)
    assert backend.dtype_name(got) == dtype
    close(backend, got, np.where(want_cond, x, 0.0), dtype)


@pytest.mark.parametrize("ndim", [3, 4])
@pytest.mark.parametrize("lens_form", ["1d", "2d", "1d-float"])
def test_below_lengths_is_the_lengths_where(backend, dtype, ndim, lens_form):
    """``below_lengths`` (MXNet: SequenceMask, above a size) equals ``where``
    with the lengths' rule, NaN replaced too, along both axes, small and large."""
    for heads, n in ((1, 3), (4, 64)):  # (the large one: past MXNet's threshold)
        batch = 5 if n > 3 else 2
        lead = (batch,) if ndim == 3 else (batch, heads)
        if lens_form.startswith("1d"):
            lens = rng.integers(0, n + 1, batch)
            row_lens = lens[:, None]  # (batch, 1): every query
            used_len = lens
        else:
            lens = rng.integers(0, n + 1, (batch, n))
            row_lens = lens
            used_len = lens.max(1)
        lens_in = put(backend, lens, "float32" if lens_form.endswith("float") else "int32")
        j = np.arange(n)
        for axis, value in ((-1, -1024.0), (-2, 0.0)):  # (exact in every dtype)
            x = rng.normal(size=lead + (n, n if axis == -1 else 32))
            x[(0,) * len(lead) + (n - 1, 0)] = np.nan  # hidden or not, per the lengths
            if axis == -1:  # (batch, [heads,] Q, K): key j below its query's length
                keep = j < row_lens.reshape((batch,) + (1,) * (ndim - 3) + (-1, 1))
            else:  # (batch, [heads,] K, d): key row j below the longest length
                keep = (j < used_len[:, None]).reshape((batch,) + (1,) * (ndim - 3) + (n, 1))
            got = opt(backend).below_lengths(
                put(backend, x, dtype), put(backend, keep), lens_in, value, axis
            )
            want = np.where(keep, rounded(x, dtype), value)
            got = backend.to_numpy(got).astype(np.float64)
            np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype])


def test_elementwise_and_reductions(backend, dtype):
    x = rounded(rng.normal(size=(2, 3)), dtype)
    a = put(backend, x, dtype)
    close(backend, backend.exp(a), np.exp(x), dtype)
    close(backend, backend.tanh(a), np.tanh(x), dtype)
    close(backend, backend.max(a, axis=1), x.max(1), dtype)
    close(backend, backend.max(a, axis=1, keepdims=True), x.max(1, keepdims=True), dtype)
    close(backend, backend.sum(a, axis=0), x.sum(0), dtype)
    assert tuple(backend.sum(a, axis=0, keepdims=True).shape) == (1, 3)


def test_repeat_and_transpose(backend, dtype):
    x = rounded(rng.normal(size=(2, 3, 4)), dtype)
    a = put(backend, x, dtype)
    close(backend, backend.repeat(a, 2, axis=0), np.repeat(x, 2, axis=0), dtype)
    close(backend, backend.transpose(a, (0, 2, 1)), x.transpose(0, 2, 1), dtype)


def test_devices(backend, dtype):
    cpu = backend.device("cpu")
    a = put(backend, [1.0, 2.0], dtype)
    moved = backend.to_device(a, cpu)
    np.testing.assert_array_equal(backend.to_numpy(moved), [1.0, 2.0])
    assert backend.device_of(moved) == backend.device_of(backend.asarray([0.0], device=cpu))
    with pytest.raises(ValueError, match="cuda:7"):
        backend.device("cuda", 7)


def test_uniform_uses_the_requested_range_and_dtype(backend, dtype):
    u = backend.uniform((4000,), -0.25, 0.5, dtype)
    assert backend.dtype_name(u) == dtype
    values = backend.to_numpy(u).astype(np.float64)
    assert values.min() >= -0.25 and values.max() <= 0.5
    assert abs(values.mean() - 0.125) < 0.02


def _dropout(backend, x, p):
    return backend.dropout(x, p, key=opt(backend).dropout_key(0))


def test_dropout_zeroes_about_p_and_rescales(backend, dtype):
    ones = put(backend, np.ones(20000), dtype)
    out = backend.to_numpy(_dropout(backend, ones, 0.25)).astype(np.float64)
    assert abs((out == 0).mean() - 0.25) < 0.02
    np.testing.assert_allclose(out[out != 0], 1 / 0.75, rtol=TOL[dtype])


def test_dropout_key_is_only_for_jax(backend):
    x = put(backend, np.ones(4), "float32")
    if opt(backend).dropout_key(0) is not None:
        with pytest.raises(ValueError, match="PRNG key"):
            backend.dropout(x, 0.5)
    else:
        with pytest.raises(ValueError, match="only used by the jax backend"):
            backend.dropout(x, 0.5, key=1)


def test_value_and_grad_or_a_clear_error(backend):
    import attention_multi as am

    net = am.NWKernelRegression(backend=backend)
    am.set_params(net, {"w": np.array([0.5])})
    q = put(backend, np.array([0.0, 1.0]), "float32")
    kv = put(backend, np.array([[0.0, 2.0], [1.0, 3.0]]), "float32")

    def loss_fn(m):
        return backend.sum(m(q, kv, kv), axis=0)

    if not supports(backend, Autodiff):
        with pytest.raises(NotImplementedError, match="torch, jax, mxnet or tensorflow"):
            value_and_grad(backend, net, loss_fn)
        return
    loss, grads = value_and_grad(backend, net, loss_fn)

    # d/dw of sum_n softmax(-((q_n - k)w)^2/2) . v_n, by central differences
    def f(w):
        out = 0.0
        for n, x in enumerate([0.0, 1.0]):
            keys = np.array([[0.0, 2.0], [1.0, 3.0]])[n]
            s = -(((x - keys) * w) ** 2) / 2
            e = np.exp(s - s.max())
            out += (e / e.sum()) @ keys
        return out

    assert loss == pytest.approx(f(0.5), rel=1e-5)
    assert set(grads) == {"w"}
    numeric = (f(0.5 + 1e-6) - f(0.5 - 1e-6)) / 2e-6
    assert backend.to_numpy(grads["w"])[0] == pytest.approx(numeric, rel=1e-3)


def native_module_members():
    """(methods, attributes) that ``NativeModule`` declares."""
    methods = [
        n
        for n, v in vars(NativeModule).items()
        if callable(v) and (n == "__call__" or not n.startswith("__"))
    ]
    return methods, list(NativeModule.__annotations__)


def test_module_base_provides_the_native_module_contract(backend):
    """backends.protocol.NativeModule, the contract every module relies on, is
    provided in full by the backend's module_base (methods) and the modules
    it makes (attributes)."""
    import attention_multi as am

    methods, attributes = native_module_members()
    assert len(methods) + len(attributes) == 14 and "_add_lazy_param" in methods
    base = backend.module_base
    assert NativeModule not in base.__mro__  # (else its raising bodies would count)
    missing = [n for n in methods if not callable(getattr(base, n, None))]
    assert not missing, f"{base.__name__} lacks {missing}"
    module = am.Linear(2, 3, backend=backend)
    assert isinstance(module, base)
    assert [n for n in attributes if not hasattr(module, n)] == []
    assert module.eval() is module and module.training is False
    assert module.train() is module and module.training is True
    assert set(module.named_arrays()) == {"weight", "bias"} and module._unsized() == []


def test_native_class_is_cached_and_native(backend):
    import attention_multi as am

    cls = native_class(backend, am.DotProductAttention)
    assert cls is native_class(backend, am.DotProductAttention)
    assert issubclass(cls, am.DotProductAttention) and issubclass(cls, backend.module_base)


REQUIRED = sorted(  # (the backends it names; transformers and flax are packages, not backends)
    n.strip()
    for n in os.environ.get("ATTENTION_MULTI_REQUIRE", "").split(",")
    if n.strip() in backends.BACKEND_NAMES
)


@pytest.mark.second_stack
@pytest.mark.parametrize("name", REQUIRED or ["numpy"])
def test_required_backend_loads(name):
    """Each backend ATTENTION_MULTI_REQUIRE names loads, in every tier: the fast
    matrix runs a backend's rows only as smokes, and this is what fails when one
    is missing (the conftest's ``backend`` fixture fails too, where it runs)."""
    try:
        b = am.get_backend(name)
    except ImportError as exc:
        pytest.fail(f"required backend {name!r} is unavailable: {exc}", pytrace=False)
    assert b.name == name
    np.testing.assert_array_equal(b.to_numpy(b.asarray(np.arange(3.0))), np.arange(3.0))
