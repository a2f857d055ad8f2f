"""Bad input raises ValueError or TypeError naming the argument and showing
the shapes or values, before any framework error."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi.backends.capabilities import opt

# (issue 63) checks the core makes: every row on NumPy, a smoke on each other backend
pytestmark = pytest.mark.core


def arr(backend, *shape, dtype="float32"):
    return backend.asarray(np.random.default_rng(0).normal(size=shape), dtype)


@pytest.fixture
def dot(backend):
    return am.DotProductAttention(0.0, backend=backend).eval()


@pytest.fixture
def mha(backend):
    return am.MultiHeadAttention(4, 4, 3, 8, 2, 0.0, backend=backend).eval()


def test_wrong_rank(backend, dot, mha):
    q, kv = arr(backend, 2, 3, 4), arr(backend, 2, 5, 4)
    for module in (dot, mha):
        with pytest.raises(ValueError, match=r"queries must be 3-D .*got shape \(3, 4\)"):
            module(arr(backend, 3, 4), kv, arr(backend, 2, 5, 3))
        with pytest.raises(ValueError, match=r"keys must be 3-D .*got shape \(2, 1, 5, 4\)"):
            module(q, arr(backend, 2, 1, 5, 4), arr(backend, 2, 5, 3))
    with pytest.raises(ValueError, match=r"X must be 3-D .*got shape \(3, 4\)"):
        am.masked_softmax(arr(backend, 3, 4), None)


def test_batch_sizes_differ(backend, dot):
    with pytest.raises(
        ValueError,
        match=r"batch sizes differ: queries \(2, 3, 4\), "
        r"keys \(3, 5, 4\), values \(2, 5, 4\)",
    ):
        dot(arr(backend, 2, 3, 4), arr(backend, 3, 5, 4), arr(backend, 2, 5, 4))


def test_query_key_feature_mismatch(backend, dot):
    with pytest.raises(
        ValueError,
        match=r"same feature size, got queries \(2, 3, 4\) "
        r"and keys \(2, 5, 6\)",
    ):
        dot(arr(backend, 2, 3, 4), arr(backend, 2, 5, 6), arr(backend, 2, 5, 4))


def test_module_feature_sizes(backend, mha):
    with pytest.raises(ValueError, match=r"values has feature size 4 .*expects 3"):
        mha(arr(backend, 2, 3, 4), arr(backend, 2, 5, 4), arr(backend, 2, 5, 4))


def test_keys_values_length_mismatch(backend, dot):
    with pytest.raises(
        ValueError,
        match=r"same length .*keys \(2, 5, 4\) and values "
        r"\(2, 6, 4\)",
    ):
        dot(arr(backend, 2, 3, 4), arr(backend, 2, 5, 4), arr(backend, 2, 6, 4))


@pytest.mark.parametrize(
    "lens, error, pattern",
    [
        ([1, 2, 3], ValueError, r"valid_lens must have shape \(2,\) .* or \(2, 3\) .*got \(3,\)"),
        ([[1, 2], [3, 4]], ValueError, r"got \(2, 2\)"),
        ([1, -1], ValueError, r"valid_lens must be >= 0, got \[1, -1\]"),
        ([1.5, 2.0], ValueError, r"valid_lens must hold whole numbers, got \[1.5, 2.0\]"),
        ([True, False], TypeError, r"valid_lens must have an integer or float dtype, got bool"),
    ],
)
def test_valid_lens_problems(backend, dot, lens, error, pattern):
    q, k, v = arr(backend, 2, 3, 4), arr(backend, 2, 5, 4), arr(backend, 2, 5, 4)
    lens = np.array(lens)
    for given in (lens, backend.asarray(lens)):
        with pytest.raises(error, match=pattern):
            dot(q, k, v, given)
        with pytest.raises(error, match=pattern):
            am.masked_softmax(arr(backend, 2, 3, 5), given)


def test_string_valid_lens_are_named(backend, dot):
    q, k, v = arr(backend, 2, 3, 4), arr(backend, 2, 5, 4), arr(backend, 2, 5, 4)
    pattern = r"valid_lens must have an integer or float dtype, got (<U1|str32)"
    for given in (["2", "3"], np.array(["2", "3"])):
        with pytest.raises(TypeError, match=pattern):
            dot(q, k, v, given)
        with pytest.raises(TypeError, match=pattern):
            am.dot_product_attention(q, k, v, given)


def test_a_misspelt_keyword_is_named_with_the_valid_ones():
    with pytest.raises(
        TypeError,
        match=r"MultiHeadAttention\(\) got an unexpected keyword argument 'backed' "
        r"\(did you mean backend=\?\); its keywords: key_size, query_size, value_size, "
        r"num_hiddens, num_heads, dropout, bias, .*backend, device, dtype$",
    ):
        am.MultiHeadAttention(8, 2, 0.1, backed="numpy")
    for cls, args in (
        (am.DotProductAttention, (0.0,)),
        (am.AdditiveAttention, (8, 0.1)),
        (am.PositionalEncoding, (8, 0.1)),
        (am.Linear, (3, 4)),
    ):
        with pytest.raises(TypeError, match=rf"{cls.__name__}\(\) got an unexpected keyword "):
            cls(*args, backed="numpy")


def test_integer_valued_float_lens_are_accepted(backend, dot):
    q, k, v = arr(backend, 2, 3, 4), arr(backend, 2, 5, 4), arr(backend, 2, 5, 4)
    a = dot(q, k, v, backend.asarray(np.array([2.0, 3.0], np.float32)))
    b = dot(q, k, v, backend.asarray(np.array([2, 3])))
    np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))


def test_heads_must_divide_num_hiddens(backend):
    with pytest.raises(ValueError, match="num_hiddens=10 is not divisible by num_heads=4"):
        am.MultiHeadAttention(4, 4, 4, 10, 4, 0.0, backend=backend)
    with pytest.raises(ValueError, match="num_hiddens=6 is not divisible by num_heads=4"):
        am.transpose_qkv(arr(backend, 2, 3, 6), 4)


def test_positional_encoding_limits(backend):
    pe = am.PositionalEncoding(8, 0.0, max_len=5, backend=backend).eval()
    with pytest.raises(
        ValueError,
        match=r"X has 6 steps \(shape \(1, 6, 8\)\), more than "
        r"max_len=5",
    ):
        pe(arr(backend, 1, 6, 8))
    with pytest.raises(ValueError, match=r"X has feature size 7 .*num_hiddens=8"):
        pe(arr(backend, 1, 3, 7))


def test_unknown_backend_and_device(backend):
    with pytest.raises(ValueError, match=r"unknown backend 'cntk'.*numpy, torch, jax, mxnet"):
        am.DotProductAttention(0.0, backend="cntk")
    with pytest.raises(ValueError, match=r"unknown device 'tpu:0'"):
        am.DotProductAttention(0.0, backend=backend, device="tpu:0")
    with pytest.raises(ValueError, match=r"cuda:9 is not available"):
        am.DotProductAttention(0.0, backend=backend, device="cuda:9")


def other_backend(backend):
    """A second backend to mix with ``backend`` (torch for the numpy row)."""
    return am.get_backend("torch" if backend.name == "numpy" else "numpy")


def test_arrays_of_two_backends(backend):
    other = other_backend(backend)
    q = arr(backend, 2, 3, 4)
    with pytest.raises(
        TypeError,
        match=rf"keys must be a {backend.name} array .*got a "
        rf"{other.name} array",
    ):
        am.DotProductAttention(0.0, backend=backend)(q, arr(other, 2, 5, 4), q)
    with pytest.raises(
        TypeError,
        match=rf"different backends .*x_train is {backend.name}, "
        rf"y_train is {other.name}",
    ):
        am.nadaraya_watson(arr(backend, 5), arr(other, 5), arr(backend, 3))


def test_module_backend_vs_input_backend(backend):
    other = other_backend(backend)
    module = am.DotProductAttention(0.0, backend=other)
    q = arr(backend, 2, 3, 4)
    with pytest.raises(
        TypeError,
        match=rf"queries must be a {other.name} array .*got a "
        rf"{backend.name} array",
    ):
        module(q, q, q)


def test_dtype_mismatch_with_parameters(backend):
    mha = am.MultiHeadAttention(4, 4, 4, 8, 2, 0.0, backend=backend)
    other = "float64" if "float64" in backend.float_dtypes else "float16"
    opt(backend).enable_float64()
    x = arr(backend, 2, 3, 4, dtype=other)
    with pytest.raises(
        TypeError,
        match=rf"dtypes differ \(queries {other}, keys {other}, "
        rf"values {other}, parameters float32\)",
    ):
        mha(x, x, x)


def test_set_params_is_strict(backend, mha):
    params = am.get_params(mha)
    missing = dict(params)
    del missing["W_o.weight"]
    with pytest.raises(ValueError, match=r"missing \['W_o.weight'\], unknown \[\]"):
        am.set_params(mha, missing)
    with pytest.raises(ValueError, match=r"missing \[\], unknown \['W_x.weight'\]"):
        am.set_params(mha, {**params, "W_x.weight": params["W_q.weight"]})
    with pytest.raises(
        ValueError,
        match=r"'W_q.weight' has shape \(8, 5\), the module "
        r"expects \(8, 4\)",
    ):
        am.set_params(mha, {**params, "W_q.weight": np.zeros((8, 5))})


def test_non_array_inputs(backend):
    with pytest.raises(
        TypeError, match="X must be a numpy, torch, jax, mxnet or tensorflow array, got list"
    ):
        am.masked_softmax([[[1.0, 2.0]]], None)
    with pytest.raises(TypeError, match="valid_lens must be"):
        am.masked_softmax(arr(backend, 1, 1, 2), "2")


# -- the modern forms: mask, bias, causal, window, grouped-query heads ---------------------


def test_a_3d_mask_is_refused_where_its_first_axis_may_be_batch_or_heads(backend):
    """With 4-D inputs and batch == heads a (B, Q, K) mask could be per batch
    element (as a module's 3-D inputs read it) or per head (NumPy's rule)."""
    q4, k4 = arr(backend, 2, 2, 3, 4), arr(backend, 2, 2, 5, 4)
    shape = r"\(2, 3, 5\) is ambiguous with 4-D inputs of batch 2 and 2 heads"
    fix = r"give it 4 axes, \(2, 1, 3, 5\) for each batch element or \(1, 2, 3, 5\) for each head"
    with pytest.raises(ValueError, match=rf"mask of shape {shape}: .*; {fix}"):
        am.dot_product_attention(q4, k4, k4, mask=backend.asarray(np.ones((2, 3, 5), bool)))
    with pytest.raises(ValueError, match=rf"bias of shape {shape}"):
        am.dot_product_attention(q4, k4, k4, bias=arr(backend, 2, 3, 5))
    # one reading each, unambiguous: 3 heads, and a module's 3-D inputs (the batch)
    q3 = arr(backend, 2, 3, 3, 4)
    am.dot_product_attention(
        q3,
        arr(backend, 2, 3, 5, 4),
        arr(backend, 2, 3, 5, 4),
        mask=backend.asarray(np.ones((3, 3, 5), bool)),
    )
    am.DotProductAttention(0.0, backend=backend).eval()(
        arr(backend, 2, 3, 4),
        arr(backend, 2, 5, 4),
        arr(backend, 2, 5, 4),
        mask=backend.asarray(np.ones((2, 3, 5), bool)),
    )


def test_mask_must_be_boolean_and_broadcast(backend, dot, mha):
    q, k = arr(backend, 2, 3, 4), arr(backend, 2, 5, 4)
    v = arr(backend, 2, 5, 3)
    floats = arr(backend, 2, 3, 5)
    with pytest.raises(
        TypeError,
        match=r"mask must be boolean \(True = may attend\), got "
        r"dtype float32; for an additive float mask use bias=",
    ):
        am.dot_product_attention(q, k, v, mask=floats)
    with pytest.raises(TypeError, match="mask must be boolean"):
        dot(q, k, v, mask=floats)
    wrong = backend.asarray(np.ones((2, 4, 5), bool))
    pattern = r"mask of shape \(2, 4, 5\) does not broadcast to \(batch=2, queries=3, keys=5\)"
    with pytest.raises(ValueError, match=pattern):
        am.dot_product_attention(q, k, v, mask=wrong)
    with pytest.raises(ValueError, match=pattern):
        dot(q, k, v, mask=wrong)
    heads = backend.asarray(np.ones((2, 3, 3, 5), bool))  # mha has 2 heads, not 3
    with pytest.raises(
        ValueError,
        match=r"mask of shape \(2, 3, 3, 5\) does not broadcast "
        r"to \(batch=2, heads=2, queries=3, keys=5\)",
    ):
        mha(q, k, arr(backend, 2, 5, 3), mask=heads)
    q4, k4 = arr(backend, 2, 2, 3, 4), arr(backend, 2, 2, 5, 4)
    with pytest.raises(
        ValueError,
        match=r"mask of shape \(3, 1, 1, 5\) does not broadcast "
        r"to \(batch=2, heads=2, queries=3, keys=5\)",
    ):
        am.dot_product_attention(q4, k4, k4, mask=backend.asarray(np.ones((3, 1, 1, 5), bool)))
    with pytest.raises(
        TypeError,
        match=r"mask must be a \w+ array or a NumPy array, got an "
        r"object of type str",
    ):
        am.dot_product_attention(q, k, v, mask="causal")


def test_bias_shape_and_dtype(backend, dot):
    q, k, v = arr(backend, 2, 3, 4), arr(backend, 2, 5, 4), arr(backend, 2, 5, 3)
    with pytest.raises(TypeError, match="bias must have a floating dtype, got int32"):
        am.dot_product_attention(q, k, v, bias=backend.asarray(np.zeros((2, 3, 5), np.int32)))
    with pytest.raises(TypeError, match="bias must have a floating dtype, got bool"):
        dot(q, k, v, bias=backend.asarray(np.zeros((3, 5), bool)))
    with pytest.raises(
        ValueError,
        match=r"bias of shape \(2, 3, 4\) does not broadcast to "
        r"\(batch=2, queries=3, keys=5\)",
    ):
        am.dot_product_attention(q, k, v, bias=arr(backend, 2, 3, 4))
    with pytest.raises(ValueError, match=r"bias of shape \(1, 2, 1, 3, 5\) does not broadcast"):
        dot(q, k, v, bias=arr(backend, 1, 2, 1, 3, 5))


@pytest.mark.parametrize("window", [-1, (2, -3), (1, 2, 3), 1.5, True, "2"])
def test_bad_window(backend, dot, window):
    q, k = arr(backend, 2, 3, 4), arr(backend, 2, 5, 4)
    with pytest.raises(
        ValueError,
        match=r"window must be a(n int or a pair| non-negative "
        r"int).*got " + __import__("re").escape(repr(window)),
    ):
        am.dot_product_attention(q, k, k, window=window)
    with pytest.raises(ValueError, match="window must be"):
        dot(q, k, k, window=window)


def test_causal_must_be_a_bool(backend):
    q = arr(backend, 2, 3, 4)
    with pytest.raises(TypeError, match="causal must be True or False, got 'yes'"):
        am.dot_product_attention(q, q, q, causal="yes")


def test_kv_heads_must_divide_heads(backend):
    q, k = arr(backend, 2, 4, 3, 4), arr(backend, 2, 3, 5, 4)
    with pytest.raises(
        ValueError,
        match=r"the heads of queries \(4\) must be a multiple of "
        r"the heads of keys and values \(3\): queries "
        r"\(2, 4, 3, 4\), keys \(2, 3, 5, 4\)",
    ):
        am.dot_product_attention(q, k, k)
    with pytest.raises(ValueError, match=r"num_heads=2 is not divisible by num_kv_heads=3"):
        am.MultiHeadAttention(4, 4, 3, 8, 2, 0.0, num_kv_heads=3, backend=backend)
