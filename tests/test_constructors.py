"""Constructor arguments are checked as carefully as call arguments (issue 18).

Every public module, on every backend: each argument with each kind of bad
value raises ValueError (bad value) or TypeError (wrong type), and the message
names the argument and shows the value it got (its repr)."""

import math
import re

import numpy as np
import pytest

import attention_multi as am
from attention_multi.backends.capabilities import opt
from attention_multi.core import checks

# (issue 63) checks the core makes: every row on NumPy, a smoke on each other backend
pytestmark = pytest.mark.core

# Every public module, built with keywords only, and its valid arguments.
GOOD = {
    "AdditiveAttention": dict(
        key_size=4, query_size=3, num_hiddens=8, dropout=0.1, memory_budget=2**20
    ),
    "DotProductAttention": dict(dropout=0.1, path="auto", memory_budget=2**20, chunk_size=16),
    "MultiHeadAttention": dict(
        key_size=4,
        query_size=3,
        value_size=5,
        num_hiddens=8,
        num_heads=2,
        dropout=0.1,
        bias=False,
        num_kv_heads=1,
        path="auto",
        memory_budget=2**20,
        chunk_size=16,
    ),
    "PositionalEncoding": dict(num_hiddens=8, dropout=0.1, max_len=20),
    "Linear": dict(in_features=4, out_features=3, bias=True),
    "NWKernelRegression": dict(),
}

# (kind of argument) -> [(bad value, error type)]
SIZE = [
    (0, ValueError),
    (-3, ValueError),
    (2.5, TypeError),
    (True, TypeError),
    (np.bool_(True), TypeError),
    ("4", TypeError),
    (np.float32(4), TypeError),
]
SIZE_NOT_NONE = SIZE + [(None, TypeError)]
DROPOUT = [
    (-0.1, ValueError),
    (1.5, ValueError),
    (float("nan"), ValueError),
    (np.float64(-1e-9), ValueError),
    (math.inf, ValueError),
    ("abc", TypeError),
    ("0.1", TypeError),
    (True, TypeError),
    (None, TypeError),
    ([0.1], TypeError),
]
BOOL = [
    ("yes", TypeError),
    (1, TypeError),
    (0, TypeError),
    (None, TypeError),
    (np.int64(1), TypeError),
]
PATH = [("fast", ValueError), ("", ValueError), (3, TypeError), (None, TypeError)]
BUDGET = [
    (0, ValueError),
    (-1, ValueError),
    (1.5, TypeError),
    (True, TypeError),
    ("1024", TypeError),
]

KINDS = {
    "key_size": SIZE,
    "query_size": SIZE,
    "value_size": SIZE,  # None: lazily sized
    "num_hiddens": SIZE_NOT_NONE,
    "num_heads": SIZE_NOT_NONE,
    "max_len": SIZE_NOT_NONE,
    "out_features": SIZE_NOT_NONE,
    "in_features": SIZE,
    "dropout": DROPOUT,
    "bias": BOOL,
    "path": PATH,
    "memory_budget": BUDGET,
    "chunk_size": BUDGET,
    "num_kv_heads": SIZE + [(3, ValueError)],  # None: num_heads; 3 does not divide 2
}

CASES = [
    (module, arg, value, error)
    for module, good in GOOD.items()
    for arg in good
    for value, error in KINDS[arg]
]


def build(module, backend, **changes):
    kwargs = dict(GOOD[module], **changes)
    return getattr(am, module)(backend=backend, **kwargs)


def message_of(arg, value):
    return re.escape(arg) + ".*" + re.escape(repr(value))


def test_every_argument_of_every_module_has_cases():
    import inspect

    for module in GOOD:
        cls = getattr(am, module)
        params = inspect.signature(cls.__init__).parameters
        named = {
            n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        } - {"self"}
        # the two-form constructors take their arguments as *args/**kwargs
        named |= set(getattr(cls, "_SEEDS", ()))
        assert named <= set(GOOD[module]), (module, named - set(GOOD[module]))
        assert set(GOOD[module]) <= set(KINDS)


@pytest.mark.parametrize(
    "module, arg, value, error", CASES, ids=[f"{m}-{a}={v!r}" for m, a, v, _ in CASES]
)
def test_bad_constructor_argument(backend, module, arg, value, error):
    with pytest.raises(error, match=message_of(arg, value)) as info:
        build(module, backend, **{arg: value})
    # ValueError for bad values, TypeError for wrong types: never both
    assert type(info.value) is error


@pytest.mark.parametrize("module", sorted(GOOD))
def test_good_arguments_build(backend, module):
    m = build(module, backend)
    assert isinstance(m, getattr(am, module)) and m.backend is backend


@pytest.mark.parametrize("module", sorted(GOOD))
def test_dtype_and_device_are_checked(backend, module):
    with pytest.raises(TypeError, match=r"dtype='int32' is not supported"):
        build(module, backend, dtype="int32")
    with pytest.raises(ValueError, match=r"tpu"):
        build(module, backend, device="tpu")
    with pytest.raises(ValueError, match=r"unknown backend 'cntk'"):
        getattr(am, module)(backend="cntk", **GOOD[module])


