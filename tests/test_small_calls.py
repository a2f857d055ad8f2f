"""The straight line of small calls (``core/paths/small.py``): with lengths or
nothing, the modules and the functional form skip the ``Mask`` and the
planning; the answers, the weights and the reported path are those of the
full path, graded by the float64 oracle."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle

RNG = np.random.default_rng(11)
Q, K, V = (RNG.standard_normal(s) for s in ((3, 2, 4, 8), (3, 1, 6, 8), (3, 1, 6, 5)))
TOL = {"float32": dict(rtol=2e-5, atol=2e-6), "float64": dict(rtol=1e-10, atol=1e-12)}
LENS = {
    "none": None,
    "1d": np.array([2, 0, 6]),  # an empty row, and a length of every key
    "1d-all": np.array([6, 9, 6]),  # past the last key: nothing masked
    "2d": np.array([[1, 2, 3, 4], [0, 6, 2, 1], [6, 6, 5, 0]]),
}


def _dtype(backend, dtype):
    if dtype not in backend.float_dtypes:
        pytest.skip(f"the {backend.name} backend has no {dtype}")
    return dtype


@pytest.mark.grid
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("lens_dtype", ["int32", "int64", "float32"])
@pytest.mark.parametrize("form", sorted(LENS))
def test_dot_product_attention_small_call(backend, dtype, lens_dtype, form):
    """3-D module calls with every lengths form and dtype (MXNet's d2l code
    passes float32 lengths): the oracle's output and weights, path "full"."""
    dtype = _dtype(backend, dtype)
    q, k, v = Q[:, 0], K[:, 0], V[:, 0]
    lens = LENS[form]
    m = am.DotProductAttention(0.0, backend=backend).eval()
    arrays = [backend.asarray(x, dtype) for x in (q, k, v)]
    got = m(*arrays, None if lens is None else backend.asarray(lens, lens_dtype))
    want, weights = oracle.dot_product_attention(q, k, v, lens)
    assert m.last_path == "full"
    np.testing.assert_allclose(backend.to_numpy(got), want, **TOL[dtype])
    np.testing.assert_allclose(backend.to_numpy(m.attention_weights), weights, **TOL[dtype])


@pytest.mark.parametrize("form", sorted(LENS))
def test_functional_grouped_query_small_call(backend, form):
    """4-D functional calls with two query heads per key head."""
    lens = LENS[form]
    got = am.dot_product_attention(
        *(backend.asarray(x, "float32") for x in (Q, K, V)),
        None if lens is None else backend.asarray(lens),
    )
    want, _ = oracle.attention(Q, K, V, lens)
    np.testing.assert_allclose(backend.to_numpy(got), want, **TOL["float32"])


