"""Mask functions and segment ids checked like arguments (issue 37): wide
segment ids keep their values, segment ids are arrays or a pair of arrays,
a function's wrong answer is an error naming it, functions written for
scalar indices run, closures may capture NumPy arrays."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle
from attention_multi.core import attend, make_mask

PATHS = ("full", "chunked", "tiled", "fused")


def _run(B, q, k, v, path, **form):
    m = make_mask(B, q.shape[0], q.shape[1], q.shape[2], k.shape[2], dtype="float32", **form)
    return B.to_numpy(attend(B, q, k, v, m, path=path, chunk_size=3)[0])


def _qkv(B, shape=(2, 2, 10, 4), seed=0):
    rng = np.random.default_rng(seed)
    host = [rng.normal(size=shape) for _ in range(3)]
    return host, [B.asarray(x, "float32") for x in host]


@pytest.mark.parametrize("big", [2**32, 2**31, -(2**40)])
def test_int64_segment_ids_keep_their_values(backend, big):
    """2**32 does not merge with 0, 2**31 is not padding (before: cut to int32)."""
    host, (q, k, v) = _qkv(backend)
    ids = np.zeros((2, 10), np.int64)
    ids[:, 5:] = big
    small = np.where(ids == 0, 0, 1 if big > 0 else -1)
    want, _ = oracle.attention(*host, segment_ids=small)
    for path in PATHS:
        for given in (ids, backend.asarray(ids, "int64")) if big < 2**40 else (ids,):
            got = _run(backend, q, k, v, path, segment_ids=given)
            np.testing.assert_allclose(got, want, atol=3e-6, err_msg=path)


def test_segment_ids_lists_are_rows_and_pairs_are_arrays(backend):
    """A nested list of two rows is a batch of two (before: a (queries, keys)
    pair); a tuple of two lists is refused as ambiguous."""
    host, (q, k, v) = _qkv(backend, (2, 1, 3, 4))
    rows = [[0, 0, 1], [0, 1, 1]]
    want, _ = oracle.attention(*host, segment_ids=np.array(rows))
    got = am.dot_product_attention(q, k, v, segment_ids=rows)
    np.testing.assert_allclose(backend.to_numpy(got), want, atol=3e-6)
    pair = (np.array(rows)[:, 1:], np.array(rows))
    got = am.dot_product_attention(q[:, :, 1:], k, v, segment_ids=pair)
    np.testing.assert_allclose(backend.to_numpy(got), want[:, :, 1:], atol=3e-6)
    with pytest.raises(TypeError, match="segment_ids is ambiguous.*pair of two arrays"):
        am.dot_product_attention(q, k, v, segment_ids=tuple(rows))


def _flex_examples(B, xp_dot, Q=12, K=20, seed=1):
    """Two functions written for flex (each index a scalar, under vmap): a
    vision cross-attention mask and a latent-attention RoPE score; their
    broadcasting NumPy twins for the oracle."""
    rng = np.random.default_rng(seed)
    img_np, intervals_np = (
        np.repeat(np.arange(4), K // 4),
        np.array([[0, 3], [2, 6], [5, 9], [8, Q]]),
    )
    qr_np, kr_np = rng.normal(size=(2, 8, Q, 3)), rng.normal(size=(2, 2, K, 3))
    img, intervals = (B.asarray(x, "int32") for x in (img_np, intervals_np))
    qr, kr = (B.asarray(x, "float32") for x in (qr_np, kr_np))

    def vision(b, h, q_idx, kv_idx):
        interval = intervals[img[kv_idx]]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    def rope(score, b, h, q_idx, kv_idx):
        return score + xp_dot(qr[b, h, q_idx], kr[b, h // 4, kv_idx])

    def vision_np(b, h, q_idx, kv_idx):
        interval = intervals_np[img_np[kv_idx]]
        return (q_idx >= interval[..., 0]) & (q_idx < interval[..., 1])

    def rope_np(score, b, h, q_idx, kv_idx):
        return score + (qr_np[b, h, q_idx] * kr_np[b, h // 4, kv_idx]).sum(-1)

    return (vision, rope), (vision_np, rope_np)


def test_functions_of_scalar_indices_run_under_vmap(backend):
    """flex's functions unchanged (before: 'The size of tensor a (96) must
    match' and '1D tensors expected'): evaluated per element by the
    backend's vmap (torch.vmap, jax.vmap; a loop on NumPy), on every path."""
    if backend.name == "mxnet":
        pytest.skip("the default vmap loops in Python: NumPy shows it, MXNet would be slow")
    dot = {"torch": "torch", "jax": "jax.numpy"}.get(backend.name, "numpy")
    xp_dot = __import__(dot, fromlist=["dot"]).dot
    (vision, rope), (vision_np, rope_np) = _flex_examples(backend, xp_dot)
    rng = np.random.default_rng(0)
    host = [rng.normal(size=(2, 8, 12, 4)), *(rng.normal(size=(2, 2, 20, 4)) for _ in "kv")]
    q, k, v = (backend.asarray(x, "float32") for x in host)
    want, _ = oracle.attention(*host, mask_mod=vision_np, score_mod=rope_np)
    for path in PATHS if backend.name == "torch" else ("full",):
        got = _run(backend, q, k, v, path, mask_mod=vision, score_mod=rope)
        np.testing.assert_allclose(got, want, atol=5e-6, err_msg=path)


