"""A second float64 reference, written from the formulas with plain loops:
tests/test_reference.py checks ``attention_multi.reference`` (the vectorised
reference that grades the backends) against it.

It never imports attention_multi or backends.
Lengths: ``lens[b][i]`` is the number of valid keys for query ``i`` of batch
``b`` (None: all). A row with no valid key has zero weights and zero output.
"""

import math

import numpy as np


def per_query_lens(valid_lens, batch, queries, keys):
    """Expand None / (B,) / (B, Q) lengths to a (B, Q) list, clipped to ``keys``."""
    if valid_lens is None:
        return [[keys] * queries for _ in range(batch)]
    v = np.asarray(valid_lens, dtype=np.float64)
    rows = [[v[b]] * queries if v.ndim == 1 else list(v[b]) for b in range(batch)]
    return [[min(int(n), keys) for n in row] for row in rows]


def softmax_prefix(scores, n):
    """Softmax over the first ``n`` entries; zeros elsewhere (all zeros if n == 0)."""
    out = [0.0] * len(scores)
    if n == 0:
        return out
    top = max(scores[:n])
    exps = [math.exp(s - top) for s in scores[:n]]
    total = sum(exps)
    for j in range(n):
        out[j] = exps[j] / total
    return out


def masked_softmax(X, valid_lens):
    X = np.asarray(X, dtype=np.float64)
    B, Q, K = X.shape
    lens = per_query_lens(valid_lens, B, Q, K)
    return np.array(
        [[softmax_prefix(list(X[b, i]), lens[b][i]) for i in range(Q)] for b in range(B)]
    )


def sequence_mask(X, valid_len, value=0.0):
    X = np.array(X, dtype=np.float64)
    for r in range(X.shape[0]):
        for t in range(X.shape[1]):
            if t >= valid_len[r]:
                X[r, t] = value
    return X


def weighted_values(weights, values, lens):
    """out[b, i] = sum over valid j of weights[b, i, j] * values[b, j]."""
    B, Q, _ = weights.shape
    out = np.zeros((B, Q, values.shape[2]))
    for b in range(B):
        for i in range(Q):
            for j in range(lens[b][i]):
                out[b, i] += weights[b, i, j] * values[b, j]
    return out


def dot_product_attention(queries, keys, values, valid_lens):
    """Returns (output, weights)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (queries, keys, values))
    B, Q, d = q.shape
    K = k.shape[1]
    scores = np.zeros((B, Q, K))
    for b in range(B):
        for i in range(Q):
            for j in range(K):
                scores[b, i, j] = sum(q[b, i, t] * k[b, j, t] for t in range(d)) / math.sqrt(d)
    lens = per_query_lens(valid_lens, B, Q, K)
    weights = masked_softmax(scores, valid_lens)
    return weighted_values(weights, v, lens), weights


def linear(x, weight, bias=None):
    """y[..., o] = sum_i x[..., i] weight[o, i] + bias[o]."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    y = np.zeros(x.shape[:-1] + (weight.shape[0],))
    for o in range(weight.shape[0]):
        y[..., o] = sum(x[..., i] * weight[o, i] for i in range(weight.shape[1]))
        if bias is not None:
            y[..., o] += float(bias[o])
    return y


def additive_attention(params, queries, keys, values, valid_lens):
    q = linear(queries, params["W_q.weight"])
    k = linear(keys, params["W_k.weight"])
    w_v = np.asarray(params["w_v.weight"], np.float64)[0]
    B, Q, h = q.shape
    K = k.shape[1]
    scores = np.zeros((B, Q, K))
    for b in range(B):
        for i in range(Q):
            for j in range(K):
                scores[b, i, j] = sum(w_v[t] * math.tanh(q[b, i, t] + k[b, j, t]) for t in range(h))
    lens = per_query_lens(valid_lens, B, Q, K)
    weights = masked_softmax(scores, valid_lens)
    return weighted_values(weights, np.asarray(values, np.float64), lens), weights


def multi_head_attention(params, queries, keys, values, valid_lens, num_heads):
    """Returns (output, weights) with weights (B * num_heads, Q, K) as d2l."""

    def proj(name, x):
        return linear(x, params[f"{name}.weight"], params.get(f"{name}.bias"))

    q, k, v = proj("W_q", queries), proj("W_k", keys), proj("W_v", values)
    B, Q, H = q.shape
    size = H // num_heads
    concat = np.zeros((B, Q, H))
    all_weights = []
    for b in range(B):
        for head in range(num_heads):
            cols = slice(head * size, (head + 1) * size)
            lens = None if valid_lens is None else np.asarray(valid_lens)[b : b + 1]
            out, w = dot_product_attention(
                q[b : b + 1, :, cols], k[b : b + 1, :, cols], v[b : b + 1, :, cols], lens
            )
            concat[b, :, cols] = out[0]
            all_weights.append(w[0])
    return proj("W_o", concat), np.array(all_weights)


