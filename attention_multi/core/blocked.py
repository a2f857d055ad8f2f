"""The block-sparse path of the programmable forms (``mask_mod``,
``score_mod``, ``segment_ids``): per batch element and block of queries,
over the blocks of keys that are not empty.

On the host (values concrete) the block states come from
``blocks.host_table``: empty blocks are never computed, full ones without a
mask. A block of queries goes through the backend's kernel (``paths.fused``)
over its runs of visible keys, put side by side, with the block's mask;
where the kernel declines (none, a ``score_mod``, a framework that compiles
each new shape), each run is an online-softmax step, recomputed in the
backward pass under autodiff. While traced (``jax.jit``), each block of the
whole batch goes through ``Backend.cond`` on a device-side test (intervals,
segment ids' least and largest values, the mask_mod on the block's grid),
so blocks are skipped at run time, nothing recompiles when the layout
changes, and the program does not grow with the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import blocks, mods
from .masking import Mask, all_finite, compute_dtype, fill
from .paths import (
    _scaled,
    dropout_fn,
    expand_kv,
    finish_blocks,
    fused,
    merge_blocks,
    softmax_block,
)

if TYPE_CHECKING:
    from backends import Backend

    from ..types import Array

DEFAULT_BLOCK = 128
KEY_BLOCK = 32  # (host: runs of non-empty key blocks are computed as one)
TRACED_BLOCK = 256  # fewer blocks: each is a cond in the compiled program


def pick_block(mask: Mask, traced: bool) -> tuple[int, int]:
    """Blocks of queries x keys: a BlockMask's own, else square blocks."""
    if mask.blocks is not None:
        return mask.blocks.block_q, mask.blocks.block_k
    if traced:
        return min(TRACED_BLOCK, mask.num_queries), min(TRACED_BLOCK, mask.num_keys)
    return min(DEFAULT_BLOCK, mask.num_queries), min(KEY_BLOCK, mask.num_keys)


def computed_fraction(
    mask: Mask, block_q: int | None = None, block_k: int | None = None
) -> float | None:
    """The share of the (batch, Q, K) scores in blocks that are computed
    (host; None while traced)."""
    if block_q is None or block_k is None:  # (given together)
        block_q, block_k = pick_block(mask, False)
    table = blocks.host_table(mask, block_q, block_k)
    if table is None:
        return None
    nq, nk = mask.num_queries, mask.num_keys
    qn = [min(block_q, nq - i) for i in range(0, nq, block_q)]
    kn = [min(block_k, nk - j) for j in range(0, nk, block_k)]
    size = np.outer(qn, kn)
    table = np.broadcast_to(table, (mask.batch,) + table.shape[1:])
    return float(((table != blocks.EMPTY) * size).sum() / (mask.batch * nq * nk))


def _spans(
    table: np.ndarray | None, b: int, qi: int, num_k: int, block_k: int
) -> list[tuple[int, int, int]]:
    """``(k0, k1, state)`` of one row of blocks: every block while traced
    (``table`` None), else the runs of blocks that are not empty, each
    computed as one (full when all its blocks are)."""
    starts = range(0, num_k, block_k)
    if table is None:
        return [(k0, min(num_k, k0 + block_k), blocks.PARTIAL) for k0 in starts]
    row = table[b if table.shape[0] > 1 else 0, qi]
    on = row != blocks.EMPTY
    edges = np.flatnonzero(np.diff(np.concatenate([[False], on, [False]]).astype(np.int8)))
    spans = []
    for j0, j1 in zip(edges[::2], edges[1::2]):
        st = blocks.FULL if (row[j0:j1] == blocks.FULL).all() else blocks.PARTIAL
        spans.append((int(j0) * block_k, min(num_k, int(j1) * block_k), st))
    return spans


def _seen(
    B: Backend, mask: Mask, b0: int, b1: int, q0: int, q1: int, k0: int, k1: int, device: Any
) -> Array | None:
    """Device bool: whether some query of the block (batch elements b0..b1)
    may see some key of it."""
    seen = None
    if mask.intervals:
        lo, hi = mask.bounds(B, device)  # (batch|1, 1, Q|1, 1)
        lo = B.zeros((1, 1, 1, 1), "int32", device) if lo is None else lo

        def rows(x: Array) -> Array:
            x = x[b0:b1] if x.shape[0] > 1 else x
            return x[:, :, q0:q1] if x.shape[2] > 1 else x

        lo, hi = rows(lo), rows(hi)
        lo_c = B.where(lo > k0, lo, k0)
        hi_c = B.minimum(hi, k1)
        seen = B.any(hi_c > lo_c)
    if mask.segments is not None:
        s = mods.segment_block_seen(B, mask, b0, b1, q0, q1, k0, k1)
        seen = s if seen is None else B.logical_and(seen, s)
    if mask.mod is not None:
        sub = blocks._region(mask, b0, b1, q0, q1, k0, k1)
        v = mods._as_bool(B, mask.mod(*mods.index_grid(B, sub, device)), device)
        s = B.any(v)
        seen = s if seen is None else B.logical_and(seen, s)
    return seen


