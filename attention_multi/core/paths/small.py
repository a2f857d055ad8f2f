"""The straight line for small calls: ``valid_lens`` or nothing, few scores.

At d2l's sizes building a ``Mask`` and planning cost more than the arithmetic:
the full path's computation runs as one straight line (lengths read once, the
mask one comparison, the mask package's rules), with the full path's answer,
weights and name. ``select.straight_line`` decides when it applies.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from attention_multi.backends.capabilities import opt

from ..checks import INT32_MAX, least_length, lengths_for_compare, lens_kind
from ..mask.intervals import lengths_visible
from ..mask.rules import masked_softmax
from ..numerics import all_finite, compute_dtype, default_scale, size, weighted
from .call import dropout_fn, expand_kv
from .full import flat

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array


def signature(
    queries: Array, keys: Array, values: Array, valid_lens: Any
) -> tuple[Any, ...] | None:
    """The types, shapes and dtypes a call's checks and ``Line`` depend on; None
    when ``valid_lens`` is neither None nor of the queries' type (checked in full)."""
    if valid_lens is None:
        lens = None
    elif type(valid_lens) is type(queries):
        lens = (valid_lens.shape, valid_lens.dtype)
    else:
        return None
    q, k, v = queries, keys, values  # (a literal: this runs on every small call)
    return (type(q), q.shape, q.dtype, type(k), k.shape, k.dtype, type(v), v.shape, v.dtype, lens)


class Line:
    """What the straight line decides from a call's ``signature``, once (a
    module reuses it outside traces); of arrays it holds only the last lengths'
    mask (``_lengths``). ``reusable``: the choice did not depend on the call's
    state (weights read, memory budget)."""

    __slots__ = tuple("reusable expand flat ndim num_keys scale lens_kind limit big".split())
    __slots__ += ("dtype", "work", "lengths")

    def __init__(
        self,
        xp: Backend,
        queries: Array,
        keys: Array,
        values: Array,
        valid_lens: Any,
        reusable: bool,
    ) -> None:
        qs, ks = queries.shape, keys.shape
        self.reusable = reusable
        self.ndim, self.num_keys = len(qs), ks[-2]
        self.flat = self.ndim == 4
        self.scale = default_scale(qs[-1])  # (the modules' scale)
        group = qs[1] // ks[1] if self.flat else 1
        self.expand = group != 1
        known = (
            valid_lens is not None and xp.is_array(valid_lens) and opt(xp).is_concrete(valid_lens)
        )
        self.lens_kind = lens_kind(xp, valid_lens, qs[0], qs[-2]) if known else None
        if None in qs or None in ks:  # (TensorFlow's unknown sizes, known when it runs)
            if qs[-1] is None:
                raise ValueError(f"the feature size of the queries must be known, got {qs}")
            self.num_keys = opt(xp).shape(keys)[-2]
            self.limit, self.big = self.num_keys, False
        else:
            self.limit = min(int(ks[-2]), INT32_MAX)
            self.big = (size(keys) + size(values)) * group >= opt(xp).finite_check_min
        self.dtype = xp.dtype_name(queries)
        self.work = compute_dtype(self.dtype)
        self.lengths: tuple[Any, ...] | None = None  # (``_lengths``)


def attention(
    xp: Backend,
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Any,
    scale: float,
    dropout: float,
    key: Any,
    line: Line,
) -> tuple[Array, Any]:
    """``(output, weights)`` of (batch, [heads,] n, d) inputs as the full path
    gives them (weights before dropout, as a function run when read)."""
    if line.expand:
        keys, values = expand_kv(xp, keys, values, queries.shape[1])
    visible = used = device = None
    lens: Any = None
    empty_rows, hidden_finite = True, False
    if valid_lens is not None:
        device = xp.device_of(queries)
        lens, least, visible, used = _lengths(xp, line, queries, valid_lens, device)
        empty_rows = least is None or least == 0
    if used is not None:  # NaN in a key or value row nobody sees must not leak
        if line.big and all_finite(xp, keys, values):
            keys_clean = True  # (a read instead of two writes)
        else:
            values = opt(xp).below_lengths(values, used, lens, 0.0, -2)
            # (into gradients through the keys; or into the scores, when adding the mask)
            keys_clean = opt(xp).may_differentiate(queries) or (
                line.big and opt(xp).masks_by_adding
            )
            if keys_clean:
                keys = opt(xp).below_lengths(keys, used, lens, 0.0, -2)
        # (lengths per batch element hide only keys nobody sees)
        hidden_finite = keys_clean and len(lens.shape) == 1
    dtype, work = line.dtype, line.work
    if work != dtype:
        queries, keys = xp.astype(queries, work), xp.astype(keys, work)
    scores = xp.matmul(queries * scale, keys, transpose_b=True)
    weights = masked_softmax(
        xp,
        scores,
        visible,
        empty_rows,
        hidden_finite,
        before_product=True,
        lens=lens,
        dtype=work,
        device=device,
    )
    drop = dropout_fn(xp, dropout, key) if dropout else None
    out = weighted(xp, weights if drop is None else drop(weights), values, dtype)
    if work != dtype:
        weights = xp.astype(weights, dtype)
    if not line.flat:
        return out, lambda: opt(xp).nan_rows(weights)
    return out, lambda: opt(xp).nan_rows(flat(weights, xp))


def _lengths(
    xp: Backend, line: Line, queries: Array, valid_lens: Array, device: Any
) -> tuple[Array, int | None, Any, Any]:
    """``(lens, least, visible, used)`` of checked lengths (None, None: every
    key seen); the line keeps the last, keyed by the lengths' bytes and device."""
    kind = line.lens_kind
    if kind is not None:
        host = xp.to_numpy(valid_lens)
        tag = (host.tobytes(), device)
        kept = line.lengths
        if kept is not None and kept[0] == tag:
            return (valid_lens,) + kept[1:]
        least = least_length(host, kind, line.limit)
        if least is not None:  # (well-formed: no copy)
            made = (least,) + _visible(xp, line, valid_lens, least, device)
            if made[1] is None or callable(made[1]) or opt(xp).can_keep(made[1]):
                line.lengths = (tag,) + made
            return (valid_lens,) + made
    lens, least = lengths_for_compare(
        xp, valid_lens, queries.shape[0], queries.shape[-2], line.num_keys, device
    )
    return (lens, least) + _visible(xp, line, lens, least, device)


def _visible(
    xp: Backend, line: Line, lens: Array, least: int | None, device: Any
) -> tuple[Any, Any]:
    """``lengths_visible``'s pair ((None, None): every key seen), made when
    asked on ``Masking.masks_by_lengths``."""
    num_k = line.num_keys
    if least is not None and least >= num_k:
        return None, None
    if opt(xp).masks_by_lengths:  # (its operator may not need them)
        return _made_once(lambda: lengths_visible(xp, lens, line.ndim, num_k, device))
    return lengths_visible(xp, lens, line.ndim, num_k, device)


def _made_once(make: Any) -> tuple[Any, Any]:
    """The two parts of ``make()``'s pair as functions; ``make`` runs once."""
    once = functools.cache(make)
    return (lambda: once()[0]), (lambda: once()[1])
