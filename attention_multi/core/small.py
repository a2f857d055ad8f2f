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

from .checks import lengths_for_compare
from .masking import compute_dtype, lengths_visible, masked_softmax
from .paths import dropout_fn, expand_kv, flat

if TYPE_CHECKING:
    from backends import Backend

    from ..types import Array

SMALL_SCORES = 1 << 15
"""``"auto"`` takes the full path at once for calls with at most this many
(batch * heads * Q * K) scores: there, planning tiles and dispatching to a
kernel cost more host time than the arithmetic they could save (the d2l
examples and chapter-11 training batches are far below it), and the full
path keeps the weights."""


def takes(path: str, queries: Array, keys: Array, forms: tuple[Any, ...]) -> bool:
    """The straight line applies: ``path`` "auto" or "full", every mask form
    but ``valid_lens`` unset (``forms``: the call's ``mask``, ``bias``,
    ``window``, ``mask_mod``, ``score_mod``, ``segment_ids``, each None, then
    ``causal`` exactly False), no empty axis, a feature size, and at most
    ``SMALL_SCORES`` scores (``path="full"``: any number)."""
    if path not in ("auto", "full") or forms[-1] is not False:
        return False
    for form in forms[:-1]:
        if form is not None:
            return False
    qs, ks = queries.shape, keys.shape
    scores = qs[-2] * ks[-2]
    for n in qs[:-2]:
        scores *= n
    return 0 < scores and qs[-1] > 0 and (path == "full" or scores <= SMALL_SCORES)


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
    empty_rows = True
    if valid_lens is not None:
        batch, num_q, num_k = queries.shape[0], queries.shape[-2], keys.shape[-2]
        device = B.device_of(queries)
        lens, least = lengths_for_compare(B, valid_lens, batch, num_q, num_k, device)
        if least is None or least < num_k:  # (else every key is seen)
            visible, used = lengths_visible(B, lens, len(queries.shape), num_k, device)
            empty_rows = least is None or least == 0
    if used is not None:  # NaN in a value row nobody sees must not leak
        values = B.where(used, values, 0.0)
        if B.may_differentiate(queries):  # nor through the keys into gradients
            keys = B.where(used, keys, 0.0)
    dtype = B.dtype_name(queries)
    work = compute_dtype(dtype)
    if work != dtype:
        queries, keys = B.astype(queries, work), B.astype(keys, work)
    scores = B.matmul(queries * scale, keys, transpose_b=True)
    weights = masked_softmax(B, scores, visible, empty_rows, before_product=True)
    if work != dtype:
        weights = B.astype(weights, dtype)
    drop = dropout_fn(B, dropout, key)
    out = B.matmul(weights if drop is None else drop(weights), values)
    if len(weights.shape) == 3:
        return out, lambda: B.nan_rows(weights)
    return out, lambda: B.nan_rows(flat(weights))
