"""The mechanisms' math, written once against the backend protocol."""
import math
import numbers

import numpy as np

from ._checks import backend_of, check_array, check_float, valid_lens_array
from backends.base import HALF_DTYPES


def sequence_mask(X, valid_len, value=0):
    """Replace the entries of ``X`` (N, T) at positions ``>= valid_len`` (N,).

    Unlike d2l's, this returns a new array and leaves ``X`` unchanged.
    """
    B = backend_of(X=X)
    check_array(B, "X", X, 2, "(N, T)")
    lens = valid_lens_array(B, valid_len, X.shape[0], -1, name="valid_len")
    mask = B.arange(X.shape[1], B.device_of(X)) < lens.reshape((-1, 1))
    return B.where(mask, X, value)


def masked_softmax(X, valid_lens):
    """Softmax over the last axis of ``X`` (B, Q, K), keys past ``valid_lens`` masked.

    ``valid_lens`` is None, (B,) (repeated over queries) or (B, Q). Unlike d2l,
    a row with no valid key (length 0) gives all-zero weights, not uniform ones.
    """
    B = backend_of(X=X)
    check_array(B, "X", X, 3, "(batch, queries, keys)")
    check_float(B, "X", X)
    if valid_lens is None:
        return _softmax(B, X, None)
    lens = valid_lens_array(B, valid_lens, X.shape[0], X.shape[1])
    return _softmax(B, X, key_mask(B, lens, X.shape[2], B.device_of(X)))


def key_mask(B, lens, num_keys, device):
    """Boolean mask (batch, 1 or queries, keys): True where the key is valid."""
    lens = lens.reshape(tuple(lens.shape) + (1,) if len(lens.shape) == 2
                        else (lens.shape[0], 1, 1))
    return B.arange(num_keys, device) < lens


def _softmax(B, scores, mask):
    """Masked softmax; half precision is computed in float32."""
    dtype = B.dtype_name(scores)
    x = B.astype(scores, "float32") if dtype in HALF_DTYPES else scores
    if mask is None:
        return B.astype(B.softmax(x, -1), dtype)
    lowest = float(np.finfo(B.dtype_name(x)).min)
    weights = B.softmax(B.where(mask, x, lowest), -1)
    # Exact zeros where masked; all-masked rows (uniform above) become zeros.
    return B.astype(B.where(mask, weights, 0.0), dtype)


def zero_masked_values(B, values, lens):
    """Zero key or value rows that no query may attend, so NaN there cannot
    leak out. ``values`` is (N, K, d) or (batch, heads, K, d)."""
    longest = lens if len(lens.shape) == 1 else B.max(lens, axis=1)
    used = B.arange(values.shape[-2], B.device_of(values)).reshape((-1, 1))
    longest = longest.reshape((-1,) + (1,) * (len(values.shape) - 1))
    return B.where(used < longest, values, 0.0)


def transpose_qkv(X, num_heads):
    """(batch, n, num_hiddens) -> (batch * num_heads, n, num_hiddens / num_heads)."""
    B = backend_of(X=X)
    check_array(B, "X", X, 3, "(batch, n, num_hiddens)")
    _check_heads(X.shape[2], num_heads)
    X = B.transpose(X.reshape((X.shape[0], X.shape[1], num_heads, -1)), (0, 2, 1, 3))
    return X.reshape((-1, X.shape[2], X.shape[3]))


def transpose_output(X, num_heads):
    """Inverse of ``transpose_qkv``."""
    B = backend_of(X=X)
    check_array(B, "X", X, 3, "(batch * num_heads, n, head_size)")
    if X.shape[0] % num_heads:
        raise ValueError(f"X.shape[0]={X.shape[0]} is not a multiple of "
                         f"num_heads={num_heads}")
    X = B.transpose(X.reshape((-1, num_heads, X.shape[1], X.shape[2])), (0, 2, 1, 3))
    return X.reshape((X.shape[0], X.shape[1], -1))


def _check_heads(num_hiddens, num_heads):
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    if num_hiddens % num_heads:
        raise ValueError(f"num_hiddens={num_hiddens} is not divisible by "
                         f"num_heads={num_heads}")


def dot_product_attention(B, queries, keys, values, lens, dropout):
    """Scaled dot-product attention on validated 3-D arrays.

    ``lens`` is None or int32 (B,) / (B, Q); ``dropout`` maps weights to
    weights. Returns ``(output, weights)``.
    """
    weights = attention_weights(B, queries, keys, lens)
    if lens is not None:
        values = zero_masked_values(B, values, lens)
    return B.matmul(dropout(weights), values), weights


# -- choosing the path of scaled dot-product attention -------------------------