def test_numpy_scalars_and_edges_are_accepted(backend):
    m = am.MultiHeadAttention(
        np.int64(4),
        np.int32(3),
        np.uint8(5),
        np.int64(8),
        np.int16(2),
        np.float32(0.25),
        np.bool_(True),
        memory_budget=np.int64(2**20),
        chunk_size=np.int32(8),
        backend=backend,
    )
    assert (m.key_size, m.query_size, m.value_size, m.num_hiddens, m.num_heads) == (4, 3, 5, 8, 2)
    assert all(
        type(x) is int
        for x in (m.key_size, m.num_hiddens, m.num_heads, m.memory_budget, m.chunk_size)
    )
    assert m.attention.dropout == 0.25 and type(m.attention.dropout) is float
    assert "W_q.bias" in am.get_params(m)
    for rate in (0, 1, 0.0, 1.0, np.float16(0.5)):
        assert am.DotProductAttention(rate, backend=backend).dropout == float(rate)
    pe = am.PositionalEncoding(np.int64(6), 0, max_len=np.int64(1), backend=backend)
    assert (pe.num_hiddens, pe.max_len) == (6, 1)
    assert am.Linear(None, 3, backend=backend).in_features is None


def test_heads_must_divide_num_hiddens(backend):
    with pytest.raises(
        ValueError,
        match=r"num_hiddens=10 is not divisible by "
        r"num_heads=4",
    ):
        build("MultiHeadAttention", backend, num_hiddens=10, num_heads=4)


def test_the_issue_examples(backend):
    """The calls of issue 18, each now refused with a clear message."""
    for call, error, pattern in [
        (
            lambda: am.DotProductAttention(-0.1, backend=backend),
            ValueError,
            r"dropout must be a real number in \[0, 1\], got -0.1",
        ),
        (lambda: am.DotProductAttention(1.5, backend=backend), ValueError, r"got 1.5"),
        (
            lambda: am.DotProductAttention("abc", backend=backend),
            TypeError,
            r"dropout must be a real number in \[0, 1\], got 'abc' \(type str\)",
        ),
        (
            lambda: am.AdditiveAttention(
                key_size=0, query_size=2, num_hiddens=4, dropout=0.1, backend=backend
            ),
            ValueError,
            r"key_size must be None or a positive int, got 0",
        ),
        (
            lambda: am.MultiHeadAttention(2, 2, 2, 0, 1, 0.1, backend=backend),
            ValueError,
            r"num_hiddens must be a positive int, got 0",
        ),
        (
            lambda: am.PositionalEncoding(0, 0.1, backend=backend),
            ValueError,
            r"num_hiddens must be a positive int, got 0",
        ),
        (
            lambda: am.PositionalEncoding(8, 0.1, max_len=0, backend=backend),
            ValueError,
            r"max_len must be a positive int, got 0",
        ),
        (
            lambda: am.MultiHeadAttention(2, 2, 2, 4, 2, 0.1, "yes", backend=backend),
            TypeError,
            r"bias must be True or False, got 'yes' \(type str\)",
        ),
        (
            lambda: am.AdditiveAttention(2, 4, -3, 0.1, backend=backend),
            ValueError,
            r"num_hiddens must be a positive int, got -3",
        ),
        (
            lambda: am.PositionalEncoding(8, 0.1, max_len=-5, backend=backend),
            ValueError,
            r"max_len must be a positive int, got -5",
        ),
        (
            lambda: am.MultiHeadAttention(2.5, 2, 2, 4, 2, 0.1, backend=backend),
            TypeError,
            r"key_size must be None or a positive int, got 2.5 \(type float\)",
        ),
    ]:
        with pytest.raises(error, match=pattern):
            call()


def test_dropout_one_drops_everything(backend):
    """dropout=1 is a valid rate: in training mode every output is zero and
    finite (never inf * 0)."""
    rng = np.random.default_rng(0)
    x = backend.asarray(rng.normal(size=(2, 3, 4)), "float32")
    key = opt(backend).dropout_key(0)
    pe = am.PositionalEncoding(4, 1.0, backend=backend).train()  # (MXNet: outside record())
    out = backend.to_numpy(pe(x, key=key))
    np.testing.assert_array_equal(out, np.zeros((2, 3, 4), np.float32))
    for path in ("fused", "tiled", "chunked", "full"):
        dot = am.DotProductAttention(1.0, path=path, backend=backend).train()
        out = backend.to_numpy(dot(x, x, x, np.array([2, 3]), key=key))
        np.testing.assert_array_equal(out, np.zeros((2, 3, 4), np.float32), path)
    x4 = x.reshape((2, 1, 3, 4))
    out = am.dot_product_attention(x4, x4, x4, dropout=1.0, key=key)
    np.testing.assert_array_equal(backend.to_numpy(out), np.zeros((2, 1, 3, 4)))
    with pytest.raises(
        ValueError,
        match=r"dropout must be a real number in \[0, 1\], "
        r"got 1.5",
    ):
        am.dot_product_attention(x4, x4, x4, dropout=1.5)


@pytest.mark.parametrize(
    "helper, good, bad",
    [
        (
            checks.check_positive_int,
            [(1, 1), (np.int64(7), 7)],
            [(0, ValueError), (True, TypeError)],
        ),
        (
            checks.check_nonnegative_int,
            [(0, 0), (np.uint8(3), 3)],
            [(-1, ValueError), (1.0, TypeError)],
        ),
        (
            checks.check_dropout,
            [(0, 0.0), (1, 1.0), (np.float32(0.5), 0.5)],
            [(float("nan"), ValueError), (np.bool_(False), TypeError)],
        ),
        (checks.check_bool, [(True, True), (np.bool_(False), False)], [(1, TypeError)]),
    ],
)
def test_shared_helpers(helper, good, bad):
    """The helpers other modules and options use: plain Python values out."""
    for value, want in good:
        got = helper("x", value)
        assert got == want and type(got) is type(want)
    for value, error in bad:
        with pytest.raises(error, match=r"^x must be .*got " + re.escape(repr(value))):
            helper("x", value)
    if helper in (checks.check_positive_int, checks.check_nonnegative_int):
        assert helper("x", None, allow_none=True) is None
        with pytest.raises(TypeError, match="x must be None or"):
            helper("x", "a", allow_none=True)