def blocked(
    B: Backend,
    q: Array,
    k: Array,
    v: Array,
    mask: Mask,
    scale: float,
    block: tuple[int, int] | None = None,
    dropout: float = 0.0,
    key: Any = None,
) -> Array:
    """Attention over the non-empty blocks; ``block`` (queries, keys) or None."""
    dtype = B.dtype_name(q)
    work = compute_dtype(dtype)
    batch, heads, num_q = q.shape[:3]
    num_k, dv = k.shape[2], v.shape[-1]
    k, v = expand_kv(B, k, v, heads)
    device = B.device_of(q)
    table = blocks.host_table(mask, *(block or pick_block(mask, False)))
    traced = table is None
    block_q, block_k = block or pick_block(mask, traced)
    if traced and table is None and not B.runtime_cond:
        table = None  # every block computed (the test is not decidable here)
    drop = dropout_fn(B, dropout, key)
    # (a block of queries through the backend's kernel, over its visible keys;
    # not on a framework that compiles each new shape: the spans vary)
    kernel = (
        table is not None
        and B.has_fused_attention
        and mask.score_mod is None
        and not B.compiles_per_shape
    )
    # (one read of the inputs instead of the NaN passes around each kernel call)
    finite = kernel and all_finite(B, q, k, v)
    if not finite:
        k, v = mask.guard_unused(B, k, v)
    # (while traced the whole batch is one group: each block is one cond,
    # skipped when empty for every element, and compiling does not grow with it)
    per_element = table is not None and table.shape[0] > 1
    groups = [(b, b + 1) for b in range(batch)] if per_element else [(0, batch)]
    if kernel:
        autodiff = any(B.may_differentiate(x) for x in (q, k, v))
        cuts = _Cuts(B, (q, k, v), per_element, (block_q, block_k), autodiff)
    outs = []
    for b0, b1 in groups:
        rows = []
        for qi, q0 in enumerate(range(0, num_q, block_q)):
            q1 = min(num_q, q0 + block_q)
            if kernel and table is not None:
                out = _kernel_rows(
                    B, cuts, mask, table, (b0, b1, q0, q1, qi), block_k, scale, dropout, finite
                )
                if out is not None:
                    rows.append(B.astype(out, work) if work != dtype else out)
                    continue
            qs = _scaled(B, q[b0:b1, :, q0:q1], scale, work)
            if traced:
                zero = B.zeros((b1 - b0, heads, q1 - q0, 1), work, device)
                state = (
                    zero + fill(B, work, device),
                    zero,
                    B.zeros(tuple(qs.shape[:3]) + (dv,), work, device),
                )
            else:
                state = None
            for k0, k1, st in _spans(table, b0, qi, num_k, block_k):
                if traced:
                    sub = mask.sub(b0, b1, q0, q1, k0, k1, state="some")
                else:
                    sub = (
                        Mask(b1 - b0, heads, q1 - q0, k1 - k0)
                        if st == blocks.FULL
                        else mask.sub(b0, b1, q0, q1, k0, k1, state="some")
                    )
                index = (b0 * num_q + q0) * num_k + k0
                block_drop = None if drop is None else (lambda p, i=index: drop(p, i))

                def step(
                    state: tuple[Array, Array, Array] | None,
                    qs: Array,
                    k: Array,
                    v: Array,
                    k0: int = k0,
                    k1: int = k1,
                    sub: Mask = sub,
                    block_drop: Callable[..., Array] | None = block_drop,
                    b0: int = b0,
                    b1: int = b1,
                ) -> tuple[Array, Array, Array] | None:
                    return merge_blocks(
                        B,
                        state,
                        softmax_block(
                            B, qs, k[b0:b1, :, k0:k1], v[b0:b1, :, k0:k1], sub, work, block_drop
                        ),
                    )

                if traced and B.runtime_cond:
                    seen = _seen(B, mask, b0, b1, q0, q1, k0, k1, device)

                    def run(
                        state: tuple[Array, Array, Array] | None,
                        qs: Array = qs,
                        step: Callable[..., Any] = step,
                    ) -> Any:
                        return B.checkpoint(step, state, qs, k, v)

                    state = B.cond(seen, run, lambda state: state, state)
                else:
                    state = B.checkpoint(step, state, qs, k, v)
            if state is None:
                rows.append(B.zeros((b1 - b0, heads, q1 - q0, dv), work, device))
            else:
                rows.append(finish_blocks(B, state))
        outs.append(rows[0] if len(rows) == 1 else B.concatenate(rows, 2))
    out = outs[0] if len(outs) == 1 else B.concatenate(outs, 0)
    return B.astype(out, dtype) if work != dtype else out


