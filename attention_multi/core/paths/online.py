"""The online-softmax step, written once: the state ``(row max, row sum,
accumulator)`` of a block of queries over a block of keys, merged into a
running state, recomputed in the backward pass (``Autodiff.checkpoint``),
skipped at run time when not seen (``Blocks.cond``); it also gives each row's
log-sum-exp, and attention sinks are one more term of the row sum."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from attention_multi.backends.capabilities import opt

from ..mask import Mask
from ..mask.arrays import arrays
from ..mask.rules import guard_block
from ..numerics import empty_rows, fill, fill_against, fill_value, in_dtype, normalize, scalar
from .call import Result

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array
    from .call import Call

State = tuple[Any, Any, Any]  # (row max, row sum, accumulator), each (batch, heads, Q, 1|dv)
EXP_FLOOR = -80.0  # masked exponents: exp(-80) is a normal float32, zeroed after


def softmax_block(
    xp: Backend,
    qs: Array,
    k: Array,
    v: Array,
    mask: Mask,
    work: str,
    dropout: Callable[..., Array] | None = None,
    hidden: Any = None,
    guard: bool = False,
) -> State:
    """The state of scaled queries ``qs`` over one block of keys and values
    (a row with no visible key: sum and accumulator 0). ``dropout`` applies to
    the product only; ``hidden``: the block's first keys no query sees here
    (an overlapping block); ``guard``: zero the keys no query sees here."""
    device = xp.device_of(qs)
    visible = mask.boolean(xp, device)
    if hidden is not None:
        after = opt(xp).reshape(xp.arange(k.shape[2], device), (1, 1, 1, k.shape[2])) >= hidden
        visible = after if visible is None else xp.logical_and(visible, after)
    if guard and visible is not None:
        k, v = guard_block(xp, visible, k, v)
    s = mask.scores(xp, xp.matmul(qs, in_dtype(xp, k, work), transpose_b=True), work)
    if visible is not None:
        s = xp.where(visible, s, fill_against(xp, work, device))
    row_max = xp.max(s, -1, keepdims=True)
    x = s - row_max
    if visible is not None:  # (exp of the lowest finite float is ~10x slower on CPUs)
        x = xp.where(visible, x, EXP_FLOOR)
    p = xp.exp(x)
    if visible is not None:  # a row with no visible key has s == row_max
        p = xp.where(visible, p, 0.0)
    row_sum = xp.sum(p, -1, keepdims=True)
    if dropout is not None:
        p = dropout(p)
    return row_max, row_sum, xp.matmul(p, in_dtype(xp, v, work))


def merge(xp: Backend, a: State | None, b: State | None) -> State | None:
    """The state of two blocks of keys together (either may be None)."""
    if a is None or b is None:
        return a if b is None else b
    row_max = xp.where(a[0] > b[0], a[0], b[0])
    ca, cb = xp.exp(a[0] - row_max), xp.exp(b[0] - row_max)
    return row_max, a[1] * ca + b[1] * cb, a[2] * ca + b[2] * cb


def start(xp: Backend, shape: tuple[int, ...], dv: int, work: str, device: Any) -> State:
    """The state of rows (batch, heads, Q) that have seen no key yet (eager,
    where each new shape compiles: made with NumPy, no program compiled)."""
    rows, acc = tuple(shape) + (1,), tuple(shape) + (dv,)
    if opt(xp).compiles_per_shape and not opt(xp).is_tracing():
        made = (np.full(rows, fill_value(work), work), np.zeros(rows, work), np.zeros(acc, work))
        return tuple(xp.asarray(x, work, device) for x in made)
    zero = xp.zeros(rows, work, device)
    return zero + fill(xp, work, device), zero, xp.zeros(acc, work, device)


def finish(xp: Backend, state: State) -> Array:
    """``accumulator / row sum``; rows with no visible key give zeros (one
    compiled program where each new shape compiles)."""
    _, row_sum, acc = state
    if opt(xp).compiles_per_shape:
        return _compiled_normalize(xp)(acc, row_sum)
    return normalize(xp, acc, row_sum)


@functools.cache
def _compiled_normalize(xp: Backend) -> Callable[[Array, Array], Array]:
    return opt(xp).compiled(functools.partial(normalize, xp))


def step(
    xp: Backend,
    state: State | None,
    qs: Array,
    k: Array,
    v: Array,
    mask: Mask,
    work: str,
    drop: Callable[..., Array] | None = None,
    cut: tuple[slice, ...] | None = None,
    seen: Any = None,
    hidden: Any = None,
    guard: bool = False,
) -> State | None:
    """``state`` merged with the block ``k[cut]``, ``v[cut]`` (``softmax_block``),
    recomputed in the backward pass (which keeps only the running state);
    with ``seen`` (a device bool), skipped at run time when False. Eager on a
    framework that compiles each new shape, one call of ``compiled_step``."""
    if (
        opt(xp).compiles_per_shape
        and seen is None
        and drop is None
        and not guard
        and mask.score_mod is None
        and all(opt(xp).is_concrete(x) for x in (qs, k, v, mask.bias) if x is not None)
    ):  # (not under autodiff: the block's mask would be held for the backward pass)
        if cut is not None:
            k, v = k[cut], v[cut]
        visible = mask.boolean(xp, xp.device_of(qs))
        return compiled_step(xp, work)(state, qs, k, v, visible, mask.bias, hidden)

    def block(state: State | None, qs: Array, k: Array, v: Array) -> State | None:
        if cut is not None:
            k, v = k[cut], v[cut]
        return merge(xp, state, softmax_block(xp, qs, k, v, mask, work, drop, hidden, guard))

    if seen is None:
        return opt(xp).checkpoint(block, state, qs, k, v)
    return opt(xp).cond(seen, lambda s: opt(xp).checkpoint(block, s, qs, k, v), lambda s: s, state)


@functools.cache
def compiled_step(xp: Backend, work: str) -> Callable[..., Any]:
    """``step`` compiled once per shape of its arrays: ``(state, qs, k, v,
    visible, bias, hidden) -> state``, the mask as its boolean and bias arrays
    (either None). Eager, one call instead of one compiled program per operation."""

    def kernel(
        state: Any, qs: Array, k: Array, v: Array, visible: Any, bias: Any, hidden: Any
    ) -> Any:
        batch, heads, num_q = qs.shape[:3]
        forms = () if visible is None and bias is None else (arrays(xp, visible, bias),)
        sub = Mask(batch, heads, num_q, k.shape[2], forms, True, xp)
        return step(xp, state, qs, k, v, sub, work, hidden=hidden)

    return opt(xp).compiled(kernel)


def minus_inf(xp: Backend, work: str, device: Any) -> Array:
    """``-inf`` as a 0-d array of ``work``: the log-sum-exp of a row that sees no key."""
    return scalar(xp, "-inf", -np.inf, work, device)


def log_sum_exp(xp: Backend, state: State) -> Array:
    """(batch, heads, Q, 1): the natural ``log(sum(exp(scores)))`` over the keys
    each row saw; ``-inf`` for a row that saw no key, with a zero gradient."""
    row_max, row_sum, _ = state
    seen = row_sum != 0  # (NaN is seen: it propagates)
    total = xp.log(xp.where(seen, row_sum, 1.0))
    return xp.where(
        seen, row_max + total, minus_inf(xp, xp.dtype_name(row_sum), xp.device_of(row_sum))
    )


def rows(call: Call, state: State | None, shape: tuple[int, ...], *inputs: Array) -> list[Array]:
    """``[output]``, with ``call.lse`` ``[output, log-sum-exp]``, of rows from
    their ``state``; None (no row saw a key): zeros of ``shape`` (kept in the
    autodiff graph of ``inputs`` when given) and ``-inf``."""
    xp, work, device = call.xp, call.work, call.device
    if state is None:
        if inputs:
            out = empty_rows(xp, shape, work, device, *inputs)
        else:
            out = xp.zeros(shape, work, device)
        lse = xp.zeros(tuple(shape[:3]) + (1,), work, device) + minus_inf(xp, work, device)
        return [out, lse] if call.lse else [out]
    out = finish(xp, state)
    return [out, log_sum_exp(xp, state)] if call.lse else [out]


def joined(xp: Backend, parts: list[Array], axis: int = 2) -> Array:
    """Blocks of rows put back together along ``axis``."""
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis)


def result(call: Call, parts: list[list[Array]], axis: int = 2) -> Result:
    """The ``Result`` of ``parts`` (each ``rows``'s) joined along ``axis``: the
    output in the call's dtype, no weights, with ``call.lse`` the log-sum-exp."""
    xp = call.xp
    out = in_dtype(xp, joined(xp, [p[0] for p in parts], axis), call.dtype)
    return Result(out, None, joined(xp, [p[1] for p in parts], axis) if call.lse else None)


def add_sinks(xp: Backend, out: Array, lse: Array, sinks: Array) -> tuple[Array, Array]:
    """Attention sinks (gpt-oss): one logit per head in each row's softmax
    denominator only: ``out * exp(lse - lse')``, ``lse' = logaddexp(lse, sink)``;
    ``sinks`` (heads,). Returns ``(out, lse')`` (no key: zeros, the sink)."""
    work = xp.dtype_name(lse)
    sink = xp.astype(sinks, work) if xp.dtype_name(sinks) != work else sinks
    sink = opt(xp).reshape(sink, (1, sink.shape[0], 1, 1))
    top = xp.maximum(lse, sink)  # (finite: the sink is)
    total = top + xp.log(xp.exp(lse - top) + xp.exp(sink - top))
    kept = xp.exp(lse - total)
    return out * in_dtype(xp, kept, xp.dtype_name(out)), total