def _no_return(b, h, q, k):
    q >= k  # noqa: B015 (the mistake under test)


ANSWERS = [
    ({"mask_mod": _no_return}, TypeError, r"mask_mod returned None.*missing return"),
    ({"mask_mod": lambda b, h, q, k: (q >= k) * 1.0}, TypeError, r"mask_mod must return booleans"),
    (
        {"mask_mod": lambda b, h, q, k: (q >= k)[..., ::2]},
        ValueError,
        r"mask_mod failed.*returned shape \(\d+, \d+, \d+, \d+\)",
    ),
    ({"score_mod": lambda s, b, h, q, k: None}, TypeError, r"score_mod returned None"),
    ({"score_mod": lambda s, b, h, q, k: s[:, :, :1]}, ValueError, r"score_mod.*\(2, 2, 1, 10\)"),
]


@pytest.mark.core
@pytest.mark.parametrize("form, error, message", ANSWERS)
def test_function_answers_are_checked(backend, form, error, message):
    """None, floats or a wrong shape: an error naming the function and the
    shapes (before: zeros, a float mask, a framework's broadcast error, or a
    silently changed output shape), on every path."""
    _, (q, k, v) = _qkv(backend)
    for path in ("full", "tiled"):
        with pytest.raises(error, match=message):
            _run(backend, q, k, v, path, **form)


TABLE = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 1, 3]])
SLOPES = np.array([0.5, -0.25])


def test_closures_may_capture_numpy_arrays(backend):
    """NumPy arrays a function captures (closure, default, global) become the
    backend's (before: a failure on torch and MXNet)."""
    host, (q, k, v) = _qkv(backend)
    table = TABLE

    def document(b, h, q_idx, kv_idx):
        return table[b, q_idx] == table[b, kv_idx]

    def alibi(s, b, h, q_idx, kv_idx, slopes=SLOPES):
        return s + slopes[h] * (kv_idx - q_idx) + TABLE[b, kv_idx]

    want, _ = oracle.attention(*host, mask_mod=document, score_mod=alibi)
    for path in ("full", "tiled"):
        got = _run(backend, q, k, v, path, mask_mod=document, score_mod=alibi)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=path)
    names = np.array(["a", "b"])

    def strings(b, h, q_idx, kv_idx):
        return names[b] == "a"

    if not backend.is_array(names):
        with pytest.raises(TypeError, match="mask_mod captures the NumPy array 'names'"):
            _run(backend, q, k, v, "full", mask_mod=strings)


def test_block_mask_broadcasts_none(backend):
    """``block_mask(fn, None, None, Q, K)``: batch and heads broadcast, as
    flex's (before: a TypeError from arange)."""
    bm = am.block_mask(lambda b, h, q, k: q >= k, None, None, 10, 10, block=4, backend=backend)
    assert bm.states.shape == (1, 1, 3, 3)
    host, (q, k, v) = _qkv(backend)
    want, _ = oracle.attention(*host, causal=True)
    np.testing.assert_allclose(_run(backend, q, k, v, "tiled", mask_mod=bm), want, atol=3e-6)