class _Cuts:
    """The queries of a block and the keys and values of a run of key
    blocks: slices, or under autodiff pieces of ``B.split``, the keys' side
    by side (a slice's gradient is as large as the array it was cut from,
    one per block; the pieces' are gathered by one concatenation)."""

    def __init__(
        self,
        B: Backend,
        arrays: tuple[Array, Array, Array],
        per_element: bool,
        block: tuple[int, int],
        autodiff: bool,
    ) -> None:
        self.B, self.arrays, self.block = B, arrays, block
        self.pieces = None
        if autodiff:

            def cut(x: Array, size: int) -> list[list[Array]]:
                return [B.split(e, size, 2) for e in (B.split(x, 1, 0) if per_element else [x])]

            q, k, v = arrays
            self.pieces = (cut(q, block[0]), cut(k, block[1]), cut(v, block[1]))

    def queries(self, b0: int, b1: int, q0: int, q1: int) -> Array:
        if self.pieces is None:
            return self.arrays[0][b0:b1, :, q0:q1]
        return self.pieces[0][b0 if b1 - b0 == 1 else 0][q0 // self.block[0]]

    def keys(self, b0: int, b1: int, spans: list[tuple[int, int, int]]) -> tuple[Array, Array]:
        """Keys and values of the runs ``spans`` ``(k0, k1, state)``
        (block-aligned), side by side."""
        B = self.B
        if self.pieces is None:
            runs = [[x[b0:b1, :, k0:k1] for k0, k1, _ in spans] for x in self.arrays[1:]]
        else:
            g, size = b0 if b1 - b0 == 1 else 0, self.block[1]
            runs = [
                [p for k0, k1, _ in spans for p in x[g][k0 // size : -(-k1 // size)]]
                for x in self.pieces[1:]
            ]
        keys, values = (r[0] if len(r) == 1 else B.concatenate(r, 2) for r in runs)
        return keys, values


def _kernel_rows(
    B: Backend,
    cuts: _Cuts,
    mask: Mask,
    table: np.ndarray,
    where: tuple[int, int, int, int, int],
    block_k: int,
    scale: float,
    dropout: float,
    finite: bool,
) -> Array | None:
    """One block of queries (batch ``b0..b1``, queries ``q0..q1``, row ``qi``
    of ``table``) through ``fused``, over its runs of visible keys (put side
    by side when there are several); None when the kernel declines or no key
    is visible."""
    b0, b1, q0, q1, qi = where
    spans = _spans(table, b0, qi, mask.num_keys, block_k)
    if not spans or (len(spans) > 1 and mask.bias is not None):
        return None
    subs = [
        Mask(b1 - b0, mask.heads, q1 - q0, k1 - k0)
        if st == blocks.FULL
        else mask.sub(b0, b1, q0, q1, k0, k1, state="some")
        for k0, k1, st in spans
    ]
    ks, vs = cuts.keys(b0, b1, spans)
    if len(spans) == 1:
        sub = subs[0]
    else:
        device = B.device_of(ks)
        heads = 1
        parts = []
        for s in subs:
            part = s.boolean(B, device)
            heads = heads if part is None else max(heads, part.shape[1])
            parts.append(part)
        shape = (b1 - b0, heads, q1 - q0)
        allowed = B.concatenate(
            [
                B.zeros(shape + (s.num_keys,), "bool", device) == 0
                if part is None
                else B.broadcast_to(part, shape + (s.num_keys,))
                for s, part in zip(subs, parts)
            ],
            3,
        )
        sub = Mask(b1 - b0, mask.heads, q1 - q0, int(ks.shape[2]), allowed=allowed)
    args = (cuts.queries(b0, b1, q0, q1), ks, vs, sub, scale)
    return fused(B, *args, dropout=dropout, queries_finite=finite, keys_finite=finite)


PROGRAMMABLE = frozenset(("mod", "score_mod", "segments"))
MIN_SCORES = 4 * DEFAULT_BLOCK * DEFAULT_BLOCK  # fewer (Q x K) scores: one dense call is cheaper


def takes(B: Backend, mask: Mask, path: str, dropout: float, key: Any) -> bool:
    """Whether ``attend`` takes this path: a programmable form is set, the
    path is ``"tiled"`` or ``"auto"``, and for ``"auto"`` the call is large
    enough (or traced on a framework that skips blocks at run time)."""
    if path not in ("auto", "tiled") or not mask.set_fields() & PROGRAMMABLE:
        return False
    if path == "tiled":
        return True
    if dropout and key is not None:  # (jit and eager must draw alike)
        return False
    big = mask.num_queries * mask.num_keys >= MIN_SCORES
    return big or (not mask.known_on_host() and B.runtime_cond)
