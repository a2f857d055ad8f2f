"""The parity grid: backend x device x mechanism x dtype x mask form, each
case against the independent float64 loop oracle in tests/oracle.py."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle

B, Q, K = 2, 3, 5  # batch, queries, keys
D, V, H, HEADS = 4, 3, 8, 2  # query/key size, value size, hidden size, heads
TOL = {"float32": dict(rtol=2e-5, atol=2e-5), "float64": dict(rtol=1e-10, atol=1e-10)}

MASKS = {  # mask form -> valid_lens
    "none": None,
    "1d": np.array([2, 4]),
    "2d": np.array([[1, 3, 5], [2, 2, 4]]),
    "zeros": np.array([0, 3]),
    "full": np.array([K, K]),
    "overlong": np.array([K + 3, 100]),
}
MASKED_MECHANISMS = ("masked_softmax", "dot_product", "additive", "multi_head", "multi_head_bias")


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        queries=rng.normal(size=(B, Q, D)),
        keys=rng.normal(size=(B, K, D)),
        values=rng.normal(size=(B, K, V)),
        scores=rng.normal(size=(B, Q, K)),
    )


def weights_for(module_name, seed=1):
    """One set of weights, shared by every backend and the oracle."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.normal(scale=0.5, size=shape)

    if module_name == "additive":
        return {"W_q.weight": w(H, D), "W_k.weight": w(H, D), "w_v.weight": w(1, H)}
    params = {
        "W_q.weight": w(H, D),
        "W_k.weight": w(H, D),
        "W_v.weight": w(H, V),
        "W_o.weight": w(H, H),
    }
    if module_name == "multi_head_bias":
        params.update({f"W_{c}.bias": w(H) for c in "qkvo"})
    return params


@pytest.fixture(params=["float32", "float64"])
def dtype(request, backend):
    if request.param not in backend.float_dtypes:
        pytest.skip(f"the {backend.name} backend has no {request.param}")
    return request.param


def to(backend, device, x, dtype):
    from attention_multi.config import native_device

    return backend.asarray(np.asarray(x), dtype, native_device(backend, device))


def check(backend, got, want, dtype):
    got = backend.to_numpy(got)
    assert got.dtype == np.dtype(dtype)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOL[dtype])


def build(name, backend, device, dtype):
    options = dict(backend=backend, device=device, dtype=dtype)
    if name == "dot_product":
        return am.DotProductAttention(0.5, **options).eval()
    if name == "additive":
        module = am.AdditiveAttention(D, D, H, 0.5, **options)
    else:
        module = am.MultiHeadAttention(
            D, D, V, H, HEADS, 0.5, bias=name == "multi_head_bias", **options
        )
    return am.set_params(module, weights_for(name)).eval()


def expected(name, x, lens):
    if name == "masked_softmax":
        return oracle.masked_softmax(x["scores"], lens), None
    if name == "dot_product":
        return oracle.dot_product_attention(x["queries"], x["keys"], x["values"], lens)
    if name == "additive":
        return oracle.additive_attention(
            weights_for(name), x["queries"], x["keys"], x["values"], lens
        )
    return oracle.multi_head_attention(
        weights_for(name), x["queries"], x["keys"], x["values"], lens, HEADS
    )


@pytest.mark.grid
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("mechanism", MASKED_MECHANISMS)
def test_masked_mechanisms(backend, device, mechanism, dtype, mask):
    x, lens = inputs(), MASKS[mask]
    want, want_weights = expected(mechanism, x, lens)
    lens_arg = None if lens is None else to(backend, device, lens, "int32")
    if mechanism == "masked_softmax":
        check(
            backend,
            am.masked_softmax(to(backend, device, x["scores"], dtype), lens_arg),
            want,
            dtype,
        )
        return
    module = build(mechanism, backend, device, dtype)
    q, k, v = (to(backend, device, x[n], dtype) for n in ("queries", "keys", "values"))
    check(backend, module(q, k, v, lens_arg), want, dtype)
    check(backend, module.attention_weights, want_weights, dtype)


