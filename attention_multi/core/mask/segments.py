"""Packed sequences: ``segment_ids``, (batch, K) ints or a pair ((batch, Q),
(batch, K)). A query sees the keys of its own segment; a negative id is
padding (seeing nothing, seen by nobody). A block's state comes from the
least and largest ids of its queries and keys: work O(Q + K + blocks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from attention_multi.backends.capabilities import opt

from .spec import Form, Mask, Region, Where, _cut, _taken, is_int, least_state, state_of

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array, BackendLike, DeviceLike

_BIG = np.iinfo(np.int32).max


class Segments(Form):
    """``query_ids`` (batch|1, Q) and ``key_ids`` (batch|1, K) int32, with
    their int64 host copies ``known`` (None while traced). ``key_start``: a
    traced position where the form's keys start among ``key_ids`` (a block
    of keys cut at a traced position, ``Mask.keys_from``), else None."""

    kind = "segment_ids"
    narrows = gathers = cuts_traced = True

    def __init__(self, query_ids: Array, key_ids: Array, known: Any, key_start: Any = None) -> None:
        self.query_ids, self.key_ids, self.known_ids = query_ids, key_ids, known
        self.key_start = key_start

    def known(self) -> bool:
        return self.known_ids is not None

    def ids(self, xp: Backend, mask: Mask) -> tuple[Array, Array]:
        """The query and key ids of the mask's grid (key ids from ``key_start`` if set)."""
        if self.key_start is None:
            return self.query_ids, self.key_ids
        at = xp.arange(mask.num_keys, xp.device_of(self.key_ids)) + self.key_start
        return self.query_ids, xp.take(self.key_ids, at, 1)

    def visible(self, xp: Backend, mask: Mask, device: Any) -> Array:
        return _same_segment(*self.ids(xp, mask), xp.logical_and, opt(xp).reshape)

    def host_visible(self, mask: Mask) -> np.ndarray | bool | None:
        if self.known_ids is None or self.key_start is not None:
            return None
        qs, ks = self.known_ids
        return _same_segment(qs, ks, np.logical_and, np.reshape)

    @staticmethod
    def _rows(ids: tuple[Any, Any], r: Region, xp: Backend | None = None) -> tuple[Any, Any]:
        """The query and key ids of the region ``r`` (``xp``: at traced starts)."""
        qs, ks = (x[r.b0 : r.b1] if x.shape[0] > 1 else x for x in ids)
        nq, nk = r.sizes or (None, None)
        return _cut(xp, qs, 1, r.q0, r.q1, nq), _cut(xp, ks, 1, r.k0, r.k1, nk)

    def region_state(self, mask: Mask, r: Region) -> int:
        q, k = self._rows(self.known_ids, r)
        return int(least_state(_states(q, k, max(1, q.shape[1]), max(1, k.shape[1]))))

    def states(self, mask: Mask, block_q: int, block_k: int) -> np.ndarray:
        qs, ks = self.known_ids
        return _states(qs, ks, block_q, block_k)

    def seen(self, xp: Backend, mask: Mask, r: Region, device: Any) -> Array:
        """From the least and largest ids: work O(block size)."""
        q, k = self._rows(self.ids(xp, mask), r)
        qlo, klo = (-xp.max(xp.where(x >= 0, -x, -_BIG), 1) for x in (q, k))
        qhi, khi = xp.max(q, 1), xp.max(k, 1)
        ok = xp.logical_and(xp.logical_and(qhi >= klo, khi >= qlo), qhi >= 0)
        return xp.any(xp.logical_and(ok, khi >= 0))

    def key_span(
        self, mask: Mask, b: int, q0: int, q1: int, start: int, stop: int
    ) -> tuple[int, int]:
        """The keys narrowed to those whose segment one of the queries has (sorted or not)."""
        if self.known_ids is None:
            return start, stop
        qs, ks = self.known_ids
        q = qs[b if qs.shape[0] > 1 else 0, q0:q1]
        k = ks[b if ks.shape[0] > 1 else 0, start:stop]
        ids = np.unique(q[q >= 0])
        hit = np.nonzero(np.isin(k, ids))[0] if ids.size else np.zeros(0, np.int64)
        if hit.size == 0:
            return 0, 0
        return start + int(hit[0]), start + int(hit[-1]) + 1

    def region(self, mask: Mask, r: Region) -> Form:
        if self.key_start is not None or (not r.on_host and r.sizes is None):
            # (a traced start of unknown size: the keys are taken when the block's grid is known)
            start = r.k0 if self.key_start is None else self.key_start + r.k0
            qs, ks = self._rows((self.query_ids, self.key_ids), r._replace(k0=0, k1=None))
            return Segments(qs, ks, None, start)
        ids = self._rows((self.query_ids, self.key_ids), r, mask.xp)
        known = None if self.known_ids is None or not r.on_host else self._rows(self.known_ids, r)
        return Segments(ids[0], ids[1], known)

    def rows(self, xp: Backend, mask: Mask, rows: np.ndarray) -> Form:
        known = self.known_ids and tuple(_taken(xp, x, rows) for x in self.known_ids)
        taken = (_taken(xp, self.query_ids, rows), _taken(xp, self.key_ids, rows))
        return Segments(*taken, known, self.key_start)

    def snapshot(self, xp: Backend) -> Form:
        return Segments(
            opt(xp).snapshot(self.query_ids),
            opt(xp).snapshot(self.key_ids),
            self.known_ids,
            self.key_start,
        )


