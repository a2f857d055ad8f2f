"""The vectorised float64 reference (``attention_multi.reference``), which
grades every backend in the tests and the report, agrees with a second one
written with plain loops (tests/loop_oracle.py)."""
import numpy as np
import pytest

from attention_multi import reference as ref

from . import loop_oracle as oracle


@pytest.mark.parametrize("seed", range(3))
def test_reference_agrees_with_test_oracle(seed):
    rng = np.random.default_rng(seed)
    n = rng.standard_normal
    close = dict(rtol=1e-12, atol=1e-12)
    lens1 = rng.integers(0, 7, 3)                   # 0 and past-the-end included
    lens2 = rng.integers(0, 7, (3, 4))
    X = n((3, 4, 5))
    for lens in (None, lens1, lens2):
        np.testing.assert_allclose(ref.masked_softmax(X, lens),
                                   oracle.masked_softmax(X, lens), **close)
    S = n((3, 6))
    np.testing.assert_allclose(ref.sequence_mask(S, lens1, -1.0),
                               oracle.sequence_mask(S, lens1, -1.0), **close)

    q, k, v = n((3, 4, 6)), n((3, 5, 6)), n((3, 5, 2))
    for lens in (None, lens1, lens2):
        for mine, theirs in zip(ref.dot_product_attention(q, k, v, lens),
                                oracle.dot_product_attention(q, k, v, lens)):
            np.testing.assert_allclose(mine, theirs, **close)

    add = {"W_q.weight": n((7, 6)), "W_k.weight": n((7, 3)), "w_v.weight": n((1, 7))}
    keys = n((3, 5, 3))
    for mine, theirs in zip(ref.additive_attention(add, q, keys, v, lens2),
                            oracle.additive_attention(add, q, keys, v, lens2)):
        np.testing.assert_allclose(mine, theirs, **close)

    for bias in (False, True):
        mha = {}
        for name, size in (("W_q", 6), ("W_k", 3), ("W_v", 2), ("W_o", 8)):
            mha[f"{name}.weight"] = n((8, size))
            if bias:
                mha[f"{name}.bias"] = n(8)
        for lens in (None, lens1, lens2):
            for mine, theirs in zip(
                    ref.multi_head_attention(mha, q, keys, v, lens, 4),
                    oracle.multi_head_attention(mha, q, keys, v, lens, 4)):
                np.testing.assert_allclose(mine, theirs, **close)

    P = n((2, 9, 6))
    np.testing.assert_allclose(ref.positional_encoding(P),
                               oracle.positional_encoding(P), **close)

    x, y, xq = np.sort(rng.random(8) * 5), n(8), rng.random(5) * 5
    np.testing.assert_allclose(ref.nadaraya_watson(x, y, xq, 1.3)[0],
                               oracle.nadaraya_watson(x, y, xq, 1.3), **close)
    keys, values = n((5, 4)), n((5, 4))
    np.testing.assert_allclose(ref.nw_kernel_regression(1.3, xq, keys, values),
                               oracle.nw_kernel_regression(1.3, xq, keys, values),
                               **close)


def test_reference_seed_example():
    """Seed 000: keys of ones give exactly the mean of the valid values."""
    queries = np.random.default_rng(0).standard_normal((2, 1, 2))
    values = np.tile(np.arange(40.0).reshape(1, 10, 4), (2, 1, 1))
    out, weights = ref.dot_product_attention(queries, np.ones((2, 10, 2)), values,
                                             np.array([2, 6]))
    np.testing.assert_allclose(out, [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], atol=1e-12)
    np.testing.assert_allclose(weights[1, 0], [1 / 6] * 6 + [0] * 4, atol=1e-15)