@pytest.mark.parametrize("lens_dtype", ["int64", "float32"])
def test_valid_lens_dtypes_and_numpy_lens(backend, device, lens_dtype):
    """Integer and integer-valued float lengths (MXNet's default) agree;
    NumPy lengths work with any backend's scores."""
    x = inputs()
    want = oracle.masked_softmax(x["scores"], MASKS["2d"])
    scores = to(backend, device, x["scores"], "float32")
    check(
        backend,
        am.masked_softmax(scores, to(backend, device, MASKS["2d"], lens_dtype)),
        want,
        "float32",
    )
    check(backend, am.masked_softmax(scores, MASKS["2d"].astype(lens_dtype)), want, "float32")


def test_sequence_mask(backend, device, dtype):
    X = np.arange(10.0).reshape(2, 5)
    for value in (0, -1.5):
        got = am.sequence_mask(
            to(backend, device, X, dtype), to(backend, device, [2, 3], "int32"), value
        )
        check(backend, got, oracle.sequence_mask(X, [2, 3], value), dtype)


def test_transpose_qkv_and_output(backend, device, dtype):
    X = np.random.default_rng(2).normal(size=(B, Q, H))
    split = am.transpose_qkv(to(backend, device, X, dtype), HEADS)
    size = H // HEADS
    want = np.stack([X[b, :, h * size : (h + 1) * size] for b in range(B) for h in range(HEADS)])
    check(backend, split, want, dtype)
    check(backend, am.transpose_output(split, HEADS), X, dtype)


@pytest.mark.parametrize("num_hiddens", [8, 7])
def test_positional_encoding(backend, device, dtype, num_hiddens):
    X = np.random.default_rng(3).normal(size=(B, 6, num_hiddens))
    module = am.PositionalEncoding(
        num_hiddens, 0.5, max_len=10, backend=backend, device=device, dtype=dtype
    ).eval()
    check(backend, module(to(backend, device, X, dtype)), oracle.positional_encoding(X), dtype)


def test_nadaraya_watson(backend, device, dtype):
    rng = np.random.default_rng(4)
    x_train = np.sort(rng.uniform(0, 5, 20))
    y_train = 2 * np.sin(x_train) + x_train**0.8
    x_query = np.linspace(0, 5, 7)
    got, weights = am.nadaraya_watson(
        *(to(backend, device, a, dtype) for a in (x_train, y_train, x_query)), return_weights=True
    )
    check(backend, got, oracle.nadaraya_watson(x_train, y_train, x_query)[0], dtype)
    assert tuple(weights.shape) == (7, 20)


def test_nw_kernel_regression_forward(backend, device, dtype):
    rng = np.random.default_rng(5)
    queries, keys, values = rng.normal(size=6), rng.normal(size=(6, 4)), rng.normal(size=(6, 4))
    net = am.set_params(
        am.NWKernelRegression(backend=backend, device=device, dtype=dtype), {"w": np.array([1.7])}
    )
    got = net(*(to(backend, device, a, dtype) for a in (queries, keys, values)))
    check(backend, got, oracle.nw_kernel_regression(1.7, queries, keys, values), dtype)
    assert tuple(net.attention_weights.shape) == (6, 4)


def test_mask_mod_capturing_an_array_on_the_device(backend, device):
    """A mask function that indexes an array on the call's device, on a call
    large enough for the block-sparse path (its block states are evaluated
    on that device too), through the module and the function."""
    rng, docs = np.random.default_rng(7), np.repeat(np.array([[0, 1, 2], [3, 3, 4]]), 100, 1)
    ids = to(backend, device, docs, "int32")

    def doc_causal(b, h, q, k):
        return (ids[b, q] == ids[b, k]) & (k <= q)

    def doc_causal_np(b, h, q, k):
        return (docs[b, q] == docs[b, k]) & (k <= q)

    q, k, v = (rng.normal(size=(2, 300, 8)) for _ in range(3))
    want = oracle.attention(q[:, None], k[:, None], v[:, None], mask_mod=doc_causal_np)[0][:, 0]
    args = [to(backend, device, x, "float32") for x in (q, k, v)]
    module = am.DotProductAttention(0.0, backend=backend, device=device).eval()
    check(backend, module(*args, mask_mod=doc_causal), want, "float32")
    check(backend, am.dot_product_attention(*args, mask_mod=doc_causal), want, "float32")


