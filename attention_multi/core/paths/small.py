"""The straight line for small calls: ``valid_lens`` or nothing, few scores.

At d2l's sizes a call's arithmetic costs a few microseconds, less than
building a ``Mask`` and planning a path. Here the full path's computation
runs as one straight line: the lengths are read once on the host, the mask
is one comparison, and the rules are the mask package's
(``intervals.lengths_visible``, ``rules.masked_softmax``, unused value rows
zeroed). The answer, the weights kept and the path reported (``"full"``) are
those of the full path. ``select.straight_line`` decides when it applies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
    """What a call's input checks and its ``Line`` depend on: the types,
    shapes and dtypes of its arrays. None when ``valid_lens`` is neither None
    nor an array of the queries' type (a list...): such a call is checked in
    full every time."""
    if valid_lens is None:
        lens = None
    elif type(valid_lens) is type(queries):
        lens = (valid_lens.shape, valid_lens.dtype)
    else:
        return None
    q, k, v = queries, keys, values  # (a literal: this runs on every small call)
    return (type(q), q.shape, q.dtype, type(k), k.shape, k.dtype, type(v), v.shape, v.dtype, lens)


class Line:
    """What the straight line decides from a call's ``signature``, once:
    a module keeps it and calls with the same signature reuse it (outside
    traces: ``Backend.is_tracing``). Of arrays it holds only the mask of the
    last lengths it saw (``lengths``, see ``_lengths``). ``reusable``: its
    choice of the straight line did not depend on the call's state (the
    weights being read, the memory budget)."""

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
        self.lens_kind = (
            None
            if valid_lens is None or not xp.is_array(valid_lens) or not xp.is_concrete(valid_lens)
            else lens_kind(xp, valid_lens, qs[0], qs[-2])
        )
        self.limit = min(int(ks[-2]), INT32_MAX)
        self.big = (size(keys) + size(values)) * group >= xp.finite_check_min
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
    """``(output, weights)`` of (batch, [heads,] n, d) inputs, as the full
    path gives them: weights (batch * heads, Q, K) before dropout, as a
    function (``Backend.nan_rows`` and the reshape run when they are read).
    ``valid_lens`` None, (batch,) or (batch, Q), checked as everywhere."""
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
            values = xp.below_lengths(values, used, lens, 0.0, -2)
            # (into gradients through the keys; or into the scores, when adding the mask)
            keys_clean = xp.may_differentiate(queries) or (line.big and xp.masks_by_adding)
            if keys_clean:
                keys = xp.below_lengths(keys, used, lens, 0.0, -2)
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
        return out, lambda: xp.nan_rows(weights)
    return out, lambda: xp.nan_rows(flat(weights))


def _lengths(
    xp: Backend, line: Line, queries: Array, valid_lens: Array, device: Any
) -> tuple[Array, int | None, Any, Any]:
    """``(lens, least, visible, used)`` of a call's lengths, checked as
    everywhere; ``visible`` and ``used`` are None when every key is seen.
    The line keeps the last of them, keyed by the lengths' host bytes and
    device: a module called again with equal lengths (a training loop's
    fixed batch, the seeds' examples) reuses the mask."""
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
            if made[1] is None or callable(made[1]) or xp.can_keep(made[1]):
                line.lengths = (tag,) + made
            return (valid_lens,) + made
    lens, least = lengths_for_compare(
        xp, valid_lens, queries.shape[0], queries.shape[-2], line.num_keys, device
    )
    return (lens, least) + _visible(xp, line, lens, least, device)


def _visible(
    xp: Backend, line: Line, lens: Array, least: int | None, device: Any
) -> tuple[Any, Any]:
    """``lengths_visible``'s pair, or (None, None) when every key is seen;
    on ``Backend.masks_by_lengths``, functions that make it if asked."""
    num_k = line.num_keys
    if least is not None and least >= num_k:
        return None, None
    if xp.masks_by_lengths:  # (its operator may not need them)
        return _made_once(lambda: lengths_visible(xp, lens, line.ndim, num_k, device))
    return lengths_visible(xp, lens, line.ndim, num_k, device)


def _made_once(make: Any) -> tuple[Any, Any]:
    """The two parts of the pair ``make()`` returns, as two functions that
    call ``make`` once, when the first of them is called."""
    made: list[Any] = []

    def part(i: int) -> Any:
        def get() -> Any:
            if not made:
                made.append(make())
            return made[0][i]

        return get

    return part(0), part(1)
