"""The ways to compute scaled dot-product attention, all reading one ``Mask``.

Every path takes ``queries`` (batch, heads, Q, d), ``keys`` and ``values``
(batch, kv_heads, K, d|dv) with ``heads`` a multiple of ``kv_heads``, and
returns (batch, heads, Q, dv) in the dtype of ``queries``. They agree up to
float rounding; ``attend`` (attend.py) picks one.

- ``full``: materializes the scores and keeps the weights.
- ``chunked``: online softmax over blocks of queries and keys (running max,
  running sum, rescaled accumulator); skips blocks no query may see.
- ``tiled``: one tile per batch element and block of queries, over only the
  keys that tile may see (padding is never computed); each tile through the
  backend's kernel, or the softmax-product written here.
- ``fused``: the backend's own kernel, given the normalized mask.
"""
import numpy as np

from .masking import compute_dtype, fill, masked_softmax

DEFAULT_BLOCK_KEYS = 1024
DEFAULT_BLOCK_QUERIES = 512
PARALLEL_MIN_SCORES = 1 << 16   # fewer scores than this: tiles run one after another


def work_itemsize(B, x):
    """Bytes per element of score-sized work on ``x`` (half runs in float32)."""
    return 8 if B.dtype_name(x) == "float64" else 4


def expand_kv(B, keys, values, heads):
    """Grouped-query attention: repeat each kv head for its query heads."""
    group = heads // keys.shape[1]
    if group == 1:
        return keys, values
    return B.repeat(keys, group, 1), B.repeat(values, group, 1)


def _scaled(B, x, scale, work):
    """``x * scale`` in the compute dtype."""
    return (B.astype(x, work) if B.dtype_name(x) != work else x) * scale


def _scores(B, qs, k, mask, work):
    """``qs k^T + bias`` for scaled queries ``qs``, in the compute dtype."""
    s = B.matmul(qs, B.astype(k, work) if B.dtype_name(k) != work else k, transpose_b=True)
    return s if mask.bias is None else s + mask.bias


def weights(B, q, k, mask, scale):
    """The (batch * heads, Q, K) attention weights, as the full path computes them."""
    dtype = B.dtype_name(q)
    k, _ = expand_kv(B, k, k, q.shape[1])
    work = compute_dtype(dtype)
    s = _scores(B, _scaled(B, q, scale, work), k, mask, work)
    w = B.astype(masked_softmax(B, s, mask.boolean(B, B.device_of(q))), dtype)
    return w.reshape((w.shape[0] * w.shape[1],) + tuple(w.shape[2:]))


def full(B, q, k, v, mask, scale, dropout=None):
    """Returns ``(output, weights)``, weights (batch * heads, Q, K)."""
    k, v = expand_kv(B, k, v, q.shape[1])
    _, v = mask.guard_unused(B, v, v)
    w = weights(B, q, k, mask, scale)
    w4 = w.reshape(tuple(q.shape[:2]) + tuple(w.shape[1:]))
    return B.matmul(w4 if dropout is None else dropout(w4), v), w


def fused(B, q, k, v, mask, scale, memory_budget=None):
    """The backend's kernel (None when it declines), with the core's rules
    around it: unused key/value rows zeroed before, empty rows zeroed after."""
    if not B.has_fused_attention:
        return None
    k, v = mask.guard_unused(B, k, v)
    out = B.fused_attention(q, k, v, mask, scale, memory_budget)
    return None if out is None else mask.zero_empty_rows(B, out)


def softmax_block(B, qs, k, v, mask, work, dropout=None):
    """The online-softmax state ``(row max, row sum, accumulator)`` of scaled
    queries ``qs`` over one block of keys and values, whose Mask is ``mask``.

    A row with no visible key in the block has sum 0 and accumulator 0.
    ``dropout`` (a function of the probabilities) applies to the product only.
    """
    device = B.device_of(qs)
    s = _scores(B, qs, k, mask, work)
    visible = mask.boolean(B, device)
    if visible is not None:
        s = B.where(visible, s, fill(B, work, device))
    row_max = B.max(s, -1, keepdims=True)
    p = B.exp(s - row_max)
    if visible is not None:     # a row with no visible key has s == row_max
        p = B.where(visible, p, 0.0)
    row_sum = B.sum(p, -1, keepdims=True)
    if dropout is not None:
        p = dropout(p)
    return row_max, row_sum, B.matmul(p, B.astype(v, work) if B.dtype_name(v) != work else v)


def merge_blocks(B, a, b):
    """The state of two blocks of keys together (either may be None)."""
    if a is None or b is None:
        return a if b is None else b
    row_max = B.where(a[0] > b[0], a[0], b[0])
    ca, cb = B.exp(a[0] - row_max), B.exp(b[0] - row_max)
    return row_max, a[1] * ca + b[1] * cb, a[2] * ca + b[2] * cb


def finish_blocks(B, state):
    """``accumulator / row sum``; rows with no visible key give zeros."""
    _, row_sum, acc = state
    has_keys = row_sum > 0
    return B.where(has_keys, acc / B.where(has_keys, row_sum, 1.0), 0.0)


