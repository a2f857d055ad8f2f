"""The public functions: d2l's helpers and the functional attention, on any
backend (the backend comes from the arrays)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from .backends.capabilities import Distributed, opt, supports
from .core import (
    checked_forms,
    compute,
    default_scale,
    make_mask,
    straight_line,
    zeros_for_empty,
)
from .core import masked_softmax as _masked_softmax
from .core.checks import (
    backend_of,
    check_array,
    check_bool,
    check_dropout,
    check_float,
    check_heads,
    check_nonnegative_int,
    check_positive_int,
    check_scale,
    valid_lens_checked,
)
from .core.mask.segments import pair_on_device
from .core.paths.call import Options, Result
from .core.paths.online import add_sinks
from .types import Array

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from attention_multi.backends import Backend

    from .core import MaskForms


def sequence_mask(X: Array, valid_len: Any, value: float = 0) -> Array:
    """Replace the entries of ``X`` (N, T) at positions ``>= valid_len`` (N,).

    Unlike d2l's, this returns a new array and leaves ``X`` unchanged.
    """
    xp = backend_of(X=X)
    check_array(xp, "X", X, 2, "(N, T)")
    n, t = X.shape
    lens, _ = valid_lens_checked(
        xp, valid_len, n, -1, name="valid_len", device=xp.device_of(X), num_keys=t
    )
    mask = make_mask(xp, n, 1, 1, t, valid_lens=lens)
    if n * t == 0:
        return zeros_for_empty(xp, (n, t), X)
    visible = mask.boolean(xp, xp.device_of(X))  # (valid lengths: never None)
    return xp.where(opt(xp).reshape(visible, (n, t)), X, value)


def masked_softmax(X: Array, valid_lens: Any) -> Array:
    """Softmax over the last axis of ``X`` (B, Q, K), keys past ``valid_lens`` masked.

    ``valid_lens`` is None, (B,) (repeated over queries) or (B, Q). Unlike d2l,
    a row with no valid key (length 0) gives all-zero weights, not uniform ones.
    """
    xp = backend_of(X=X)
    check_array(xp, "X", X, 3, "(batch, queries, keys)")
    check_float(xp, "X", X)
    b, q, k = X.shape
    mask = make_mask(xp, b, 1, q, k, valid_lens=valid_lens, device=xp.device_of(X))
    if b * q * k == 0:
        return zeros_for_empty(xp, (b, q, k), X)
    return _masked_softmax(xp, X, mask.boolean_one_head(xp, xp.device_of(X)))


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
) -> Array:
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
    - ``return_lse=True`` (deprecated: ``attention(..., lse=True)`` gives
      the log-sum-exp in a named result): ``(output, lse)``, with a
      ``DeprecationWarning``.

    ``attention`` is the same call with a named result (output,
    log-sum-exp, the path taken).
    """
    if check_bool("return_lse", return_lse):
        warnings.warn(
            "dot_product_attention(return_lse=True) is deprecated: "
            "attention(..., lse=True) returns the output and .lse by name",
            DeprecationWarning,
            stacklevel=2,
        )
        done = attention(
            queries,
            keys,
            values,
            valid_lens,
            scale=scale,
            dropout=dropout,
            key=key,
            sinks=sinks,
            lse=True,
            **forms,
        )
        return done.output, done.lse
    return attention(
        queries,
        keys,
        values,
        valid_lens,
        scale=scale,
        dropout=dropout,
        key=key,
        sinks=sinks,
        **forms,
    ).output


