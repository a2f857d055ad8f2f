"""KV-cache decoding and grouped-query heads in MultiHeadAttention: decoding a
sequence step by step equals one causal pass (and the float64 oracle), on
every backend; under jax.jit one compiled step serves every length; errors
for a cache of another module, backend, batch or past max_len."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle
from attention_multi.backends.capabilities import Autodiff, supports

BATCH, T, MAX_LEN, SIZE, HIDDEN, HEADS, KV_HEADS = 2, 6, 8, 5, 8, 4, 2
TOL = {"float32": 2e-5, "float64": 1e-10}


def build(backend, dtype="float32", num_kv_heads=KV_HEADS, seed=0):
    rng = np.random.default_rng(seed)
    kv_hidden = HIDDEN // HEADS * num_kv_heads
    params = {
        "W_q.weight": rng.normal(scale=0.5, size=(HIDDEN, SIZE)),
        "W_k.weight": rng.normal(scale=0.5, size=(kv_hidden, SIZE)),
        "W_v.weight": rng.normal(scale=0.5, size=(kv_hidden, SIZE)),
        "W_o.weight": rng.normal(scale=0.5, size=(HIDDEN, HIDDEN)),
    }
    module = am.MultiHeadAttention(
        SIZE,
        SIZE,
        SIZE,
        HIDDEN,
        HEADS,
        0.0,
        num_kv_heads=num_kv_heads,
        backend=backend,
        dtype=dtype,
    )
    return am.set_params(module, params).eval(), params


def sequence(backend, dtype, seed=1):
    x = np.random.default_rng(seed).normal(size=(BATCH, T, SIZE))
    return x, backend.asarray(x, dtype)


@pytest.fixture(params=["float32", "float64"])
def dtype(request, backend):
    if request.param not in backend.float_dtypes:
        pytest.skip(f"the {backend.name} backend has no {request.param}")
    return request.param


@pytest.mark.parametrize("path", ["auto", "fused", "tiled", "chunked"])
def test_gqa_projections_and_oracle(backend, dtype, path):
    mha, params = build(backend, dtype)
    mha.path = path
    assert tuple(mha.W_k.named_arrays()["weight"].shape) == (HIDDEN // 2, SIZE)
    assert sorted(am.get_params(mha)) == sorted(params)  # names unchanged
    x, xb = sequence(backend, dtype)
    for forms in ({}, dict(causal=True), dict(window=(1, 1))):
        want, weights = oracle.multi_head_attention(params, x, x, x, None, HEADS, KV_HEADS, **forms)
        got = mha(xb, xb, xb, **forms)
        if backend.name == "torch" and path == "fused":  # SDPA with enable_gqa
            assert mha.last_path == "fused"
        np.testing.assert_allclose(backend.to_numpy(got), want, rtol=TOL[dtype], atol=TOL[dtype])
        np.testing.assert_allclose(
            backend.to_numpy(mha.attention_weights), weights, rtol=TOL[dtype], atol=TOL[dtype]
        )


@pytest.mark.parametrize("steps", [(1,) * T, (3, 1, 2)])
def test_decoding_equals_one_causal_pass(backend, dtype, steps):
    mha, params = build(backend, dtype)
    x, xb = sequence(backend, dtype)
    full = backend.to_numpy(mha(xb, xb, xb, causal=True))
    want, _ = oracle.multi_head_attention(params, x, x, x, None, HEADS, KV_HEADS, causal=True)
    np.testing.assert_allclose(full, want, rtol=TOL[dtype], atol=TOL[dtype])
    cache = mha.init_cache(BATCH, MAX_LEN)
    assert int(backend.to_numpy(cache.length)) == 0 and cache.max_len == MAX_LEN
    outs, t = [], 0
    for n in steps:
        step = xb[:, t : t + n]
        out, cache = mha(step, step, step, cache=cache)
        outs.append(backend.to_numpy(out))
        t += n
        assert int(backend.to_numpy(cache.length)) == t
    np.testing.assert_allclose(np.concatenate(outs, 1), want, rtol=TOL[dtype], atol=TOL[dtype])


def test_decoding_with_a_padding_mask(backend):
    """valid_lens and a boolean mask over the cache's keys combine with the
    cache's causal rule by AND."""
    mha, params = build(backend)
    x, xb = sequence(backend, "float32")
    keep = np.ones((BATCH, 1, MAX_LEN), bool)
    keep[0, 0, 1] = keep[1, 0, 0] = False  # padding in the prompt
    lens = np.array([MAX_LEN, 5])
    want, _ = oracle.multi_head_attention(
        params, x, x, x, lens, HEADS, KV_HEADS, causal=True, mask=keep[:, :, :T]
    )
    cache = mha.init_cache(BATCH, MAX_LEN)
    outs = []
    for t in range(T):
        step = xb[:, t : t + 1]
        out, cache = mha(
            step, step, step, backend.asarray(lens), mask=backend.asarray(keep), cache=cache
        )
        outs.append(backend.to_numpy(out))
    np.testing.assert_allclose(np.concatenate(outs, 1), want, rtol=2e-5, atol=2e-5)


