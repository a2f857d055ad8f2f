"""The grid of the modern masking forms: boolean masks, bias, bottom-right
causal, windows, grouped-query heads, d2l's lengths, alone and combined by
AND, with rows that see no key, on every backend, dtype and path, against the
float64 oracle (``attention_multi.reference.attention``), with gradients on
the backends that have autodiff (against the oracle's analytic gradients,
themselves checked against central differences in test_reference.py)."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle
from attention_multi.backends.capabilities import Autodiff, Fused, supports
from attention_multi.core import attend, make_mask

BATCH, HEADS, D = 2, 4, 4
TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 2e-5, "float64": 1e-10}
GRAD_TOL = {"float32": 1e-4, "float64": 1e-9}
PATHS = ("full", "chunked", "tiled", "fused")
HALF_CASES = ("causal", "mask_heads", "bias", "gqa_all")


def _case(name):
    """(kv_heads, Q, K, form) of one case; arrays are NumPy."""
    rng = np.random.default_rng(sum(map(ord, name)))
    kv, q, k = (2, 5, 7) if name.startswith("gqa") else (HEADS, 5, 7)
    if name == "causal_square":
        q = k = 6
    if name == "causal_more_queries":  # the first queries sit before key 0: no key
        q, k = 7, 5

    def boolean(shape):
        m = rng.random(shape) < 0.7
        m[(0,) * (len(shape) - 2) + (1,)] = False  # a fully masked row
        return m

    def bias(shape):
        b = rng.normal(size=shape)
        b[(-1,) * (len(shape) - 2) + (2, slice(0, 3))] = -np.inf
        return b

    forms = {
        "causal": dict(causal=True),
        "causal_square": dict(causal=True),
        "causal_more_queries": dict(causal=True),
        "mask": dict(mask=boolean((BATCH, 1, q, k))),
        "mask_heads": dict(mask=boolean((BATCH, HEADS, q, k))),
        "bias": dict(bias=bias((BATCH, HEADS, q, k))),
        "bias_broadcast": dict(bias=bias((1, 1, q, k))),
        "window": dict(window=(2, 1)),
        "window_causal": dict(window=2, causal=True),
        "lens_mask": dict(
            valid_lens=np.array([[0, 3, 7, 2, 5], [4, 4, 1, 6, 9]]), mask=boolean((BATCH, 1, q, k))
        ),
        "gqa": {},
        "gqa_all": dict(
            valid_lens=np.array([6, 3]),
            mask=boolean((BATCH, HEADS, q, k)),
            bias=bias((BATCH, 1, q, k)),
            causal=True,
            window=(3, 1),
        ),
    }
    return kv, q, k, forms[name]


CASES = (
    "causal",
    "causal_square",
    "causal_more_queries",
    "mask",
    "mask_heads",
    "bias",
    "bias_broadcast",
    "window",
    "window_causal",
    "lens_mask",
    "gqa",
    "gqa_all",
)


def _inputs(backend, kv, q, k, dtype, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [
        rng.normal(size=s) for s in ((BATCH, HEADS, q, D), (BATCH, kv, k, D), (BATCH, kv, k, D))
    ]
    return [backend.asarray(x, dtype) for x in arrays]


def _run(backend, q, k, v, form, path, bias=None):
    form = dict(form)
    if bias is not None:
        form["bias"] = bias
    if "valid_lens" in form:
        form["valid_lens"] = backend.asarray(form["valid_lens"])
    m = make_mask(
        backend, q.shape[0], q.shape[1], q.shape[2], k.shape[2], dtype=backend.dtype_name(q), **form
    )
    out, _, _, taken = attend(backend, q, k, v, m, path=path, chunk_size=3)
    return out, taken


def _expect_path(backend, path, dtype, form):
    if path != "fused":
        return path
    declines = (
        not supports(backend, Fused)
        or (backend.name == "jax" and dtype == "float64")
        or (backend.name == "torch" and "bias" in form and dtype in ("float16", "bfloat16"))
    )
    return None if declines else "fused"


@pytest.mark.grid
@pytest.mark.parametrize(
    "case, dtype",
    [(c, d) for c in CASES for d in ("float32", "float64")]
    + [(c, d) for c in HALF_CASES for d in ("float16", "bfloat16")],
)
def test_forms_every_path(backend, case, dtype, grid_paths):
    if dtype not in backend.float_dtypes:
        pytest.skip(f"the {backend.name} backend has no {dtype}")
    kv, nq, nk, form = _case(case)
    q, k, v = _inputs(backend, kv, nq, nk, dtype)
    want, _ = oracle.attention(*(backend.to_numpy(x) for x in (q, k, v)), **form)
    tol = TOL[dtype]
    for path in grid_paths(PATHS):
        out, taken = _run(backend, q, k, v, form, path)
        expected = _expect_path(backend, path, dtype, form)
        if expected is not None:
            assert taken == expected, (path, taken)
        assert backend.dtype_name(out) == dtype
        got = backend.to_numpy(out).astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{path}")
    rows = oracle.allowed_keys(BATCH, HEADS, nq, nk, **form).any(-1)
    if not rows.all():  # rows with no allowed key are exactly zero
        assert (got[~rows] == 0).all()


@pytest.mark.grid
@pytest.mark.parametrize("case", ["causal_more_queries", "bias", "gqa_all"])
def test_forms_gradients(backend, case, grid_paths):
    if not supports(backend, Autodiff):
        pytest.skip(f"the {backend.name} backend has no autodiff")
    dtype = "float64" if "float64" in backend.float_dtypes else "float32"
    kv, nq, nk, form = _case(case)
    q, k, v = _inputs(backend, kv, nq, nk, dtype)
    rng = np.random.default_rng(1)
    grad_out = rng.normal(size=(BATCH, HEADS, nq, D))
    bias = np.array(np.broadcast_to(form.get("bias", 0.0), (BATCH, HEADS, nq, nk)))
    want = oracle.attention_gradients(
        *(backend.to_numpy(x) for x in (q, k, v)), grad_out, **{**form, "bias": bias}
    )
    form = {n: x for n, x in form.items() if n != "bias"}
    R = backend.asarray(grad_out, dtype)
    dummy = am.DotProductAttention(0.0, backend=backend, dtype=dtype)
    for path in grid_paths(PATHS):

        def loss(module, q, k, v, b, path=path):
            out, _ = _run(backend, q, k, v, form, path, bias=b)
            return backend.sum((out * R).reshape((-1,)), 0)

        _, _, grads = backend.gradients(loss, dummy, q, k, v, backend.asarray(bias, dtype))
        for name, g, w in zip(("queries", "keys", "values", "bias"), grads, want):
            g = backend.to_numpy(g).astype(np.float64)
            assert np.isfinite(g).all(), (path, name)
            np.testing.assert_allclose(
                g, w, rtol=GRAD_TOL[dtype], atol=GRAD_TOL[dtype], err_msg=f"{path} d{name}"
            )


def test_forms_through_the_api(backend):
    """The functional form (3-D and 4-D), DotProductAttention and
    MultiHeadAttention (mask with a heads axis) take every form."""
    kv, nq, nk, form = _case("gqa_all")
    q, k, v = _inputs(backend, kv, nq, nk, "float32")
    lens = backend.asarray(form["valid_lens"])
    want, _ = oracle.attention(*(backend.to_numpy(x) for x in (q, k, v)), **form)
    args = {
        **form,
        "valid_lens": lens,
        "mask": backend.asarray(form["mask"]),
        "bias": backend.asarray(form["bias"], "float32"),
    }
    got = am.dot_product_attention(q, k, v, args.pop("valid_lens"), **args)
    np.testing.assert_allclose(backend.to_numpy(got), want, rtol=2e-5, atol=2e-5)

    kv, nq, nk, form = _case("lens_mask")  # 3-D: (batch, Q, K) masks
    q, k, v = (x[:, 0] for x in _inputs(backend, 1, nq, nk, "float32"))
    mask3 = form["mask"][:, 0]
    bias3 = np.random.default_rng(3).normal(size=(BATCH, nq, nk))
    for options in (
        dict(mask=mask3),
        dict(mask=mask3, causal=True, window=(1, 0)),
        dict(bias=bias3, window=1),
    ):
        want, _ = oracle.attention(
            *(backend.to_numpy(x)[:, None] for x in (q, k, v)),
            form["valid_lens"],
            **{n: (x[:, None] if isinstance(x, np.ndarray) else x) for n, x in options.items()},
        )
        native = {
            n: (
                backend.asarray(x, None if x.dtype == bool else "float32")
                if isinstance(x, np.ndarray)
                else x
            )
            for n, x in options.items()
        }
        lens = backend.asarray(form["valid_lens"])
        got = am.dot_product_attention(q, k, v, lens, **native)
        np.testing.assert_allclose(backend.to_numpy(got), want[:, 0], rtol=2e-5, atol=2e-5)
        module = am.DotProductAttention(0.0, backend=backend).eval()
        got = module(q, k, v, lens, **native)
        np.testing.assert_allclose(backend.to_numpy(got), want[:, 0], rtol=2e-5, atol=2e-5)


# (192 positions: the masks are large enough to be made on the host)
SEGMENTS = np.repeat(np.array([[0, 0, 1, 1, 1, -1, 2, 2, 2], [5, 5, 5, 5, 7, 7, 7, -1, -1]]), 22, 1)
SEGMENTS = np.concatenate([SEGMENTS, SEGMENTS[:, :-6]], 1)[:, :192]
LENS = np.arange(2 * 192).reshape(2, 192) % 200
HOST_CASES = {  # (Q, K, keywords)
    "lens_per_query": (192, 192, dict(valid_lens=LENS)),
    "causal_window_more_keys": (96, 192, dict(causal=True, window=(40, 10))),
    "window_past_the_lengths": (192, 192, dict(window=(20, 5), valid_lens=np.array([50, 192]))),
    "segments_causal": (192, 192, dict(segment_ids=SEGMENTS, causal=True)),
    "segments_lens": (192, 192, dict(segment_ids=SEGMENTS, valid_lens=np.array([150, 91]))),
    "segments_pair_window": (
        96,
        192,
        dict(segment_ids=(SEGMENTS[:, 96:], SEGMENTS), window=(60, 20)),
    ),
    "segments_beyond_int32": (
        192,
        192,
        dict(segment_ids=np.where(SEGMENTS < 0, -1, SEGMENTS << 33)),
    ),
}


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", list(HOST_CASES))
def test_masks_known_on_the_host_equal_the_oracle(case, framework):
    """torch and eager JAX make a CPU mask known on the host with NumPy
    (``host_masks``): every form, the whole grid and a region of it, against
    the oracle."""
    from attention_multi import backends
    from attention_multi.core.mask.spec import Region

    xp = backends.load(framework)
    assert xp.host_masks
    nq, nk, form = HOST_CASES[case]
    # (NumPy's int64 ids as they are where the framework holds 32 bits: JAX without x64)
    native = framework == "torch" or case != "segments_beyond_int32"
    given = {
        name: tuple(xp.asarray(x) for x in v)
        if isinstance(v, tuple) and name == "segment_ids"
        else (xp.asarray(v) if isinstance(v, np.ndarray) and native else v)
        for name, v in form.items()
    }
    expected = oracle.allowed_keys(BATCH, HEADS, nq, nk, **form)
    mask = make_mask(xp, BATCH, HEADS, nq, nk, **given)
    r = Region(0, 2, 1, nq - 1, 2, nk)
    for m, want in ((mask, expected), (mask.region(r), expected[:, :, 1 : nq - 1, 2:nk])):
        got = m.boolean(xp, None)
        got = (
            np.ones(want.shape, bool)
            if got is None
            else np.broadcast_to(xp.to_numpy(got), want.shape)
        )
        np.testing.assert_array_equal(got, want)
