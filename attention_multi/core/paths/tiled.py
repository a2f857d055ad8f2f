"""The tiled path: tiles of batch elements and a block of queries over only the
keys they see (never the padding), each through the backend's kernel or the
softmax-product here, on ``Threads.parallel_map``; the intervals on the host."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from attention_multi.backends.capabilities import Fused, opt, supports

from ...types import Path
from ..mask.intervals import element_ranges, host_bounds
from ..mask.rules import guard_unused, unguarded_holds, zero_empty_rows
from ..mask.spec import Mask, Region
from ..numerics import all_finite, compute_dtype, empty_rows, fill_against, readable, scaled
from . import full, fused
from .call import (
    Call,
    Pieces,
    Plan,
    Result,
    dropout_fn,
    expand_kv,
    grouped,
    in_fewer_threads,
    many_calls_cost,
)

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array

NAME = Path.TILED
DEFAULT_BLOCK_QUERIES = 512
PARALLEL_MIN_SCORES = 1 << 16  # fewer scores than this: tiles run one after another
TILED_WORK_MAX = 0.9  # tiles beat one kernel call at 0.9 of its work (calls counted): cost / this
# a tile's framework calls on an accelerator, each a launch from the host (its slices, its
# mask, its guards, its rows put back): measured 1.1 ms of host time a tile on an H200
ACCELERATOR_TILE_CALLS = 32


class Group(NamedTuple):
    """One kernel call: batch elements ``rows``, queries ``[q0, q1)`` over keys
    ``[k0, k1)``; ``whole``: every row sees all of them (no mask)."""

    rows: np.ndarray
    q0: int
    q1: int
    k0: int
    k1: int
    whole: bool

    @property
    def ranged(self) -> bool:
        """Its rows are a range (sliced, not gathered); they are sorted."""
        return int(self.rows[-1]) - int(self.rows[0]) + 1 == len(self.rows)


class Tiles(NamedTuple):
    """The groups of each block of queries; ``scores`` the scores computed;
    ``copied`` the elements copied (gathered rows, the output put back);
    ``backs`` each block's ``_back_order``; ``calls`` its framework calls (``calls``)."""

    groups: list[list[Group]]
    blocks: list[tuple[int, int]]
    scores: int
    copied: int
    backs: list[np.ndarray | None]
    calls: int


_PLANS: dict[tuple, Tiles | None] = {}  # (recent plans of masks of intervals alone)
_PLANS_KEPT = 64


def plan_tiles(call: Call, memory_budget: int) -> Tiles | None:
    """Per block of queries, the batch elements grouped by the keys they see
    (``grouped``); None while traced, or when one query's scores exceed the budget.
    The plans of the last calls whose mask is intervals alone are kept by what
    they depend on (the host lengths among it): every layer of a model plans
    the same lengths again."""
    if not call.mask.known_on_host():
        return None
    key = _plan_key(call, memory_budget)
    if key is not None and key in _PLANS:
        return _PLANS[key]
    tiles = _plan_tiles(call, memory_budget)
    if key is not None:
        if len(_PLANS) >= _PLANS_KEPT:
            del _PLANS[next(iter(_PLANS))]
        _PLANS[key] = tiles
    return tiles


def _plan_key(call: Call, memory_budget: int) -> tuple | None:
    """What ``_plan_tiles`` reads of a call whose mask is intervals alone
    (None for any other mask)."""
    xp, mask = call.xp, call.mask
    form = mask.intervals
    if form is None or len(mask.forms) != 1:
        return None
    lens = form.valid_lens_known
    lens = None if lens is None else (lens.shape, lens.dtype.str, lens.tobytes())
    taped = any(opt(xp).is_differentiated(x) for x in (call.queries, call.keys, call.values))
    shapes = (tuple(call.queries.shape), tuple(call.keys.shape), tuple(call.values.shape))
    o = opt(xp)
    costs = (o.concurrency(), o.masked_score_cost, o.copy_cost, group_cost(call))
    intervals = (lens, form.offset_known, form.causal, form.window)
    return (xp.name, intervals, shapes, call.itemsize, call.chunk_size, memory_budget, taped, costs)


