"""The chunked path: online softmax over blocks of queries and keys. Extra
memory is O(Q d) plus one block of scores, whose size follows ``chunk_size``
or else the memory budget; blocks no query may see are skipped; under
autodiff each block is recomputed in the backward pass."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from attention_multi.backends.capabilities import opt

from ...types import Path
from ..mask import EMPTY
from ..mask.intervals import key_range
from ..mask.rules import guard_unused
from ..mask.spec import Region
from ..numerics import scaled
from . import online
from .call import Call, Pieces, Plan, Result, dropout_fn, expand_kv

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array
    from ..mask import Mask

NAME = Path.CHUNKED
DEFAULT_BLOCK_KEYS = 1024
DIAGONAL_BLOCK = 256  # blocks under causal or window masks
PASSES = 3
"""Score-sized passes of online softmax, per score."""


def queries_per_block(xp: Backend, q: Array, block_k: int, memory_budget: int) -> int:
    """Queries per block over ``block_k`` keys: the block's scores fill a
    sixteenth of ``memory_budget`` (the backward pass holds about eight)."""
    batch, heads = q.shape[:2]
    itemsize = 8 if xp.dtype_name(q) == "float64" else 4
    return max(1, memory_budget // 16 // (batch * heads * block_k * itemsize))


def plan(call: Call) -> Plan | None:
    """When asked for, or when the scores do not fit the budget."""
    if call.path == "chunked" or (call.path == "auto" and call.scores_bytes > call.budget):
        return Plan(PASSES * call.scores)
    return None


def run(call: Call, plan: Plan) -> Result:
    """Blocks of ``chunk_size`` queries and keys, or up to 1024 keys and the
    queries that fill a sixteenth of the budget (square blocks of up to 256
    under causal or window masks: those past the diagonal are skipped)."""
    xp, q, mask, work = call.xp, call.queries, call.mask, call.work
    batch, heads, num_q = call.batch, call.heads, call.num_queries
    k, v = expand_kv(xp, call.keys, call.values, heads)
    k, v = guard_unused(xp, mask, k, v)
    start, stop = key_range(mask)
    intervals = mask.intervals
    diagonal = intervals is not None and (intervals.causal or intervals.window is not None)
    if call.chunk_size:
        block_q = block_k = call.chunk_size
    else:
        block_k = max(1, min(stop - start, DEFAULT_BLOCK_KEYS))
        if diagonal:
            block_k = min(block_k, DIAGONAL_BLOCK)
        block_q = queries_per_block(xp, q, block_k, call.budget)
        if diagonal:
            block_q = min(block_q, block_k)
    drop = dropout_fn(xp, call.dropout, call.key)
    # (scanned where a scan is one compiled loop: unrolled, every block's scores may be kept)
    scan = opt(xp).sequential_scan and not mask.dense  # (keys_from: interval masks only)
    grid = None  # (the full blocks of keys and values, made once)
    q_cuts = Pieces(xp, q, range(0, num_q, block_q))
    k_cuts, v_cuts = (Pieces(xp, x, [*range(start, stop, block_k), stop]) for x in (k, v))
    parts = []
    for q0 in range(0, num_q, block_q):
        q1 = min(num_q, q0 + block_q)
        qs = scaled(xp, q_cuts.take(q0, q1), scale=call.scale, work=work)
        blocks = []
        for k0 in range(start, stop, block_k):
            r = Region(0, batch, q0, q1, k0, min(stop, k0 + block_k))
            seen = mask.block_state(r)
            if seen != EMPTY:
                blocks.append((r, seen))
        state = None
        i = 0
        while i < len(blocks):
            # the full blocks from the second on, up to the next skipped one
            run = 0
            if scan and i > 0:
                while (
                    i + run < len(blocks)
                    and blocks[i + run][0].k0 == blocks[i][0].k0 + run * block_k
                    and blocks[i + run][0].k1 == blocks[i + run][0].k0 + block_k
                ):
                    run += 1
            if run >= 2:
                if grid is None:
                    full = (stop - start) // block_k
                    grid = (*(key_blocks(xp, x, start, block_k, full) for x in (k, v)), start)
                first = (blocks[i][0].k0 - start) // block_k
                rows = mask.region(Region(0, mask.batch, q0, q1, 0, mask.num_keys))
                index = q0 * mask.num_keys
                state = scan_keys(call, state, qs, rows, grid, first, run, block_k, drop, index)
                i += run
                continue
            r, st = blocks[i]
            i += 1
            index = q0 * mask.num_keys + r.k0
            block_drop = None if drop is None else (lambda p, index=index: drop(p, index))
            ks, vs = k_cuts.take(r.k0, r.k1), v_cuts.take(r.k0, r.k1)
            state = online.step(xp, state, qs, ks, vs, mask.region(r, st), work, block_drop)
        # (None: no query of this block may see any key)
        parts.append(online.rows(call, state, (batch, heads, q1 - q0, v.shape[-1]), qs, k, v))
    return online.result(call, parts)


def key_blocks(xp: Backend, x: Array, start: int, block_k: int, count: int) -> Array:
    """The ``count`` full blocks of keys from ``start``, (count, batch, heads,
    block_k, d), to scan over."""
    x = x[:, :, start : start + count * block_k]
    x = opt(xp).reshape(x, tuple(x.shape[:2]) + (count, block_k, x.shape[-1]))
    return xp.transpose(x, (2, 0, 1, 3, 4))


def scan_keys(
    call: Call,
    state: Any,
    qs: Array,
    rows: Mask,
    grid: tuple[Array, Array, int],
    first: int,
    count: int,
    block_k: int,
    drop: Any = None,
    index: int = 0,
    seen: Callable[[Any, Any], Array] | None = None,
) -> Any:
    """``state`` merged with the ``count`` blocks ``first, ...`` of ``grid``
    (``key_blocks``) in one ``Blocks.scan``, for the queries ``qs`` whose Mask
    over every key is ``rows`` (an interval mask: ``Mask.keys_from`` at a traced
    start); dropout draws from ``index`` plus the block's first key, and
    ``seen(k0, k1)`` skips a block at run time."""
    xp = call.xp
    kb, vb, start = grid
    starts = np.arange(first, first + count) * block_k + start
    xs = [kb[first : first + count], vb[first : first + count]]
    xs.append(xp.asarray(starts.astype(np.int32), device=call.device))
    if drop is not None:  # (the index each block's dropout draws from, as unrolled)
        xs.append(xp.asarray((starts + index).astype(np.uint32), device=call.device))

    def block(state: Any, x: Any) -> Any:
        kb, vb, k0, *at = x
        block_drop = None if drop is None else (lambda p: drop(p, at[0]))
        sub = rows.keys_from(k0, block_k)
        skip = None if seen is None else seen(k0, k0 + block_k)
        return online.step(xp, state, qs, kb, vb, sub, call.work, block_drop, seen=skip)

    return opt(xp).scan(block, state, xs)