def _same_segment(
    qs: Any, ks: Any, both: Callable[[Any, Any], Any], rs: Callable[[Any, Any], Any]
) -> Any:
    """The rule, for query ids (batch|1, Q) and key ids (batch|1, K) of one
    namespace (``both``: its logical AND): (batch|1, 1, Q, K), the same id
    and not padding."""
    q4 = rs(qs, (qs.shape[0], 1, qs.shape[1], 1))
    return both(q4 == rs(ks, (ks.shape[0], 1, 1, ks.shape[1])), q4 >= 0)


def _states(qs: np.ndarray, ks: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
    """int8 (batch|1, Q blocks, K blocks) states of host query and key ids."""
    qlo, qhi, qall = (x[:, :, None] for x in _host_ranges(qs, block_q))
    klo, khi, kall = (x[:, None, :] for x in _host_ranges(ks, block_k))
    empty = (qhi < klo) | (khi < qlo) | (qhi < 0) | (khi < 0)
    return state_of(empty, (qlo == qhi) & (klo == khi) & (qlo == klo) & qall & kall)


def _host_ranges(ids: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row and block of ``block`` positions: (least id >= 0, largest id,
    all ids >= 0); a block with no id >= 0 gets (big, -1)."""
    n = ids.shape[1]
    nb = -(-n // block)
    pad = np.full((ids.shape[0], nb * block - n), -1, ids.dtype)
    x = np.concatenate([ids, pad], 1).reshape(ids.shape[0], nb, block)
    lo = np.where(x >= 0, x, _BIG).min(-1)
    hi = x.max(-1)
    whole = (x >= 0).all(-1)
    if pad.shape[1]:  # the padded tail does not count against "all >= 0"
        whole[:, -1] = (ids[:, (nb - 1) * block :] >= 0).all(-1)
    return lo, hi, whole


def _is_pair(xp: Backend, segment_ids: Any) -> bool:
    """A pair is a tuple of two arrays; lists (nested or not) are one array
    (a batch of two rows is not a pair); a tuple of two lists is ambiguous."""
    if not isinstance(segment_ids, tuple) or len(segment_ids) != 2:
        return False
    if all(xp.is_array(x) or isinstance(x, np.ndarray) for x in segment_ids):
        return True
    raise TypeError(
        "segment_ids is ambiguous: a tuple of two lists may be two rows or a "
        "(query ids, key ids) pair; give a (batch, K) array, or a pair of two arrays "
        "(np.asarray(query_ids), np.asarray(key_ids))"
    )


def _fits(hosts: list[np.ndarray]) -> bool:
    """Whether every host id fits in int32."""
    return all(h.size == 0 or (h.min() >= -_BIG - 1 and h.max() <= _BIG) for h in hosts)


def _as_int32(hosts: list[np.ndarray]) -> list[np.ndarray]:
    """Host ids as int32, comparing as given: themselves where all fit, else
    their joint ranks."""
    return [h.astype(np.int32) for h in hosts] if _fits(hosts) else _int32_ranks(hosts)


def _int32_ranks(hosts: list[np.ndarray]) -> list[np.ndarray]:
    """Ids as int32 with the same order and equalities (jointly over ``hosts``),
    negative ones -1: hashed 64-bit ids keep their documents apart."""
    ids = np.concatenate([h.reshape(-1) for h in hosts])
    ranks = np.unique(ids[ids >= 0])
    return [np.where(h >= 0, np.searchsorted(ranks, h), -1).astype(np.int32) for h in hosts]


def pair_on_device(xp: Backend, pair: Any, device: Any) -> tuple[Any, Any]:
    """A pair of ids with the host ones (NumPy arrays, lists) as arrays of
    ``xp``, comparing as given: int32 where every host one fits, else their
    joint ranks (``_int32_ranks``); the backend's as they are."""
    hosts = [None if xp.is_array(x) else np.asarray(x) for x in pair]
    for i, h in enumerate(hosts):
        if h is not None and h.dtype.kind not in "iu":
            raise TypeError(f"segment_ids[{i}] must hold integers, got dtype {h.dtype}")
    given = [h for h in hosts if h is not None]
    if len(given) < len(hosts) and not _fits(given):
        raise ValueError(
            "segment_ids past the int32 range as one NumPy array and one of the backend's: "
            "give both alike, so that they are compared exactly"
        )
    made = iter(_as_int32(given))
    a, b = (x if h is None else xp.asarray(next(made), device=device) for x, h in zip(pair, hosts))
    return a, b


def _on_device(xp: Backend, x: Any, ids: np.ndarray, fits: bool, device: Any) -> Array:
    """``x`` itself when it is an int32 array that fits, else ``ids`` uploaded."""
    if fits and xp.is_array(x) and xp.dtype_name(x) == "int32":
        return x
    return xp.asarray(ids, device=device if not xp.is_array(x) else xp.device_of(x))


def _int32_or_64(xp: Backend, x: Array) -> Array:
    return x if xp.dtype_name(x) in ("int32", "int64") else xp.astype(x, "int32")


def make_segments(where: Where, segment_ids: Any = None) -> Segments:
    """The checked form of ``segment_ids``: one (batch, K) array (queries take
    the ids of their positions, ``i + offset``) or a pair. Ids are compared
    exactly whatever their width: int32 on the device when they fit, else
    their ranks (known values) or int64 (traced)."""
    xp, batch, num_queries, num_keys = where.xp, where.batch, where.num_queries, where.num_keys
    offset, device = where.offset, where.device
    pair = _is_pair(xp, segment_ids)
    parts = segment_ids if pair else (None, segment_ids)
    out: list[Any] = []
    for name, x, n in (
        ("segment_ids[0] (queries)", parts[0], num_queries),
        ("segment_ids" + ("[1] (keys)" if pair else ""), parts[1], num_keys),
    ):
        if x is not None:
            if not xp.is_array(x):
                x = np.asarray(x)
                if x.dtype.kind not in "iu":
                    raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
            elif not xp.dtype_name(x).startswith(("int", "uint")):
                raise TypeError(f"{name} must hold integers, got dtype {xp.dtype_name(x)}")
            if len(x.shape) != 2:
                raise ValueError(f"{name} must be 2-D (batch, {n}), got shape {tuple(x.shape)}")
            if tuple(x.shape) != (batch, n) and tuple(x.shape) != (1, n):
                raise ValueError(
                    f"{name} must have shape (batch, {'Q' if n == num_queries and pair else 'K'})"
                    f" = ({batch}, {n}), got {tuple(x.shape)}"
                )
        out.append(x)
    given = [x for x in out if x is not None]
    if all(not xp.is_array(x) or opt(xp).is_concrete(x) for x in given):  # known values
        hosts = [x if isinstance(x, np.ndarray) else xp.to_numpy(x) for x in given]
        fits = _fits(hosts)
        ids = iter(_as_int32(hosts))
        out = [None if x is None else _on_device(xp, x, next(ids), fits, device) for x in out]
    else:  # traced: as wide as given (int64 keeps its values)
        out = [None if x is None else _int32_or_64(xp, x) for x in out]
    qs, ks = out
    if qs is None:
        if is_int(offset):
            qs = ks[:, offset : offset + num_queries]
        else:
            qs = xp.take(ks, xp.arange(num_queries, device) + offset, 1)
    concrete = opt(xp).is_concrete(qs) and opt(xp).is_concrete(ks)
    known = tuple(xp.to_numpy(x).astype(np.int64) for x in (qs, ks)) if concrete else None
    return Segments(qs, ks, known)


def segments_from_lengths(
    lengths: Sequence[Any],
    total: int | None = None,
    backend: BackendLike | None = None,
    device: DeviceLike | None = None,
) -> Array:
    """``segment_ids`` (batch, total) from document lengths: ``lengths`` a
    list (one packed row) or a list of lists (one per row), or FlashAttention's
    ``cu_seqlens`` form via ``segments_from_cu_seqlens``. Positions past the
    last document are padding (-1). ``total`` defaults to the longest row."""
    rows = [lengths] if lengths and np.ndim(lengths[0]) == 0 else list(lengths)
    rows = [[int(n) for n in row] for row in rows]
    if any(n < 0 for row in rows for n in row):
        raise ValueError(f"lengths must be >= 0, got {lengths!r}")
    longest = max((sum(row) for row in rows), default=0)
    total = longest if total is None else int(total)
    if longest > total:
        raise ValueError(f"the documents fill {longest} positions, more than total={total}")
    ids = np.full((len(rows), total), -1, np.int32)
    for r, row in enumerate(rows):
        ids[r, : sum(row)] = np.repeat(np.arange(len(row), dtype=np.int32), row)
    if backend is None:
        return ids
    from ...config import get_backend, native_device

    xp = get_backend(backend)
    return xp.asarray(ids, "int32", native_device(xp, device))


def segments_from_cu_seqlens(
    cu_seqlens: Any,
    total: int | None = None,
    backend: BackendLike | None = None,
    device: DeviceLike | None = None,
) -> Array:
    """``segment_ids`` (1, total) from FlashAttention's cumulative lengths
    ``[0, n0, n0 + n1, ...]`` of documents packed into one row."""
    cu = np.asarray(cu_seqlens, np.int64).reshape(-1)
    if cu.size == 0 or cu[0] != 0 or (np.diff(cu) < 0).any():
        raise ValueError(f"cu_seqlens must start at 0 and not decrease, got {cu.tolist()}")
    return segments_from_lengths(np.diff(cu).tolist(), total, backend, device)
