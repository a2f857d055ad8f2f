"""The public functions: d2l's helpers and the functional attention, on any
backend (the backend comes from the arrays)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core import attend, checked_forms, default_scale, make_mask, straight_line, zeros_for_empty
from .core import masked_softmax as _masked_softmax
from .core.checks import (
    backend_of,
    check_array,
    check_bool,
    check_dropout,
    check_float,
    check_heads,
    check_positive_int,
    check_scale,
    valid_lens_array,
)
from .core.paths import small
from .core.paths.online import add_sinks
from .types import Array, Window

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from attention_multi.backends import Backend

    from .core import MaskForms


def sequence_mask(X: Array, valid_len: Any, value: float = 0) -> Array:
    """Replace the entries of ``X`` (N, T) at positions ``>= valid_len`` (N,).

    Unlike d2l's, this returns a new array and leaves ``X`` unchanged.
    """
    B = backend_of(X=X)
    check_array(B, "X", X, 2, "(N, T)")
    n, t = X.shape
    lens = valid_lens_array(
        B, valid_len, n, -1, name="valid_len", device=B.device_of(X), num_keys=t
    )
    mask = make_mask(B, n, 1, 1, t, valid_lens=lens)
    if n * t == 0:
        return zeros_for_empty(B, (n, t), X)
    visible = mask.boolean(B, B.device_of(X))  # (valid lengths: never None)
    return B.where(visible.reshape((n, t)), X, value)  # type: ignore[union-attr]


def masked_softmax(X: Array, valid_lens: Any) -> Array:
    """Softmax over the last axis of ``X`` (B, Q, K), keys past ``valid_lens`` masked.

    ``valid_lens`` is None, (B,) (repeated over queries) or (B, Q). Unlike d2l,
    a row with no valid key (length 0) gives all-zero weights, not uniform ones.
    """
    B = backend_of(X=X)
    check_array(B, "X", X, 3, "(batch, queries, keys)")
    check_float(B, "X", X)
    b, q, k = X.shape
    mask = make_mask(B, b, 1, q, k, valid_lens=valid_lens, device=B.device_of(X))
    if b * q * k == 0:
        return zeros_for_empty(B, (b, q, k), X)
    return _masked_softmax(B, X, mask.boolean_one_head(B, B.device_of(X)))


def dot_product_attention(
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Array | None = None,
    *,
    scale: float | None = None,
    dropout: float = 0.0,
    key: Any = None,
    sinks: Array | None = None,
    return_lse: bool = False,
    **forms: Unpack[MaskForms],
) -> Array | tuple[Array, Array]:
    """Scaled dot-product attention, functional, on any backend.

    ``queries`` (batch, Q, d) or (batch, heads, Q, d); ``keys``/``values``
    (batch, K, d) or (batch, kv_heads, K, d) with ``heads % kv_heads == 0``
    (grouped-query attention: each kv head serves ``heads // kv_heads``
    consecutive query heads). Returns the output in the layout of ``queries``.

    - ``valid_lens``: d2l's, (batch,) or (batch, Q).

    The mask keywords (``MaskForms``; any mix):

    - ``mask``: boolean, True = may attend, broadcastable to (batch, [heads,] Q, K).
    - ``bias``: float, added to the scaled scores, broadcastable likewise
      (``-inf`` masks the position).
    - ``causal=True``: query ``i`` attends keys ``j <= i + (K - Q)``, aligned
      at the bottom right (torch's ``is_causal`` is top-left; the two agree
      when Q == K).
    - ``window=w`` or ``(left, right)``: query ``i``, at ``p = i + K - Q``,
      attends keys in ``[p - left, p + right]``.
    - ``mask_mod(b, h, q_idx, kv_idx) -> bool``: True where a query may
      attend (FlexAttention's signature and sense); the arguments are int32
      arrays of the backend broadcasting over (batch, heads, Q, K). A
      ``BlockMask`` from ``am.block_mask`` may be passed instead.
    - ``score_mod(score, b, h, q_idx, kv_idx) -> score``: changes the scaled
      score (after ``bias``), e.g. ALiBi or soft-capping.
    - ``segment_ids``: (batch, K) ints, or a pair ((batch, Q), (batch, K)):
      packed sequences, each query sees the keys of its segment; negative ids
      are padding. With ``causal=True``: causal within each segment.

    Everything combines by AND; a query with no allowed key gets a zero output.
    ``scale``: default ``1 / sqrt(d)``; ``dropout`` on the weights (JAX needs
    ``key=``).

    - ``sinks``: (heads,) float, learnable attention sinks (gpt-oss): one
      logit per head added to each row's softmax denominator only, as if a
      key of that score and a zero value were always visible; the output is
      ``out * sigmoid(lse - sink)``. A row with no allowed key stays zero.
      Differentiable (its gradient reaches ``sinks``).
    - ``return_lse=True``: returns ``(output, lse)``, ``lse`` (batch, [heads,]
      Q) the natural log of each row's softmax denominator: ``log(sum(exp(s)))``
      over the allowed keys of the scaled scores ``s`` after ``bias`` and
      ``score_mod`` (and ``+ exp(sink)`` with ``sinks``), in float32 for half
      precision; ``-inf`` for a row with no allowed key (the sink with
      ``sinks``). Differentiable; a framework's fused kernel does not give
      it, so another path computes such calls.
    """
    checked_forms("dot_product_attention", forms)
    B, q, k, v, ndim = _checked_inputs(queries, keys, values)
    batch, heads, num_q, _ = q.shape
    return_lse = check_bool("return_lse", return_lse)
    if sinks is not None:
        check_array(B, "sinks", sinks, 1, "(heads,)")
        check_float(B, "sinks", sinks)
        if tuple(sinks.shape) != (heads,):
            raise ValueError(
                f"sinks must have shape ({heads},) (one per head), got {tuple(sinks.shape)}"
            )
    if sinks is not None or return_lse:
        return _with_lse(
            B, q, k, v, valid_lens, scale, dropout, key, sinks, return_lse, ndim, forms
        )
    line = straight_line(B, "auto", q, k, v, valid_lens, forms)
    if line is not None:
        dropout = check_dropout("dropout", dropout)
        scale = check_scale(scale)
        scale = default_scale(q.shape[-1]) if scale is None else scale
        out, _ = small.attention(B, q, k, v, valid_lens, scale, dropout, key, line)
        return out if ndim == 4 else out.reshape((batch,) + tuple(out.shape[2:]))
    m = make_mask(
        B,
        batch,
        heads,
        num_q,
        k.shape[2],
        valid_lens=valid_lens,
        dtype=B.dtype_name(q),
        heads_axis=ndim == 4,
        device=B.device_of(q),
        **forms,
    )
    dropout = check_dropout("dropout", dropout)
    scale = check_scale(scale)
    out, _, _ = attend(B, q, k, v, m, scale=scale, dropout=dropout, key=key, weights="never")
    return out if ndim == 4 else out.reshape((batch,) + tuple(out.shape[2:]))


def _with_lse(
    B: Backend,
    q: Array,
    k: Array,
    v: Array,
    valid_lens: Any,
    scale: Any,
    dropout: Any,
    key: Any,
    sinks: Array | None,
    return_lse: bool,
    ndim: int,
    forms: Any,
) -> Array | tuple[Array, Array]:
    """``dot_product_attention`` with ``sinks`` or ``return_lse`` (4-D views)."""
    batch, heads, num_q, _ = q.shape
    m = make_mask(
        B,
        batch,
        heads,
        num_q,
        k.shape[2],
        valid_lens=valid_lens,
        dtype=B.dtype_name(q),
        heads_axis=ndim == 4,
        device=B.device_of(q),
        **forms,
    )
    dropout = check_dropout("dropout", dropout)
    scale = check_scale(scale)
    out, lse, _ = attend(
        B, q, k, v, m, scale=scale, dropout=dropout, key=key, weights="never", lse=True
    )
    if sinks is not None:
        out, lse = add_sinks(B, out, lse, sinks)
    if ndim == 3:
        out = out.reshape((batch,) + tuple(out.shape[2:]))
    if not return_lse:
        return out
    return out, lse.reshape((batch, heads, num_q) if ndim == 4 else (batch, num_q))


def _checked_inputs(queries: Array, keys: Array, values: Array) -> tuple:
    """``(backend, q, k, v, ndim)``: the checked inputs of the functional
    attention as (batch, heads, n, features), and the rank the caller gave."""
    B = backend_of(queries=queries, keys=keys, values=values)
    ndim = len(queries.shape)
    names = ("batch", "heads", "n", "features")[4 - ndim :] if ndim in (3, 4) else ()
    what = "(" + ", ".join(names) + ")" if names else "(batch, [heads,] n, features)"
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        check_array(B, name, x, 4 if ndim == 4 else 3, what)
        check_float(B, name, x)
    q, k, v = (
        x if ndim == 4 else x.reshape((x.shape[0], 1) + tuple(x.shape[1:]))
        for x in (queries, keys, values)
    )
    _check_shapes(B, q, k, v, ndim)
    return B, q, k, v, ndim


def _check_shapes(B: Backend, q: Array, k: Array, v: Array, ndim: int) -> None:
    """Batch sizes, lengths, feature sizes, heads and dtypes agree (4-D views)."""
    shapes = f"queries {_shape(q, ndim)}, keys {_shape(k, ndim)}, values {_shape(v, ndim)}"
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"batch sizes differ: {shapes}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"keys and values must have the same heads and length, got {shapes}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"queries and keys must have the same feature size, got {shapes}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"the heads of queries ({q.shape[1]}) must be a multiple of "
            f"the heads of keys and values ({k.shape[1]}): {shapes}"
        )
    dtypes = {n: B.dtype_name(x) for n, x in (("queries", q), ("keys", k), ("values", v))}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        raise TypeError(f"dtypes differ ({listing}); cast them to one dtype")


def _shape(x: Array, ndim: int) -> tuple[int, ...]:
    shape = tuple(x.shape)
    return shape if ndim == 4 else shape[:1] + shape[2:]


def transpose_qkv(X: Array, num_heads: int) -> Array:
    """(batch, n, num_hiddens) -> (batch * num_heads, n, num_hiddens / num_heads)."""
    B = backend_of(X=X)
    check_array(B, "X", X, 3, "(batch, n, num_hiddens)")
    num_heads = check_heads(X.shape[2], num_heads)
    b, n, hidden = X.shape
    X = B.transpose(X.reshape((b, n, num_heads, hidden // num_heads)), (0, 2, 1, 3))
    return X.reshape((b * num_heads, n, hidden // num_heads))


def transpose_output(X: Array, num_heads: int) -> Array:
    """Inverse of ``transpose_qkv``."""
    B = backend_of(X=X)
    check_array(B, "X", X, 3, "(batch * num_heads, n, head_size)")
    num_heads = check_positive_int("num_heads", num_heads)
    if X.shape[0] % num_heads:
        raise ValueError(f"X.shape[0]={X.shape[0]} is not a multiple of num_heads={num_heads}")
    bh, n, size = X.shape
    X = B.transpose(X.reshape((bh // num_heads, num_heads, n, size)), (0, 2, 1, 3))
    return X.reshape((bh // num_heads, n, num_heads * size))


def nadaraya_watson(
    x_train: Array, y_train: Array, x_query: Array, return_weights: bool = False
) -> Array | tuple[Array, Array]:
    """Nadaraya-Watson regression with a Gaussian kernel (no parameters).

    ``f(x) = sum_i softmax(-(x - x_i)^2 / 2) y_i`` for 1-D ``x_train``,
    ``y_train`` (n,) and ``x_query`` (m,). Returns ``(m,)`` predictions, and
    the (m, n) weights too when ``return_weights``. With no training points
    the predictions are 0 (no key: zero output).
    """
    B = backend_of(x_train=x_train, y_train=y_train, x_query=x_query)
    for name, x in (("x_train", x_train), ("y_train", y_train), ("x_query", x_query)):
        check_array(B, name, x, 1, "(n,)")
        check_float(B, name, x)
    if x_train.shape != y_train.shape:
        raise ValueError(
            f"x_train and y_train must have the same shape, got "
            f"{tuple(x_train.shape)} and {tuple(y_train.shape)}"
        )
    m, n = x_query.shape[0], x_train.shape[0]
    if m * n == 0:
        y_hat = zeros_for_empty(B, (m,), x_query, x_train, y_train)
        weights = zeros_for_empty(B, (m, n), x_query, x_train)
    else:
        diff = x_query.reshape((m, 1)) - x_train.reshape((1, n))
        weights = _masked_softmax(B, -(diff * diff) / 2, None)
        y_hat = B.matmul(weights.reshape((1, m, n)), y_train.reshape((1, n, 1))).reshape((m,))
    return (y_hat, weights) if return_weights else y_hat


def ring_attention(
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Array | None = None,
    *,
    causal: bool = False,
    window: Window = None,
    scale: float | None = None,
    group: Any = None,
    axis_name: str | None = None,
    memory_budget: int | None = None,
) -> Array:
    """Sequence-parallel (ring) scaled dot-product attention.

    Each participant (a torch.distributed process, or a device of a JAX mesh
    axis inside ``shard_map``) passes its own consecutive shard of the
    sequence: ``queries`` (batch, [heads,] Q, d), ``keys`` and ``values``
    (batch, [kv_heads,] K, d|dv), participant ``r`` holding queries
    ``[r Q, (r+1) Q)`` and keys ``[r K, (r+1) K)`` of the whole sequence
    (equal shards). It returns the attention of its queries over the keys of
    all participants, equal to ``dot_product_attention`` on the whole
    sequence; memory per participant is O((Q + K) d) plus one block in flight.

    - ``valid_lens``: (batch,) key lengths of the whole sequence, or (batch,
      Q) lengths of the local queries; ``causal`` and ``window`` as in
      ``dot_product_attention``, positions counted in the whole sequence
      (bottom-right aligned: query ``i`` of participant ``r`` sits at key
      position ``r Q + i + P (K - Q)``).
    - ``scale``: the factor of the scores, as in ``dot_product_attention``
      (default ``1 / sqrt(d)``).
    - ``group``: the torch process group (None: the default one);
      ``axis_name``: on JAX, the mesh axis the sequence is split over.
    - ``memory_budget``: bytes for the scores of one step, computed a block
      of local queries at a time (default ``DEFAULT_MEMORY_BUDGET``).

    Differentiable on both (JAX through ``ppermute``, torch through a
    point-to-point exchange whose gradient goes back round the ring); each
    step is recomputed in the backward pass.
    """
    from .core import DEFAULT_MEMORY_BUDGET, check_path_options
    from .core.paths.ring import ring

    memory_budget = check_path_options("auto", memory_budget, None)[1]
    B, q, k, v, ndim = _checked_inputs(queries, keys, values)
    rank, size, shift = B.ring_exchange(axis_name if group is None else group)
    batch, heads, num_q, _ = q.shape
    num_k = k.shape[2]
    offset = rank * num_q + size * (num_k - num_q)
    m = make_mask(
        B,
        batch,
        heads,
        num_q,
        size * num_k,
        valid_lens=valid_lens,
        causal=causal,
        window=window,
        offset=offset,
        dtype=B.dtype_name(q),
        device=B.device_of(q),
    )
    scale = check_scale(scale)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    if 0 in (batch, heads, num_q, num_k):
        out = zeros_for_empty(B, (batch, heads, num_q, v.shape[-1]), q, k, v)
    else:
        out = ring(B, q, k, v, m, scale, rank, size, shift, memory_budget or DEFAULT_MEMORY_BUDGET)
    return out if ndim == 4 else out.reshape((batch,) + tuple(out.shape[2:]))
