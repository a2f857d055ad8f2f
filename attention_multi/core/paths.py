"""The ways to compute scaled dot-product attention, all reading one ``Mask``.

Every path takes ``queries`` (batch, heads, Q, d), ``keys`` and ``values``
(batch, kv_heads, K, d|dv) with ``heads`` a multiple of ``kv_heads``, and
returns (batch, heads, Q, dv) in the dtype of ``queries``. They agree up to
float rounding; ``attend`` (attend.py) picks one.

- ``full``: materializes the scores and keeps the weights.
- ``chunked``: online softmax over blocks of queries and keys (running max,
  running sum, rescaled accumulator); skips blocks no query may see, and under
  autodiff recomputes each block in the backward pass instead of keeping it.
- ``tiled``: one tile per batch element and block of queries, over only the
  keys that tile may see (padding is never computed); each tile through the
  backend's kernel, or the softmax-product written here.
- ``fused``: the backend's own kernel, given the normalized mask.

``dropout`` is a rate; ``key`` the PRNG key of frameworks that need one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import mods
from .masking import (
    Mask,
    all_finite,
    compute_dtype,
    empty_rows,
    fill,
    fill_against,
    masked_softmax,
    normalize,
)

if TYPE_CHECKING:
    from backends import Backend

    from ..types import Array

DEFAULT_BLOCK_KEYS = 1024
DEFAULT_BLOCK_QUERIES = 512
DEFAULT_TRACED_BLOCK_KEYS = 64
DEFAULT_DIAGONAL_BLOCK = 256  # chunked blocks under causal or window masks
EXP_FLOOR = -80.0  # masked exponents: exp(-80) is a normal float32, zeroed after
PARALLEL_MIN_SCORES = 1 << 16  # fewer scores than this: tiles run one after another


def default_scale(features: int) -> float:
    """The default ``scale``: 1/sqrt(d) (d = 0 counts as 1: the scores are 0)."""
    return 1.0 / max(features, 1) ** 0.5


def work_itemsize(B: Backend, x: Array) -> int:
    """Bytes per element of score-sized work on ``x`` (half runs in float32)."""
    return 8 if B.dtype_name(x) == "float64" else 4


def queries_per_block(B: Backend, q: Array, block_k: int, memory_budget: int) -> int:
    """Queries per block of online softmax over ``block_k`` keys: the block's
    scores fill at most a sixteenth of ``memory_budget`` (the backward pass
    holds about eight such arrays)."""
    batch, heads = q.shape[:2]
    return max(1, memory_budget // 16 // (batch * heads * block_k * work_itemsize(B, q)))


def expand_kv(B: Backend, keys: Array, values: Array, heads: int) -> tuple[Array, Array]:
    """Grouped-query attention: repeat each kv head for its query heads."""
    group = heads // keys.shape[1]
    if group == 1:
        return keys, values
    return B.repeat(keys, group, 1), B.repeat(values, group, 1)


def dropout_fn(B: Backend, rate: float, key: Any) -> Callable[..., Array] | None:
    """``drop(weights, index)``: dropout at ``rate`` with the ``index``-th key
    folded from ``key`` (None when the rate is 0)."""
    if not rate:
        return None

    def drop(w: Array, index: Any = None) -> Array:  # (callers pass an int index)
        return B.dropout(w, rate, B.fold_key(key, index))

    return drop


def _scaled(B: Backend, x: Array, scale: float, work: str) -> Array:
    """``x * scale`` in the compute dtype."""
    return (B.astype(x, work) if B.dtype_name(x) != work else x) * scale


def _scores(B: Backend, qs: Array, k: Array, mask: Mask, work: str) -> Array:
    """``qs k^T + bias`` for scaled queries ``qs``, in the compute dtype."""
    s = B.matmul(qs, B.astype(k, work) if B.dtype_name(k) != work else k, transpose_b=True)
    s = s if mask.bias is None else s + mask.bias
    return s if mask.score_mod is None else mods.apply_score_mod(B, mask, s, work)


def _weights4(
    B: Backend,
    q: Array,
    k: Array,
    mask: Mask,
    scale: float,
    keys_guarded: bool = False,
    before_product: bool = False,
) -> Array:
    """The (batch, heads, Q, K) weights in the dtype of ``q``; ``k`` expanded;
    ``keys_guarded``: key rows nobody sees were zeroed; ``before_product``:
    as ``masked_softmax``'s."""
    dtype = B.dtype_name(q)
    work = compute_dtype(dtype)
    s = _scores(B, _scaled(B, q, scale, work), k, mask, work)
    w = masked_softmax(
        B,
        s,
        mask.boolean(B, B.device_of(q)),
        empty_rows=not mask.every_row_sees_a_key,
        # (a per-batch mask hides only key rows nobody sees: zeroed, their scores are finite)
        hidden_finite=keys_guarded and mask.per_batch_lens is not None,
        before_product=before_product,
    )
    return B.astype(w, dtype) if work != dtype else w


