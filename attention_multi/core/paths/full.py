"""The full path: materializes the (batch, heads, Q, K) scores and keeps the
weights. The smallest calls take it (planning would cost more than it could
save), calls whose weights will be read take it, and it is the last resort
within the memory budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attention_multi.backends.capabilities import opt

from ...types import Path
from ..mask.rules import guard_unused, masked_softmax
from ..numerics import compute_dtype, in_dtype, scaled, weighted
from . import online
from .call import Call, Plan, Result, dropout_fn, expand_kv

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array
    from ..mask import Mask

NAME = Path.FULL
PASSES = 4
"""Its cost per score: the scores and weights written and read back."""
CALLS = 5
"""Its kernel calls, at least: scale, scores, mask, softmax, product."""


def weights4(
    xp: Backend,
    q: Array,
    k: Array,
    mask: Mask,
    scale: float,
    keys_guarded: bool = False,
    before_product: bool = False,
    rounded: bool = True,
) -> Array:
    """The (batch, heads, Q, K) weights in the dtype of ``q`` (its compute dtype
    unless ``rounded``); ``keys_guarded``: key rows nobody sees were zeroed."""
    dtype = xp.dtype_name(q)
    work = compute_dtype(dtype)
    qs = scaled(xp, q, scale, work)
    s = xp.matmul(qs, xp.astype(k, work) if xp.dtype_name(k) != work else k, transpose_b=True)
    w = masked_softmax(
        xp,
        mask.scores(xp, s, work),
        mask.boolean(xp, xp.device_of(q)),
        empty_rows=not mask.every_row_sees_a_key,
        # (a per-batch mask hides only key rows nobody sees: zeroed, their scores are finite)
        hidden_finite=keys_guarded and mask.per_batch_lens is not None,
        before_product=before_product,
    )
    return xp.astype(w, dtype) if rounded and work != dtype else w


def flat(w: Array, xp: Backend | None = None) -> Array:
    """(batch, heads, Q, K) -> (batch * heads, Q, K)."""
    if xp is None:
        return w.reshape((w.shape[0] * w.shape[1],) + tuple(w.shape[2:]))
    b, h, *rest = opt(xp).shape(w)
    return opt(xp).reshape(w, (b * h, *rest))


def weights(xp: Backend, q: Array, k: Array, mask: Mask, scale: float) -> Array:
    """The (batch * heads, Q, K) attention weights, as the full path computes them."""
    k, _ = expand_kv(xp, k, k, q.shape[1])
    return flat(weights4(xp, q, k, mask, scale), xp)


def fits(call: Call) -> bool:
    """Its scores (held for the backward pass under autodiff) fit the budget."""
    return call.scores_bytes <= call.budget


def plan(call: Call) -> Plan | None:
    """Within the memory budget (or asked for by name), ``PASSES`` per score
    and ``CALLS`` kernel calls."""
    if call.path == "full" or (call.path == "auto" and fits(call)):
        return Plan(PASSES * call.scores + CALLS * call.call_cost)
    return None


def run(call: Call, plan: Plan | None = None) -> Result:
    """Output and weights (batch * heads, Q, K) before dropout, as a
    function that reshapes them when read (a reshape costs an operator call)."""
    xp, q, mask = call.xp, call.queries, call.mask
    k, v = expand_kv(xp, call.keys, call.values, call.heads)
    if call.lse:
        return with_lse(call, k, v)
    # (masked by where, NaN in unused keys reaches only gradients; by adding, the scores)
    guard = opt(xp).may_differentiate(q) or (
        opt(xp).masks_by_adding and mask.per_batch_lens is not None
    )
    k, v = guard_unused(xp, mask, k, v, guard_keys=guard)
    w4 = weights4(xp, q, k, mask, call.scale, guard, before_product=True, rounded=False)
    drop = dropout_fn(xp, call.dropout, call.key)
    dtype = xp.dtype_name(q)
    out = weighted(xp, w4 if drop is None else drop(w4), v, dtype)
    return Result(out, lambda: opt(xp).nan_rows(flat(in_dtype(xp, w4, dtype), xp)))


def with_lse(call: Call, k: Array, v: Array) -> Result:
    """Output and log-sum-exp of every key as one online-softmax block."""
    xp, q, mask, work = call.xp, call.queries, call.mask, call.work
    k, v = guard_unused(xp, mask, k, v)
    drop = dropout_fn(xp, call.dropout, call.key)
    state = online.softmax_block(xp, scaled(xp, q, call.scale, work), k, v, mask, work, drop)
    return online.result(call, [online.rows(call, state, ())])  # (call.lse)
