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
