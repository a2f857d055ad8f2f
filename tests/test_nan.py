"""NaN in the inputs: it propagates to every output a query may see it from,
and never reaches a query that may not see it (the masking contract,
core/mask/). Every form of the grid (test_forms.py), every path and
backend, against the float64 oracle, whose NaN positions must match exactly;
plus the traced paths (``jax.jit`` with traced lengths) and ``ring_attention``."""

import warnings

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle

from .test_forms import BATCH, CASES, HEADS, PATHS, D, _case, _run

# where the NaN goes: (array, index) with None meaning "a slice"
INJECTIONS = {
    "query_row": ("q", (0, 1, 2, 0)),  # one query's features
    "query_last": ("q", (1, 3, -1, slice(None))),
    "key": ("k", (0, 0, 2, 1)),  # queries before key 2 (causal) must not see it
    "key_last": ("k", (1, 1, -1, slice(None))),
    "bias": ("bias", (0, 0, 3, 1)),
}


def nan_inputs(case, where):
    kv, nq, nk, form = _case(case)
    rng = np.random.default_rng(7)
    q, k, v = (
        rng.normal(size=s) for s in ((BATCH, HEADS, nq, D), (BATCH, kv, nk, D), (BATCH, kv, nk, D))
    )
    form = dict(form)
    arrays = {"q": q, "k": k, "v": v}
    name, index = INJECTIONS[where]
    if name == "bias":
        bias = np.array(np.broadcast_to(form.get("bias", 0.0), (BATCH, HEADS, nq, nk)))
        bias[index] = np.nan
        form["bias"] = bias
    else:
        arrays[name][index] = np.nan
    return q, k, v, form


def expected(q, k, v, form):
    want, _ = oracle.attention(q, k, v, **form)
    return want


def check(got, want, label):
    got = np.asarray(got, np.float64)
    nan_want = np.isnan(want)
    assert (np.isnan(got) == nan_want).all(), (
        f"{label}: NaN at {np.argwhere(np.isnan(got) != nan_want)[:6].tolist()} "
        f"(got NaN: {np.isnan(got).sum()}, want NaN: {nan_want.sum()})"
    )
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=label)


@pytest.mark.grid(rows={"where": ("query_row", "key", "bias")})
@pytest.mark.parametrize("where", list(INJECTIONS))
@pytest.mark.parametrize("case", CASES + ("none", "lens"))
def test_nan_propagates_and_never_leaks_every_path(backend, case, where, grid_paths):
    if case in ("none", "lens"):
        q, k, v, form = nan_inputs("gqa", where)
        k, v = k.repeat(2, 1), v.repeat(2, 1)
        if case == "lens":
            form = dict(form, valid_lens=np.array([3, 0]))
    else:
        q, k, v, form = nan_inputs(case, where)
    want = expected(q, k, v, form)
    args = [backend.asarray(x, "float32") for x in (q, k, v)]
    bias = form.pop("bias", None)
    for path in grid_paths(PATHS):
        out, taken = _run(
            backend, *args, form, path, None if bias is None else backend.asarray(bias, "float32")
        )
        check(backend.to_numpy(out), want, f"{case} {where} {path} ({taken})")


@pytest.mark.parametrize("where", ["query_row", "key"])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_through_the_api(backend, where, causal):
    """``am.dot_product_attention`` on its default path (the torch kernel
    zeroes NaN query rows on its own: the core restores them)."""
    q, k, v, form = nan_inputs("mask", where)
    form = {"causal": causal}
    for lens in (None, np.array([7, 4])):
        want = expected(q, k, v, dict(form, valid_lens=lens))
        args = [backend.asarray(x, "float32") for x in (q, k, v)]
        got = am.dot_product_attention(
            *args, None if lens is None else backend.asarray(lens), **form
        )
        check(backend.to_numpy(got), want, f"lens={lens}")


@pytest.mark.second_stack
def test_nan_under_jit_with_traced_lengths():
    jax = pytest.importorskip("jax")
    B = am.get_backend("jax")
    for where in ("query_row", "key", "key_last"):
        q, k, v, form = nan_inputs("gqa", where)
        for lens in (np.array([7, 3]), np.array([[0, 3, 7, 2, 5], [4, 4, 1, 6, 0]])):
            want = expected(q, k, v, dict(form, valid_lens=lens, causal=True))
            fn = jax.jit(lambda q, k, v, n: am.dot_product_attention(q, k, v, n, causal=True))
            got = fn(*(B.asarray(x, "float32") for x in (q, k, v)), B.asarray(lens))
            check(np.asarray(got), want, f"{where} lens={lens.tolist()}")


@pytest.mark.parametrize("path", ["auto", "full", "chunked", "tiled"])
def test_no_runtime_warning_for_what_the_contract_handles(path):
    """inf and NaN in key and value rows no query sees give the oracle's
    answer on NumPy with RuntimeWarnings as errors (``-W error``)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 40, 4)).astype(np.float32) for _ in range(3))
    k[1, -1], v[1, -1] = np.inf, np.nan
    lens = np.array([40, 39])
    seen = np.where(np.isfinite(v), v, 0.0)  # (the row no query sees: its values never matter)
    want, _ = oracle.attention(
        *(x[:, None].astype(np.float64) for x in (q, k, seen)), valid_lens=lens
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = am.DotProductAttention(0.0, path=path, backend="numpy").eval()(q, k, v, lens)
    np.testing.assert_allclose(out, want[:, 0], rtol=1e-5, atol=1e-5)