def test_a_function_by_position_is_not_a_length(backend):
    """The fourth argument is d2l's ``valid_lens``: a function there is
    refused, naming the keywords (before: a message about array types)."""
    _, (q, k, v) = _qkv(backend)
    with pytest.raises(TypeError, match="valid_lens got a function.*score_mod="):
        am.dot_product_attention(q, k, v, lambda s, b, h, q_idx, kv_idx: s)
    attention = am.DotProductAttention(0.0, backend=backend)
    with pytest.raises(TypeError, match="valid_lens got a function.*mask_mod="):
        attention(q[:, 0], k[:, 0], v[:, 0], lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)


def test_one_query_position_per_call(backend):
    """q_idx counts from 0 (flex's); causal= puts query i at i + K - Q: with
    Q != K and no cache a call giving both is refused (before: each read its
    own way, silently), and each alone keeps its meaning."""
    host, (q, k, v) = _qkv(backend)
    q6, h6 = q[:, :, :6], host[0][:, :, :6]

    def first_rows(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    want, _ = oracle.attention(h6, *host[1:], mask_mod=first_rows)  # top-left
    np.testing.assert_allclose(
        _run(backend, q6, k, v, "full", mask_mod=first_rows), want, atol=3e-6
    )
    want, _ = oracle.attention(h6, *host[1:], causal=True)  # bottom-right
    np.testing.assert_allclose(_run(backend, q6, k, v, "full", causal=True), want, atol=3e-6)
    with pytest.raises(ValueError, match=r"mask_mod with causal when Q=6 != K=10.*q_idx \+ 4"):
        am.dot_product_attention(q6, k, v, causal=True, mask_mod=first_rows)
    # (a pair of ids would not move causal's query: the hint says what would)
    with pytest.raises(ValueError, match=r"kv_idx <= q_idx \+ 4\) instead of the keyword$"):
        am.dot_product_attention(
            q6, k, v, causal=True, segment_ids=TABLE, score_mod=lambda s, b, h, q_idx, kv_idx: s
        )
    with pytest.raises(ValueError, match="score_mod with segment_ids.*pair"):
        am.dot_product_attention(
            q6, k, v, segment_ids=TABLE, score_mod=lambda s, b, h, q_idx, kv_idx: s
        )
    shifted = oracle.attention(h6, *host[1:], causal=True)[0]
    got = am.dot_product_attention(q6, k, v, mask_mod=lambda b, h, i, j: j <= i + 4)
    np.testing.assert_allclose(backend.to_numpy(got), shifted, atol=3e-6)


@pytest.mark.parametrize("form", ["segment_ids", "mask_mod"])
def test_compiled_training_on_the_block_sparse_path(form):
    """``torch.compile(fullgraph=True)``, forward and backward, of a
    MultiHeadAttention on the block-sparse path (Q·K >= 65536, the issue's
    T=300 layout): equal to eager (no state mutated inside checkpoint)."""
    torch = pytest.importorskip("torch")
    ids = torch.zeros(2, 300, dtype=torch.int32)
    ids[:, 120:] = 1
    forms = {
        "segment_ids": {"segment_ids": ids, "causal": True},
        "mask_mod": {"mask_mod": lambda b, h, q, k: (ids[b, q] == ids[b, k]) & (k <= q)},
    }[form]
    torch.manual_seed(0)
    mha = am.MultiHeadAttention(8, 8, 8, 8, 2, 0.0, backend="torch", path="tiled")
    x = torch.randn(2, 300, 8, requires_grad=True)
    results = []
    for call in (torch.compile(mha, fullgraph=True, backend="aot_eager"), mha):
        out = call(x, x, x, **forms)
        out.sum().backward()
        results.append((out.detach(), x.grad.clone()))
        x.grad = None
    assert mha.last_path == "blocked"
    for got, want in zip(*results):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=3e-6)
