"""Integers past int32: lengths and window sides larger than the number of
keys mean no limit, on every backend, in every dtype a length may come in;
nothing wraps (3e9 as float32, 2**32 + 2 on JAX, window=(0, 2**31 - 1))."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle
from attention_multi.core import attend, make_mask

B_, H, Q, K, D = 2, 2, 5, 7, 4


def _inputs(backend):
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(B_, H, n, D)) for n in (Q, K, K)]
    return arrays, [backend.asarray(x, "float32") for x in arrays]


@pytest.mark.parametrize(
    "lens, dtype",
    [
        ([3e9, 4], "float32"),
        ([3e9, 4], "bfloat16"),
        ([3e9, 4], "float64"),
        ([2**32 + 2, 4], "int64"),
        ([2**31 - 1, 4], "int32"),
        ([2**31, 4], "int64"),
    ],
)
def test_huge_lengths_mean_no_limit(backend, lens, dtype):
    if dtype in ("bfloat16", "float64") and dtype not in backend.float_dtypes:
        pytest.skip(f"the {backend.name} backend has no {dtype}")
    if dtype == "float64" and backend.name == "jax":
        pytest.skip("float64 on jax needs x64")
    host, (q, k, v) = _inputs(backend)
    want, _ = oracle.attention(*host, valid_lens=np.array([K, 4]))
    as_numpy = np.array(lens, dtype=np.float64 if "float" in dtype else np.int64)
    given = [as_numpy]  # a NumPy array (JAX would wrap int64 to int32 on conversion)
    if dtype != "int64" or backend.name != "jax":
        native = "float32" if dtype == "bfloat16" and backend.name == "numpy" else dtype
        if backend.name == "jax" and dtype == "int64":
            native = None
        given.append(backend.asarray(as_numpy.astype(np.float32) if "float" in dtype else as_numpy))
        if native and native != "float32" and "float" in dtype:
            given[-1] = backend.astype(given[-1], native)
    for lens_arg in given:
        for causal in (False, True):
            got = am.dot_product_attention(q, k, v, lens_arg, causal=causal)
            want_c, _ = oracle.attention(*host, valid_lens=np.array([K, 4]), causal=causal)
            np.testing.assert_allclose(backend.to_numpy(got), want_c, rtol=2e-5, atol=2e-5)
    for given in (as_numpy, as_numpy.tolist()):
        got = am.dot_product_attention(q, k, v, given)
        np.testing.assert_allclose(backend.to_numpy(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("big", [2**63, 2**64 - 1, 2**32])
def test_uint64_lengths_past_int64_mean_no_limit(backend, big):
    """uint64 lengths at or past 2**63 (no int64 holds them) mean no limit,
    as a NumPy array and through ``masked_softmax``: nothing wraps negative."""
    host, (q, k, v) = _inputs(backend)
    lens = np.array([big, 4], np.uint64)
    for causal in (False, True):
        got = am.dot_product_attention(q, k, v, lens, causal=causal)
        want, _ = oracle.attention(*host, valid_lens=np.array([K, 4]), causal=causal)
        np.testing.assert_allclose(backend.to_numpy(got), want, rtol=2e-5, atol=2e-5)
    ones = backend.asarray(np.ones((B_, Q, K)), "float32")
    got = am.masked_softmax(ones, lens)
    np.testing.assert_allclose(backend.to_numpy(got)[0], np.full((Q, K), 1 / K), rtol=1e-6)


@pytest.mark.parametrize(
    "window, same",
    [
        ((0, 2**31 - 1), (0, None)),
        ((2**31 - 1, 0), (None, 0)),
        ((2**40, 2**40), None),
        (2**31, None),
        ((1, 2**31 - 1), (1, None)),
    ],
)
def test_huge_window_sides_mean_no_limit(backend, window, same):
    host, (q, k, v) = _inputs(backend)
    want, _ = oracle.attention(*host, window=same)
    got = am.dot_product_attention(q, k, v, window=window)
    np.testing.assert_allclose(backend.to_numpy(got), want, rtol=2e-5, atol=2e-5)
    for path in ("full", "chunked", "tiled", "fused"):
        mask = make_mask(backend, B_, H, Q, K, window=window)
        got, _, _, _ = attend(backend, q, k, v, mask, path=path, chunk_size=3)
        np.testing.assert_allclose(
            backend.to_numpy(got), want, rtol=2e-5, atol=2e-5, err_msg=f"{path}"
        )


def test_huge_lengths_and_window_under_jit():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    backend = am.get_backend("jax")
    host, (q, k, v) = _inputs(backend)
    want, _ = oracle.attention(*host, valid_lens=np.array([K, 4]), window=(0, None))
    fn = jax.jit(lambda q, k, v, n: am.dot_product_attention(q, k, v, n, window=(0, 2**31 - 1)))
    for lens in (jnp.array([3e9, 4.0], jnp.float32), jnp.array([3e9, 4.0], jnp.bfloat16)):
        np.testing.assert_allclose(np.asarray(fn(q, k, v, lens)), want, rtol=2e-5, atol=2e-5)
