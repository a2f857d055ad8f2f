"""The rules of ``mask/__init__.py`` that every path keeps: masked weights 0
(``masked_softmax``), empty rows (``zero_empty_rows``), and NaN from keys no
query sees (``guard_unused``, ``kernel_inputs``; per block: ``guard_block``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from attention_multi.backends.capabilities import opt

from ..numerics import all_finite, compute_dtype, fill, fill_against, fill_value, size, zero
from .functions import USED_KEYS
from .intervals import keys_all_used, rows_nonempty
from .spec import Mask

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array


def zero_empty_rows(xp: Backend, mask: Mask, out: Array) -> Array:
    """Zero the output rows (batch, heads, Q, dv) of queries that see no key."""
    form, device = mask.intervals, xp.device_of(out)
    if mask.restricted:  # (rows with keys: bool (batch|1, heads|1, Q, 1), None: all)
        rows = xp.any(mask.boolean(xp, device), -1, keepdims=True)
    elif form is None:
        rows = None if mask.num_keys else xp.zeros((1, 1, 1, 1), "bool", device)
    elif rows_nonempty(mask):
        rows = None
    else:
        lo, hi = form.bounds(xp, mask, device)
        rows = hi > (0 if lo is None else lo)
    return out if rows is None else xp.where(rows, out, 0.0)


def _one_row(mask: Mask) -> bool:
    """Every query of a batch element sees the same keys."""
    form, arrays = mask.intervals, mask.form("arrays")
    return (
        (form is None or (not form.causal and form.window is None and _per_batch(form)))
        and (arrays is None or tuple(arrays.allowed.shape[1:3]) == (1, 1))
        and all(f.kind in ("intervals", "arrays", "score_mod") for f in mask.forms)
    )


def _per_batch(form: Any) -> bool:
    return form.valid_lens is None or form.valid_lens.shape[2] == 1


def used_keys(xp: Backend, mask: Mask, device: Any) -> Array | None:
    """bool (batch|1, 1, K, 1): True where some query of that batch
    element may see the key; None when every key is known to be seen."""
    form = mask.intervals
    if not mask.restricted and form is None:
        return None
    by_bounds = not mask.restricted and (form.window is None or _per_batch(form))
    if by_bounds and keys_all_used(mask):
        return None
    used = mask.kept(USED_KEYS) if form is None else None
    if used is not None and [f.kind for f in mask.forms if f.restricts] == ["mask_mod"]:
        return xp.asarray(used.reshape((used.shape[0], 1, used.shape[1], 1)), device=device)
    if by_bounds and not _one_row(mask):  # (one row: its visible keys are the used ones)
        lo, hi = form.bounds(xp, mask, device)
        nonempty = hi > (0 if lo is None else lo)
        last = xp.max(xp.where(nonempty, hi, 0), 2, keepdims=True)
        j = opt(xp).reshape(xp.arange(mask.num_keys, device), (1, 1, mask.num_keys, 1))
        if lo is None:
            return j < last
        first = -xp.max(xp.where(nonempty, -lo, -mask.num_keys), 2, keepdims=True)
        return xp.logical_and(j >= first, j < last)
    visible = mask.boolean(xp, device)  # (..., Q, K): any over heads and queries
    if visible is None:
        return None
    used = xp.any(xp.any(visible, 2, keepdims=True), 1, keepdims=True)
    # (b, 1, 1, K) -> (b, 1, K, 1): a reshape (MXNet cannot transpose booleans)
    return opt(xp).reshape(used, (opt(xp).shape(used)[0], 1, used.shape[3], 1))


def guard_unused(
    xp: Backend, mask: Mask, keys: Array, values: Array, guard_keys: bool = True
) -> tuple[Array, Array]:
    """Zero key and value rows (batch, heads, K, d) that no query may see (no
    NaN leaks from them); ``guard_keys=False``: the values only (for a caller
    that masks the scores by ``where``, no gradient through the keys)."""
    big = size(keys) + size(values) >= opt(xp).finite_check_min
    # (where each new shape compiles, a sum is cheaper than the mask's operations)
    check = big or (opt(xp).compiles_per_shape and mask.kept(USED_KEYS) is None)
    if mask.restricted and check and all_finite(xp, keys, values):  # (no dense mask to build)
        return keys, values
    used = used_keys(xp, mask, xp.device_of(keys))
    if used is None or (check and all_finite(xp, keys, values)):
        return keys, values
    return xp.where(used, keys, 0.0) if guard_keys else keys, xp.where(used, values, 0.0)


def guard_block(xp: Backend, visible: Array, keys: Array, values: Array) -> tuple[Array, Array]:
    """``guard_unused`` for one block of keys and values (batch, heads, k, d) by its
    ``visible`` (batch|1, heads|1, q, k): no mask of the whole call is built."""
    seen = xp.any(visible, 2, keepdims=True)  # (batch|1, heads|1, 1, k)
    seen = opt(xp).reshape(seen, tuple(opt(xp).shape(seen)[:2]) + (seen.shape[3], 1))
    return xp.where(seen, keys, 0.0), xp.where(seen, values, 0.0)


def kernel_inputs(
    xp: Backend,
    mask: Mask,
    queries: Array,
    keys: Array,
    values: Array,
    queries_finite: bool = False,
    keys_finite: bool = False,
    rows_see_keys: bool = False,
) -> tuple[Array, Array, Callable[[Array], Array]]:
    """``(keys, values, finish)`` for a kernel: unused key and value rows zeroed,
    ``finish(out)`` zeroes empty rows. Without ``Fused.fused_keeps_nan`` the
    NaN rules are kept around it on the device (a query row's NaN comes back;
    under a per-query mask, rows that may see a NaN key are NaN).
    ``queries_finite``, ``keys_finite``: checked finite by the caller;
    ``rows_see_keys``: known to the caller, every query sees a key."""
    if not keys_finite:
        keys, values = guard_unused(xp, mask, keys, values)

    def empty(out: Array) -> Array:
        return out if rows_see_keys else zero_empty_rows(xp, mask, out)

    if opt(xp).fused_keeps_nan:
        return keys, values, empty
    seen = None
    # (a kernel that skips the hidden half of top-left causal itself never reads it)
    if mask.per_query and not keys_finite and not (mask.top_left_causal and opt(xp).fused_causal):
        seen = _sees_nan_keys(xp, mask, queries, keys)
        if seen is not None:
            keys = xp.where(xp.any(keys != keys, -1, keepdims=True), 0.0, keys)

    def finish(out: Array) -> Array:
        dtype = xp.dtype_name(out)
        if not queries_finite:
            out = out + xp.astype(xp.sum(queries * 0.0, -1, keepdims=True), dtype)
        if seen is not None:
            nan = xp.astype(xp.asarray(np.float32(np.nan), device=xp.device_of(out)), dtype)
            out = xp.where(seen, nan, out)
        return empty(out)

    return keys, values, finish


def unguarded_holds(xp: Backend, queries: Array, keys: Array, values: Array, out: Array) -> bool:
    """Whether a kernel's output without the NaN guards is the contract's (host
    read; False while traced): output and queries finite, and under autodiff
    keys and values too (a hidden NaN would reach the gradients)."""
    if not all_finite(xp, out, queries):
        return False
    differentiated = any(opt(xp).may_differentiate(x) for x in (queries, keys, values))
    return not differentiated or all_finite(xp, keys, values)


def _sees_nan_keys(xp: Backend, mask: Mask, queries: Array, keys: Array) -> Array | None:
    """bool (batch, heads, Q, 1): the query may see a key with a NaN (None: sees
    every key); one product of the visible keys (0/1) with each key's NaN flag."""
    batch, heads, num_q = queries.shape[:3]
    work = compute_dtype(xp.dtype_name(queries))
    bad = xp.astype(xp.any(keys != keys, -1, keepdims=True), work)  # (b, kv_heads, K, 1)
    if heads != bad.shape[1]:
        bad = xp.repeat(bad, heads // bad.shape[1], 1)
    visible = mask.boolean(xp, xp.device_of(keys))
    if visible is None:  # every query sees every key after all
        return None
    visible = xp.astype(visible, work)
    columns = visible.shape[1] == 1
    if columns:  # (b, 1, Q, K) @ (b, 1, K, heads) -> (b, 1, Q, heads)
        bad = xp.transpose(bad, (0, 3, 2, 1))
    else:
        visible = xp.broadcast_to(visible, (visible.shape[0], heads, num_q, mask.num_keys))
    if visible.shape[0] != batch:
        visible = xp.broadcast_to(visible, (batch,) + tuple(visible.shape[1:]))
    count = xp.matmul(visible, bad)
    if columns:
        count = xp.transpose(count, (0, 3, 2, 1))
    return count > 0


def masked_softmax(
    xp: Backend,
    scores: Array,
    visible: Array | None,
    empty_rows: bool = True,
    hidden_finite: bool = False,
    before_product: bool = False,
    lens: Array | None = None,
    dtype: str | None = None,
    device: Any = None,
) -> Array:
    """Softmax over the last axis restricted to ``visible`` (None: all), in
    float32 for half precision, in the dtype of ``scores``; masked weights and
    empty rows are exactly 0. What the caller knows makes it cheaper, never
    different: ``empty_rows=False``, every row sees a key; ``hidden_finite``,
    no hidden score is NaN (``Masking.masks_by_adding``); ``before_product``
    (``Masking.softmax_before_product``); ``lens``, the lengths ``visible``
    came from (``Masking.below_lengths``; ``visible`` may then be a function
    that makes it); ``dtype``, ``device``: of ``scores``."""
    dtype = dtype or xp.dtype_name(scores)
    work = compute_dtype(dtype)
    x = xp.astype(scores, work) if work != dtype else scores
    softmax = opt(xp).softmax_before_product if before_product else xp.softmax
    if visible is None:
        weights = softmax(x, -1)
    else:
        if device is None:
            device = xp.device_of(x)
        by_lengths = lens is not None and opt(xp).masks_by_lengths
        if not by_lengths and callable(visible):
            visible = visible()
        if by_lengths:
            x = opt(xp).below_lengths(x, visible, lens, fill_value(work), -1)
        elif hidden_finite and opt(xp).masks_by_adding and size(visible) * 8 <= size(x):
            x = x + xp.where(visible, zero(xp, work, device), fill(xp, work, device))
        else:
            x = xp.where(visible, x, fill_against(xp, work, device))
        weights = softmax(x, -1)
        if empty_rows and by_lengths:
            weights = opt(xp).below_lengths(weights, visible, lens, 0.0, -1)
        elif empty_rows:
            weights = xp.where(visible, weights, 0.0)
    return weights if work == dtype else xp.astype(weights, dtype)
