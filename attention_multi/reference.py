"""Float64 NumPy reference of every mechanism, written from the formulas.

``attention-multi report`` grades the backends against it, so it imports
nothing from ``attention_multi`` or ``backends`` and shares no code with them.
Lengths: ``valid_lens`` is None (all keys), (B,) (same for every query) or
(B, Q); keys at positions ``>= length`` get weight 0, and a query with no valid
key gets all-zero weights (hence a zero output).
"""

import numpy as np


def _f64(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def key_mask(valid_lens, batch, queries, keys):
    """(B, Q, K) boolean: True where key ``k`` is valid for query ``q``."""
    if valid_lens is None:
        return np.ones((batch, queries, keys), dtype=bool)
    lens = np.asarray(valid_lens)
    lens = np.broadcast_to(lens[:, None] if lens.ndim == 1 else lens, (batch, queries))
    return np.arange(keys) < lens[:, :, None]


def masked_softmax(X, valid_lens):
    """softmax over the valid prefix of the last axis of X (B, Q, K); 0 elsewhere."""
    (X,) = _f64(X)
    return softmax_where(X, key_mask(valid_lens, *X.shape))


def softmax_where(X, mask):
    """softmax over the last axis restricted to ``mask``; rows with none: zeros."""
    top = np.where(mask, X, -np.inf).max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(mask, np.exp(np.where(mask, X - top, 0.0)), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


def sequence_mask(X, valid_len, value=0.0):
    """X (N, T) with entries at ``t >= valid_len[n]`` set to ``value``."""
    (X,) = _f64(X)
    keep = np.arange(X.shape[1]) < np.asarray(valid_len)[:, None]
    return np.where(keep, X, value)


def linear(x, weight, bias=None):
    """x W^T + b, W laid out (out, in)."""
    y = np.einsum("...i,oi->...o", *_f64(x, weight))
    return y if bias is None else y + np.asarray(bias, np.float64)


def attend(scores, values, valid_lens):
    """(weights, output) for (B, Q, K) scores and (B, K, V) values."""
    weights = masked_softmax(scores, valid_lens)
    return weights, np.einsum("bqk,bkv->bqv", weights, values)


def dot_product_attention(queries, keys, values, valid_lens=None):
    """softmax(Q K^T / sqrt(d)) V. Returns (output, weights)."""
    q, k, v = _f64(queries, keys, values)
    scores = np.einsum("bqd,bkd->bqk", q, k) / np.sqrt(q.shape[-1])
    weights, out = attend(scores, v, valid_lens)
    return out, weights


def additive_attention(params, queries, keys, values, valid_lens=None):
    """score(q, k) = w_v^T tanh(W_q q + W_k k). Returns (output, weights)."""
    q = linear(queries, params["W_q.weight"])
    k = linear(keys, params["W_k.weight"])
    w_v = np.asarray(params["w_v.weight"], np.float64).reshape(-1)
    scores = np.tanh(q[:, :, None, :] + k[:, None, :, :]) @ w_v
    weights, out = attend(scores, *_f64(values), valid_lens)
    return out, weights


def multi_head_attention(
    params, queries, keys, values, valid_lens, num_heads, num_kv_heads=None, **forms
):
    """W_o concat_h(attention_h(W_q q, W_k k, W_v v)), heads on contiguous feature
    blocks; with ``num_kv_heads`` W_k and W_v give that many heads, each serving
    ``num_heads // num_kv_heads`` consecutive query heads. ``forms``: ``mask``,
    ``bias`` (broadcast to (B, heads, Q, K); a 3-D one is (B, Q, K)), ``causal``,
    ``window`` as in ``attention``. Returns (output, weights) with weights
    (B * num_heads, Q, K) as d2l."""

    def proj(name, x):
        return linear(x, params[f"{name}.weight"], params.get(f"{name}.bias"))

    def heads(x, n):  # (B, n, H) -> (B, heads, n, H / heads)
        return x.reshape(x.shape[0], x.shape[1], n, -1).transpose(0, 2, 1, 3)

    kv = num_heads if num_kv_heads is None else num_kv_heads
    forms = {
        n: (np.asarray(x)[:, None] if n in ("mask", "bias") and np.ndim(x) == 3 else x)
        for n, x in forms.items()
    }
    q = heads(proj("W_q", queries), num_heads)
    out, weights = attention(
        q, heads(proj("W_k", keys), kv), heads(proj("W_v", values), kv), valid_lens, **forms
    )
    B, _, Q, K = weights.shape
    concat = out.transpose(0, 2, 1, 3).reshape(B, Q, -1)
    return proj("W_o", concat), weights.reshape(B * num_heads, Q, K)


def positional_encoding(X):
    """X + P, P[t, 2i] = sin(t / 10000^(2i/d)), P[t, 2i+1] = cos(t / 10000^(2i/d))."""
    (X,) = _f64(X)
    _, T, d = X.shape
    t = np.arange(T)[:, None]
    j = np.arange(d)[None, :]
    angle = t / 10000.0 ** ((j - j % 2) / d)
    return X + np.where(j % 2 == 0, np.sin(angle), np.cos(angle))


def nadaraya_watson(x_train, y_train, x_query, w=1.0):
    """f(x) = sum_i softmax_i(-((x - x_i) w)^2 / 2) y_i. Returns (f, weights)."""
    xt, yt, xq = _f64(x_train, y_train, x_query)
    weights = softmax_where(-(((xq[:, None] - xt[None, :]) * w) ** 2) / 2, True)
    return weights @ yt, weights


def nw_kernel_regression(w, queries, keys, values):
    """Seed 003's forward: query n attends its own row keys[n], values[n]."""
    q, k, v = _f64(queries, keys, values)
    weights = softmax_where(-(((q[:, None] - k) * float(w)) ** 2) / 2, True)
    return (weights * v).sum(axis=1)


# -- the modern forms: boolean mask, bias, causal, window, grouped-query heads --------------


def allowed_keys(
    batch,
    heads,
    queries,
    keys,
    valid_lens=None,
    mask=None,
    bias=None,
    causal=False,
    window=None,
    mask_mod=None,
    segment_ids=None,
    q_base=0,
):
    """(B, H, Q, K) boolean: True where query ``i`` may attend key ``j``.

    Query ``i`` sits at position ``p = i + K - Q`` among the keys (bottom-right
    alignment). ``valid_lens`` as d2l (keys ``j < length``); ``mask`` True = may
    attend; ``bias`` masks where it is ``-inf``; ``causal``: ``j <= p``;
    ``window`` ``w`` or ``(left, right)`` (None: unbounded side):
    ``p - left <= j <= p + right``. ``mask`` and ``bias`` broadcast to
    (B, H, Q, K) as NumPy broadcasts. ``mask_mod(b, h, q_idx, kv_idx)``
    evaluated on NumPy index arrays broadcasting to (B, H, Q, K) (``q_idx``
    from ``q_base``); ``segment_ids`` (B, K), queries taking the id at their
    position ``p``, or a pair ((B, Q), (B, K)): same id, not negative. All
    conditions combine by AND.
    """
    shape = (batch, heads, queries, keys)
    ok = np.broadcast_to(key_mask(valid_lens, batch, queries, keys)[:, None], shape)
    j = np.arange(keys)[None, :]
    p = np.arange(queries)[:, None] + (keys - queries)
    if causal:
        ok = ok & (j <= p)
    if window is not None:
        left, right = (window, window) if np.ndim(window) == 0 else window
        if left is not None:
            ok = ok & (j >= p - left)
        if right is not None:
            ok = ok & (j <= p + right)
    if mask is not None:
        ok = ok & np.broadcast_to(np.asarray(mask, bool), shape)
    if bias is not None:
        ok = ok & (np.broadcast_to(np.asarray(bias, np.float64), shape) != -np.inf)
    if mask_mod is not None:
        grid = np.ix_(np.arange(batch), np.arange(heads), np.arange(queries) + q_base, j[0])
        ok = ok & np.broadcast_to(np.asarray(mask_mod(*grid), bool), shape)
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            qs, ks = (np.asarray(x) for x in segment_ids)
        else:
            ks = np.asarray(segment_ids)
            qs = ks[:, p[:, 0]]
        qs = np.broadcast_to(qs, (batch, queries))
        ks = np.broadcast_to(ks, (batch, keys))
        same = (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] >= 0)
        ok = ok & same[:, None]
    return np.broadcast_to(ok, shape)


def _group(x, heads):
    """(B, kv_heads, n, d) -> (B, heads, n, d): kv head ``h // (heads // kv_heads)``
    serves query head ``h`` (grouped-query attention, torch's ``enable_gqa``)."""
    return np.repeat(x, heads // x.shape[1], axis=1)


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
    mask_mod=None,
    score_mod=None,
    segment_ids=None,
    q_base=0,
    sinks=None,
    return_lse=False,
):
    """softmax(scale Q K^T + bias, restricted to ``allowed_keys``) V for
    queries (B, H, Q, d), keys and values (B, H_kv, K, d|dv), ``H % H_kv == 0``.
    A query with no allowed key gets zero weights and a zero output.
    ``score_mod(score, b, h, q_idx, kv_idx)`` maps the scores (after the bias).
    ``sinks`` (H,): one more column of scores, the head's sink, in every
    row's softmax, then dropped (its value is zero). Returns (output
    (B, H, Q, dv), weights (B, H, Q, K)), and with ``return_lse`` the
    log-sum-exp (B, H, Q) of each row's allowed scores (and sink): -inf for
    a row with none."""
    q, k, v = _f64(queries, keys, values)
    B, H, Q, d = q.shape
    K = k.shape[2]
    k, v = _group(k, H), _group(v, H)
    ok = allowed_keys(
        B, H, Q, K, valid_lens, mask, bias, causal, window, mask_mod, segment_ids, q_base
    )
    scale = 1 / np.sqrt(d) if scale is None else scale
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if bias is not None:
        scores = scores + np.where(ok, np.asarray(bias, np.float64), 0.0)
    if score_mod is not None:
        grid = np.ix_(np.arange(B), np.arange(H), np.arange(Q) + q_base, np.arange(K))
        scores = np.asarray(score_mod(scores, *grid), np.float64)
        scores = np.where(ok, scores, 0.0)
    if sinks is not None:
        column = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (B, H, Q, 1))
        scores = np.concatenate([scores, column], -1)
        ok = np.concatenate([ok, np.ones((B, H, Q, 1), bool)], -1)
    weights = softmax_where(scores, ok)
    if sinks is not None:
        weights = weights[..., :K]
    out = np.einsum("bhqk,bhkv->bhqv", weights, v)
    if not return_lse:
        return out, weights
    top = np.where(ok, scores, -np.inf).max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        lse = np.log(np.where(ok, np.exp(np.where(ok, scores - top, 0.0)), 0.0).sum(-1))
    return out, weights, lse + top[..., 0]


