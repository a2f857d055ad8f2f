"""The block-sparse path in blocks of one shape (``Tracing.compiles_per_shape``):
what is compiled for one block serves every block and length. The last block
of each axis ends at the end, overlapping the one before (its queries computed
again, its keys counted before hidden: ``online.step``'s ``hidden``).
``scanned`` (traced, ``Blocks.sequential_scan``): scans over blocks of queries
and of keys, each step skipped at run time. ``compiled`` (host): one call of one
compiled kernel per block of keys that is not empty.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from attention_multi.backends.capabilities import opt

from ..mask import EMPTY, PARTIAL
from ..mask.rules import guard_unused
from ..mask.spec import Region
from ..numerics import scaled
from . import online
from .call import Call, Result, dropout_fn, expand_kv

if TYPE_CHECKING:
    from ...types import Array


def starts(n: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """``(start, hidden)`` int32 per block of ``block`` positions over ``n``
    (the last starts at ``n - block``, hiding what the one before covers)."""
    first = np.arange(0, n, block)
    start = np.minimum(first, n - block)
    return start.astype(np.int32), (first - start).astype(np.int32)


def scanned(call: Call, block_q: int, block_k: int) -> Result:
    """Traced: scans over the blocks of queries and of keys; ``(output, None)``,
    or ``(output, None, log-sum-exp)`` with ``call.lse``."""
    xp, mask, work, device = call.xp, call.mask, call.work, call.device
    batch, heads, num_q, num_k = call.batch, call.heads, call.num_queries, call.num_keys
    k, v = expand_kv(xp, call.keys, call.values, heads)  # (guarded per block: no dense mask)
    dv = v.shape[-1]
    bq, bk = min(block_q, num_q), min(block_k, num_k)
    q_starts = starts(num_q, bq)[0]
    k_starts, hidden = starts(num_k, bk)
    overlap = bool(hidden.any())  # (else nothing to hide: no mask of it)
    qs_all = scaled(xp, call.queries, call.scale, work)
    drop = dropout_fn(xp, call.dropout, call.key)

    cols = [xp.asarray(x, "int32", device) for x in (k_starts, hidden)]

    def row(q0: Array) -> tuple[Array, ...]:
        """The rows ``[q0, q0 + bq)``, recomputed one at a time backward."""
        qs = opt(xp).read_slice(qs_all, q0, bq, 2)

        def col(state: Any, y: list[Array]) -> Any:
            k0, hide = y
            sub = mask.block_at(q0, k0, bq, bk)
            block_drop = None if drop is None else (lambda p: drop(p, q0 * num_k + k0))
            # (cut outside the cond: what it keeps for the backward pass is one block)
            kb, vb = opt(xp).read_slice(k, k0, bk, 2), opt(xp).read_slice(v, k0, bk, 2)
            seen = sub.seen(xp, sub.whole(), device)
            hide = hide if overlap else None
            return online.step(
                xp, state, qs, kb, vb, sub, work, block_drop, None, seen, hide, guard=True
            )

        state = opt(xp).scan(col, online.start(xp, (batch, heads, bq), dv, work, device), cols)
        return tuple(online.rows(call, state, ()))

    def rows(done: tuple[Array, ...], x: list[Array]) -> tuple[Array, ...]:
        parts = opt(xp).checkpoint(row, x[0])
        return tuple(opt(xp).write_slice(d, p, x[0], 2) for d, p in zip(done, parts))

    widths = (dv, 1) if call.lse else (dv,)
    done = tuple(xp.zeros((batch, heads, num_q, n), work, device) for n in widths)
    done = opt(xp).scan(rows, done, [xp.asarray(q_starts, "int32", device)])
    return online.result(call, [list(done)])


def compiled(call: Call, block_q: int, block_k: int, table: np.ndarray) -> Result:
    """The blocks of keys not empty in ``table`` (host states), each one call of
    the compiled kernel (a ``score_mod`` or dropout: the step). As ``scanned``."""
    xp, mask, work, device = call.xp, call.mask, call.work, call.device
    batch, heads, num_q, num_k = call.batch, call.heads, call.num_queries, call.num_keys
    k, v = expand_kv(xp, call.keys, call.values, heads)
    k, v = guard_unused(xp, mask, k, v)
    dv = v.shape[-1]
    bq, bk = min(block_q, num_q), min(block_k, num_k)
    q_starts, repeated = starts(num_q, bq)
    k_starts, hidden = starts(num_k, bk)
    qs_all = scaled(xp, call.queries, call.scale, work)
    step = online.compiled_step(xp, work) if mask.score_mod is None and not call.dropout else None
    drop = dropout_fn(xp, call.dropout, call.key)
    per_element = table.shape[0] > 1
    groups = [(b, b + 1) for b in range(batch)] if per_element else [(0, batch)]
    parts = []
    for b0, b1 in groups:
        rows = []
        for qi, (q0, again) in enumerate(zip(q_starts.tolist(), repeated.tolist())):
            qs = qs_all[b0:b1, :, q0 : q0 + bq]
            state: Any = online.start(xp, (b1 - b0, heads, bq), dv, work, device)
            states = table[b0 if per_element else 0, qi]
            for kj in np.flatnonzero(states != EMPTY).tolist():
                k0, hide = int(k_starts[kj]), int(hidden[kj])
                # (a repeated block's first rows are not those of its state)
                st = PARTIAL if again else int(states[kj])
                sub = mask.region(Region(b0, b1, q0, q0 + bq, k0, k0 + bk), st)
                kb, vb = k[b0:b1, :, k0 : k0 + bk], v[b0:b1, :, k0 : k0 + bk]
                if step is not None:
                    state = step(state, qs, kb, vb, sub.boolean(xp, device), sub.bias, hide)
                    continue
                index = (b0 * num_q + q0) * num_k + k0
                block_drop = None if drop is None else (lambda p, i=index: drop(p, i))
                state = online.step(xp, state, qs, kb, vb, sub, work, block_drop, hidden=hide)
            rows.append([x[:, :, again:] if again else x for x in online.rows(call, state, ())])
        parts.append([online.joined(xp, list(x)) for x in zip(*rows)])
    return online.result(call, parts, 0)
