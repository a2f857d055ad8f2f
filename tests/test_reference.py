"""The vectorised float64 reference (``attention_multi.reference``), which
grades every backend in the tests and the report, agrees with a second one
written with plain loops (tests/loop_oracle.py)."""

import numpy as np
import pytest

from attention_multi import reference as ref

from . import loop_oracle as oracle

# (issue 63) the oracle, on NumPy 1 and NumPy 2
pytestmark = pytest.mark.second_stack


@pytest.mark.parametrize("seed", range(3))
def test_reference_agrees_with_test_oracle(seed):
    rng = np.random.default_rng(seed)
    n = rng.standard_normal
    close = dict(rtol=1e-12, atol=1e-12)
    lens1 = rng.integers(0, 7, 3)  # 0 and past-the-end included
    lens2 = rng.integers(0, 7, (3, 4))
    X = n((3, 4, 5))
    for lens in (None, lens1, lens2):
        np.testing.assert_allclose(
            ref.masked_softmax(X, lens), oracle.masked_softmax(X, lens), **close
        )
    S = n((3, 6))
    np.testing.assert_allclose(
        ref.sequence_mask(S, lens1, -1.0), oracle.sequence_mask(S, lens1, -1.0), **close
    )

    q, k, v = n((3, 4, 6)), n((3, 5, 6)), n((3, 5, 2))
    for lens in (None, lens1, lens2):
        for mine, theirs in zip(
            ref.dot_product_attention(q, k, v, lens), oracle.dot_product_attention(q, k, v, lens)
        ):
            np.testing.assert_allclose(mine, theirs, **close)

    add = {"W_q.weight": n((7, 6)), "W_k.weight": n((7, 3)), "w_v.weight": n((1, 7))}
    keys = n((3, 5, 3))
    for mine, theirs in zip(
        ref.additive_attention(add, q, keys, v, lens2),
        oracle.additive_attention(add, q, keys, v, lens2),
    ):
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
                oracle.multi_head_attention(mha, q, keys, v, lens, 4),
            ):
                np.testing.assert_allclose(mine, theirs, **close)

    P = n((2, 9, 6))
    np.testing.assert_allclose(ref.positional_encoding(P), oracle.positional_encoding(P), **close)

    x, y, xq = np.sort(rng.random(8) * 5), n(8), rng.random(5) * 5
    np.testing.assert_allclose(
        ref.nadaraya_watson(x, y, xq, 1.3)[0], oracle.nadaraya_watson(x, y, xq, 1.3), **close
    )
    keys, values = n((5, 4)), n((5, 4))
    np.testing.assert_allclose(
        ref.nw_kernel_regression(1.3, xq, keys, values),
        oracle.nw_kernel_regression(1.3, xq, keys, values),
        **close,
    )


def test_reference_seed_example():
    """Seed 000: keys of ones give exactly the mean of the valid values."""
    queries = np.random.default_rng(0).standard_normal((2, 1, 2))
    values = np.tile(np.arange(40.0).reshape(1, 10, 4), (2, 1, 1))
    out, weights = ref.dot_product_attention(queries, np.ones((2, 10, 2)), values, np.array([2, 6]))
    np.testing.assert_allclose(out, [[[2, 3, 4, 5]], [[10, 11, 12, 13]]], atol=1e-12)
    np.testing.assert_allclose(weights[1, 0], [1 / 6] * 6 + [0] * 4, atol=1e-15)


def _forms(rng, B, H, Q, K):
    """Every masking form of the modern API, alone and combined."""
    mask = rng.random((B, 1, Q, K)) < 0.7
    mask[0, 0, 1] = False  # a row with no allowed key
    bias = rng.normal(size=(B, H, Q, K))
    bias[1, 0, 2, :3] = -np.inf
    return {
        "none": {},
        "lens": dict(valid_lens=rng.integers(0, K + 2, (B, Q))),
        "mask": dict(mask=mask),
        "bias": dict(bias=bias),
        "causal": dict(causal=True),
        "window": dict(window=(2, 1)),
        "window_int": dict(window=1),
        "left_only": dict(window=(1, None)),
        "all": dict(
            valid_lens=rng.integers(0, K + 2, B), mask=mask, bias=bias, causal=True, window=(3, 0)
        ),
    }


@pytest.mark.parametrize("shape", [(2, 4, 2, 3, 5), (2, 2, 2, 4, 4), (2, 2, 1, 6, 3)])
def test_modern_forms_agree_with_loop_oracle(shape):
    """Boolean mask, bias, bottom-right causal, windows, GQA, by AND; empty rows 0."""
    B, H, Hkv, Q, K = shape
    rng = np.random.default_rng(sum(shape))
    q, k, v = (rng.normal(size=s) for s in ((B, H, Q, 3), (B, Hkv, K, 3), (B, Hkv, K, 2)))
    for name, form in _forms(rng, B, H, Q, K).items():
        full = {n: np.broadcast_to(form[n], (B, H, Q, K)) for n in ("mask", "bias") if n in form}
        mine = ref.attention(q, k, v, **form)
        theirs = oracle.attention(q, k, v, **{**form, **full})
        for a, b in zip(mine, theirs):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=name)


