"""``scale=`` is checked by name; a feature size of 0 gives scores of 0
(uniform weights over the visible keys), not ZeroDivisionError."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle
from attention_multi.backends.capabilities import Autodiff, supports

# (issue 63) checks the core makes: every row on NumPy, a smoke on each other backend
pytestmark = pytest.mark.core


@pytest.mark.parametrize(
    "scale, error, message",
    [
        ("x", TypeError, "scale must be None or a positive real number, got 'x'"),
        ([1.0], TypeError, r"scale must be None or a positive real number, got \[1.0\]"),
        (True, TypeError, "scale must be None or a positive real number, got True"),
        (float("nan"), ValueError, "scale must be None or a finite real number > 0, got nan"),
        (float("inf"), ValueError, "got inf"),
        (0.0, ValueError, "got 0.0"),
        (-1.0, ValueError, "got -1.0"),
    ],
)
def test_scale_is_checked_by_name(backend, scale, error, message):
    x = backend.asarray(np.ones((1, 2, 3)), "float32")
    with pytest.raises(error, match=message):
        am.dot_product_attention(x, x, x, scale=scale)


def test_scale_is_used(backend):
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 1, 3, 4)) for _ in range(3))
    want, _ = oracle.attention(q, k, v, scale=0.7)
    got = am.dot_product_attention(*(backend.asarray(x, "float32") for x in (q, k, v)), scale=0.7)
    np.testing.assert_allclose(backend.to_numpy(got), want, rtol=2e-5, atol=2e-5)
    got = am.dot_product_attention(
        *(backend.asarray(x, "float32") for x in (q, k, v)), scale=np.float32(0.7)
    )
    np.testing.assert_allclose(backend.to_numpy(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("path", ["auto", "fused", "tiled", "chunked", "full"])
def test_feature_size_zero_gives_uniform_weights(backend, path):
    rng = np.random.default_rng(1)
    q, k = np.zeros((2, 3, 0)), np.zeros((2, 5, 0))
    v = rng.normal(size=(2, 5, 2))
    lens = np.array([5, 2])
    # (any scale: every score is 0; the oracle's default 1/sqrt(0) would make it NaN)
    want, _ = oracle.attention(q[:, None], k[:, None], v[:, None], lens, scale=1.0)
    want = want[:, 0]
    np.testing.assert_allclose(want[1], np.repeat(v[1, :2].mean(0, keepdims=True), 3, 0))
    m = am.DotProductAttention(0.0, backend=backend, path=path).eval()
    args = [backend.asarray(x, "float32") for x in (q, k, v)]
    got = m(*args, backend.asarray(lens))
    np.testing.assert_allclose(backend.to_numpy(got), want, rtol=2e-5, atol=2e-5)
    w = backend.to_numpy(m.attention_weights)
    np.testing.assert_allclose(w[1, :, :2], 0.5, rtol=1e-6)
    if supports(backend, Autodiff):

        def loss(module, q, k, v):
            out = module(q, k, v, backend.asarray(lens))
            return backend.sum((out * out).reshape((-1,)), 0)

        _, _, grads = backend.gradients(loss, m, *args)
        assert all(np.isfinite(backend.to_numpy(g)).all() for g in grads)