def test_packed_documents_path_on_each_device(backend, device):
    """Packed documents (segment ids, causal): on a CPU the tiles skip what no
    query sees; on a GPU one fused call (a tile's launches cost more there
    than the scores it skips), both agreeing with the oracle."""
    rng, docs = np.random.default_rng(8), np.repeat(np.array([[0, 1, 2, 3], [4, 4, 5, 6]]), 128, 1)
    q, k, v = (rng.normal(size=(2, 512, 8)) for _ in range(3))
    expected = oracle.attention(q[:, None], k[:, None], v[:, None], segment_ids=docs, causal=True)
    want = expected[0][:, 0]
    module = am.DotProductAttention(0.0, backend=backend, device=device).eval()
    args = [to(backend, device, x, "float32") for x in (q, k, v)]
    ids = to(backend, device, docs, "int32")
    check(backend, module(*args, segment_ids=ids, causal=True), want, "float32")
    assert module.last_path.family == ("tiled" if device == "cpu" else "fused")  # (the blocks)


# -- the seeds' worked examples ---------------------------------------------------


def seed_example(backend):
    rng = np.random.default_rng(6)
    values = np.tile(np.arange(40, dtype=np.float32).reshape(1, 10, 4), (2, 1, 1))
    return (
        backend.asarray(np.ones((2, 10, 2), np.float32)),
        backend.asarray(values),
        backend.asarray(np.array([2, 6])),
        rng,
    )


def test_seed_dot_product_example(backend):
    keys, values, valid_lens, rng = seed_example(backend)
    queries = backend.asarray(rng.normal(size=(2, 1, 2)).astype(np.float32))
    attention = am.DotProductAttention(dropout=0.5, backend=backend)
    attention.eval()
    out = backend.to_numpy(attention(queries, keys, values, valid_lens))
    np.testing.assert_allclose(out, [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], rtol=1e-6)
    weights = backend.to_numpy(attention.attention_weights).reshape(2, 10)
    np.testing.assert_allclose(weights[0, :2], 0.5, rtol=1e-6)
    np.testing.assert_allclose(weights[1, :6], 1 / 6, rtol=1e-6)
    assert (weights[0, 2:] == 0).all() and (weights[1, 6:] == 0).all()


def test_seed_additive_example(backend):
    keys, values, valid_lens, rng = seed_example(backend)
    queries = backend.asarray(rng.normal(size=(2, 1, 20)).astype(np.float32))
    attention = am.AdditiveAttention(
        key_size=2, query_size=20, num_hiddens=8, dropout=0.1, backend=backend
    )
    attention.eval()
    out = backend.to_numpy(attention(queries, keys, values, valid_lens))
    assert out.shape == (2, 1, 4)
    # keys are all ones: every valid key scores the same, so the weights are uniform
    np.testing.assert_allclose(out, [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], rtol=1e-5)


def test_seed_masked_softmax_example(backend):
    X = backend.asarray(np.random.default_rng(7).random((2, 2, 4)).astype(np.float32))
    got = backend.to_numpy(am.masked_softmax(X, backend.asarray(np.array([2, 3]))))
    np.testing.assert_array_equal(got != 0, [[[1, 1, 0, 0]] * 2, [[1, 1, 1, 0]] * 2])
    np.testing.assert_allclose(got.sum(-1), 1, rtol=1e-6)


def test_seed_sequence_mask_example(backend):
    x = backend.asarray(np.arange(10).reshape(2, 5))
    got = backend.to_numpy(am.sequence_mask(x, backend.asarray(np.array([2, 3]))))
    np.testing.assert_array_equal(got, [[0, 1, 0, 0, 0], [5, 6, 7, 0, 0]])


def test_seed_multi_head_example(backend):
    """d2l: num_hiddens 100, 5 heads, batch 2, 4 queries, 6 keys, valid_lens [3, 2]."""
    attention = am.MultiHeadAttention(100, 100, 100, 100, 5, 0.5, backend=backend).eval()
    X = backend.asarray(np.ones((2, 4, 100), np.float32))
    Y = backend.asarray(np.ones((2, 6, 100), np.float32))
    out = attention(X, Y, Y, backend.asarray(np.array([3, 2])))
    assert tuple(out.shape) == (2, 4, 100)
    params = am.get_params(attention)
    want, _ = oracle.multi_head_attention(
        params, np.ones((2, 4, 100)), np.ones((2, 6, 100)), np.ones((2, 6, 100)), [3, 2], 5
    )
    np.testing.assert_allclose(backend.to_numpy(out), want, rtol=1e-4, atol=1e-5)