DEFAULT_MEMORY_BUDGET = 512 * 2**20
"""Default extra memory (bytes) one attention call may use for its score-sized
intermediates; modules take ``memory_budget=`` to change it per module."""

PATHS = ("auto", "fused", "chunked", "full")
_DEFAULT_BLOCK_KEYS = 1024


def check_path_options(path, memory_budget, chunk_size):
    """Validated ``(path, memory_budget, chunk_size)`` of an attention module."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(map(repr, PATHS))}, "
                         f"got {path!r}")
    checked = []
    for name, value in (("memory_budget", memory_budget), ("chunk_size", chunk_size)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
                    or value < 1:
                raise ValueError(f"{name} must be None or a positive int, got {value!r}")
            value = int(value)
        checked.append(value)
    return (path, *checked)


def attend(B, queries, keys, values, lens, *, dropout=None, path="auto",
           memory_budget=None, chunk_size=None):
    """Scaled dot-product attention on validated arrays, on the path it picks.

    ``queries`` (N, Q, d) or (batch, heads, Q, d), ``keys`` and ``values``
    alike; ``lens`` None or int32 (N,) / (N, Q), or (batch,) / (batch, Q)
    broadcast over the heads. ``dropout`` is None when inactive, else a
    function ``dropout(weights, index=None)``.

    Paths (``path=``):

    - ``"fused"``: the backend's own kernel (``Backend.fused_attention``),
      whatever its memory needs; taken only when dropout is inactive, and
      the weights are not computed: they are computed from the kept
      queries and keys on first access of ``attention_weights``.
    - ``"chunked"``: the online-softmax recurrence over blocks of queries and
      keys (running max, running sum, rescaled accumulator); extra memory is
      O(T d) plus one block of scores, whose size follows ``chunk_size``
      (keys and queries per block) or else ``memory_budget``. Weights are
      computed on first access, as for ``"fused"`` (that materializes them).
    - ``"full"``: materializes the (N, Q, K) scores and keeps the weights.
    - ``"auto"`` (default): ``"fused"`` if dropout is inactive and the
      backend's kernel fits in ``memory_budget``; else ``"chunked"`` if the
      float32 scores would exceed ``memory_budget``
      (default ``DEFAULT_MEMORY_BUDGET``, 512 MiB); else ``"full"``.

    A forced ``"fused"`` falls back as ``"auto"`` does when the backend has
    no kernel for the case or dropout is active. All paths give the same
    results (up to float rounding) with the same masking semantics.

    Returns ``(output, weights or a function computing them, path taken)``;
    the output has the layout of ``queries``.
    """
    if path not in PATHS:
        check_path_options(path, memory_budget, chunk_size)   # raises
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
    scale = 1.0 / math.sqrt(queries.shape[-1])
    if path in ("auto", "fused") and dropout is None:
        out = B.fused_attention(queries, keys, values, lens, scale,
                                None if path == "fused" else budget)
        if out is not None:
            return out, lambda: attention_weights(B, queries, keys, lens), "fused"
    heads = queries.shape[1] if len(queries.shape) == 4 else None
    q, k, v, lens3 = ((queries, keys, values, lens) if heads is None else
                      _flatten_heads(B, queries, keys, values, lens, heads))
    scores_bytes = q.shape[0] * q.shape[1] * k.shape[1] * work_itemsize(B, q)
    if path == "chunked" or (path != "full" and scores_bytes > budget):
        out = chunked_attention(B, q, k, v, lens3, scale, dropout, budget, chunk_size)
        kept, taken = (lambda: attention_weights(B, queries, keys, lens)), "chunked"
    else:
        out, kept = dot_product_attention(
            B, q, k, v, lens3, dropout if dropout is not None else (lambda w: w))
        taken = "full"
    if heads is not None:
        out = out.reshape((-1, heads) + tuple(out.shape[1:]))
    return out, kept, taken


def work_itemsize(B, x):
    """Bytes per element of score-sized work on ``x`` (half runs in float32)."""
    return 8 if B.dtype_name(x) == "float64" else 4


def _flatten_heads(B, queries, keys, values, lens, heads):
    """(batch, heads, n, d) -> (batch * heads, n, d); lengths repeated per head."""
    q, k, v = (x.reshape((-1,) + tuple(x.shape[2:])) for x in (queries, keys, values))
    return q, k, v, None if lens is None else B.repeat(lens, heads, axis=0)


def attention_weights(B, queries, keys, lens):
    """The (N, Q, K) weights of scaled dot-product attention, as the full path
    computes them; 4-D (batch, heads, ...) inputs give (batch * heads, Q, K)."""
    if len(queries.shape) == 4:
        queries, keys, _, lens = _flatten_heads(B, queries, keys, keys, lens,
                                                queries.shape[1])
    scores = B.matmul(queries, keys, transpose_b=True) / math.sqrt(queries.shape[-1])
    mask = None if lens is None else key_mask(B, lens, keys.shape[1], B.device_of(keys))
    return _softmax(B, scores, mask)


def chunked_attention(B, queries, keys, values, lens, scale, dropout=None,
                      memory_budget=DEFAULT_MEMORY_BUDGET, chunk_size=None):
    """Online-softmax attention over blocks: O(Q d) extra memory plus one block.

    ``queries`` (N, Q, d), ``keys`` (N, K, d), ``values`` (N, K, dv), ``lens``
    None or int32 (N,) / (N, Q). Blocks hold ``chunk_size`` queries and keys,
    or by default up to 1024 keys and as many queries as fit in an eighth of
    ``memory_budget``. When the lengths are concrete (not traced), keys past
    the longest length are skipped, and blocks within the shortest length
    are not masked. Half precision is computed in float32.
    """
    dtype = B.dtype_name(queries)
    work = "float32" if dtype in HALF_DTYPES else dtype
    n, num_q, num_k = queries.shape[0], queries.shape[1], keys.shape[1]
    device = B.device_of(keys)
    stop, shortest = num_k, 0
    if lens is not None:
        values = zero_masked_values(B, values, lens)
        if B.is_concrete(lens):   # skip keys past every length, and the mask
            known = B.to_numpy(lens)  # within every length
            if known.size:
                stop = max(1, min(num_k, int(known.max())))
                shortest = int(known.min())
        lens = lens.reshape((n, 1, 1) if len(lens.shape) == 1 else (n, num_q, 1))
    if chunk_size:
        block_q = block_k = chunk_size
    else:
        block_k = min(stop, _DEFAULT_BLOCK_KEYS)
        per_query = n * block_k * work_itemsize(B, queries)
        block_q = max(1, memory_budget // 8 // per_query)
    lowest = float(np.finfo(work).min)
    outs = []
    for q0 in range(0, num_q, block_q):
        q = B.astype(queries[:, q0:q0 + block_q], work) * scale
        row_lens = None if lens is None else (
            lens if lens.shape[1] == 1 else lens[:, q0:q0 + block_q])
        m = total = acc = None
        for index, k0 in enumerate(range(0, stop, block_k)):
            k = B.astype(keys[:, k0:min(stop, k0 + block_k)], work)
            s = B.matmul(q, k, transpose_b=True)
            valid = None
            if row_lens is not None and k0 + k.shape[1] > shortest:
                valid = (B.arange(k.shape[1], device) + k0) < row_lens
                s = B.where(valid, s, lowest)
            m_new = B.max(s, -1, keepdims=True)
            if m is not None:
                m_new = B.where(m > m_new, m, m_new)
            p = B.exp(s - m_new)
            if valid is not None:   # rows masked so far have s == m_new
                p = B.where(valid, p, 0.0)
            row_sum = B.sum(p, -1, keepdims=True)
            if dropout is not None:
                p = dropout(p, q0 * num_k + index)
            pv = B.matmul(p, B.astype(values[:, k0:min(stop, k0 + block_k)], work))
            if m is None:
                total, acc = row_sum, pv
            else:
                c = B.exp(m - m_new)
                total, acc = total * c + row_sum, acc * c + pv
            m = m_new
        has_keys = total > 0
        outs.append(B.where(has_keys, acc / B.where(has_keys, total, 1.0), 0.0))
    out = outs[0] if len(outs) == 1 else B.concatenate(outs, axis=1)
    return B.astype(out, dtype)


def nadaraya_watson(x_train, y_train, x_query, return_weights=False):
    """Nadaraya-Watson regression with a Gaussian kernel (no parameters).

    ``f(x) = sum_i softmax(-(x - x_i)^2 / 2) y_i`` for 1-D ``x_train``,
    ``y_train`` (n,) and ``x_query`` (m,). Returns ``(m,)`` predictions, and
    the (m, n) weights too when ``return_weights``.
    """
    B = backend_of(x_train=x_train, y_train=y_train, x_query=x_query)
    for name, x in (("x_train", x_train), ("y_train", y_train), ("x_query", x_query)):
        check_array(B, name, x, 1, "(n,)")
        check_float(B, name, x)
    if x_train.shape != y_train.shape:
        raise ValueError(f"x_train and y_train must have the same shape, got "
                         f"{tuple(x_train.shape)} and {tuple(y_train.shape)}")
    diff = x_query.reshape((-1, 1)) - x_train.reshape((1, -1))
    weights = _softmax(B, -(diff * diff) / 2, None)
    m, n = weights.shape
    y_hat = B.matmul(weights.reshape((1, m, n)), y_train.reshape((1, n, 1))).reshape((-1,))
    return (y_hat, weights) if return_weights else y_hat
