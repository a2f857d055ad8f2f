"""The tiled path: one tile per batch element and block of queries, over only
the keys that tile may see (padding is never computed), each through the
backend's kernel or the softmax-product written here, on
``Backend.parallel_map``. Needs the rows' intervals on the host."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..mask import Mask
from ..mask.intervals import element_ranges
from ..mask.rules import guard_unused, zero_empty_rows
from ..mask.spec import Region
from ..numerics import (
    all_finite,
    compute_dtype,
    empty_rows,
    fill_against,
    scaled,
    work_itemsize,
)
from . import fused
from .call import Call, Plan, dropout_fn, expand_kv

if TYPE_CHECKING:
    from backends import Backend

    from ...types import Array

NAME = "tiled"
DEFAULT_BLOCK_QUERIES = 512
PARALLEL_MIN_SCORES = 1 << 16  # fewer scores than this: tiles run one after another
TILED_WORK_MAX = 0.9
"""Tiles are taken over one kernel call when their work, each call counted,
is at most 0.9 of it: their cost is divided by this."""


class Tiles(NamedTuple):
    """``tasks`` ``(b, q0, q1, key start, key stop, whole)``, one per batch
    element and block of queries ``blocks``, element by element (``whole``:
    every row sees all of its keys); ``scores`` the scores they compute."""

    tasks: list[tuple[int, int, int, int, int, bool]]
    blocks: list[tuple[int, int]]
    scores: int


def plan_tiles(
    xp: Backend,
    q: Array,
    mask: Mask,
    memory_budget: int | None = None,
    chunk_size: int | None = None,
) -> Tiles | None:
    """The tiles of a call, or None when they cannot run (the mask's
    intervals traced, or not even one query's scores within the budget)."""
    if not mask.known_on_host():
        return None
    batch, heads, num_q = q.shape[:3]
    block_q = max(1, min(num_q, chunk_size or DEFAULT_BLOCK_QUERIES))
    if memory_budget is not None:
        # scores and their exponentials, for each tile running at once
        per_query = 2 * heads * mask.num_keys * work_itemsize(xp, q)
        block_q = min(block_q, memory_budget // (per_query * xp.concurrency()))
        if block_q < 1:
            return None
    blocks = [(q0, min(num_q, q0 + block_q)) for q0 in range(0, num_q, block_q)]
    per_block = [element_ranges(mask, q0, q1) for q0, q1 in blocks]
    tasks, work = [], 0
    for b in range(batch):
        for (q0, q1), (starts, stops, whole) in zip(blocks, per_block):
            begin, end = int(starts[b]), int(stops[b])
            tasks.append((b, q0, q1, begin, end, bool(whole[b])))
            work += heads * (q1 - q0) * max(0, end - begin)
    return Tiles(tasks, blocks, work)


def plan(call: Call) -> Plan | None:
    """The tiles' scores and kernel calls (divided by ``TILED_WORK_MAX``);
    not with keyed dropout (a jitted call must draw what an eager one draws),
    nor on a framework that compiles each new shape unless asked for by name;
    under autodiff every tile's scores are held at once: all must fit."""
    xp = call.xp
    if not call.asks("tiled") or call.keyed_dropout:
        return None
    if call.path != "tiled" and xp.compiles_per_shape:
        return None
    tiles = plan_tiles(
        xp, call.queries, call.mask, max(1, call.budget // call.held), call.chunk_size
    )
    if tiles is None:
        return None
    if call.held > 1 and call.path != "tiled":
        if tiles.scores * call.itemsize * call.held > call.budget:
            return None
    calls = xp.kernel_call_cost * len(tiles.tasks)
    return Plan((tiles.scores + calls) / TILED_WORK_MAX, tiles)


def run(call: Call, plan: Plan) -> tuple[Array, None]:
    """The tiles of ``plan``: each batch element and block of queries over
    the keys its rows may see, through the backend's kernel or
    ``softmax_product``, on ``Backend.parallel_map``."""
    xp, q, k, v, mask, scale = call.xp, call.queries, call.keys, call.values, call.mask, call.scale
    tiles: Tiles = plan.detail
    heads, dv, dtype, device = call.heads, v.shape[-1], call.dtype, call.device
    drop = dropout_fn(xp, call.dropout, call.key)
    # (one read of the inputs instead of the NaN passes around each tile's kernel)
    finite = xp.has_fused_attention and not xp.fused_keeps_nan and all_finite(xp, q)
    # (per-batch lengths leave no key of a tile unseen: nothing to guard there)
    keys_finite = xp.has_fused_attention and mask.per_query and all_finite(xp, k, v)

    def tile(index: int) -> Array:
        b, q0, q1, start, stop, whole = tiles.tasks[index]
        if stop <= start:  # (still in the autodiff graph)
            return empty_rows(xp, (1, heads, q1 - q0, dv), dtype, device, q, k, v)
        sub = (
            Mask(1, heads, q1 - q0, stop - start)
            if whole
            else mask.region(Region(b, b + 1, q0, q1, start, stop))
        )
        args = (q[b : b + 1, :, q0:q1], k[b : b + 1, :, start:stop], v[b : b + 1, :, start:stop])
        out = fused.kernel(
            xp,
            *args,
            sub,
            scale,
            dropout=call.dropout,
            queries_finite=finite,
            keys_finite=keys_finite,
        )
        if out is None:
            tile_drop = None if drop is None else (lambda p: drop(p, index))
            out = softmax_product(xp, *args, sub, scale, tile_drop)
        return out

    indices = range(len(tiles.tasks))
    outs = (
        xp.parallel_map(tile, indices)
        if call.scores >= PARALLEL_MIN_SCORES
        else [tile(i) for i in indices]
    )
    n = len(tiles.blocks)  # tasks: per element, its blocks of queries in order
    rows = [
        outs[i] if n == 1 else xp.concatenate(outs[i : i + n], 2) for i in range(0, len(outs), n)
    ]
    return (rows[0] if len(rows) == 1 else xp.concatenate(rows, 0)), None


def softmax_product(
    xp: Backend,
    q: Array,
    k: Array,
    v: Array,
    mask: Mask,
    scale: float,
    dropout: Any = None,
) -> Array:
    """``softmax(scale q k^T) v`` of one tile.

    Softmax is shift-invariant: when ``|score| <= scale |q_i| max_j |k_j|``
    (Cauchy-Schwarz) bounds every score well inside exp's range (checked on
    the host when the values are concrete), the scores are exponentiated as
    they are, without the pass for the row maxima.
    ``dropout`` (a function of the probabilities) applies to the product only.
    """
    dtype = xp.dtype_name(q)
    work = compute_dtype(dtype)
    k, v = expand_kv(xp, k, v, q.shape[1])
    k, v = guard_unused(xp, mask, k, v)
    if xp.dtype_name(k) != work:
        k, v = xp.astype(k, work), xp.astype(v, work)
    qs = scaled(xp, q, scale, work)
    s = mask.scores(xp, xp.matmul(qs, k, transpose_b=True), work)
    visible = mask.boolean(xp, xp.device_of(q))
    if visible is not None:
        s = xp.where(visible, s, fill_against(xp, work, xp.device_of(q)))
    shift = mask.bias is not None or mask.score_mod is not None or not xp.is_concrete(q)
    if not shift:
        info = np.finfo(np.dtype(work))
        limit = min(np.log(info.max) - np.log(max(1, s.shape[-1])), -np.log(info.tiny)) - 2
        norms = [float(xp.to_numpy(xp.max(xp.sum(x * x, -1), -1)).max()) for x in (qs, k)]
        shift = not np.sqrt(norms[0]) * np.sqrt(norms[1]) <= limit  # (also NaN)
    if shift:
        s = s - xp.max(s, -1, keepdims=True)
    p = xp.exp_inplace(s)
    total = xp.sum(p, -1, keepdims=True)
    if dropout is not None:
        p = dropout(p)
    out = xp.matmul(p, v) / xp.where(total > 0, total, 1.0)
    if shift:  # a row with no visible key became all ones
        out = zero_empty_rows(xp, mask, out)
    return xp.astype(out, dtype) if work != dtype else out
