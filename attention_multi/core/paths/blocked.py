"""The block-sparse path of the programmable forms (``mask_mod``,
``score_mod``, ``segment_ids``): per block of queries, over the blocks of keys
that are not empty (``mask.host_table``; full ones without a mask), through
``fused.kernel`` over its runs of keys side by side, or one online-softmax step
per run. While traced, each block is a ``Blocks.cond`` on a device-side test.
A framework that compiles each new shape runs ``fixed_blocks``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from attention_multi.backends.capabilities import Fused, opt, supports

from ...types import Path
from ..mask import EMPTY, FULL, PARTIAL, Mask, computed_fraction, host_table
from ..mask.arrays import arrays
from ..mask.rules import guard_unused
from ..mask.spec import Region
from ..numerics import all_finite, in_dtype, scaled
from . import fixed_blocks, fused, online
from .call import Call, Pieces, Plan, Result, dropout_fn, expand_kv, grouped, in_fewer_threads

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array

NAME = Path.BLOCKED
DEFAULT_BLOCK = 128
KEY_BLOCK = 32  # (host: runs of non-empty key blocks are computed as one)
TRACED_BLOCK = 256  # fewer blocks: each is a cond in the compiled program
MIN_SCORES = 4 * DEFAULT_BLOCK * DEFAULT_BLOCK  # fewer (Q x K) scores: one dense call is cheaper
PROGRAMMABLE = ("mask_mod", "score_mod", "segment_ids")
TRACED_SHARE = 0.5  # of the scores, a traced call's expected share (blocks skipped at run time)


def pick_block(mask: Mask, traced: bool, fixed: bool = False) -> tuple[int, int]:
    """Blocks of queries x keys: a BlockMask's own, else square ones when
    ``fixed`` (under a scan 128 ran 2.3x faster than 256 at T=4096) or
    ``traced``, else short blocks of keys (runs of them are one call)."""
    form = mask.form("mask_mod")
    if form is not None and form.block_mask is not None:
        return form.block_mask.block_q, form.block_mask.block_k
    if fixed:
        return min(DEFAULT_BLOCK, mask.num_queries), min(DEFAULT_BLOCK, mask.num_keys)
    if traced:
        return min(TRACED_BLOCK, mask.num_queries), min(TRACED_BLOCK, mask.num_keys)
    return min(DEFAULT_BLOCK, mask.num_queries), min(KEY_BLOCK, mask.num_keys)


def _fixed(xp: Backend, traced: bool) -> bool:
    """Whether the blocks have one shape (``fixed_blocks``)."""
    return opt(xp).sequential_scan if traced else opt(xp).compiles_per_shape


def plan(call: Call) -> Plan | None:
    """A programmable form, and a large enough call (or traced where blocks
    are skipped at run time), or asked for by name. The cost: the non-empty
    blocks' scores and a kernel call per block of queries (traced: a share)."""
    xp, mask = call.xp, call.mask
    if not call.asks(NAME) or not any(mask.form(n) for n in PROGRAMMABLE):
        return None
    traced = not mask.known_on_host()
    if not call.named(NAME):
        if call.keyed_dropout:  # (jit and eager must draw alike)
            return None
        if mask.num_queries * mask.num_keys < MIN_SCORES and not (traced and opt(xp).runtime_cond):
            return None
    fixed, size = _fixed(xp, traced), call.chunk_size
    block_q, block_k = (size, size) if size else pick_block(mask, traced, fixed)
    table = None if traced else host_table(mask, block_q, block_k)
    if table is None:  # (a branch per block, compiled into one program)
        branches = -(-mask.num_queries // block_q) * -(-mask.num_keys // block_k)
        cost = TRACED_SHARE * call.scores + branches * call.compiled_call_cost
        return Plan(cost, (block_q, block_k, None))
    if fixed:  # (a compiled kernel call per block that is not empty)
        calls = int((table != EMPTY).sum()) * (call.batch if table.shape[0] == 1 else 1)
    else:
        calls = call.batch * -(-call.num_queries // block_q)
    share = computed_fraction(mask, table, block_q, block_k)
    return Plan(share * call.scores + call.call_cost * calls, (block_q, block_k, table))


def _spans(
    table: np.ndarray | None, b: int, qi: int, num_k: int, block_k: int
) -> list[tuple[int, int, Any]]:
    """``(k0, k1, state)`` of one row of blocks: every block while traced
    (``table`` None), else each run of non-empty blocks (full if all are)."""
    starts = range(0, num_k, block_k)
    if table is None:
        return [(k0, min(num_k, k0 + block_k), PARTIAL) for k0 in starts]
    row = table[b if table.shape[0] > 1 else 0, qi].tolist()  # (a few blocks: Python's loop)
    spans, j, n = [], 0, len(row)
    while j < n:
        j0, full = j, True
        while j < n and row[j] != EMPTY:
            full, j = full and row[j] == FULL, j + 1
        if j > j0:
            spans.append((j0 * block_k, min(num_k, j * block_k), FULL if full else PARTIAL))
        j += 1
    return spans


def run(call: Call, plan: Plan) -> Result:
    """Attention over the non-empty blocks; ``plan.detail``: the block size
    (queries, keys) and the host table of states (None while traced); in
    fewer threads where ``fewer_threads``."""
    return in_fewer_threads(call, lambda c: _run(c, plan))


def _run(call: Call, plan: Plan) -> Result:
    xp, q, mask, work, device = call.xp, call.queries, call.mask, call.work, call.device
    batch, heads, num_q, num_k = call.batch, call.heads, call.num_queries, call.num_keys
    block_q, block_k, table = plan.detail
    traced = table is None
    if _fixed(xp, traced):  # (traced: one loop's program; eager: one compiled kernel)
        if traced:
            return fixed_blocks.scanned(call, block_q, block_k)
        return fixed_blocks.compiled(call, block_q, block_k, table)
    k, v = expand_kv(xp, call.keys, call.values, heads)
    dv = v.shape[-1]
    drop = dropout_fn(xp, call.dropout, call.key)
    # (blocks of queries through the backend's kernel, which gives no log-sum-exp)
    kernel = not traced and not call.lse and supports(xp, Fused) and mask.score_mod is None
    # (one read of the inputs instead of the NaN passes around each kernel call)
    finite = kernel and all_finite(xp, q, k, v)
    if not finite:
        k, v = guard_unused(xp, mask, k, v)
    # (traced: the whole batch is one group, each block one cond, skipped when empty for all)
    per_element = not traced and table.shape[0] > 1
    groups = [(b, b + 1) for b in range(batch)] if per_element else [(0, batch)]
    num_rows = -(-num_q // block_q)
    spans = {
        (b0, qi): _spans(table, b0, qi, num_k, block_k)
        for b0, _ in groups
        for qi in range(num_rows)
    }
    cuts = _Cuts(xp, (q, k, v), groups, spans, block_q)
    parts = []
    for b0, b1 in groups:
        done: dict[int, Array] = {}  # first row -> the output of its rows
        for first, last in _stacked(spans, b0, b1, block_q, call) if kernel else ():
            q0, q1 = first * block_q, min(num_q, (last + 1) * block_q)
            runs = [spans[b0, qi] for qi in range(first, last + 1)]
            if len(runs) > 1:  # (consecutive rows over the keys they see together: one call)
                runs = [[(min(s[0][0] for s in runs), max(s[0][1] for s in runs), None)]]
            row_states = table[b0 if table.shape[0] > 1 else 0, first : last + 1]
            every_row = bool((row_states == FULL).any(-1).all())  # (a full block in each row)
            out = _kernel_rows(call, cuts, runs[0], (b0, b1, q0, q1), finite, every_row)
            if out is not None:
                done[first] = in_dtype(xp, out, work)
        rows, qi = [], 0
        while qi * block_q < num_q:
            if qi in done:
                rows.append([done[qi]])
                qi += -(-done[qi].shape[2] // block_q)
                continue
            q0, q1 = qi * block_q, min(num_q, (qi + 1) * block_q)
            qs = scaled(xp, cuts.queries(b0, b1, q0, q1), call.scale, work)
            state = online.start(xp, tuple(qs.shape[:3]), dv, work, device) if traced else None
            for k0, k1, st in spans[b0, qi]:
                r = Region(b0, b1, q0, q1, k0, k1)
                index = (b0 * num_q + q0) * num_k + k0
                block_drop = None if drop is None else (lambda p, i=index: drop(p, i))
                seen = mask.seen(xp, r, device) if traced and opt(xp).runtime_cond else None
                ks, vs = cuts.keys(b0, b1, [(k0, k1, st)])
                sub = mask.region(r, PARTIAL if traced else st)
                state = online.step(xp, state, qs, ks, vs, sub, work, block_drop, seen=seen)
            rows.append(online.rows(call, state, (b1 - b0, heads, q1 - q0, dv)))
            qi += 1
        parts.append([online.joined(xp, list(x)) for x in zip(*rows)])
    return online.result(call, parts, 0)


def _stacked(
    spans: dict[tuple[int, int], list[tuple[int, int, Any]]],
    b0: int,
    b1: int,
    block_q: int,
    call: Call,
) -> list[tuple[int, int]]:
    """``(first, last)`` rows of blocks of queries per kernel call: rows that
    each see one run of keys are stacked where that costs less (``grouped``)."""
    rows = -(-call.num_queries // block_q)
    row_spans = [spans[b0, qi] for qi in range(rows)]
    out: list[tuple[int, int]] = []
    qi = 0
    while qi < rows:
        if len(row_spans[qi]) != 1:
            out.append((qi, qi))
            qi += 1
            continue
        end = qi
        while end < rows and len(row_spans[end]) == 1:
            end += 1
        k0 = np.array([row_spans[i][0][0] for i in range(qi, end)])
        k1 = np.array([row_spans[i][0][1] for i in range(qi, end)])
        work = (b1 - b0) * call.heads * block_q
        for members, _, _, _ in grouped(k0, k1, k0 < 0, work, call.call_cost, end - qi, False):
            out.append((qi + int(members[0]), qi + int(members[-1])))
        qi = end
    return out


class _Cuts:
    """Blocks of queries and runs of keys and values of each group of batch
    elements: slices, or under autodiff ``Pieces`` cut where a block of
    queries or some row's run of keys starts or ends."""

    def __init__(
        self,
        xp: Backend,
        arrays: tuple[Array, ...],
        groups: list[tuple[int, int]],
        spans: dict[tuple[int, int], list[tuple[int, int, Any]]],
        block_q: int,
    ) -> None:
        self.xp, self.arrays = xp, arrays
        self.pieces: dict[int, tuple[Pieces, ...]] | None = None
        if not any(opt(xp).is_differentiated(x) for x in arrays):
            return
        sizes = [b1 - b0 for b0, b1 in groups]
        per_group = [xp.split(x, sizes, 0) if len(groups) > 1 else [x] for x in arrays]
        self.pieces = {}
        for i, (b0, _) in enumerate(groups):
            q, k, v = (x[i] for x in per_group)
            rows = range(-(-q.shape[2] // block_q))
            points = {e for qi in rows for k0, k1, _ in spans[b0, qi] for e in (k0, k1)}
            self.pieces[b0] = (
                Pieces(xp, q, range(0, q.shape[2], block_q)),
                Pieces(xp, k, points),
                Pieces(xp, v, points),
            )

    def queries(self, b0: int, b1: int, q0: int, q1: int) -> Array:
        """The queries ``[q0, q1)`` (block-aligned: one block, or several)."""
        if self.pieces is None:
            return self.arrays[0][b0:b1, :, q0:q1]
        return self.pieces[b0][0].take(q0, q1)

    def keys(self, b0: int, b1: int, spans: list[tuple[int, int, Any]]) -> tuple[Array, Array]:
        """Keys and values of the runs ``spans``, side by side."""
        xp = self.xp
        if self.pieces is None:
            runs = [[x[b0:b1, :, k0:k1] for k0, k1, _ in spans] for x in self.arrays[1:]]
        else:
            runs = [[p.take(k0, k1) for k0, k1, _ in spans] for p in self.pieces[b0][1:]]
        keys, values = (r[0] if len(r) == 1 else xp.concatenate(r, 2) for r in runs)
        return keys, values


def _kernel_rows(
    call: Call,
    cuts: _Cuts,
    spans: list[tuple[int, int, Any]],
    where: Any,
    finite: bool,
    rows_see_keys: bool,
) -> Array | None:
    """One block of queries (batch ``b0..b1``, queries ``q0..q1``) through
    ``fused.kernel``, over the runs of keys ``spans`` ``(k0, k1, state or
    None)`` (put side by side when there are several); None when the kernel
    declines or no key is visible. ``rows_see_keys``: each query sees a key."""
    xp, mask, (b0, b1, q0, q1) = call.xp, call.mask, where
    if not spans or (len(spans) > 1 and mask.bias is not None):
        return None
    subs = [mask.region(Region(b0, b1, q0, q1, k0, k1), st) for k0, k1, st in spans]
    ks, vs = cuts.keys(b0, b1, spans)
    if len(spans) == 1:
        sub = subs[0]
    else:
        device = xp.device_of(ks)
        parts = [s.boolean(xp, device) for s in subs]
        heads = max([1] + [p.shape[1] for p in parts if p is not None])
        shape = (b1 - b0, heads, q1 - q0)
        allowed = xp.concatenate(
            [
                xp.zeros(shape + (s.num_keys,), "bool", device) == 0
                if part is None
                else xp.broadcast_to(part, shape + (s.num_keys,))
                for s, part in zip(subs, parts)
            ],
            3,
        )
        forms = (arrays(xp, allowed, None),)
        sub = Mask(b1 - b0, mask.heads, q1 - q0, int(ks.shape[2]), forms, True, xp)
    args = (cuts.queries(b0, b1, q0, q1), ks, vs, sub, call.scale)
    return fused.kernel(
        xp,
        *args,
        dropout=call.dropout,
        queries_finite=finite,
        keys_finite=finite,
        rows_see_keys=rows_see_keys,
    )