def _plan_tiles(call: Call, memory_budget: int) -> Tiles | None:
    xp, mask, heads, num_q = call.xp, call.mask, call.heads, call.num_queries
    # (where every query of an element sees the same keys, blocks of queries only add
    # calls and a join: one block, within the budget, unless chunk_size says otherwise)
    default = DEFAULT_BLOCK_QUERIES if mask.per_query else num_q
    block_q = max(1, min(num_q, call.chunk_size or default))
    per_query = 2 * heads * mask.num_keys * call.itemsize * opt(xp).concurrency()
    # (scores and their exponentials, each tile at once)
    block_q = min(block_q, memory_budget // per_query)
    if block_q < 1:
        return None
    # (under autodiff consecutive elements only: a gather's gradient fills an input-sized buffer)
    taped = any(opt(xp).is_differentiated(x) for x in (call.queries, call.keys, call.values))
    gather = all(f.gathers for f in mask.forms) and not taped
    masked = opt(xp).masked_score_cost
    blocks = [(q0, min(num_q, q0 + block_q)) for q0 in range(0, num_q, block_q)]
    groups, work, copied, backs = [], 0, 0, []
    kv_heads, d, dv = call.keys.shape[1], call.queries.shape[-1], call.values.shape[-1]
    for q0, q1 in blocks:
        starts, stops, whole = element_ranges(mask, q0, q1)
        rows = heads * (q1 - q0)
        most = max(1, memory_budget // (per_query * (q1 - q0)))
        per_element, per_key = rows * d, kv_heads * (d + dv)  # (a gathered group's copies)
        copies = (per_element * opt(xp).copy_cost, per_key * opt(xp).copy_cost)
        block = grouped(starts, stops, whole, rows, group_cost(call), most, gather, masked, copies)
        # (in the order of their first rows: groups that are ranges join in batch order)
        block = sorted(block, key=lambda g: int(g[0][0]))
        groups.append([Group(r, q0, q1, k0, k1, w) for r, k0, k1, w in block])
        work += sum(len(r) * rows * (k1 - k0) for r, k0, k1, _ in block)
        gathered = [g for g in groups[-1] if g.k1 > g.k0 and not g.ranged]
        copied += sum(len(g.rows) * (per_element + per_key * (g.k1 - g.k0)) for g in gathered)
        backs.append(_back_order(groups[-1]))
        if len(block) > 1:  # (the outputs joined, and put back in batch order)
            copied += call.batch * rows * dv * (1 + (backs[-1] is not None))
    return Tiles(groups, blocks, work, copied, backs, _calls(groups, backs))


def plan(call: Call) -> Plan | None:
    """The tiles' scores and calls / ``TILED_WORK_MAX``; not with keyed dropout
    or ``lse``, nor, unless named, where each new shape compiles."""
    xp, named = call.xp, call.named(NAME)
    if not call.asks(NAME) or call.keyed_dropout or call.lse:
        return None
    if not named and opt(xp).compiles_per_shape:
        return None
    budget = max(1, call.budget // call.held)
    tiles = plan_tiles(call, budget)
    held_at_once = call.held > 1 and not named  # (under autodiff: every tile's scores)
    if tiles is None or (held_at_once and tiles.scores * call.itemsize * call.held > call.budget):
        return None
    copies = tiles.copied * opt(xp).copy_cost
    return Plan((tiles.scores + copies + tile_cost(call) * tiles.calls) / TILED_WORK_MAX, tiles)


def tile_cost(call: Call) -> float:
    """What a tile costs beyond its scores: through the framework's kernel, a
    call (waits included) and its host work (``Costs.tile_host_cost``; on an
    accelerator ``ACCELERATOR_TILE_CALLS`` launches); else the full path's calls;
    each call at ``many_calls_cost``."""
    xp = call.xp
    calls = many_calls_cost(call)
    if not fused.takes(call):
        return calls * full.CALLS
    if opt(xp).on_accelerator(call.device):
        return call.call_cost * (1 + ACCELERATOR_TILE_CALLS)
    return calls + opt(xp).tile_host_cost


def group_cost(call: Call) -> float:
    """What ``grouped`` weighs a tile: a tile's cost through the kernel, else one call."""
    return tile_cost(call) if fused.takes(call) else call.call_cost


def bound(call: Call) -> float:
    """A lower bound of ``plan``'s cost, from the rows' intervals alone: the
    tiles compute at least the scores the rows' intervals hold, in one call
    if any (0 where another form narrows the keys, or while traced); on an
    accelerator, one tile (no host read)."""
    if opt(call.xp).on_accelerator(
        call.device
    ):  # (a host read there waits for every kernel queued)
        return tile_cost(call) / TILED_WORK_MAX
    known = host_bounds(call.mask)
    if known is None or any(f.narrows for f in call.mask.forms):
        return 0.0
    seen = np.maximum(known[1] - known[0], 0)  # (batch|1, Q|1)
    rows = int(seen.sum()) * (call.batch // seen.shape[0]) * (call.num_queries // seen.shape[1])
    return (call.heads * rows + tile_cost(call) * (rows > 0)) / TILED_WORK_MAX


def calls(tiles: Tiles) -> int:
    """Framework calls: one per group (3 gathers more unless a range), one per
    block out of order."""
    return _calls(tiles.groups, tiles.backs)


def _calls(groups: list[list[Group]], backs: list[np.ndarray | None]) -> int:
    count = sum(back is not None for back in backs)
    for g in (g for block in groups for g in block):
        count += (g.k1 > g.k0) * (1 if g.ranged else 4)
    return int(count)


def _back_order(block: list[Group]) -> np.ndarray | None:
    """The permutation that puts a block's rows back in batch order (None: they are)."""
    order = np.concatenate([g.rows for g in block])
    return np.argsort(order) if (order != np.arange(len(order))).any() else None


def run(call: Call, plan: Plan) -> Result:
    """The groups on ``Threads.parallel_map``, back in batch order; unguarded
    first where one check of the output allows (``fused.trusting``); in
    fewer threads where ``fewer_threads``."""
    return Result(in_fewer_threads(call, lambda c: _run(c, plan)))


def _run(call: Call, plan: Plan) -> Array:
    xp, q, k, v = call.xp, call.queries, call.keys, call.values
    if supports(xp, Fused) and fused.trusting(xp, q, k, v):
        out = _groups(call, plan.detail, guarded=False)
        if unguarded_holds(xp, q, k, v, out):
            return out
    return _groups(call, plan.detail, guarded=True)


def _groups(call: Call, tiles: Tiles, guarded: bool) -> Array:
    xp, q, k, v, mask, scale = call.xp, call.queries, call.keys, call.values, call.mask, call.scale
    heads, dv, dtype, device = call.heads, v.shape[-1], call.dtype, call.device
    drop = dropout_fn(xp, call.dropout, call.key)
    groups = [g for block in tiles.groups for g in block]
    checks = {"queries_finite": False, "keys_finite": False, "guarded": guarded}
    if guarded:
        # (one read of the inputs instead of the NaN passes around each tile's kernel)
        finite = supports(xp, Fused) and not opt(xp).fused_keeps_nan and all_finite(xp, q)
        # (keys a group holds that some of its rows do not see: read once, not zeroed per group)
        unseen = mask.per_query or any(not g.whole and len(g.rows) > 1 for g in groups)
        checks["queries_finite"] = finite
        checks["keys_finite"] = supports(xp, Fused) and unseen and all_finite(xp, k, v)

    pieces = _pieces(xp, call, tiles)

    def tile(index: int) -> Array:
        g = groups[index]
        n = len(g.rows)
        if g.k1 <= g.k0:  # (still in the autodiff graph)
            return empty_rows(xp, (n, heads, g.q1 - g.q0, dv), dtype, device, q, k, v)
        b0 = int(g.rows[0])
        if g.ranged:  # (slices, no copies)
            part, region = slice(b0, b0 + n), Region(b0, b0 + n, *g[1:5])
            if index in pieces:
                q_rows, k_rows, v_rows = pieces[index]
                args = (q_rows, k_rows.take(g.k0, g.k1), v_rows.take(g.k0, g.k1))
            else:
                args = (q[part, :, g.q0 : g.q1], k[part, :, g.k0 : g.k1], v[part, :, g.k0 : g.k1])
            sub = None if g.whole else mask.region(region)
        else:
            rows = xp.asarray(g.rows, "int32", device)
            cut = (q[:, :, g.q0 : g.q1], k[:, :, g.k0 : g.k1], v[:, :, g.k0 : g.k1])
            args = tuple(xp.take(x, rows, 0) for x in cut)  # (only what the tile reads)
            sub = None if g.whole else mask.rows(g.rows).region(Region(0, n, *g[1:5]))
        if sub is None:
            sub = Mask(n, heads, g.q1 - g.q0, g.k1 - g.k0)
        out = fused.kernel(xp, *args, sub, scale, dropout=call.dropout, **checks)
        if out is None:
            tile_drop = None if drop is None else (lambda p: drop(p, index))
            out = softmax_product(xp, *args, sub, scale, tile_drop)
        return out

    indices = range(len(groups))
    parallel = call.scores >= PARALLEL_MIN_SCORES
    outs = opt(xp).parallel_map(tile, indices) if parallel else [tile(i) for i in indices]
    parts, i = [], 0
    for block, back in zip(tiles.groups, tiles.backs):
        done, i = outs[i : i + len(block)], i + len(block)
        out = done[0] if len(done) == 1 else xp.concatenate(done, 0)
        if back is not None:
            out = xp.take(out, xp.asarray(back, "int32", device), 0)
        parts.append(out)
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, 2)


def _pieces(xp: Backend, call: Call, tiles: Tiles) -> dict[int, tuple[Any, Pieces, Pieces]]:
    """Under autodiff, for each group whose rows are a range: its queries and
    its rows' keys and values (``Pieces`` cut at the groups' key ranges), cut
    from the inputs by ``Backend.split`` (a slice's gradient is a buffer as
    large as its array, per group; the pieces' are joined once)."""
    q, k, v = call.queries, call.keys, call.values
    if not any(opt(xp).is_differentiated(x) for x in (q, k, v)):
        return {}
    q_blocks = Pieces(xp, q, [q0 for q0, _ in tiles.blocks])
    rows: dict[int, tuple[Any, int]] = {}  # group index -> (batch cuts, which piece)
    key_points: dict[tuple[Any, int], set[int]] = {}
    queries, index = {}, 0
    for block, (q0, q1) in zip(tiles.groups, tiles.blocks):
        cut = [i for i, g in enumerate(block) if g.ranged and g.k1 > g.k0]
        ends = {int(block[i].rows[0]) for i in cut} | {int(block[i].rows[-1]) + 1 for i in cut}
        edges = sorted(ends | {0, call.batch})
        bounds = tuple(np.diff(edges).tolist())
        q_parts = xp.split(q_blocks.take(q0, q1), list(bounds), 0)
        for i in cut:
            at = edges.index(int(block[i].rows[0]))
            rows[index + i], queries[index + i] = (bounds, at), q_parts[at]
            key_points.setdefault((bounds, at), set()).update((block[i].k0, block[i].k1))
        index += len(block)
    kv_parts = {b: [xp.split(x, list(b), 0) for x in (k, v)] for b, _ in key_points}
    kv = {
        (b, at): tuple(Pieces(xp, parts[at], points) for parts in kv_parts[b])
        for (b, at), points in key_points.items()
    }
    return {i: (queries[i], *kv[where]) for i, where in rows.items()}


def softmax_product(
    xp: Backend, q: Array, k: Array, v: Array, mask: Mask, scale: float, dropout: Any = None
) -> Array:
    """``softmax(scale q k^T) v`` of one tile (``dropout`` on the product only);
    no row maxima where Cauchy-Schwarz keeps every score inside exp's range."""
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
    shift = mask.bias is not None or mask.score_mod is not None or not readable(xp, q)
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
