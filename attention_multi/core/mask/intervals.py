"""Lengths, causal and window: each query sees one interval of keys. Query
``i`` sits at key position ``p = i + offset`` (default ``K - Q``: aligned at
the bottom right, as decoding needs) and sees key ``j`` when ``lo <= j < hi``,
``lo = max(0, p - left)``, ``hi = min(K, valid_len, p + 1 if causal, p +
right + 1)`` for ``window = (left, right)``. Kept as integers, not matrices:
a block is skipped, or computed without a mask, from them alone."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Union

import numpy as np

from attention_multi.backends.capabilities import opt

from ..numerics import positions
from .spec import Form, Mask, Region, _sliced, _taken, state_of

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array

SIDE_MAX = 2**30  # window sides while the offset is traced: far past any key, no int32 overflow
Sides = Union[tuple[Union[int, None], ...], None]  # a window's (left, right), None: no limit


@dataclass(frozen=True, eq=False)
class Intervals(Form):
    """``valid_lens`` int32 (batch, 1, Q|1, 1) or None, with its int64 host
    copy ``valid_lens_known`` (None while traced); ``offset`` an int or a 0-d
    int array (traced), ``offset_known`` its host value or None; ``causal``;
    ``window`` (left, right) or None."""

    valid_lens: Any = None
    valid_lens_known: Any = None
    offset: Any = 0
    offset_known: int | None = 0
    causal: bool = False
    window: Sides = None
    kind: ClassVar[str] = "intervals"
    gathers: ClassVar[bool] = True
    cuts_traced: ClassVar[bool] = True

    @property
    def only_lens(self) -> bool:
        return self.valid_lens is not None and not self.causal and self.window is None

    @property
    def only_causal(self) -> bool:
        return self.causal and self.valid_lens is None and self.window is None

    def known(self) -> bool:
        lens_known = self.valid_lens is None or self.valid_lens_known is not None
        offset_read = self.causal or self.window is not None
        return lens_known and not (offset_read and self.offset_known is None)

    def least_length(self, mask: Mask) -> int:
        """The least known length (host)."""
        known = self.valid_lens_known
        return mask._once("least_length", lambda: int(known.min()) if known.size else mask.num_keys)

    def limits(self, p: Any, hi: Any, maximum: Callable, minimum: Callable) -> tuple[Any, Any]:
        """The rule, for query positions ``p`` and lengths ``hi`` (None: no
        lengths), in the array library of ``maximum`` and ``minimum``: ``(lo,
        hi)``, ``lo = max(0, p - left)`` (None without a left side), ``hi``
        capped by ``p + 1`` if causal and ``p + right + 1``."""
        left, right = (None, None) if self.window is None else self.window
        ends = ([p + 1] if self.causal else []) + ([] if right is None else [p + (right + 1)])
        for end in ends:
            hi = end if hi is None else minimum(hi, end)
        return (None if left is None else maximum(p - left, 0)), hi

    # -- on the device ------------------------------------------------------------------
    def bounds(self, xp: Backend, mask: Mask, device: Any) -> tuple[Array | None, Array]:
        """``(lo or None, hi)`` int32 arrays broadcastable to (batch, 1, Q, 1)."""
        lo, hi = None, self.valid_lens
        if self.causal or self.window is not None:
            q = mask.num_queries
            p = opt(xp).reshape(xp.arange(q, device), (1, 1, q, 1)) + self.offset
            lo, hi = self.limits(p, hi, lambda a, b: xp.where(a > b, a, b), xp.minimum)
        if hi is None:
            hi = xp.zeros((1, 1, 1, 1), "int32", device) + mask.num_keys
        return lo, hi

    def visible(self, xp: Backend, mask: Mask, device: Any) -> Array | None:
        if sees_all(mask):
            return None
        lo, hi = self.bounds(xp, mask, device)
        j = positions(xp, mask.num_keys, device)
        return j < hi if lo is None else xp.logical_and(j >= lo, j < hi)

    def host_visible(self, mask: Mask) -> np.ndarray | bool | None:
        known = host_bounds(mask)
        if known is None:
            return None
        if sees_all(mask):
            return True
        nk = mask.num_keys
        lo, hi = (np.clip(x, 0, nk).astype(np.int32).reshape((x.shape[0], 1, -1, 1)) for x in known)
        # (lo <= j < hi as one unsigned comparison: j - lo wraps below lo)
        width = np.maximum(hi - lo, 0).view(np.uint32)
        return (np.arange(nk, dtype=np.int32) - lo).view(np.uint32) < width

    def seen(self, xp: Backend, mask: Mask, r: Region, device: Any) -> Array:
        lo, hi = self.bounds(xp, mask, device)  # (batch|1, 1, Q|1, 1)
        lo = xp.zeros((1, 1, 1, 1), "int32", device) if lo is None else lo
        lo, hi = _sliced(lo, r, False, xp), _sliced(hi, r, False, xp)
        return xp.any(xp.minimum(hi, r.k1) > xp.where(lo > r.k0, lo, r.k0))

    # -- on the host ---------------------------------------------------------------------
    def region_state(self, mask: Mask, r: Region) -> int:
        lo, hi = host_bounds(mask, r.b0, r.b1, r.q0, r.q1)
        empty = (np.maximum(lo, r.k0) >= np.minimum(hi, r.k1)).all()
        return int(state_of(empty, (lo <= r.k0).all() and (hi >= r.k1).all()))

    def states(self, mask: Mask, block_q: int, block_k: int) -> np.ndarray:
        nq, nk = mask.num_queries, mask.num_keys
        nqb, nkb = -(-nq // block_q), -(-nk // block_k)
        lo, hi = host_bounds(mask)
        batch = max(lo.shape[0], hi.shape[0])
        lo, hi = (np.clip(np.broadcast_to(x, (batch, nq)), 0, nk) for x in (lo, hi))
        seen = _intervals_seen(lo, hi, block_q, block_k, nkb)
        pad = ((0, 0), (0, nqb * block_q - nq))  # (rows past Q see every key)
        most_lo = np.pad(lo, pad).reshape(batch, nqb, block_q).max(2)[:, :, None]
        least_hi = np.pad(hi, pad, constant_values=nk).reshape(batch, nqb, block_q).min(2)
        k0 = np.arange(nkb) * block_k
        k1 = np.minimum(k0 + block_k, nk)
        whole = (most_lo <= k0) & (least_hi[:, :, None] >= k1)
        return state_of(~seen, whole)

    def region(self, mask: Mask, r: Region) -> Form:
        lens = _sliced(self.valid_lens, r, False, mask.xp)
        known = _sliced(self.valid_lens_known, r, False) if r.on_host else None  # (else unknown)
        offset_known = self.offset_known if r.on_host else None
        return replace(
            self,
            valid_lens=None if lens is None else lens - r.k0,
            valid_lens_known=None if known is None else known - r.k0,
            offset=self.offset + (r.q0 - r.k0),
            offset_known=None if offset_known is None else offset_known + r.q0 - r.k0,
        )

    def rows(self, xp: Backend, mask: Mask, rows: np.ndarray) -> Form:
        lens, known = (_taken(xp, x, rows) for x in (self.valid_lens, self.valid_lens_known))
        return replace(self, valid_lens=lens, valid_lens_known=known)

    def snapshot(self, xp: Backend) -> Form:
        lens, known = self.valid_lens, self.valid_lens_known
        if lens is None:
            return self
        if known is None:
            return replace(self, valid_lens=opt(xp).snapshot(lens))
        copy = xp.asarray(known.astype(np.int32), device=xp.device_of(lens))  # (no framework read)
        return replace(self, valid_lens=copy)


def window_within(window: Sides, num_queries: int, num_keys: int, offset_known: Any) -> Sides:
    """A window side past every key for every query is no limit (None): positions
    never near 2**31 (int32 wraps); traced offset: sides clamped to ``SIDE_MAX``."""
    if window is None or window == (None, None):
        return window
    if offset_known is None:
        return tuple(None if s is None else min(s, SIDE_MAX) for s in window)
    left, right = window
    # query positions p run over [offset, offset + Q): p - left <= 0 and p + right >= K - 1
    if left is not None and left >= offset_known + num_queries - 1:
        left = None
    if right is not None and right >= num_keys - 1 - offset_known:
        right = None
    return None if left is None and right is None else (left, right)


# -- host planning: the rows' intervals, known on the host --------------------------------
def host_bounds(
    mask: Mask, b0: int = 0, b1: int | None = None, q0: int = 0, q1: int | None = None
) -> Any:  # (lo, hi) or None
    """Host ``(lo, hi)`` int64, broadcastable to (batch block, Q block), of
    the rows' visible keys by their intervals (all keys without any); None
    while traced. Computed once per Mask, then sliced."""
    if not mask.known_on_host():
        return None

    def compute() -> tuple[np.ndarray, np.ndarray]:
        lo, hi = np.zeros((1, 1), np.int64), np.full((1, 1), mask.num_keys, np.int64)
        form = mask.intervals
        if form is None:
            return lo, hi
        if form.valid_lens is not None:
            known = form.valid_lens_known
            hi = np.minimum(hi, known.reshape(known.shape[0], known.shape[2]))
        p = np.arange(mask.num_queries)[None, :] + form.offset_known
        start, hi = form.limits(p, hi, np.maximum, np.minimum)
        return (lo if start is None else start), hi

    rows, cols, every = slice(b0, b1), slice(q0, q1), slice(None)
    return tuple(
        x[rows if x.shape[0] > 1 else every, cols if x.shape[1] > 1 else every]
        for x in mask._once("host_bounds", compute)
    )


def _known_lens(mask: Mask) -> Any:
    """The intervals form when it is lengths alone, known on the host; else None."""
    form = mask.intervals
    return form if form is not None and form.only_lens and mask.known_on_host() else None


def _host_fact(compute: Callable[[Mask], bool]) -> Callable[[Mask], bool]:
    """``compute(mask)`` as a bool, once per Mask (``Mask._once``)."""
    name = compute.__name__

    @functools.wraps(compute)
    def fact(mask: Mask) -> bool:
        return bool(mask._once(name, lambda: compute(mask)))

    return fact


@_host_fact
def sees_all(mask: Mask) -> bool:
    """Known on the host: every row's interval is all the keys."""
    if mask.intervals is None:
        return True
    lens = _known_lens(mask)
    if lens is not None:  # (one reduction, not the rows' intervals)
        return lens.least_length(mask) >= mask.num_keys
    known = host_bounds(mask)
    return known is not None and bool((known[0] <= 0).all() and (known[1] >= mask.num_keys).all())