def flat(w: Array) -> Array:
    """(batch, heads, Q, K) -> (batch * heads, Q, K)."""
    return w.reshape((w.shape[0] * w.shape[1],) + tuple(w.shape[2:]))


def weights(B: Backend, q: Array, k: Array, mask: Mask, scale: float) -> Array:
    """The (batch * heads, Q, K) attention weights, as the full path computes them."""
    k, _ = expand_kv(B, k, k, q.shape[1])
    return flat(_weights4(B, q, k, mask, scale))


def full(
    B: Backend,
    q: Array,
    k: Array,
    v: Array,
    mask: Mask,
    scale: float,
    dropout: float = 0.0,
    key: Any = None,
) -> tuple[Array, Callable[[], Array]]:
    """Returns ``(output, weights)``, weights (batch * heads, Q, K) before
    dropout, as a function that reshapes them when they are read (a reshape
    is an operator call: MXNet's cost about as much as a small product)."""
    k, v = expand_kv(B, k, v, q.shape[1])
    # (masked by where, NaN in unused keys reaches only gradients; by adding, the scores)
    guard_keys = B.may_differentiate(q) or (B.masks_by_adding and mask.per_batch_lens is not None)
    k, v = mask.guard_unused(B, k, v, guard_keys=guard_keys)
    w4 = _weights4(B, q, k, mask, scale, keys_guarded=guard_keys, before_product=True)
    drop = dropout_fn(B, dropout, key)
    return B.matmul(w4 if drop is None else drop(w4), v), lambda: B.nan_rows(flat(w4))


def fused(
    B: Backend,
    q: Array,
    k: Array,
    v: Array,
    mask: Mask,
    scale: float,
    memory_budget: int | None = None,
    dropout: float = 0.0,
    queries_finite: bool = False,
    keys_finite: bool = False,
) -> Array | None:
    """The backend's kernel (None when it declines), with the core's rules
    around it: unused key/value rows zeroed before, empty rows zeroed after,
    NaN kept where the kernel would not (``Mask.kernel_inputs``)."""
    if not B.has_fused_attention or mask.score_mod is not None:
        return None
    k, v, finish = mask.kernel_inputs(B, q, k, v, queries_finite, keys_finite)  # (NaN rules)
    out = B.fused_attention(q, k, v, mask, scale, memory_budget, dropout)
    return None if out is None else finish(out)


# -- online softmax ------------------------------------------------------------------