def test_sinks_and_lse_agree_with_loop_oracle():
    """``sinks`` and ``return_lse`` with every form, rows without a key
    included (their lse is -inf, or the sink)."""
    B, H, Hkv, Q, K = 2, 4, 2, 3, 5
    rng = np.random.default_rng(7)
    q, k, v = (rng.normal(size=s) for s in ((B, H, Q, 3), (B, Hkv, K, 3), (B, Hkv, K, 2)))
    sinks = rng.normal(size=H)
    for name, form in _forms(rng, B, H, Q, K).items():
        full = {n: np.broadcast_to(form[n], (B, H, Q, K)) for n in ("mask", "bias") if n in form}
        for s in (None, sinks):
            mine = ref.attention(q, k, v, **form, sinks=s, return_lse=True)
            theirs = oracle.attention(q, k, v, **{**form, **full}, sinks=s, return_lse=True)
            for a, b in zip(mine, theirs):
                np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=name)


def test_modern_forms_bottom_right_examples():
    """Hand-checked visibility: Q=2 queries over K=4 keys sit at positions 2 and 3."""
    ok = ref.allowed_keys(1, 1, 2, 4, causal=True)[0, 0]
    assert ok.tolist() == [[True, True, True, False], [True, True, True, True]]
    ok = ref.allowed_keys(1, 1, 2, 4, window=(1, 0))[0, 0]
    assert ok.tolist() == [[False, True, True, False], [False, False, True, True]]
    ok = ref.allowed_keys(1, 1, 3, 2, causal=True)[0, 0]  # first query sees nothing
    assert ok.tolist() == [[False, False], [True, False], [True, True]]


def test_attention_gradients_match_central_differences():
    rng = np.random.default_rng(5)
    B, H, Hkv, Q, K = 2, 4, 2, 3, 4
    q, k, v = (
        rng.normal(size=(B, H, Q, 3)),
        rng.normal(size=(B, Hkv, K, 3)),
        rng.normal(size=(B, Hkv, K, 2)),
    )
    g = rng.normal(size=(B, H, Q, 2))
    for name, form in _forms(rng, B, H, Q, K).items():
        bias = np.array(np.broadcast_to(form.get("bias", 0.0), (B, H, Q, K)))
        form = {**form, "bias": bias}
        analytic = ref.attention_gradients(q, k, v, g, **form)
        for x, want in zip((q, k, v, bias), analytic):
            numeric = np.zeros_like(x)
            for idx in np.ndindex(x.shape):
                if not np.isfinite(x[idx]):
                    continue
                saved = x[idx]
                x[idx] = saved + 1e-6
                up = (ref.attention(q, k, v, **form)[0] * g).sum()
                x[idx] = saved - 1e-6
                down = (ref.attention(q, k, v, **form)[0] * g).sum()
                x[idx] = saved
                numeric[idx] = (up - down) / 2e-6
            np.testing.assert_allclose(want, numeric, rtol=1e-5, atol=1e-7, err_msg=name)


def test_attention_gradients_through_a_score_mod_match_central_differences():
    """The chain rule through score_mod (soft-capping) with its derivative, under a
    causal mask and grouped heads; the bias's gradient is the one before score_mod."""
    rng = np.random.default_rng(6)
    B, H, Hkv, Q, K = 2, 2, 1, 3, 4
    q, k = rng.normal(size=(B, H, Q, 3)) * 2, rng.normal(size=(B, Hkv, K, 3)) * 2
    v, g = rng.normal(size=(B, Hkv, K, 2)), rng.normal(size=(B, H, Q, 2))
    bias = rng.normal(size=(B, H, Q, K))

    def cap(s, b, h, i, j):
        return 1.5 * np.tanh(s / 1.5)

    def derivative(s, b, h, i, j):
        return 1 - np.tanh(s / 1.5) ** 2

    form = dict(bias=bias, causal=True, score_mod=cap)
    analytic = ref.attention_gradients(q, k, v, g, score_mod_derivative=derivative, **form)
    for x, want in zip((q, k, v, bias), analytic):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            saved = x[idx]
            x[idx] = saved + 1e-6
            up = (ref.attention(q, k, v, **form)[0] * g).sum()
            x[idx] = saved - 1e-6
            down = (ref.attention(q, k, v, **form)[0] * g).sum()
            x[idx] = saved
            numeric[idx] = (up - down) / 2e-6
        np.testing.assert_allclose(want, numeric, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="score_mod_derivative"):
        ref.attention_gradients(q, k, v, g, score_mod=cap)
