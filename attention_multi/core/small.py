"""The straight line for small calls: ``valid_lens`` or nothing, few scores.

At d2l's sizes a call's arithmetic costs a few microseconds, less than
building a ``Mask`` and planning a path. Here the full path's computation
runs as one straight line: the lengths are read once on the host, the mask
is one comparison, and the rules are masking.py's (``lengths_visible``,
``masked_softmax``, unused value rows zeroed). The answer, the weights kept
and the path reported (``"full"``) are those of ``attend``'s full path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import attend
from .checks import lengths_for_compare
from .masking import (
    _size,
    all_finite,
    compute_dtype,
    lengths_visible,
    masked_softmax,
)
from .paths import dropout_fn, expand_kv, flat, work_itemsize

if TYPE_CHECKING:
    from backends import Backend

    from ..types import Array


def takes(
    B: Backend,
    path: str,
    queries: Array,
    keys: Array,
    forms: tuple[Any, ...],
    want_weights: bool = False,
    memory_budget: int | None = None,
) -> bool:
    """The straight line applies: ``path`` "auto" or "full", every mask form
    but ``valid_lens`` unset (``forms``: the call's ``mask``, ``bias``,
    ``window``, ``mask_mod``, ``score_mod``, ``segment_ids``, each None, then
    ``causal`` exactly False), no empty axis, a feature size, and "auto"
    would take the full path: at most ``attend.SMALL_SCORES`` scores, or
    ``want_weights`` and the scores fit in ``memory_budget``."""
    if path not in ("auto", "full") or forms[-1] is not False:
        return False
    for form in forms[:-1]:
        if form is not None:
            return False
    qs, ks = queries.shape, keys.shape
    scores = qs[-2] * ks[-2]
    for n in qs[:-2]:
        scores *= n
    if scores == 0 or qs[-1] == 0:
        return False
    if path == "full" or scores <= attend.SMALL_SCORES:
        return True
    budget = attend.DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
    return want_weights and scores * work_itemsize(B, queries) * attend.held(B, queries) <= budget


def attention(
    B: Backend,
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Any,
    scale: float,
    dropout: float = 0.0,
    key: Any = None,
) -> tuple[Array, Any]:
    """``(output, weights)`` of (batch, [heads,] n, d) inputs, as the full
    path gives them: weights (batch * heads, Q, K) before dropout, as a
    function (``Backend.nan_rows`` and the reshape run when they are read).
    ``valid_lens`` None, (batch,) or (batch, Q), checked as everywhere."""
    if len(queries.shape) == 4:
        keys, values = expand_kv(B, keys, values, queries.shape[1])
    visible = used = None
    lens: Any = None
    empty_rows, hidden_finite = True, False
    if valid_lens is not None:
        batch, num_q, num_k = queries.shape[0], queries.shape[-2], keys.shape[-2]
        device = B.device_of(queries)
        lens, least = lengths_for_compare(B, valid_lens, batch, num_q, num_k, device)
        if least is None or least < num_k:  # (else every key is seen)
            visible, used = lengths_visible(B, lens, len(queries.shape), num_k, device)
            empty_rows = least is None or least == 0
    if used is not None:  # NaN in a key or value row nobody sees must not leak
        big = _size(keys) + _size(values) >= B.finite_check_min
        if big and all_finite(B, keys, values):
            keys_clean = True  # (a read instead of two writes)
        else:
            values = B.below_lengths(values, used, lens, 0.0, -2)
            # (into gradients through the keys; or into the scores, when adding the mask)
            keys_clean = B.may_differentiate(queries) or (big and B.masks_by_adding)
            if keys_clean:
                keys = B.below_lengths(keys, used, lens, 0.0, -2)
        # (lengths per batch element hide only keys nobody sees)
        hidden_finite = keys_clean and len(lens.shape) == 1
    dtype = B.dtype_name(queries)
    work = compute_dtype(dtype)
    if work != dtype:
        queries, keys = B.astype(queries, work), B.astype(keys, work)
    scores = B.matmul(queries * scale, keys, transpose_b=True)
    weights = masked_softmax(
        B, scores, visible, empty_rows, hidden_finite, before_product=True, lens=lens
    )
    if work != dtype:
        weights = B.astype(weights, dtype)
    drop = dropout_fn(B, dropout, key)
    out = B.matmul(weights if drop is None else drop(weights), values)
    if len(weights.shape) == 3:
        return out, lambda: B.nan_rows(weights)
    return out, lambda: B.nan_rows(flat(weights))