def softmax_block(
    B: Backend,
    qs: Array,
    k: Array,
    v: Array,
    mask: Mask,
    work: str,
    dropout: Callable[..., Array] | None = None,
) -> tuple[Array, Array, Array]:
    """The online-softmax state ``(row max, row sum, accumulator)`` of scaled
    queries ``qs`` over one block of keys and values, whose Mask is ``mask``.

    A row with no visible key in the block has sum 0 and accumulator 0.
    ``dropout`` (a function of the probabilities) applies to the product only.
    """
    device = B.device_of(qs)
    s = _scores(B, qs, k, mask, work)
    visible = mask.boolean(B, device)
    if visible is not None:
        s = B.where(visible, s, fill_against(B, work, device))
    row_max = B.max(s, -1, keepdims=True)
    x = s - row_max
    if visible is not None:  # (exp of the lowest finite float is ~10x slower on CPUs)
        x = B.where(visible, x, EXP_FLOOR)
    p = B.exp(x)
    if visible is not None:  # a row with no visible key has s == row_max
        p = B.where(visible, p, 0.0)
    row_sum = B.sum(p, -1, keepdims=True)
    if dropout is not None:
        p = dropout(p)
    return row_max, row_sum, B.matmul(p, B.astype(v, work) if B.dtype_name(v) != work else v)


def merge_blocks(
    B: Backend, a: tuple[Array, Array, Array] | None, b: tuple[Array, Array, Array] | None
) -> tuple[Array, Array, Array] | None:
    """The state of two blocks of keys together (either may be None)."""
    if a is None or b is None:
        return a if b is None else b
    row_max = B.where(a[0] > b[0], a[0], b[0])
    ca, cb = B.exp(a[0] - row_max), B.exp(b[0] - row_max)
    return row_max, a[1] * ca + b[1] * cb, a[2] * ca + b[2] * cb


def finish_blocks(B: Backend, state: tuple[Array, Array, Array]) -> Array:
    """``accumulator / row sum``; rows with no visible key give zeros."""
    _, row_sum, acc = state
    return normalize(B, acc, row_sum)


def chunked(
    B: Backend,
    q: Array,
    k: Array,
    v: Array,
    mask: Mask,
    scale: float,
    memory_budget: Any = None,  # an int unless chunk_size is given
    chunk_size: int | None = None,
    dropout: float = 0.0,
    key: Any = None,
) -> Array:
    """Online-softmax attention over blocks: O(Q d) extra memory plus one block
    of scores, whose size follows ``chunk_size`` (queries and keys per block)
    or else ``memory_budget`` (up to 1024 keys, queries filling a sixteenth;
    with causal or window masks square blocks of up to 256).
    Blocks that no query may see are skipped; under autodiff each block is
    recomputed in the backward pass (``B.checkpoint``) instead of kept."""
    dtype = B.dtype_name(q)
    work = compute_dtype(dtype)
    batch, heads, num_q = q.shape[:3]
    k, v = expand_kv(B, k, v, heads)
    k, v = mask.guard_unused(B, k, v)
    device = B.device_of(q)
    start, stop = mask.key_range()
    if chunk_size:
        block_q = block_k = chunk_size
    else:
        block_k = max(1, min(stop - start, DEFAULT_BLOCK_KEYS))
        if mask.causal or mask.window is not None:
            # square blocks along the diagonal: those beyond it are skipped
            # whole (causal attention then computes about half the blocks)
            block_k = min(block_k, DEFAULT_DIAGONAL_BLOCK)
        block_q = queries_per_block(B, q, block_k, memory_budget)
        if mask.causal or mask.window is not None:
            block_q = min(block_q, block_k)
    drop = dropout_fn(B, dropout, key)
    # (a framework whose scan is one compiled loop scans the full blocks of
    # keys: unrolled, its compiler may keep every block's scores alive at once)
    scan = B.sequential_scan and not mask.dense  # (keys_from: interval masks only)
    grid = None  # (the full blocks of keys and values, made once)
    outs = []
    for q0 in range(0, num_q, block_q):
        q1 = min(num_q, q0 + block_q)
        qs = _scaled(B, q[:, :, q0:q1], scale, work)
        blocks = [
            k0
            for k0 in range(start, stop, block_k)
            if mask.block_state(0, batch, q0, q1, k0, min(stop, k0 + block_k)) != "none"
        ]
        state = None
        i = 0
        while i < len(blocks):
            # the full blocks from the second on, up to the next skipped one
            run = 0
            if scan and i > 0:
                while (
                    i + run < len(blocks)
                    and blocks[i + run] == blocks[i] + run * block_k
                    and blocks[i + run] + block_k <= stop
                ):
                    run += 1
            if run >= 2:
                if grid is None:
                    full = (stop - start) // block_k
                    grid = (*(_key_blocks(B, x, start, block_k, full) for x in (k, v)), start)
                first = (blocks[i] - start) // block_k
                state = _scan_blocks(
                    B, state, qs, grid, mask, (q0, q1), first, block_k, run, work, drop
                )
                i += run
                continue
            k0 = blocks[i]
            k1 = min(stop, k0 + block_k)
            i += 1
            sub = mask.sub(0, batch, q0, q1, k0, k1)
            block_drop = (
                None if drop is None else (lambda p, index=q0 * mask.num_keys + k0: drop(p, index))
            )

            # (the whole step is recomputed in the backward pass: it keeps only
            # the running state, not the block's scores nor slices of k and v)
            def step(
                state: tuple[Array, Array, Array] | None,
                qs: Array,
                k: Array,
                v: Array,
                k0: int = k0,
                k1: int = k1,
                sub: Mask = sub,
                block_drop: Callable[..., Array] | None = block_drop,
            ) -> tuple[Array, Array, Array] | None:
                return merge_blocks(
                    B,
                    state,
                    softmax_block(B, qs, k[:, :, k0:k1], v[:, :, k0:k1], sub, work, block_drop),
                )

            state = B.checkpoint(step, state, qs, k, v)
        if state is None:  # no query of this block may see any key
            outs.append(empty_rows(B, (batch, heads, q1 - q0, v.shape[-1]), work, device, qs, k, v))
        else:
            outs.append(finish_blocks(B, state))
    out = outs[0] if len(outs) == 1 else B.concatenate(outs, 2)
    return B.astype(out, dtype) if work != dtype else out


