"""Property-based parity and invariants with hypothesis: random shapes,
valid_lens and dtypes on every backend. 25 examples a test; on JAX in the
fast matrix 8 (each new shape compiles: 35 s of the legacy stack's JAX rows
and 46 s of the modern's at 25), the core's facts keep all 25 on NumPy."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attention_multi as am
from attention_multi import reference as oracle

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
JAX_FAST_EXAMPLES = 8


def given_on(backend, request, **strategies):
    """``given(**strategies)`` with this backend's number of examples."""
    fast = request.config.getoption("matrix") == "fast" and backend.name == "jax"
    examples = JAX_FAST_EXAMPLES if fast else SETTINGS.max_examples

    def decorate(check):
        return settings(SETTINGS, max_examples=examples)(given(**strategies)(check))

    return decorate


TOL = {"float16": 2e-3, "float32": 2e-5, "float64": 1e-10}


@st.composite
def cases(draw):
    batch, queries, keys = (draw(st.integers(1, 4)) for _ in range(3))
    d, v = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    form = draw(st.sampled_from(["none", "1d", "2d"]))
    lens = None
    if form == "1d":
        lens = draw(st.lists(st.integers(0, keys + 2), min_size=batch, max_size=batch))
    elif form == "2d":
        lens = [
            draw(st.lists(st.integers(0, keys + 2), min_size=queries, max_size=queries))
            for _ in range(batch)
        ]
    seed = draw(st.integers(0, 2**16))
    dtype = draw(st.sampled_from(["float16", "float32", "float64"]))
    return batch, queries, keys, d, v, None if lens is None else np.array(lens), seed, dtype


def arrays(backend, case):
    batch, queries, keys, d, v, lens, seed, dtype = case
    if dtype not in backend.float_dtypes:
        dtype = "float32"
    rng = np.random.default_rng(seed)
    q, k, vals = (
        rng.normal(size=s).astype(dtype).astype(np.float64)
        for s in ((batch, queries, d), (batch, keys, d), (batch, keys, v))
    )
    return q, k, vals, lens, dtype


def test_dot_product_parity_and_invariants(backend, request):
    given_on(backend, request, case=cases())(_parity_and_invariants)(backend=backend)


def _parity_and_invariants(backend, case):
    q, k, v, lens, dtype = arrays(backend, case)
    attention = am.DotProductAttention(0.0, backend=backend, dtype=dtype).eval()
    out = attention(*(backend.asarray(a, dtype) for a in (q, k, v)), lens)
    w = backend.to_numpy(attention.attention_weights).astype(np.float64)
    want_out, want_w = oracle.dot_product_attention(q, k, v, lens)
    tol = TOL[dtype]
    np.testing.assert_allclose(
        backend.to_numpy(out).astype(np.float64),
        want_out,
        rtol=tol,
        atol=tol * max(1, np.abs(v).max()),
    )
    np.testing.assert_allclose(w, want_w, rtol=tol, atol=tol)
    # weights >= 0; masked positions exactly 0; rows sum to 1, or 0 if fully masked
    valid = np.array(oracle.key_mask(lens, *w.shape).sum(-1))
    positions = np.arange(w.shape[2])
    assert (w >= 0).all()
    assert (w[positions >= valid[..., None]] == 0).all()
    np.testing.assert_allclose(w.sum(-1), np.where(valid > 0, 1.0, 0.0), atol=4 * tol)


def test_permuting_valid_keys_and_values_leaves_output_unchanged(backend, request):
    given_on(backend, request, case=cases(), data=st.data())(_permuting)(backend=backend)


def _permuting(backend, case, data):
    q, k, v, lens, dtype = arrays(backend, case)
    if lens is not None and lens.ndim == 2:
        lens = lens.max(axis=1)  # one valid region per batch element
    keys = k.shape[1]
    region = keys if lens is None else int(min(lens.min(), keys))
    perm = np.concatenate(
        [data.draw(st.permutations(range(region))), np.arange(region, keys)]
    ).astype(int)
    attention = am.DotProductAttention(0.0, backend=backend, dtype=dtype).eval()
    before = backend.to_numpy(attention(*(backend.asarray(a, dtype) for a in (q, k, v)), lens))
    after = backend.to_numpy(
        attention(*(backend.asarray(a, dtype) for a in (q, k[:, perm], v[:, perm])), lens)
    )
    tol = TOL[dtype]
    np.testing.assert_allclose(
        after.astype(np.float64),
        before.astype(np.float64),
        rtol=tol,
        atol=tol * max(1, np.abs(v).max()),
    )


def test_masked_softmax_parity(backend, request):
    given_on(backend, request, case=cases())(_softmax_parity)(backend=backend)


def _softmax_parity(backend, case):
    q, k, _, lens, dtype = arrays(backend, case)
    scores = np.einsum("bqd,bkd->bqk", q, k)
    got = backend.to_numpy(am.masked_softmax(backend.asarray(scores, dtype), lens))
    want = oracle.masked_softmax(scores.astype(dtype).astype(np.float64), lens)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype])
