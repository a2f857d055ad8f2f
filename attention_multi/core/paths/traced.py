"""Tiles while the mask's intervals are traced (``jax.jit`` with lengths as
arguments): per batch element, blocks of keys that ``Blocks.cond`` skips at
run time when no query of that element may see them (static shapes, so it
compiles once). Blocks are recomputed in the backward pass."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attention_multi.backends.capabilities import opt

from ...types import Path
from ..mask.rules import guard_unused
from ..mask.spec import Region
from ..numerics import scaled
from . import online
from .call import Call, Plan, Result, expand_kv
from .chunked import key_blocks, scan_keys

if TYPE_CHECKING:
    from ...types import Array

NAME = Path.TRACED
DEFAULT_BLOCK_KEYS = 64
SKIPPED_SHARE = 0.5  # of the scores, a traced call's expected share (blocks skipped at run time)


def plan(call: Call) -> Plan | None:
    """Traced intervals, a framework that branches at run time, no dropout."""
    xp, mask = call.xp, call.mask
    if not call.asks(NAME) or call.dropout or not opt(xp).runtime_cond:
        return None
    if mask.intervals is None or mask.known_on_host():
        return None
    branches = call.batch * -(-call.num_keys // _block_keys(call))  # (per element and block)
    return Plan(SKIPPED_SHARE * call.scores + branches * call.compiled_call_cost)


def _block_keys(call: Call) -> int:
    """Keys per block: ``chunk_size``, or at most 16 blocks (small blocks skip
    more), within the budget."""
    block_k = call.chunk_size
    if not block_k:
        fits = call.budget // (3 * call.heads * call.num_queries * call.itemsize)
        block_k = min(max(DEFAULT_BLOCK_KEYS, -(-call.num_keys // 16)), max(1, fits))
    return max(1, min(call.num_keys, block_k))


def run(call: Call, plan: Plan) -> Result:
    """Per batch element, its blocks of keys (at most 16 within the budget, or
    ``chunk_size``), each skipped when no query of the element sees it."""
    xp, q, mask, work, device = call.xp, call.queries, call.mask, call.work, call.device
    batch, heads, num_q, num_k = call.batch, call.heads, call.num_queries, call.num_keys
    k, v = expand_kv(xp, call.keys, call.values, heads)
    k, v = guard_unused(xp, mask, k, v)
    dv = v.shape[-1]
    block_k = _block_keys(call)
    lo, hi = mask.intervals.bounds(xp, mask, device)  # (batch|1, 1, Q|1, 1)
    lo = xp.zeros((1, 1, 1, 1), "int32", device) if lo is None else lo
    rows = hi > lo
    # (scanned where a scan is one compiled loop: unrolled, every block's scores may be kept)
    scan = opt(xp).sequential_scan and not mask.dense  # (keys_from: interval masks only)
    full_blocks = num_k // block_k if scan else 0
    parts = []
    for b in range(batch):
        lo_b, hi_b, rows_b = (x[b : b + 1] if x.shape[0] > 1 else x for x in (lo, hi, rows))

        def seen(
            k0: Any, k1: Any, lo_b: Array = lo_b, hi_b: Array = hi_b, rows_b: Array = rows_b
        ) -> Array:
            return xp.any(xp.logical_and(xp.logical_and(rows_b, hi_b > k0), lo_b < k1))

        qs = scaled(xp, q[b : b + 1], call.scale, work)
        state: Any = online.start(xp, (1, heads, num_q), dv, work, device)
        if full_blocks:
            element = mask.region(Region(b, b + 1, 0, num_q, 0, num_k))
            grid = (*(key_blocks(xp, x[b : b + 1], 0, block_k, full_blocks) for x in (k, v)), 0)
            state = scan_keys(call, state, qs, element, grid, 0, full_blocks, block_k, seen=seen)
        for k0 in range(full_blocks * block_k, num_k, block_k):
            k1 = min(num_k, k0 + block_k)
            sub = mask.region(Region(b, b + 1, 0, num_q, k0, k1))
            cut = (slice(b, b + 1), slice(None), slice(k0, k1))
            state = online.step(xp, state, qs, k, v, sub, work, cut=cut, seen=seen(k0, k1))
        parts.append(online.rows(call, state, ()))
    return online.result(call, parts, 0)