def test_multi_head_small_call_with_lists(backend):
    """A list of lengths (checked and placed as everywhere) and the seeds'
    module: the oracle's output and (batch * heads, Q, K) weights."""
    m = am.MultiHeadAttention(8, 8, 5, 12, 3, 0.0, backend=backend).eval()
    params = {n: np.asarray(x, np.float64) for n, x in am.get_params(m).items()}
    lens = [4, 1, 0]
    q, kv = Q[:, 0], K[:, 0]
    values = RNG.standard_normal((3, 6, 5))
    got = m(*(backend.asarray(x, "float32") for x in (q, kv, values)), lens)
    want, weights = oracle.multi_head_attention(params, q, kv, values, np.array(lens), 3)
    assert m.last_path == "full"
    np.testing.assert_allclose(backend.to_numpy(got), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(backend.to_numpy(m.attention_weights), weights, **TOL["float32"])


def test_nan_in_unseen_rows_stays_out_and_nan_query_rows_propagate(backend):
    """The masking contract on the straight line: NaN in a key or value row
    nobody sees changes nothing; a NaN query row is NaN, weights included."""
    q, k, v = Q[:, 0].copy(), K[:, 0].copy(), V[:, 0].copy()
    k[0, 4], v[0, 5] = np.nan, np.nan  # batch 0 sees keys 0-1
    q[2, 1] = np.nan
    lens = np.array([2, 3, 6])
    m = am.DotProductAttention(0.0, backend=backend).eval()
    got = np.array(backend.to_numpy(m(*(backend.asarray(x, "float32") for x in (q, k, v)), lens)))
    weights = np.array(backend.to_numpy(m.attention_weights))
    clean = Q[:, 0].copy()
    clean[2, 1] = 0.0
    want, want_weights = oracle.dot_product_attention(
        clean, np.nan_to_num(k), np.nan_to_num(v), lens
    )
    assert m.last_path == "full"
    assert np.isnan(got[2, 1]).all() and np.isnan(weights[2, 1]).all()
    got[2, 1], weights[2, 1] = want[2, 1], want_weights[2, 1]
    np.testing.assert_allclose(got, want, **TOL["float32"])
    np.testing.assert_allclose(weights, want_weights, **TOL["float32"])


@pytest.mark.parametrize(
    "lens, message",
    [
        (np.array([1.0, np.nan, 2.0], np.float32), "valid_lens contains NaN"),
        (np.array([1, -1, 2]), "valid_lens must be >= 0"),
        (np.array([1.5, 1.0, 2.0], np.float32), "valid_lens must hold whole numbers"),
        (np.array([1, 2]), r"valid_lens must have shape \(3,\)"),
    ],
)
def test_lengths_errors_are_those_of_the_full_checks(backend, lens, message):
    m = am.DotProductAttention(0.0, backend=backend).eval()
    q, k, v = (backend.asarray(x, "float32") for x in (Q[:, 0], K[:, 0], V[:, 0]))
    with pytest.raises(ValueError, match=message):
        m(q, k, v, backend.asarray(lens))


def _set_forms(backend):
    """A value for every mask keyword that changes what a small call sees."""
    b, q, k = 3, 4, 6
    return {
        "mask": backend.asarray(np.tril(np.ones((b, q, k), bool), 2)),
        "bias": backend.asarray(np.linspace(-1, 1, b * q * k).reshape(b, q, k), "float32"),
        "causal": True,
        "window": 1,
        "mask_mod": lambda b, h, q_idx, kv_idx: kv_idx <= q_idx,
        "score_mod": lambda score, b, h, q_idx, kv_idx: score * 0.5,
        "segment_ids": backend.asarray(np.array([[0, 0, 0, 1, 1, 1]] * b)),
    }


NOT_FORMS = {"self", "queries", "keys", "values", "valid_lens", "key", "cache", "scale", "dropout"}
NOT_FORMS |= {"sinks", "return_lse"}  # (the softmax's denominator, not a mask: tests/test_flex.py)


def _callers(backend):
    """``where -> (call, signature)`` of the three entry points with mask keywords."""
    import inspect

    d = am.DotProductAttention(0.0, backend=backend).eval()
    m = am.MultiHeadAttention(8, 8, 8, 8, 2, 0.0, backend=backend).eval()
    return {
        "functional": (am.dot_product_attention, inspect.signature(am.dot_product_attention)),
        "DotProductAttention": (d, inspect.signature(type(d).forward)),
        "MultiHeadAttention": (m, inspect.signature(type(m).forward)),
    }


def _oracle_with_form(backend, where, module, arrays, name, value):
    """The float64 answer of a small call on ``arrays`` (queries, keys,
    values) with one mask keyword set."""
    if backend.is_array(value):
        value = backend.to_numpy(value)
    q, k, v = (backend.to_numpy(x).astype(np.float64) for x in arrays)
    if where == "MultiHeadAttention":
        params = {n: np.asarray(x, np.float64) for n, x in am.get_params(module).items()}
        heads = module.num_heads
        return oracle.multi_head_attention(params, q, k, v, None, heads, **{name: value})[0]
    if name in ("mask", "bias"):
        value = value[:, None]
    out, _ = oracle.attention(q[:, None], k[:, None], v[:, None], **{name: value})
    return out[:, 0]


@pytest.mark.parametrize("where", ["DotProductAttention", "MultiHeadAttention", "functional"])
def test_every_mask_form_leaves_the_straight_line(backend, where):
    """A call that sets any mask keyword but valid_lens never takes the
    straight line (which reads lengths only): each gives the oracle's answer
    with that keyword. The keywords are one list (``core.mask.KEYWORDS``),
    taken as ``**forms`` everywhere: a form added there without a value here,
    or a keyword added to a signature beside them, is named by this test."""
    import inspect

    from attention_multi.core.mask import KEYWORDS

    q = backend.asarray(Q[:, 0, :4], "float32")
    kv = backend.asarray(K[:, 0], "float32")
    call, signature = _callers(backend)[where]
    forms = _set_forms(backend)
    assert set(forms) == set(KEYWORDS) - {"valid_lens"}, "give every mask form a value here"
    kinds = {p.name: p.kind for p in signature.parameters.values()}
    assert kinds.pop("forms") is inspect.Parameter.VAR_KEYWORD
    assert not set(kinds) - NOT_FORMS, "a mask keyword belongs in core.mask.MaskForms"
    plain = backend.to_numpy(call(q, kv, kv))
    for name, value in forms.items():
        got = backend.to_numpy(call(q, kv, kv, **{name: value}))
        want = _oracle_with_form(backend, where, call, (q, kv, kv), name, value)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=name)
        assert not np.allclose(got, plain), name  # (the keyword changes the answer)