def _key_blocks(B: Backend, x: Array, start: int, block_k: int, count: int) -> Array:
    """``x[:, :, start : start + count * block_k]`` as (count, batch, heads,
    block_k, d): the full blocks of keys from ``start``, to scan over."""
    x = x[:, :, start : start + count * block_k]
    x = x.reshape(tuple(x.shape[:2]) + (count, block_k, x.shape[-1]))
    return B.transpose(x, (2, 0, 1, 3, 4))


def _scan_blocks(
    B: Backend,
    state: Any,
    qs: Array,
    grid: tuple[Array, Array, int],
    mask: Mask,
    rows: tuple[int, int],
    first: int,
    block_k: int,
    count: int,
    work: str,
    drop: Callable[..., Array] | None,
) -> Any:
    """``state`` merged with ``count`` blocks of ``block_k`` keys, the blocks
    ``first, ...`` of ``grid`` (keys and values by ``_key_blocks``, from key
    ``start``), for the queries ``rows``: an interval mask, whose block Mask
    comes from ``Mask.keys_from`` at a traced start. One ``B.scan``; each step
    is recomputed in the backward pass, which keeps only the running states."""
    q0, q1 = rows
    kb, vb, start = grid
    batch = kb.shape[1]
    device = B.device_of(qs)
    rows_mask = mask.sub(0, batch, q0, q1, 0, mask.num_keys)
    starts = np.arange(first, first + count) * block_k + start
    xs = [kb[first : first + count], vb[first : first + count]]
    xs.append(B.asarray(starts.astype(np.int32), device=device))
    if drop is not None:  # (the index each block's dropout draws from, as unrolled)
        xs.append(B.asarray((starts + q0 * mask.num_keys).astype(np.uint32), device=device))

    def block(state: Any, qs: Array, kb: Array, vb: Array, k0: Array, *index: Any) -> Any:
        block_drop = None if drop is None else (lambda p: drop(p, index[0]))
        sub = rows_mask.keys_from(k0, block_k)
        return merge_blocks(B, state, softmax_block(B, qs, kb, vb, sub, work, block_drop))

    return B.scan(lambda state, x: B.checkpoint(block, state, qs, *x), state, xs)