def test_decoding_with_a_window(backend):
    mha, params = build(backend)
    x, xb = sequence(backend, "float32")
    want, _ = oracle.multi_head_attention(
        params, x, x, x, None, HEADS, KV_HEADS, causal=True, window=(2, 0)
    )
    cache, outs = mha.init_cache(BATCH, MAX_LEN), []
    for t in range(T):
        out, cache = mha(
            xb[:, t : t + 1], xb[:, t : t + 1], xb[:, t : t + 1], window=(2, 0), cache=cache
        )
        outs.append(backend.to_numpy(out))
    np.testing.assert_allclose(np.concatenate(outs, 1), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window", [None, (2, 0)])
def test_jit_step_compiles_once(window):
    jax = pytest.importorskip("jax")
    mha, params = build("jax")
    x, xb = sequence(mha.backend, "float32")
    traces = []

    @jax.jit
    def step(module, cache, token):
        traces.append(1)
        return module(token, token, token, window=window, cache=cache)

    cache = mha.init_cache(BATCH, MAX_LEN)
    outs = []
    for t in range(T):
        out, cache = step(mha, cache, xb[:, t : t + 1])
        outs.append(np.asarray(out))
    assert len(traces) == 1
    assert int(cache.length) == T
    want, _ = oracle.multi_head_attention(
        params, x, x, x, None, HEADS, KV_HEADS, causal=True, window=window
    )
    np.testing.assert_allclose(np.concatenate(outs, 1), want, rtol=2e-5, atol=2e-5)
    leaves = jax.tree_util.tree_leaves(cache)
    assert len(leaves) == 3  # keys, values, length


def test_cache_errors(backend):
    mha, _ = build(backend)
    x, xb = sequence(backend, "float32")
    token = xb[:, :1]
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        mha(token, token, token, cache=(1, 2))
    other, _ = build(backend, num_kv_heads=HEADS)
    with pytest.raises(ValueError, match=r"cache of another module.*num_kv_heads=2"):
        mha(token, token, token, cache=other.init_cache(BATCH, MAX_LEN))
    with pytest.raises(ValueError, match=r"batch_size=3 .* batch size 2"):
        mha(token, token, token, cache=mha.init_cache(3, MAX_LEN))
    other_name = "numpy" if backend.name != "numpy" else "torch"
    try:
        foreign, _ = build(other_name)
    except ImportError:
        foreign = None
    if foreign is not None:
        with pytest.raises(
            TypeError, match=f"cache holds a {other_name} array.*{backend.name} backend"
        ):
            mha(token, token, token, cache=foreign.init_cache(BATCH, MAX_LEN))
    cache = mha.init_cache(BATCH, 4)
    _, cache = mha(xb[:, :3], xb[:, :3], xb[:, :3], cache=cache)
    with pytest.raises(
        ValueError,
        match=r"decoding past max_len: the cache holds 3 of "
        r"max_len=4 positions and this step adds 2",
    ):
        mha(xb[:, :2], xb[:, :2], xb[:, :2], cache=cache)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_len must be a positive int"):
            mha.init_cache(BATCH, bad)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        mha.init_cache(0, 4)


@pytest.mark.parametrize(
    "kv, error, pattern",
    [
        (3, ValueError, "num_heads=4 is not divisible by num_kv_heads=3"),
        (0, ValueError, "num_kv_heads must be None or a positive int, got 0"),
        (-2, ValueError, "num_kv_heads must be None or a positive int, got -2"),
        (2.0, TypeError, r"num_kv_heads must be None or a positive int, got 2.0 \(type float\)"),
    ],
)
def test_num_kv_heads_must_divide_num_heads(backend, kv, error, pattern):
    with pytest.raises(error, match=pattern):
        am.MultiHeadAttention(
            SIZE, SIZE, SIZE, HIDDEN, HEADS, 0.0, num_kv_heads=kv, backend=backend
        )


def test_lazily_sized_module_with_gqa_and_a_cache(backend):
    """d2l 1.0's form (sizes from the first call) with num_kv_heads and a cache."""
    mha = am.MultiHeadAttention(HIDDEN, HEADS, 0.0, num_kv_heads=KV_HEADS, backend=backend).eval()
    cache = mha.init_cache(BATCH, MAX_LEN)  # before any call
    x, xb = sequence(backend, "float32")
    out, cache = mha(xb[:, :1], xb[:, :1], xb[:, :1], cache=cache)
    assert tuple(out.shape) == (BATCH, 1, HIDDEN)
    assert tuple(mha.W_k.named_arrays()["weight"].shape) == (HIDDEN // HEADS * KV_HEADS, SIZE)
    params = am.get_params(mha)
    want, _ = oracle.multi_head_attention(
        params, x[:, :1], x[:, :1], x[:, :1], None, HEADS, KV_HEADS, causal=True
    )
    np.testing.assert_allclose(backend.to_numpy(out), want, rtol=2e-5, atol=2e-5)


def test_decoding_under_autodiff_equals_one_causal_pass(backend):
    """The cache write works while the framework records (MXNet's
    ``autograd.record()`` refuses in-place writes), and its gradients are
    those of one causal pass."""
    if not supports(backend, Autodiff):
        pytest.skip(f"the {backend.name} backend has no autodiff")
    mha, _ = build(backend)
    _, xb = sequence(backend, "float32")

    def full(module, x):
        out = module(x, x, x, causal=True)
        return backend.sum((out * out).reshape((-1,)), 0)

    def decoded(module, x):
        cache, total = module.init_cache(BATCH, MAX_LEN), 0.0
        for t0, t1 in ((0, 2), (2, 3), (3, T)):
            step = x[:, t0:t1]
            out, cache = module(step, step, step, cache=cache)
            total = total + backend.sum((out * out).reshape((-1,)), 0)
        return total

    want_loss, want, _ = backend.gradients(full, mha, xb)
    loss, got, _ = backend.gradients(decoded, mha, xb)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for name in want:
        np.testing.assert_allclose(
            backend.to_numpy(got[name]), backend.to_numpy(want[name]), rtol=1e-4, atol=1e-5
        )