@_host_fact
def rows_nonempty(mask: Mask) -> bool:
    """Known on the host: every row's interval holds a key."""
    lens = _known_lens(mask)
    if lens is not None:
        return mask.num_keys > 0 and lens.least_length(mask) > 0
    known = host_bounds(mask)
    return known is not None and bool((known[1] > known[0]).all())


@_host_fact
def keys_all_used(mask: Mask) -> bool:
    """Known on the host: each batch element's rows together see every key
    (their intervals overlap or touch: the union is [least lo, last hi))."""
    lens = _known_lens(mask)
    if lens is not None and lens.valid_lens.shape[2] == 1:
        return lens.least_length(mask) >= mask.num_keys
    known = host_bounds(mask)
    if known is None:
        return False
    start, stop = _spans(known[0], known[1], mask.num_keys)
    return bool(((start == 0) & (stop >= mask.num_keys) & (stop > 0)).all())


def _spans(lo: np.ndarray, hi: np.ndarray, num_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Per element of host rows ``[lo, hi)`` (batch, Q): the keys they see lie in
    ``[start, stop)`` ((0, 0): none)."""
    rows = hi > lo
    start = np.where(rows, lo, num_keys).min(axis=1, initial=num_keys)
    stop = np.where(rows, hi, 0).max(axis=1, initial=0)
    empty = stop <= start
    start[empty], stop[empty] = 0, 0
    return start, stop


def key_range(
    mask: Mask, b0: int = 0, b1: int | None = None, q0: int = 0, q1: int | None = None
) -> tuple[int, int]:
    """Host ``(start, stop)``: the keys that any query of the block may see
    lie in ``[start, stop)``; all keys while traced."""
    known = host_bounds(mask, b0, b1, q0, q1)
    if known is None:
        return 0, mask.num_keys
    lo, hi = (x.reshape(1, -1) for x in np.broadcast_arrays(*known))
    start, stop = _spans(lo, hi, mask.num_keys)
    return int(start[0]), int(stop[0])


def element_ranges(mask: Mask, q0: int = 0, q1: int | None = None) -> Any:
    """Host ``(start, stop, whole)`` (batch,) or None while traced: the rows
    ``[q0, q1)`` of each element see keys in ``[start, stop)`` (``(0, 0)``:
    none); ``whole``: each row sees all of them (never, past the intervals)."""
    known = host_bounds(mask, 0, None, q0, q1)
    if known is None:
        return None
    q1 = q1 or mask.num_queries
    lo, hi = (np.broadcast_to(x, (mask.batch, q1 - q0)) for x in known)
    start, stop = _spans(lo, hi, mask.num_keys)
    whole = (lo <= start[:, None]).all(axis=1) & (hi >= stop[:, None]).all(axis=1)
    if any(f.narrows for f in mask.forms):
        for b in range(mask.batch):
            start[b], stop[b] = mask.key_span(b, q0, q1, int(start[b]), int(stop[b]))
    return start, stop, whole & (not mask.dense)


def _intervals_seen(
    lo: np.ndarray, hi: np.ndarray, block_q: int, block_k: int, nkb: int
) -> np.ndarray:
    """bool (batch, Q blocks, K blocks): some row (keys ``[lo, hi)``, (batch, Q))
    of the block sees a key of it. Each row adds 1 to its first block of keys
    and -1 past its last; a running sum counts the rows: work O(Q + blocks)."""
    batch, nq = lo.shape
    nqb, width = -(-nq // block_q), nkb + 1
    cell = (np.arange(batch)[:, None] * nqb + np.arange(nq) // block_q) * width
    rows = hi > lo
    first = cell + np.where(rows, lo // block_k, nkb)  # (an empty row adds and removes at nkb)
    stop = cell + np.where(rows, (hi - 1) // block_k + 1, nkb)
    n = batch * nqb * width
    count = np.bincount(first.ravel(), minlength=n) - np.bincount(stop.ravel(), minlength=n)
    return count.reshape(batch, nqb, width).cumsum(-1)[:, :, :nkb] > 0


# -- the lengths rule without a Mask (the straight line of small calls) ---------------------
def lengths_visible(
    xp: Backend, lens: Array, ndim: int, num_keys: int, device: Any
) -> tuple[Array, Array]:
    """Key ``j`` is visible to a query when below its length (``lens`` (batch,)
    or (batch, Q), integers or whole floats; ``ndim`` the inputs', 3 or 4):
    ``(visible, used)``, bool (batch, [1,] Q|1, K) and (batch, [1,] K, 1)."""
    dtype = xp.dtype_name(lens)
    if dtype == "float32" and num_keys > 2**24:  # (positions past 2**24 are not exact there)
        lens, dtype = xp.astype(lens, "int32"), "int32"
    j = positions(xp, num_keys, device, dtype, ndim=1)
    rs, lead = opt(xp).reshape, (1,) * (ndim - 3)
    shape = opt(xp).shape(lens)  # (the batch: known, or known when a trace runs)
    if len(shape) == 1:
        visible = j < rs(lens, shape + lead + (1, 1))
        return visible, rs(visible, shape + lead + (num_keys, 1))
    lens = rs(lens, shape[:1] + lead + (shape[1], 1))
    visible = j < lens
    return visible, rs(j, (num_keys, 1)) < xp.max(lens, -2, keepdims=True)
