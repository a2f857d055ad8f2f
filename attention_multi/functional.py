"""The mechanisms' math, written once against the backend protocol."""
import math

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
    """Zero value rows that no query may attend, so NaN there cannot leak out."""
    longest = lens if len(lens.shape) == 1 else B.max(lens, axis=1)
    used = B.arange(values.shape[1], B.device_of(values)).reshape((1, -1, 1))
    return B.where(used < longest.reshape((-1, 1, 1)), values, 0.0)


def transpose_qkv(X, num_heads):
    """(batch, n, num_hiddens) -> (batch * num_heads, n, num_hiddens / num_heads)."""
    B = backend_of(X=X)
    check_array(B, "X", X, 3, "(batch, n, num_hiddens)")
    _check_heads(X.shape[2], num_heads)
    return split_heads(B, X, num_heads)


def transpose_output(X, num_heads):
    """Inverse of ``transpose_qkv``."""
    B = backend_of(X=X)
    check_array(B, "X", X, 3, "(batch * num_heads, n, head_size)")
    if X.shape[0] % num_heads:
        raise ValueError(f"X.shape[0]={X.shape[0]} is not a multiple of "
                         f"num_heads={num_heads}")
    return merge_heads(B, X, num_heads)


def split_heads(B, X, num_heads):
    X = B.transpose(X.reshape((X.shape[0], X.shape[1], num_heads, -1)), (0, 2, 1, 3))
    return X.reshape((-1, X.shape[2], X.shape[3]))


def merge_heads(B, X, num_heads):
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
    scores = B.matmul(queries, keys, transpose_b=True) / math.sqrt(queries.shape[-1])
    mask = None if lens is None else key_mask(B, lens, keys.shape[1], B.device_of(keys))
    weights = _softmax(B, scores, mask)
    if lens is not None:
        values = zero_masked_values(B, values, lens)
    return B.matmul(dropout(weights), values), weights


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