@pytest.mark.parametrize("where", ["DotProductAttention", "MultiHeadAttention", "functional"])
def test_an_unknown_mask_keyword_is_refused_by_name(backend, where):
    """``**forms`` takes only the mask keywords: a misspelt one is a
    TypeError that names it and the function, not a silently unmasked call."""
    call, _ = _callers(backend)[where]
    q = backend.asarray(Q[:, 0, :4], "float32")
    kv = backend.asarray(K[:, 0], "float32")
    name = "dot_product_attention" if where == "functional" else f"{where}.forward"
    with pytest.raises(
        TypeError, match=rf"^{name}\(\) got an unexpected keyword argument 'casual'"
    ):
        call(q, kv, kv, casual=True)
    call(q, kv, kv, causal=True)  # (the right name passes)


@pytest.mark.parametrize("where", ["DotProductAttention", "MultiHeadAttention"])
def test_a_kept_line_skips_no_check_a_call_needs(backend, where):
    """A module keeps the straight line of a small call for the next calls
    with the same signature (types, shapes, dtypes): lengths' values are
    still checked every call, other shapes and every mask form are checked
    in full, and a new ``path`` is honoured."""
    q, k, v = (backend.asarray(x, "float32") for x in (Q[:, 0], K[:, 0], V[:, 0]))
    if where == "DotProductAttention":
        m = am.DotProductAttention(0.0, backend=backend).eval()
    else:
        m = am.MultiHeadAttention(8, 8, 5, 12, 3, 0.0, backend=backend).eval()
        v = backend.asarray(V[:, 0], "float32")
    lens = np.array([2, 0, 6])
    first = backend.to_numpy(m(q, k, v, backend.asarray(lens)))
    again = backend.to_numpy(m(q, k, v, backend.asarray(lens)))
    np.testing.assert_array_equal(again, first)
    with pytest.raises(ValueError, match="valid_lens must be >= 0"):
        m(q, k, v, backend.asarray(np.array([2, -1, 6])))
    with pytest.raises(ValueError, match=r"valid_lens must have shape \(3,\)"):
        m(q, k, v, backend.asarray(np.array([2, 1])))
    with pytest.raises(ValueError, match="batch sizes differ"):
        m(q, k[:2], v[:2], backend.asarray(lens))
    if "float64" in backend.float_dtypes:
        with pytest.raises(TypeError, match="dtypes differ"):
            m(q, backend.asarray(K[:, 0], "float64"), v)
    m(q, k, v, backend.asarray(lens))  # kept again
    for name, value in _set_forms(backend).items():
        got = backend.to_numpy(m(q, k, v, **{name: value}))
        want = _oracle_with_form(backend, where, m, (q, k, v), name, value)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=name)
    m.path = "chunked"
    got = backend.to_numpy(m(q, k, v, backend.asarray(lens)))
    assert m.last_path == "chunked"
    np.testing.assert_allclose(got, first, **TOL["float32"])


