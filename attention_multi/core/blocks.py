"""Block bookkeeping of the programmable forms: for a block of queries x a
block of keys, is it empty (skipped), full (computed without a mask) or
partial (computed with the mask's value)?

- ``segment_ids`` answer from integers: the least and largest id of each
  block of queries and of keys (work proportional to Q + K, then to the
  number of blocks).
- A ``mask_mod`` answers by being evaluated on the index grid of one block
  row at a time, reduced per block: ``block_mask`` does it once and the
  ``BlockMask`` is reused across layers and steps; without one, a path
  evaluates the function per block.

States: 0 empty, 1 partial, 2 full.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import mods

if TYPE_CHECKING:
    from backends import Backend

    from ..types import Array, BackendLike, DeviceLike
    from .masking import Mask

BLOCK_FIELDS = frozenset(("mod", "segments"))  # the value forms classified here
EMPTY, PARTIAL, FULL = 0, 1, 2
_NAMES = {EMPTY: "none", PARTIAL: "some", FULL: "all"}


class BlockMask:
    """A ``mask_mod`` and its block states (``states`` int8 (batch|1,
    heads|1, Q blocks, K blocks)) over (batch, heads, Q, K) with blocks of
    ``block_q`` x ``block_k``. Callable as the ``mask_mod`` itself: pass it as
    ``mask_mod=`` and the paths skip its empty blocks and drop the mask on its
    full ones."""

    def __init__(
        self,
        mask_mod: Callable[..., Array],
        states: np.ndarray,
        shape: tuple[int, int, int, int],
        block_q: int,
        block_k: int,
    ) -> None:
        self.mask_mod, self.states = mask_mod, states
        self.batch, self.heads, self.num_queries, self.num_keys = shape
        self.block_q, self.block_k = block_q, block_k

    def __call__(self, b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
        return self.mask_mod(b, h, q_idx, kv_idx)

    @property
    def sparsity(self) -> float:
        """The share of blocks that are empty (as FlexAttention's ``BlockMask.sparsity``)."""
        return float((self.states == EMPTY).mean())

    def __repr__(self) -> str:
        return (
            f"BlockMask(shape={(self.batch, self.heads, self.num_queries, self.num_keys)}, "
            f"block=({self.block_q}, {self.block_k}), sparsity={self.sparsity:.3f})"
        )

    def check(self, batch: int, num_queries: int, num_keys: int) -> None:
        if self.num_keys != num_keys or self.batch not in (1, batch):
            raise ValueError(
                f"the BlockMask was built for batch {self.batch} and {self.num_keys} keys; "
                f"this call has batch {batch} and {num_keys} keys"
            )
        if num_queries > self.num_queries:
            raise ValueError(
                f"the BlockMask was built for {self.num_queries} queries; this call has "
                f"{num_queries}"
            )

    def lookup(self, b0: int, b1: int, q0: int, q1: int, k0: int, k1: int) -> int:
        """The state of the covering blocks of a region (global positions)."""
        s = self.states
        b = slice(b0, b1) if s.shape[0] > 1 else slice(None)
        region = s[
            b,
            :,
            q0 // self.block_q : -(-q1 // self.block_q),
            k0 // self.block_k : -(-k1 // self.block_k),
        ]
        if (region == EMPTY).all():
            return EMPTY
        return FULL if (region == FULL).all() else PARTIAL


def _split(block: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(block, (tuple, list)):
        return int(block[0]), int(block[1])
    return int(block), int(block)


def block_mask(
    mask_mod: Callable[..., Array],
    batch: int,
    heads: int,
    num_queries: int,
    num_keys: int,
    *,
    block: int | tuple[int, int] = 128,
    backend: BackendLike | None = None,
    device: DeviceLike | None = None,
) -> BlockMask:
    """A reusable ``BlockMask`` of ``mask_mod`` over (batch, heads, Q, K),
    blocks of ``block`` (an int or (queries, keys)); ``batch`` or ``heads``
    may be 1 when the function ignores them. The function is evaluated on one
    block row (block_q x K indices) at a time, on ``backend`` (default: the
    current one); host memory is the (batch, heads, blocks) states."""
    from ..config import get_backend, native_device

    B = get_backend(backend)
    dev = native_device(B, device)
    bq, bk = _split(block)
    if min(bq, bk) < 1:
        raise ValueError(f"block must be positive, got {block!r}")
    states = _evaluate(B, mask_mod, (batch, heads, num_queries, num_keys), bq, bk, dev)
    return BlockMask(mask_mod, states, (batch, heads, num_queries, num_keys), bq, bk)


def _evaluate(
    B: Backend,
    mask_mod: Callable[..., Array],
    shape: tuple[int, int, int, int],
    bq: int,
    bk: int,
    dev: Any,
    bases: tuple[Any, Any, Any] = (0, 0, 0),
) -> np.ndarray:
    """int8 (batch|1, heads|1, Q blocks, K blocks) states of ``mask_mod``,
    evaluated one block row (bq x K indices) at a time."""
    batch, heads, num_queries, num_keys = shape
    nqb, nkb = -(-num_queries // bq), -(-num_keys // bk)
    width = nkb * bk
    padded = width > num_keys  # (a last block of keys past K)
    kv = B.arange(width, dev).reshape((1, 1, 1, width))
    col_ok = kv < num_keys
    kv = B.where(col_ok, kv, num_keys - 1) + bases[2]  # (padding: a function may index arrays)
    b = B.arange(batch, dev).reshape((batch, 1, 1, 1)) + bases[0]
    h = B.arange(heads, dev).reshape((1, heads, 1, 1))
    rows = []
    for i in range(nqb):
        q = B.arange(bq, dev).reshape((1, 1, bq, 1)) + i * bq
        ok = None  # (only a row with padding needs it: the last one, or every one)
        if padded or (i + 1) * bq > num_queries:
            ok = B.logical_and(q < num_queries, col_ok)
            q = B.where(q < num_queries, q, num_queries - 1)
        grid = (b, h, q + bases[1], kv)
        if B.dense_index_grids:  # (boolean operators there do not broadcast)
            grid = tuple(B.broadcast_to(x, (batch, heads, bq, width)) for x in grid)
        v = mods._as_bool(B, mask_mod(*grid), dev)
        v = B.broadcast_to(v, (v.shape[0], v.shape[1], bq, width))
        if ok is not None:
            v = B.logical_and(v, ok)
        # (a sum of booleans, then exact integers: one pass over the row)
        seen = B.astype(B.sum(v.reshape((v.shape[0], v.shape[1], bq, nkb, bk)), 4), "int32")
        rows.append(B.to_numpy(B.sum(seen, 2)))
    counts = np.stack(rows, 2)  # (b|1, h|1, nqb, nkb)
    qn = np.minimum(bq, num_queries - np.arange(nqb) * bq)
    kn = np.minimum(bk, num_keys - np.arange(nkb) * bk)
    size = qn[:, None] * kn[None, :]
    return np.where(counts == 0, EMPTY, np.where(counts == size, FULL, PARTIAL)).astype(np.int8)


# -- states of a Mask's blocks --------------------------------------------------------------


def _mod_state(mask: Mask, b0: int, b1: int, q0: int, q1: int, k0: int, k1: int) -> int | None:
    """State of ``mask.mod`` on a block (None: cannot tell on the host)."""
    bm = mask.blocks
    if bm is not None:
        if not all(isinstance(x, (int, np.integer)) for x in (mask.q_base, mask.k_base)):
            return None
        b = mask.b_base
        return bm.lookup(
            b + b0, b + b1, mask.q_base + q0, mask.q_base + q1, mask.k_base + k0, mask.k_base + k1
        )
    B = mask.backend
    if B is None:
        return None
    sub = _region(mask, b0, b1, q0, q1, k0, k1)
    v = mods._as_bool(B, mask.mod(*mods.index_grid(B, sub, None)), None)
    if not B.is_concrete(v):
        return None
    v = B.to_numpy(v)
    return EMPTY if not v.any() else FULL if v.all() else PARTIAL


class _Region:
    """The index grid of a block (what ``mods.index_grid`` reads)."""

    def __init__(
        self, batch: int, heads: int, nq: int, nk: int, bases: tuple[Any, Any, Any]
    ) -> None:
        self.batch, self.heads, self.num_queries, self.num_keys = batch, heads, nq, nk
        self.b_base, self.q_base, self.k_base = bases


def _region(mask: Mask, b0: int, b1: int, q0: int, q1: int, k0: int, k1: int) -> _Region:
    return _Region(
        b1 - b0,
        mask.heads,
        q1 - q0,
        k1 - k0,
        (mask.b_base + b0, mask.q_base + q0, mask.k_base + k0),
    )


def extra_state(mask: Mask, b0: int, b1: int, q0: int, q1: int, k0: int, k1: int) -> str:
    """``"none"``/``"all"``/``"some"`` of ``mask_mod`` and ``segment_ids``
    together on a block (host; ``"some"`` when unknown)."""
    cache = mask.__dict__.setdefault("_extra_states", {})
    where = (b0, b1, q0, q1, k0, k1)
    if where in cache:
        return cache[where]
    state = FULL
    if mask.segments is not None:
        seg: Any = mods.segment_block_state(mask, b0, b1, q0, q1, k0, k1)
        seg = PARTIAL if seg is None else {"none": EMPTY, "all": FULL, "some": PARTIAL}[seg]
        state = min(state, seg)
    if mask.mod is not None and state != EMPTY:
        mod = _mod_state(mask, b0, b1, q0, q1, k0, k1)
        state = min(state, PARTIAL if mod is None else mod)
    cache[where] = _NAMES[state]
    return cache[where]


def sub_fields(mask: Mask, b0: int, b1: int, q0: int, q1: int, k0: int, k1: int) -> dict[str, Any]:
    """The programmable fields of ``mask.sub``: the functions kept, the
    segment ids sliced, the bases shifted to the block's start."""
    out: dict[str, Any] = {"mod": mask.mod, "score_mod": mask.score_mod, "blocks": mask.blocks}
    out["backend"] = mask.backend
    out["bases"] = (mask.b_base + b0, mask.q_base + q0, mask.k_base + k0)
    if mask.segments is not None:

        def rows(x: Array, a: int, z: int) -> Array:
            return x[b0:b1, a:z] if x.shape[0] > 1 else x[:, a:z]

        qs, ks = mask.segments
        out["segments"] = (rows(qs, q0, q1), rows(ks, k0, k1))
        if mask.segments_known is not None:
            qk, kk = mask.segments_known
            out["segments_known"] = (rows(qk, q0, q1), rows(kk, k0, k1))
    return out


def host_table(mask: Mask, block_q: int, block_k: int) -> np.ndarray | None:
    """int8 (batch|1, Q blocks, K blocks) states of every block, on the host
    (None while traced): intervals, segments and the mask_mod together, work
    proportional to the number of blocks (a mask_mod without a BlockMask:
    one block row of evaluations at a time)."""
    if not mask.known_on_host():
        return None
    nq, nk = mask.num_queries, mask.num_keys
    nqb, nkb = -(-nq // block_q), -(-nk // block_k)
    k0 = np.arange(nkb) * block_k
    k1 = np.minimum(k0 + block_k, nk)
    states: np.ndarray = np.full((1, nqb, nkb), FULL, np.int8)
    if mask.intervals:
        lo, hi = mask._bounds_known()
        batch = max(lo.shape[0], hi.shape[0])
        lo, hi = (np.clip(np.broadcast_to(x, (batch, nq)), 0, nk) for x in (lo, hi))
        seen = _intervals_seen(lo, hi, block_q, block_k, nkb)
        pad = ((0, 0), (0, nqb * block_q - nq))  # (rows past Q see every key)
        most_lo = np.pad(lo, pad).reshape(batch, nqb, block_q).max(2)[:, :, None]
        least_hi = np.pad(hi, pad, constant_values=nk).reshape(batch, nqb, block_q).min(2)
        whole = (most_lo <= k0) & (least_hi[:, :, None] >= k1)
        states = np.minimum(states, np.where(seen, np.where(whole, FULL, PARTIAL), EMPTY))
    if mask.segments is not None:
        qs, ks = mask.segments_known
        qlo, qhi, qall = mods._host_ranges(qs, block_q)
        klo, khi, kall = mods._host_ranges(ks, block_k)
        qlo, qhi, qall = (x[:, :, None] for x in (qlo, qhi, qall))
        klo, khi, kall = (x[:, None, :] for x in (klo, khi, kall))
        empty = (qhi < klo) | (khi < qlo) | (qhi < 0) | (khi < 0)
        one = (qlo == qhi) & (klo == khi) & (qlo == klo) & qall & kall
        states = np.minimum(states, np.where(empty, EMPTY, np.where(one, FULL, PARTIAL)))
    if mask.mod is not None:
        states = np.minimum(states, _mod_table(mask, block_q, block_k, nqb, nkb, states))
    rest = mask.set_fields() - {"lens", "causal", "window"} - BLOCK_FIELDS
    if rest:
        states = np.minimum(states, PARTIAL)
    return states.astype(np.int8)


def _intervals_seen(
    lo: np.ndarray, hi: np.ndarray, block_q: int, block_k: int, nkb: int
) -> np.ndarray:
    """bool (batch, Q blocks, K blocks): some row of the block of queries sees
    a key of the block of keys, rows seeing keys ``[lo, hi)`` (batch, Q).
    Each row adds 1 to its first block of keys and -1 past its last; a
    running sum then counts the rows on each block: work O(Q + blocks)."""
    batch, nq = lo.shape
    nqb, width = -(-nq // block_q), nkb + 1
    cell = (np.arange(batch)[:, None] * nqb + np.arange(nq) // block_q) * width
    rows = hi > lo
    first = cell + np.where(rows, lo // block_k, nkb)  # (an empty row adds and removes at nkb)
    stop = cell + np.where(rows, (hi - 1) // block_k + 1, nkb)
    n = batch * nqb * width
    count = np.bincount(first.ravel(), minlength=n) - np.bincount(stop.ravel(), minlength=n)
    return count.reshape(batch, nqb, width).cumsum(-1)[:, :, :nkb] > 0


def _mod_table(
    mask: Mask, block_q: int, block_k: int, nqb: int, nkb: int, states: np.ndarray
) -> np.ndarray:
    """(batch|1, nqb, nkb) states of the mask_mod (union over heads)."""
    bm = mask.blocks
    if (
        bm is not None
        and (bm.block_q, bm.block_k) == (block_q, block_k)
        and (mask.b_base, mask.q_base, mask.k_base) == (0, 0, 0)
    ):
        s = bm.states
        b = s[: mask.batch] if s.shape[0] > 1 else s
        empty = (b[:, :, :nqb] == EMPTY).all(1)
        full = (b[:, :, :nqb] == FULL).all(1)
        return np.where(empty, EMPTY, np.where(full, FULL, PARTIAL))
    if mask.backend is None or not all(
        isinstance(x, (int, np.integer)) for x in (mask.b_base, mask.q_base, mask.k_base)
    ):
        return np.full((1, nqb, nkb), PARTIAL)
    B = mask.backend
    shape = (mask.batch, mask.heads, mask.num_queries, mask.num_keys)
    probe = mask.mod(*mods.index_grid(B, _Region(1, 1, 1, 1, (0, 0, 0)), None))
    if B.is_array(probe) and not B.is_concrete(probe):  # traced closures
        return np.full((1, nqb, nkb), PARTIAL)
    s = _evaluate(
        B, mask.mod, shape, block_q, block_k, None, (mask.b_base, mask.q_base, mask.k_base)
    )
    empty = (s == EMPTY).all(1)
    full = (s == FULL).all(1)
    return np.where(empty, EMPTY, np.where(full, FULL, PARTIAL))