def chunked(B, q, k, v, mask, scale, dropout=None, memory_budget=None, chunk_size=None):
    """Online-softmax attention over blocks: O(Q d) extra memory plus one block
    of scores, whose size follows ``chunk_size`` (queries and keys per block)
    or else ``memory_budget`` (up to 1024 keys, queries filling an eighth).
    Blocks that no query may see are skipped."""
    dtype = B.dtype_name(q)
    work = compute_dtype(dtype)
    batch, heads, num_q = q.shape[:3]
    k, v = expand_kv(B, k, v, heads)
    _, v = mask.guard_unused(B, v, v)
    device = B.device_of(q)
    start, stop = mask.key_range()
    if chunk_size:
        block_q = block_k = chunk_size
    else:
        block_k = max(1, min(stop - start, DEFAULT_BLOCK_KEYS))
        per_query = batch * heads * block_k * work_itemsize(B, q)
        block_q = max(1, memory_budget // 8 // per_query)
    outs = []
    for q0 in range(0, num_q, block_q):
        q1 = min(num_q, q0 + block_q)
        qs = _scaled(B, q[:, :, q0:q1], scale, work)
        state = None
        for k0 in range(start, stop, block_k):
            k1 = min(stop, k0 + block_k)
            if mask.block_state(0, batch, q0, q1, k0, k1) == "none":
                continue
            drop = None if dropout is None else (
                lambda p, index=q0 * mask.num_keys + k0: dropout(p, index))
            state = merge_blocks(B, state, softmax_block(
                B, qs, k[:, :, k0:k1], v[:, :, k0:k1], mask.sub(0, batch, q0, q1, k0, k1),
                work, drop))
        if state is None:      # no query of this block may see any key
            outs.append(B.zeros((batch, heads, q1 - q0, v.shape[-1]), work, device))
        else:
            outs.append(finish_blocks(B, state))
    out = outs[0] if len(outs) == 1 else B.concatenate(outs, 2)
    return B.astype(out, dtype) if work != dtype else out


def tiled(B, q, k, v, mask, scale, memory_budget=None, chunk_size=None):
    """One tile per batch element and block of queries, over the keys that
    block may see. Needs the mask's intervals on the host: None while traced.
    Tiles run through ``B.parallel_map``; each within its share of
    ``memory_budget``."""
    if not mask.known_on_host() or not B.is_concrete(q):
        return None
    dtype = B.dtype_name(q)
    batch, heads, num_q = q.shape[:3]
    dv = v.shape[-1]
    device = B.device_of(q)
    block_q = max(1, min(num_q, chunk_size or DEFAULT_BLOCK_QUERIES))
    if memory_budget is not None:
        # scores and their exponentials, for each tile running at once
        per_query = 2 * heads * mask.num_keys * work_itemsize(B, q) * B.concurrency()
        block_q = min(block_q, memory_budget // per_query)
        if block_q < 1:     # not even one query's scores fit
            return None
    blocks = [(q0, min(num_q, q0 + block_q)) for q0 in range(0, num_q, block_q)]
    tasks = [(b, q0, q1, *mask.key_range(b, b + 1, q0, q1))
             for b in range(batch) for q0, q1 in blocks]

    def tile(task):
        b, q0, q1, start, stop = task
        if stop <= start:
            return B.zeros((1, heads, q1 - q0, dv), dtype, device)
        sub = mask.sub(b, b + 1, q0, q1, start, stop)
        args = (q[b:b + 1, :, q0:q1], k[b:b + 1, :, start:stop], v[b:b + 1, :, start:stop])
        out = fused(B, *args, sub, scale)
        return softmax_product(B, *args, sub, scale) if out is None else out

    scores = batch * heads * num_q * mask.num_keys
    outs = (B.parallel_map(tile, tasks) if scores >= PARALLEL_MIN_SCORES
            else [tile(t) for t in tasks])
    n = len(blocks)
    rows = [outs[i] if n == 1 else B.concatenate(outs[i:i + n], 2)
            for i in range(0, len(outs), n)]
    return rows[0] if batch == 1 else B.concatenate(rows, 0)


def softmax_product(B, q, k, v, mask, scale):
    """``softmax(scale q k^T) v`` of one tile whose values are concrete.

    Softmax is shift-invariant: when ``|score| <= scale |q_i| max_j |k_j|``
    (Cauchy-Schwarz) bounds every score well inside exp's range, the scores
    are exponentiated as they are, without the pass for the row maxima.
    """
    dtype = B.dtype_name(q)
    work = compute_dtype(dtype)
    k, v = expand_kv(B, k, v, q.shape[1])
    k, v = mask.guard_unused(B, k, v)
    if B.dtype_name(k) != work:
        k, v = B.astype(k, work), B.astype(v, work)
    qs = _scaled(B, q, scale, work)
    s = _scores(B, qs, k, mask, work)
    visible = mask.boolean(B, B.device_of(q))
    if visible is not None:
        s = B.where(visible, s, fill(B, work, B.device_of(q)))
    shift = mask.bias is not None
    if not shift:
        info = np.finfo(np.dtype(work))
        limit = min(np.log(info.max) - np.log(max(1, s.shape[-1])), -np.log(info.tiny)) - 2
        norms = [float(B.to_numpy(B.max(B.sum(x * x, -1), -1)).max()) for x in (qs, k)]
        shift = not np.sqrt(norms[0]) * np.sqrt(norms[1]) <= limit   # (also NaN)
    if shift:
        s = s - B.max(s, -1, keepdims=True)
    p = B.exp_inplace(s)
    total = B.sum(p, -1, keepdims=True)
    out = B.matmul(p, v) / B.where(total > 0, total, 1.0)
    if shift:   # a row with no visible key became all ones
        out = mask.zero_empty_rows(B, out)
    return B.astype(out, dtype) if work != dtype else out