def positional_encoding(X):
    """X + P with P[t, 2i] = sin(t / 10000^(2i/d)), P[t, 2i+1] = cos(same)."""
    X = np.array(X, dtype=np.float64)
    _, T, d = X.shape
    for t in range(T):
        for c in range(d):
            angle = t / 10000 ** ((c - c % 2) / d)
            X[:, t, c] += math.sin(angle) if c % 2 == 0 else math.cos(angle)
    return X


def nadaraya_watson(x_train, y_train, x_query, w=1.0):
    """f(x) = sum_i softmax_i(-((x - x_i) w)^2 / 2) y_i for each query."""
    out = []
    for x in np.asarray(x_query, np.float64):
        scores = [-(((x - xi) * w) ** 2) / 2 for xi in np.asarray(x_train, np.float64)]
        weights = softmax_prefix(scores, len(scores))
        out.append(sum(wi * yi for wi, yi in zip(weights, np.asarray(y_train, np.float64))))
    return np.array(out)


def nw_kernel_regression(w, queries, keys, values):
    """Seed 003's forward: row n attends its own keys[n] and values[n]."""
    return np.array(
        [nadaraya_watson(keys[n], values[n], [queries[n]], w)[0] for n in range(len(queries))]
    )


def visible(b, h, i, j, Q, K, lens=None, mask=None, bias=None, causal=False, window=None):
    """Whether query ``i`` of batch ``b``, head ``h``, may attend key ``j``:
    every condition must hold. ``mask``/``bias`` are full (B, H, Q, K) arrays."""
    p = i + K - Q  # bottom-right alignment
    if lens is not None and not j < lens[b][i]:
        return False
    if causal and not j <= p:
        return False
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        if left is not None and j < p - left:
            return False
        if right is not None and j > p + right:
            return False
    if mask is not None and not mask[b][h][i][j]:
        return False
    if bias is not None and bias[b][h][i][j] == -math.inf:
        return False
    return True


def attention(
    queries,
    keys,
    values,
    valid_lens=None,
    mask=None,
    bias=None,
    causal=False,
    window=None,
    scale=None,
    sinks=None,
    return_lse=False,
):
    """Loops over (batch, head, query): queries (B, H, Q, d), keys/values
    (B, H_kv, K, d|dv), kv head ``h // (H // H_kv)`` for query head ``h``.
    ``mask``/``bias`` given as full (B, H, Q, K). ``sinks`` (H,): a term
    ``exp(sink)`` more in each row's denominator. Returns (output, weights),
    and the rows' log-sum-exp (-inf: no key, no sink) with ``return_lse``."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (queries, keys, values))
    B, H, Q, d = q.shape
    kv_heads, K = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    lens = (
        None
        if valid_lens is None
        else [[int(n) for n in row] for row in per_query_lens(valid_lens, B, Q, 10**9)]
    )
    out = np.zeros((B, H, Q, v.shape[3]))
    weights = np.zeros((B, H, Q, K))
    lse = np.full((B, H, Q), -math.inf)
    for b in range(B):
        for h in range(H):
            g = h // (H // kv_heads)
            for i in range(Q):
                seen = [
                    j
                    for j in range(K)
                    if visible(b, h, i, j, Q, K, lens, mask, bias, causal, window)
                ]
                scores = {}
                for j in seen:
                    s = sum(q[b, h, i, t] * k[b, g, j, t] for t in range(d)) * scale
                    scores[j] = s + (0.0 if bias is None else float(bias[b][h][i][j]))
                terms = list(scores.values()) + ([] if sinks is None else [float(sinks[h])])
                if not terms:
                    continue  # no allowed key: zeros
                top = max(terms)
                total = sum(math.exp(s - top) for s in terms)
                lse[b, h, i] = top + math.log(total)
                for j in seen:
                    weights[b, h, i, j] = math.exp(scores[j] - top) / total
                    out[b, h, i] += weights[b, h, i, j] * v[b, g, j]
    return (out, weights, lse) if return_lse else (out, weights)