# -- tiles over the keys each batch element may see ----------------------------------------


class TilePlan:
    """The tiles of one call: ``tasks`` ``(b, q0, q1, key start, key stop,
    whole)``, one per batch element and block of queries ``blocks``, element
    by element (``whole``: every row sees all of its keys). ``cost``: the
    share of a single kernel call over all the (batch, Q, K) scores that the
    tiles cost, counting ``Backend.kernel_call_cost`` per call; ``scores``:
    how many scores the tiles compute (all of them held under autodiff)."""

    def __init__(
        self,
        tasks: list[tuple[int, int, int, int, int, bool]],
        blocks: list[tuple[int, int]],
        cost: float,
        scores: int = 0,
    ) -> None:
        self.tasks, self.blocks, self.cost, self.scores = tasks, blocks, cost, scores


def plan_tiles(
    B: Backend,
    q: Array,
    mask: Mask,
    memory_budget: int | None = None,
    chunk_size: int | None = None,
) -> TilePlan | None:
    """The ``TilePlan`` of the tiled path, or None when it cannot run (the
    mask's intervals traced, or not even one query's scores within the budget)."""
    if not mask.known_on_host():
        return None
    batch, heads, num_q = q.shape[:3]
    block_q = max(1, min(num_q, chunk_size or DEFAULT_BLOCK_QUERIES))
    if memory_budget is not None:
        # scores and their exponentials, for each tile running at once
        per_query = 2 * heads * mask.num_keys * work_itemsize(B, q) * B.concurrency()
        block_q = min(block_q, memory_budget // per_query)
        if block_q < 1:
            return None
    blocks = [(q0, min(num_q, q0 + block_q)) for q0 in range(0, num_q, block_q)]
    per_block = [mask.element_ranges(q0, q1) for q0, q1 in blocks]
    tasks, work = [], 0
    for b in range(batch):
        for (q0, q1), (starts, stops, whole) in zip(blocks, per_block):
            begin, end = int(starts[b]), int(stops[b])
            tasks.append((b, q0, q1, begin, end, bool(whole[b])))
            work += heads * (q1 - q0) * max(0, end - begin)
    call = B.kernel_call_cost
    return TilePlan(
        tasks,
        blocks,
        (work + call * len(tasks)) / (heads * batch * num_q * mask.num_keys + call),
        work,
    )


def tiled(
    B: Backend,
    q: Array,
    k: Array,
    v: Array,
    mask: Mask,
    scale: float,
    plan: TilePlan,
    dropout: float = 0.0,
    key: Any = None,
) -> Array:
    """The tiles of ``plan`` (a ``TilePlan``): each batch element and block of
    queries over the keys its rows may see, through the backend's kernel or
    ``softmax_product``, on ``B.parallel_map``."""
    dtype = B.dtype_name(q)
    batch, heads, num_q = q.shape[:3]
    dv = v.shape[-1]
    device = B.device_of(q)
    drop = dropout_fn(B, dropout, key)
    # (one read of the inputs instead of the NaN passes around each tile's kernel)
    finite = B.has_fused_attention and not B.fused_keeps_nan and all_finite(B, q)
    # (per-batch lengths leave no key of a tile unseen: nothing to guard there)
    keys_finite = B.has_fused_attention and mask.per_query and all_finite(B, k, v)

    def tile(index: int) -> Array:
        b, q0, q1, start, stop, whole = plan.tasks[index]
        if stop <= start:  # (still in the autodiff graph)
            return empty_rows(B, (1, heads, q1 - q0, dv), dtype, device, q, k, v)
        sub = (
            Mask(1, heads, q1 - q0, stop - start)
            if whole
            else mask.sub(b, b + 1, q0, q1, start, stop)
        )
        args = (q[b : b + 1, :, q0:q1], k[b : b + 1, :, start:stop], v[b : b + 1, :, start:stop])
        out = fused(
            B, *args, sub, scale, dropout=dropout, queries_finite=finite, keys_finite=keys_finite
        )
        if out is None:
            tile_drop = None if drop is None else (lambda p: drop(p, index))
            out = softmax_product(B, *args, sub, scale, tile_drop)
        return out

    scores = batch * heads * num_q * mask.num_keys
    indices = range(len(plan.tasks))
    outs = (
        B.parallel_map(tile, indices)
        if scores >= PARALLEL_MIN_SCORES
        else [tile(i) for i in indices]
    )
    n = len(plan.blocks)  # tasks: per element, its blocks of queries in order
    rows = [
        outs[i] if n == 1 else B.concatenate(outs[i : i + n], 2) for i in range(0, len(outs), n)
    ]
    return rows[0] if len(rows) == 1 else B.concatenate(rows, 0)


def softmax_product(
    B: Backend,
    q: Array,
    k: Array,
    v: Array,
    mask: Mask,
    scale: float,
    dropout: Callable[..., Array] | None = None,
) -> Array:
    """``softmax(scale q k^T) v`` of one tile.

    Softmax is shift-invariant: when ``|score| <= scale |q_i| max_j |k_j|``
    (Cauchy-Schwarz) bounds every score well inside exp's range (checked on
    the host when the values are concrete), the scores are exponentiated as
    they are, without the pass for the row maxima.
    ``dropout`` (a function of the probabilities) applies to the product only.
    """
    dtype = B.dtype_name(q)
    work = compute_dtype(dtype)
    k, v = expand_kv(B, k, v, q.shape[1])
    k, v = mask.guard_unused(B, k, v)
    if B.dtype_name(k) != work:
        k, v = B.astype(k, work), B.astype(v, work)
    qs = _scaled(B, q, scale, work)
    s = _scores(B, qs, k, mask, work)
    visible = mask.boolean(B, B.device_of(q))
    if visible is not None:
        s = B.where(visible, s, fill_against(B, work, B.device_of(q)))
    shift = mask.bias is not None or mask.score_mod is not None or not B.is_concrete(q)
    if not shift:
        info = np.finfo(np.dtype(work))
        limit = min(np.log(info.max) - np.log(max(1, s.shape[-1])), -np.log(info.tiny)) - 2
        norms = [float(B.to_numpy(B.max(B.sum(x * x, -1), -1)).max()) for x in (qs, k)]
        shift = not np.sqrt(norms[0]) * np.sqrt(norms[1]) <= limit  # (also NaN)
    if shift:
        s = s - B.max(s, -1, keepdims=True)
    p = B.exp_inplace(s)
    total = B.sum(p, -1, keepdims=True)
    if dropout is not None:
        p = dropout(p)
    out = B.matmul(p, v) / B.where(total > 0, total, 1.0)
    if shift:  # a row with no visible key became all ones
        out = mask.zero_empty_rows(B, out)
    return B.astype(out, dtype) if work != dtype else out


def tiled_traced(
    B: Backend,
    q: Array,
    k: Array,
    v: Array,
    mask: Mask,
    scale: float,
    memory_budget: int,
    block_k: int | None = None,
) -> Array:
    """The tiled path while the mask's intervals are traced (``jax.jit`` with
    lengths as arguments): per batch element, blocks of keys that ``B.cond``
    skips at run time when no query of that element may see them (static
    shapes, so it compiles once). Blocks are recomputed in the backward pass."""
    dtype = B.dtype_name(q)
    work = compute_dtype(dtype)
    batch, heads, num_q = q.shape[:3]
    num_k, dv = k.shape[2], v.shape[-1]
    k, v = expand_kv(B, k, v, heads)
    k, v = mask.guard_unused(B, k, v)
    device = B.device_of(q)
    if not block_k:  # small blocks skip more; at most 16 of them, within the budget
        fits = memory_budget // (3 * heads * num_q * work_itemsize(B, q))
        block_k = min(max(DEFAULT_TRACED_BLOCK_KEYS, -(-num_k // 16)), max(1, fits))
    block_k = max(1, min(num_k, block_k))
    lo, hi = mask.bounds(B, device)  # (batch|1, 1, Q|1, 1)
    lo = B.zeros((1, 1, 1, 1), "int32", device) if lo is None else lo
    rows = hi > lo
    start = B.zeros((1, heads, num_q, 1), work, device)
    # (a framework whose scan is one compiled loop scans the full blocks:
    # unrolled, its compiler may keep every block's scores alive at once)
    scan = B.sequential_scan and not mask.dense  # (keys_from: interval masks only)
    full_blocks = num_k // block_k if scan else 0
    outs = []
    for b in range(batch):
        lo_b, hi_b, rows_b = (x[b : b + 1] if x.shape[0] > 1 else x for x in (lo, hi, rows))
        qs = _scaled(B, q[b : b + 1], scale, work)
        state = (start + fill(B, work, device), start, B.zeros((1, heads, num_q, dv), work, device))
        if full_blocks:
            element = mask.sub(b, b + 1, 0, num_q, 0, num_k)

            def scanned(
                state: Any,
                x: Any,
                qs: Array = qs,
                lo_b: Array = lo_b,
                hi_b: Array = hi_b,
                rows_b: Array = rows_b,
                element: Mask = element,
            ) -> Any:
                kb, vb, k0 = x
                seen = B.any(B.logical_and(B.logical_and(rows_b, hi_b > k0), lo_b < k0 + block_k))

                def block(state: Any, qs: Array, kb: Array, vb: Array, k0: Array) -> Any:
                    sub = element.keys_from(k0, block_k)
                    return merge_blocks(B, state, softmax_block(B, qs, kb, vb, sub, work))

                def step(state: Any) -> Any:
                    return B.checkpoint(block, state, qs, kb, vb, k0)

                return B.cond(seen, step, lambda state: state, state)

            starts = (np.arange(full_blocks) * block_k).astype(np.int32)
            xs = [_key_blocks(B, x[b : b + 1], 0, block_k, full_blocks) for x in (k, v)]
            xs.append(B.asarray(starts, device=device))
            state = B.scan(scanned, state, xs)
        for k0 in range(full_blocks * block_k, num_k, block_k):
            k1 = min(num_k, k0 + block_k)
            seen = B.any(B.logical_and(B.logical_and(rows_b, hi_b > k0), lo_b < k1))

            def block(
                state: tuple[Array, Array, Array],
                qs: Array,
                k: Array,
                v: Array,
                b: int = b,
                k0: int = k0,
                k1: int = k1,
            ) -> tuple[Array, Array, Array] | None:
                sub = mask.sub(b, b + 1, 0, num_q, k0, k1)
                return merge_blocks(
                    B,
                    state,
                    softmax_block(B, qs, k[b : b + 1, :, k0:k1], v[b : b + 1, :, k0:k1], sub, work),
                )

            def step(
                state: tuple[Array, Array, Array],
                qs: Array = qs,
                block: Callable[..., Any] = block,
            ) -> tuple[Array, Array, Array]:
                return B.checkpoint(block, state, qs, k, v)

            state = B.cond(seen, step, lambda state: state, state)
        outs.append(finish_blocks(B, state))
    out = outs[0] if batch == 1 else B.concatenate(outs, 0)
    return B.astype(out, dtype) if work != dtype else out