def attention(
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Array | None = None,
    *,
    scale: float | None = None,
    dropout: float = 0.0,
    key: Any = None,
    sinks: Array | None = None,
    lse: bool = False,
    **forms: Unpack[MaskForms],
) -> Result:
    """``dot_product_attention``'s call (the same arguments; see it), with a
    named result, a ``Result``: ``output`` in the layout of ``queries``;
    ``weights`` None; ``lse`` where ``lse=True`` (else None): (batch,
    [heads,] Q), the natural log of each row's softmax denominator,
    ``log(sum(exp(s)))`` over the allowed keys of the scaled scores ``s``
    after ``bias`` and ``score_mod`` (and ``+ exp(sink)`` with ``sinks``), in
    float32 for half precision, ``-inf`` for a row with no allowed key (the
    sink with ``sinks``), differentiable (a framework's fused kernel does not
    give it, so another path computes such calls); ``path``, the ``Path``
    taken."""
    checked_forms("dot_product_attention", forms)
    xp, q, k, v, ndim = _checked_inputs(queries, keys, values)
    batch, heads, num_q, _ = q.shape
    lse = check_bool("lse", lse)
    if sinks is not None:
        check_array(xp, "sinks", sinks, 1, "(heads,)")
        check_float(xp, "sinks", sinks)
        if tuple(sinks.shape) != (heads,):
            raise ValueError(
                f"sinks must have shape ({heads},) (one per head), got {tuple(sinks.shape)}"
            )
    rows = lse or sinks is not None  # (the straight line gives no log-sum-exp)
    line = None if rows else straight_line(xp, "auto", q, k, v, valid_lens, forms)
    if line is not None:
        options = Options(check_dropout("dropout", dropout), key, weights="never")
        done = compute(
            xp, q, k, v, valid_lens, None, line, scale=check_scale(scale), options=options
        )
    else:
        m, dropout, scale = _checked(xp, q, k, valid_lens, dropout, scale, ndim, forms)
        options = Options(dropout, key, weights="never", lse=rows)
        done = compute(xp, q, k, v, valid_lens, lambda: m, None, scale=scale, options=options)
    out, lse_rows = done.output, done.lse
    if sinks is not None:
        out, lse_rows = add_sinks(xp, out, lse_rows, sinks)
    if lse_rows is not None:
        shape = (batch, heads, num_q) if ndim == 4 else (batch, num_q)
        lse_rows = opt(xp).reshape(lse_rows, shape) if lse else None
    return Result(out if ndim == 4 else out[:, 0], None, lse_rows, done.path)


def _checked(
    xp: Backend,
    q: Array,
    k: Array,
    valid_lens: Any,
    dropout: Any,
    scale: Any,
    ndim: int,
    forms: Any,
) -> tuple[Any, float, Any]:
    """The call's ``Mask``, checked dropout and scale (4-D views)."""
    batch, heads, num_q, _ = q.shape
    m = make_mask(
        xp,
        batch,
        heads,
        num_q,
        k.shape[2],
        valid_lens=valid_lens,
        dtype=xp.dtype_name(q),
        heads_axis=ndim == 4,
        device=xp.device_of(q),
        **forms,
    )
    return m, check_dropout("dropout", dropout), check_scale(scale)


def _checked_inputs(queries: Array, keys: Array, values: Array) -> tuple:
    """``(backend, q, k, v, ndim)``: the checked inputs of the functional
    attention as (batch, heads, n, features), and the rank the caller gave."""
    xp = backend_of(queries=queries, keys=keys, values=values)
    ndim = len(queries.shape)
    names = ("batch", "heads", "n", "features")[4 - ndim :] if ndim in (3, 4) else ()
    what = "(" + ", ".join(names) + ")" if names else "(batch, [heads,] n, features)"
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        check_array(xp, name, x, 4 if ndim == 4 else 3, what)
        check_float(xp, name, x)
    q, k, v = (
        x if ndim == 4 else opt(xp).reshape(x, _with_heads(opt(xp).shape(x)))
        for x in (queries, keys, values)
    )
    _check_shapes(xp, q, k, v, ndim)
    return xp, q, k, v, ndim


def _with_heads(shape: tuple[Any, ...]) -> tuple[Any, ...]:
    """(batch, n, d) -> (batch, 1, n, d)."""
    return shape[:1] + (1,) + shape[1:]


def _check_shapes(xp: Backend, q: Array, k: Array, v: Array, ndim: int) -> None:
    """Batch sizes, lengths, feature sizes, heads and dtypes agree (4-D views)."""
    shapes = f"queries {_shape(q, ndim)}, keys {_shape(k, ndim)}, values {_shape(v, ndim)}"
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"batch sizes differ: {shapes}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"keys and values must have the same heads and length, got {shapes}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"queries and keys must have the same feature size, got {shapes}")
    if (k.shape[1] == 0) != (q.shape[1] == 0) or (k.shape[1] and q.shape[1] % k.shape[1]):
        raise ValueError(
            f"the heads of queries ({q.shape[1]}) must be a multiple of "
            f"the heads of keys and values ({k.shape[1]}): {shapes}"
        )
    dtypes = {n: xp.dtype_name(x) for n, x in (("queries", q), ("keys", k), ("values", v))}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        raise TypeError(f"dtypes differ ({listing}); cast them to one dtype")