def attention_gradients(
    queries,
    keys,
    values,
    grad_out,
    valid_lens=None,
    mask=None,
    bias=None,
    causal=False,
    window=None,
    scale=None,
    mask_mod=None,
    segment_ids=None,
    score_mod=None,
    score_mod_derivative=None,
):
    """Gradients of ``sum(attention(...)[0] * grad_out)`` with respect to
    queries, keys, values and the bias (full (B, H, Q, K); zero where masked),
    from the formulas: ``dV = P^T dO``, ``dP = dO V^T``,
    ``dS = P (dP - rowsum(P dP))``, ``dQ = scale dS K``, ``dK = scale dS^T Q``;
    grouped heads sum their kv head's gradients. With ``score_mod``,
    ``score_mod_derivative(score, b, h, q_idx, kv_idx)`` is its derivative
    with respect to the score, elementwise (the chain rule multiplies ``dS``
    by it: the bias's gradient is the one before ``score_mod``)."""
    q, k, v, g = _f64(queries, keys, values, grad_out)
    B, H, Q, d = q.shape
    K = k.shape[2]
    kv_heads = k.shape[1]
    scale = 1 / np.sqrt(d) if scale is None else scale
    if score_mod is not None and score_mod_derivative is None:
        raise ValueError("score_mod needs score_mod_derivative for its gradients")
    _, P = attention(
        q, k, v, valid_lens, mask, bias, causal, window, scale, mask_mod, score_mod, segment_ids
    )
    kg, vg = _group(k, H), _group(v, H)
    dv = np.einsum("bhqk,bhqv->bhkv", P, g)
    dP = np.einsum("bhqv,bhkv->bhqk", g, vg)
    dS = P * (dP - (P * dP).sum(-1, keepdims=True))
    if score_mod is not None:  # the score score_mod was given: scale Q K^T + bias where allowed
        ok = P > 0
        scores = np.einsum("bhqd,bhkd->bhqk", q, kg) * scale
        if bias is not None:
            scores = scores + np.where(ok, np.asarray(bias, np.float64), 0.0)
        grid = np.ix_(np.arange(B), np.arange(H), np.arange(Q), np.arange(K))
        dS = dS * np.asarray(score_mod_derivative(np.where(ok, scores, 0.0), *grid), np.float64)
    dq = scale * np.einsum("bhqk,bhkd->bhqd", dS, kg)
    dk = scale * np.einsum("bhqk,bhqd->bhkd", dS, q)

    def fold(x):  # sum the query heads of each group into their kv head
        return x.reshape(B, kv_heads, H // kv_heads, *x.shape[2:]).sum(2)

    return dq, fold(dk), fold(dv), dS