def test_a_kept_mask_follows_the_lengths(backend):
    """A kept line keeps the mask of the last lengths it saw (``small._lengths``):
    new lengths, lengths equal to earlier ones and lengths changed in place
    after a call each give the oracle's answer, and the weights read are
    those of the call that made them."""
    q, k, v = Q[:, 0], K[:, 0], V[:, 0]
    m = am.DotProductAttention(0.0, backend=backend).eval()
    arrays = [backend.asarray(x, "float32") for x in (q, k, v)]
    for lens in ([2, 0, 6], [6, 1, 3], [6, 1, 3], [2, 0, 6], [6, 9, 6], [0, 0, 0], [2, 0, 6]):
        got = m(*arrays, backend.asarray(np.array(lens)))
        want, weights = oracle.dot_product_attention(q, k, v, np.array(lens))
        np.testing.assert_allclose(backend.to_numpy(got), want, **TOL["float32"])
        np.testing.assert_allclose(backend.to_numpy(m.attention_weights), weights, **TOL["float32"])
    if backend.name == "jax":  # (its arrays are immutable)
        return
    lens = backend.asarray(np.array([6, 1, 3]))
    m(*arrays, lens)
    lens[:] = backend.asarray(np.array([1, 5, 0]))
    _, before = oracle.dot_product_attention(q, k, v, np.array([6, 1, 3]))
    np.testing.assert_allclose(backend.to_numpy(m.attention_weights), before, **TOL["float32"])
    got = m(*arrays, lens)
    want, _ = oracle.dot_product_attention(q, k, v, np.array([1, 5, 0]))
    np.testing.assert_allclose(backend.to_numpy(got), want, **TOL["float32"])


def test_a_kept_line_then_torch_compile_is_one_graph():
    """An eager small call keeps its line; the same module compiled with
    fullgraph=True afterwards traces the straight line without it."""
    torch = pytest.importorskip("torch")
    m = am.DotProductAttention(0.0, backend="torch").eval()
    q, k, v = (torch.tensor(x, dtype=torch.float32) for x in (Q[:, 0], K[:, 0], V[:, 0]))
    lens = torch.tensor([2, 0, 6])
    want = m(q, k, v, lens)
    explained = torch._dynamo.explain(m)(q, k, v, lens)
    assert explained.graph_break_count == 0
    got = torch.compile(m, fullgraph=True, backend="eager")(q, k, v, lens)
    torch.testing.assert_close(got, want)


def test_a_mask_made_under_inference_mode_is_not_kept():
    """torch refuses tensors made under ``inference_mode`` in a later
    autograd graph: a small call there keeps its line but not its mask, so
    training the same module afterwards works and gives the same gradients."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.tensor(x, dtype=torch.float32) for x in (Q[:, 0], K[:, 0], V[:, 0]))
    lens = torch.tensor([2, 0, 6])
    m = am.DotProductAttention(0.0, backend="torch")
    with torch.inference_mode():
        m(q, k, v, lens)
    grads = []
    for module in (m, am.DotProductAttention(0.0, backend="torch")):
        qg = q.clone().requires_grad_()
        module(qg, k, v, lens).pow(2).sum().backward()
        grads.append(qg.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