def _shape(x: Array, ndim: int) -> tuple[int, ...]:
    shape = tuple(x.shape)
    return shape if ndim == 4 else shape[:1] + shape[2:]


def transpose_qkv(X: Array, num_heads: int) -> Array:
    """(batch, n, num_hiddens) -> (batch * num_heads, n, num_hiddens / num_heads)."""
    xp = backend_of(X=X)
    check_array(xp, "X", X, 3, "(batch, n, num_hiddens)")
    num_heads = check_heads(X.shape[2], num_heads)
    rs, (b, n, hidden) = opt(xp).reshape, opt(xp).shape(X)
    X = xp.transpose(rs(X, (b, n, num_heads, hidden // num_heads)), (0, 2, 1, 3))
    return rs(X, (b * num_heads, n, hidden // num_heads))


def transpose_output(X: Array, num_heads: int) -> Array:
    """Inverse of ``transpose_qkv``."""
    xp = backend_of(X=X)
    check_array(xp, "X", X, 3, "(batch * num_heads, n, head_size)")
    num_heads = check_positive_int("num_heads", num_heads)
    if X.shape[0] % num_heads:
        raise ValueError(f"X.shape[0]={X.shape[0]} is not a multiple of num_heads={num_heads}")
    rs, (bh, n, size) = opt(xp).reshape, opt(xp).shape(X)
    X = xp.transpose(rs(X, (bh // num_heads, num_heads, n, size)), (0, 2, 1, 3))
    return rs(X, (bh // num_heads, n, num_heads * size))


def nadaraya_watson(
    x_train: Array, y_train: Array, x_query: Array, return_weights: bool = False
) -> Array | tuple[Array, Array]:
    """Nadaraya-Watson regression with a Gaussian kernel (no parameters).

    ``f(x) = sum_i softmax(-(x - x_i)^2 / 2) y_i`` for 1-D ``x_train``,
    ``y_train`` (n,) and ``x_query`` (m,). Returns ``(m,)`` predictions, and
    the (m, n) weights too when ``return_weights``. With no training points
    the predictions are 0 (no key: zero output).
    """
    xp = backend_of(x_train=x_train, y_train=y_train, x_query=x_query)
    for name, x in (("x_train", x_train), ("y_train", y_train), ("x_query", x_query)):
        check_array(xp, name, x, 1, "(n,)")
        check_float(xp, name, x)
    if x_train.shape != y_train.shape:
        raise ValueError(
            f"x_train and y_train must have the same shape, got "
            f"{tuple(x_train.shape)} and {tuple(y_train.shape)}"
        )
    m, n = x_query.shape[0], x_train.shape[0]
    if m * n == 0:
        y_hat = zeros_for_empty(xp, (m,), x_query, x_train, y_train)
        weights = zeros_for_empty(xp, (m, n), x_query, x_train)
    else:
        rs = opt(xp).reshape
        diff = rs(x_query, (m, 1)) - rs(x_train, (1, n))
        weights = _masked_softmax(xp, -(diff * diff) / 2, None)
        y_hat = rs(xp.matmul(rs(weights, (1, m, n)), rs(y_train, (1, n, 1))), (m,))
    return (y_hat, weights) if return_weights else y_hat


def ring_attention(
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Array | None = None,
    *,
    layout: str = "contiguous",
    scale: float | None = None,
    group: Any = None,
    axis_name: str | None = None,
    memory_budget: int | None = None,
    step_log: list[dict[str, Any]] | None = None,
    **forms: Unpack[MaskForms],
) -> Array:
    """Sequence-parallel (ring) scaled dot-product attention.

    Each participant (a torch.distributed process, or a device of a JAX mesh
    axis inside ``shard_map``) passes its own part of the sequence:
    ``queries`` (batch, [heads,] Q, d), ``keys`` and ``values`` (batch,
    [kv_heads,] K, d|dv), equal parts in ``layout`` (``ring_shard`` cuts them
    from the whole sequence):

    - ``"contiguous"``: participant ``r`` holds queries ``[r Q, (r+1) Q)``
      and keys ``[r K, (r+1) K)``;
    - ``"zigzag"``: the sequence cut into ``2 P`` chunks, participant ``r``
      holds chunks ``r`` and ``2 P - 1 - r``, in that order (Q and K even):
      under ``causal`` each participant then computes as many scores as any
      other.

    It returns the attention of its queries over the keys of all
    participants, in its layout's order, equal to ``dot_product_attention``
    on the whole sequence; memory per participant is O((Q + K) d) plus one
    block in flight.

    - ``valid_lens``: (batch,) key lengths of the whole sequence, or (batch,
      Q) lengths of the local queries (in the layout's order).
    - The mask keywords of ``dot_product_attention`` but ``mask=`` and
      ``bias=``: ``causal``, ``window``, ``segment_ids`` (of the whole
      sequence: (batch, P K), or a pair ((batch, P Q), (batch, P K))),
      ``mask_mod`` and ``score_mod`` (``q_idx`` and ``kv_idx`` count
      positions of the whole sequence), positions aligned at the bottom right
      of the whole sequence (query ``i`` sits at key position ``i + P (K -
      Q)``). Per step, a chunk of keys that no local query may see is
      skipped: no kernel call.
    - ``scale``: the factor of the scores, as in ``dot_product_attention``
      (default ``1 / sqrt(d)``).
    - ``group``: the torch process group (None: the default one);
      ``axis_name``: on JAX, the mesh axis the sequence is split over.
    - ``memory_budget``: bytes for the scores of one step, computed a block
      of local queries at a time (default ``DEFAULT_MEMORY_BUDGET``).
    - ``step_log``: a list that gets, per step, a dict of the scores this
      participant computed, its kernel calls and the seconds of compute and
      of exchange (torch; on JAX the rank is traced and nothing is logged).

    Differentiable on both (JAX through ``ppermute``, torch through a
    point-to-point exchange whose gradient goes back round the ring); each
    step is recomputed in the backward pass. Keys and values travel in the
    compute dtype (float32 for half precision).
    """
    from .core import DEFAULT_MEMORY_BUDGET, check_path_options
    from .core.paths.ring import chunks_per_participant, held_chunks, ring

    checked_forms("ring_attention", forms, refused=("mask", "bias"))
    for name in ("mask", "bias"):
        if forms.get(name) is not None:
            raise ValueError(
                f"ring_attention takes valid_lens, causal, window, segment_ids, mask_mod and "
                f"score_mod, not {name}= (an array over the whole sequence on every participant)"
            )
    parts = chunks_per_participant(layout)
    memory_budget = check_path_options("auto", memory_budget, None)[1]
    xp, q, k, v, ndim = _checked_inputs(queries, keys, values)
    if not supports(xp, Distributed):
        raise NotImplementedError(
            f"ring attention needs a communicating framework; the {xp.name} "
            f"backend has none (use torch.distributed or a JAX mesh)"
        )
    rank, size, shift = xp.ring_exchange(axis_name if group is None else group)
    batch, heads, num_q, _ = q.shape
    num_k = k.shape[2]
    if num_q % parts or num_k % parts:
        raise ValueError(
            f"layout={layout!r} holds {parts} chunks per participant: the local queries "
            f"({num_q}) and keys ({num_k}) must be multiples of {parts}"
        )
    chunk_q, device = num_q // parts, xp.device_of(q)
    lens_all: Any = valid_lens
    lens_2d = lens_all is not None and np.ndim(lens_all) == 2
    if lens_2d and not xp.is_array(lens_all):
        lens_all = xp.asarray(np.asarray(lens_all), device=device)
    segment_ids: Any = forms.pop("segment_ids", None)
    pair = isinstance(segment_ids, (tuple, list)) and len(segment_ids) == 2
    if pair:  # (both the backend's: the keys' are cut at the traced position of each block)
        segment_ids = pair_on_device(xp, segment_ids, device)
    masks = []
    for c, index in enumerate(held_chunks(layout, rank, size)):
        first = index * chunk_q  # (the chunk's first query in the whole sequence)
        lens = lens_all[:, c * chunk_q : (c + 1) * chunk_q] if lens_2d else lens_all
        ids = (
            (_rows_at(xp, segment_ids[0], first, chunk_q), segment_ids[1]) if pair else segment_ids
        )
        masks.append(
            make_mask(
                xp,
                batch,
                heads,
                chunk_q,
                size * num_k,
                valid_lens=lens,
                offset=first + size * (num_k - num_q),
                query_base=first,
                segment_ids=ids,
                dtype=xp.dtype_name(q),
                device=device,
                **forms,
            )
        )
    scale = check_scale(scale)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    if 0 in (batch, heads, num_q, num_k):
        out = zeros_for_empty(xp, (batch, heads, num_q, v.shape[-1]), q, k, v)
    else:
        budget = memory_budget or DEFAULT_MEMORY_BUDGET
        out = ring(xp, q, k, v, masks, scale, rank, size, shift, budget, layout, step_log)
    return out if ndim == 4 else out[:, 0]


def _rows_at(xp: Backend, x: Array, start: Any, n: int) -> Array:
    """``x[:, start : start + n]``, ``start`` an int or traced."""
    if isinstance(start, int):
        return x[:, start : start + n]
    return xp.take(x, xp.arange(n, xp.device_of(x)) + start, 1)


def ring_shard(
    x: Array, rank: int, world: int, *, layout: str = "contiguous", axis: int = -2
) -> Array:
    """Participant ``rank``'s part of the whole sequence ``x`` (an array of
    any backend), split along ``axis`` over ``world`` participants in
    ``layout`` (see ``ring_attention``): what it passes to
    ``ring_attention``. ``axis`` -2 is the sequence axis of queries, keys
    and values; pass -1 for 2-D ``valid_lens`` (batch, T)."""
    from .core.paths.ring import held_chunks

    xp, cut = _chunks(x, world, layout, axis)
    rank = check_nonnegative_int("rank", rank)
    if rank >= world:
        raise ValueError(f"rank must be below world ({world}), got {rank}")
    return _joined(xp, [cut(i) for i in held_chunks(layout, rank, world)], axis)


def ring_order(x: Array, world: int, *, layout: str = "contiguous", axis: int = -2) -> Array:
    """The whole sequence ``x`` in the participants' order: the parts of
    ``ring_shard`` for ranks 0, 1, ... one after the other. Split it into
    equal consecutive parts (JAX: ``shard_map``'s ``in_specs``) and each
    participant holds its part in ``layout``; ``ring_gather`` undoes it."""
    from .core.paths.ring import held_chunks

    xp, cut = _chunks(x, world, layout, axis)
    order = [i for r in range(world) for i in held_chunks(layout, r, world)]
    return _joined(xp, [cut(i) for i in order], axis)


def ring_gather(
    parts: Any, *, layout: str = "contiguous", axis: int = -2, world: int | None = None
) -> Array:
    """The whole sequence from the participants' parts in ``layout``:
    ``parts`` a list of them in rank order, or one array of them one after
    the other (``ring_order``'s order, e.g. ``shard_map``'s output), with
    ``world`` participants. The inverse of ``ring_shard`` and ``ring_order``."""
    from .core.paths.ring import held_chunks

    if isinstance(parts, (list, tuple)):
        world = len(parts) if world is None else world
        if world != len(parts):
            raise ValueError(f"world={world}, but {len(parts)} parts were given")
        xp = backend_of(parts=parts[0])
        x = _joined(xp, list(parts), axis)
    elif world is None:
        raise ValueError("ring_gather of one array needs world= (how many parts it holds)")
    else:
        x = parts
    xp, cut = _chunks(x, world, layout, axis)
    order = [i for r in range(world) for i in held_chunks(layout, r, world)]
    place = {index: n for n, index in enumerate(order)}
    return _joined(xp, [cut(place[i]) for i in range(len(order))], axis)


def _chunks(x: Array, world: int, layout: str, axis: int) -> tuple[Backend, Any]:
    """``(backend, cut)``: ``cut(i)`` is the ``i``-th of the equal chunks of
    ``x`` along ``axis`` that ``layout`` cuts a sequence into over ``world``."""
    from .core.paths.ring import chunks_per_participant

    xp = backend_of(x=x)
    check_positive_int("world", world)
    count = chunks_per_participant(layout) * world
    length = x.shape[axis]
    if length % count:
        raise ValueError(
            f"layout={layout!r} over {world} participants cuts the sequence into {count} "
            f"equal chunks: its length along axis {axis} ({length}) is not a multiple of {count}"
        )
    n = length // count
    axis = axis % len(x.shape)

    def cut(i: int) -> Array:
        index = [slice(None)] * len(x.shape)
        index[axis] = slice(i * n, (i + 1) * n)
        return x[tuple(index)]

    return xp, cut


def _joined(xp: Backend, pieces: list[Array], axis: int) -> Array:
    return pieces[0] if len(pieces) == 1 else xp.concatenate(pieces, axis)
