"""Programmable masks: ``mask_mod``, ``score_mod`` and ``segment_ids``,
evaluated by the core (FlexAttention's signatures and sense).

- ``mask_mod(b, h, q_idx, kv_idx) -> bool``: True where query ``q_idx`` of
  head ``h`` of batch element ``b`` may see key ``kv_idx``. The arguments are
  int32 arrays of the backend shaped (batch, 1, 1, 1), (1, heads, 1, 1),
  (1, 1, Q, 1) and (1, 1, 1, K), so ordinary operators broadcast them; a
  function may index arrays it closes over (``doc[b, q_idx] == doc[b, kv_idx]``).
- ``score_mod(score, b, h, q_idx, kv_idx) -> score``: the new scaled score
  (after ``bias``); differentiated through.
- ``segment_ids``: (batch, K) ints, or a pair ((batch, Q), (batch, K)): a
  query sees the keys of its own segment; a negative id is padding (such a
  query sees nothing, such a key is seen by nobody).

Indices are positions: ``q_idx`` counts from ``q_base`` (the KV cache's
length when decoding, else 0), ``kv_idx`` from 0. A block of a ``Mask``
(``Mask.sub``) keeps the function and shifts the bases, so every path
evaluates the same function on its own block's grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .checks import check_array

if TYPE_CHECKING:
    from backends import Backend

    from ..types import Array, BackendLike, DeviceLike
    from .masking import Mask


def index_grid(B: Backend, mask: Any, device: Any) -> tuple[Array, ...]:
    """``(b, h, q_idx, kv_idx)`` int32 arrays broadcasting to the mask's
    (batch, heads, Q, K), positions counted from its bases."""
    b = B.arange(mask.batch, device).reshape((mask.batch, 1, 1, 1)) + mask.b_base
    h = B.arange(mask.heads, device).reshape((1, mask.heads, 1, 1))
    q = B.arange(mask.num_queries, device).reshape((1, 1, mask.num_queries, 1)) + mask.q_base
    kv = B.arange(mask.num_keys, device).reshape((1, 1, 1, mask.num_keys)) + mask.k_base
    if B.dense_index_grids:  # (boolean operators there do not broadcast)
        shape = (mask.batch, mask.heads, mask.num_queries, mask.num_keys)
        return tuple(B.broadcast_to(x, shape) for x in (b, h, q, kv))
    return b, h, q, kv


def _as_bool(B: Backend, x: Any, device: Any) -> Array:
    """A mask_mod's answer as a bool array of rank 4."""
    if not B.is_array(x):
        x = B.asarray(np.asarray(x, bool), device=device)
    if B.dtype_name(x) != "bool":
        x = B.astype(x, "bool")
    while len(x.shape) < 4:
        x = x.reshape((1,) + tuple(x.shape))
    return x


def visible(B: Backend, mask: Mask, device: Any) -> Array | None:
    """bool broadcastable to (batch, heads, Q, K): what ``mask_mod`` and
    ``segment_ids`` allow (None when neither is set)."""
    out = None
    if mask.mod is not None:
        out = _as_bool(B, mask.mod(*index_grid(B, mask, device)), device)
    if mask.segments is not None:
        qs, ks = mask.segments
        nq, nk = qs.shape[1], ks.shape[1]
        qs4 = qs.reshape((qs.shape[0], 1, nq, 1))
        same = B.logical_and(qs4 == ks.reshape((ks.shape[0], 1, 1, nk)), qs4 >= 0)
        out = same if out is None else B.logical_and(out, same)
    if out is not None and out.shape[-1] != mask.num_keys:  # (a function of q_idx alone)
        out = B.broadcast_to(out, tuple(out.shape[:-1]) + (mask.num_keys,))
    return out


def apply_score_mod(B: Backend, mask: Any, s: Array, work: str) -> Array:
    """``score_mod`` applied to the scaled scores ``s`` (batch, heads, Q, K),
    kept in the compute dtype ``work``."""
    if mask.score_mod is None:
        return s
    s = mask.score_mod(s, *index_grid(B, mask, B.device_of(s)))
    return B.astype(s, work) if B.dtype_name(s) != work else s


def check_segments(
    B: Backend, segment_ids: Any, batch: int, num_queries: int, num_keys: int, device: Any
) -> tuple[Array | None, Array]:
    """``(query ids (batch|1, Q), key ids (batch|1, K), host copies or None)``
    int32 from ``segment_ids``: one (batch, K) array (queries take the ids of
    their positions, bottom-right, set by ``make_mask``) or a pair."""
    pair = isinstance(segment_ids, (tuple, list)) and len(segment_ids) == 2
    parts = segment_ids if pair else (None, segment_ids)
    out: list[Array | None] = []
    for name, x, n in (
        ("segment_ids[0] (queries)", parts[0], num_queries),
        ("segment_ids" + ("[1] (keys)" if pair else ""), parts[1], num_keys),
    ):
        if x is None:
            out.append(None)
            continue
        if not B.is_array(x):
            x = B.asarray(np.asarray(x), device=device)
        check_array(B, name, x, 2, f"(batch, {n})")
        if tuple(x.shape) != (batch, n) and tuple(x.shape) != (1, n):
            raise ValueError(
                f"{name} must have shape (batch, {'Q' if n == num_queries and pair else 'K'})"
                f" = ({batch}, {n}), got {tuple(x.shape)}"
            )
        if not B.dtype_name(x).startswith(("int", "uint")):
            raise TypeError(f"{name} must hold integers, got dtype {B.dtype_name(x)}")
        out.append(B.astype(x, "int32") if B.dtype_name(x) != "int32" else x)
    return out[0], out[1]


def query_segments(
    B: Backend, key_ids: Array, num_queries: int, offset: int | Array, device: Any
) -> Array:
    """The ids of the queries from the keys' ids when only one array was
    given: query ``i`` sits at key position ``i + offset``."""
    if isinstance(offset, (int, np.integer)):
        return key_ids[:, offset : offset + num_queries]
    return B.take(key_ids, B.arange(num_queries, device) + offset, 1)


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
    from ..config import get_backend, native_device

    B = get_backend(backend)
    return B.asarray(ids, "int32", native_device(B, device))


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


# -- blocks ------------------------------------------------------------------------------


def _host_ranges(ids: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row and block of ``block`` positions: (least id >= 0, largest id,
    all ids >= 0); a block with no id >= 0 gets (big, -1)."""
    n = ids.shape[1]
    nb = -(-n // block)
    pad = np.full((ids.shape[0], nb * block - n), -1, ids.dtype)
    x = np.concatenate([ids, pad], 1).reshape(ids.shape[0], nb, block)
    big = np.iinfo(np.int32).max
    lo = np.where(x >= 0, x, big).min(-1)
    hi = x.max(-1)
    whole = (x >= 0).all(-1)
    if pad.shape[1]:  # the padded tail does not count against "all >= 0"
        whole[:, -1] = (ids[:, (nb - 1) * block :] >= 0).all(-1)
    return lo, hi, whole


def segment_block_state(
    mask: Mask, b0: int, b1: int, q0: int, q1: int, k0: int, k1: int
) -> str | None:
    """From the host copies of the segment ids: ``"none"`` when no query of
    the block shares a segment with a key of it, ``"all"`` when all of them
    are of one segment, else ``"some"``; None when the ids are traced."""
    known = mask.segments_known
    if known is None:
        return None
    qs, ks = known

    def rows(x: Array, a: int, z: int) -> Array:
        return x[b0:b1, a:z] if x.shape[0] > 1 else x[:, a:z]

    q, k = rows(qs, q0, q1), rows(ks, k0, k1)
    qlo, qhi, qall = (a[:, 0] for a in _host_ranges(q, max(1, q.shape[1])))
    klo, khi, kall = (a[:, 0] for a in _host_ranges(k, max(1, k.shape[1])))
    if ((qhi < klo) | (khi < qlo) | (qhi < 0) | (khi < 0)).all():
        return "none"
    one = (qlo == qhi) & (klo == khi) & (qlo == klo) & qall & kall
    return "all" if one.all() else "some"


def segment_key_range(
    mask: Mask, b: int, q0: int, q1: int, start: int, stop: int
) -> tuple[int, int]:
    """Host: the keys ``[start, stop)`` of element ``b`` narrowed to those
    whose segment one of the queries ``[q0, q1)`` has (sorted or not)."""
    known = mask.segments_known
    if known is None or stop <= start:
        return start, stop
    qs, ks = known
    q = qs[b if qs.shape[0] > 1 else 0, q0:q1]
    k = ks[b if ks.shape[0] > 1 else 0, start:stop]
    ids = np.unique(q[q >= 0])
    hit = np.nonzero(np.isin(k, ids))[0] if ids.size else np.zeros(0, np.int64)
    if hit.size == 0:
        return 0, 0
    return start + int(hit[0]), start + int(hit[-1]) + 1


def segment_block_seen(
    B: Backend, mask: Mask, b0: int, b1: int, q0: int, q1: int, k0: int, k1: int
) -> Array:
    """Device bool (0-d): whether a query of the block may share a segment
    with a key of it (min/max of the ids, so work O(block size))."""
    qs, ks = mask.segments

    def rows(x: Array, a: int, z: int) -> Array:
        return x[b0:b1, a:z] if x.shape[0] > 1 else x[:, a:z]

    q, k = rows(qs, q0, q1), rows(ks, k0, k1)
    big = np.iinfo(np.int32).max

    def lo(x: Array) -> Array:
        return -B.max(B.where(x >= 0, -x, -big), 1)

    def hi(x: Array) -> Array:
        return B.max(x, 1)

    ok = B.logical_and(B.logical_and(hi(q) >= lo(k), hi(k) >= lo(q)), hi(q) >= 0)
    return B.any(B.logical_and(ok, hi(k) >= 0))


def make_fields(
    B: Backend,
    batch: int,
    num_queries: int,
    num_keys: int,
    mask_mod: Callable[..., Array] | None,
    score_mod: Callable[..., Array] | None,
    segment_ids: Any,
    offset: int | Array | None,
    device: Any,
) -> dict[str, Any]:
    """The ``Mask`` keywords of the programmable forms (checked); a
    ``BlockMask`` given as ``mask_mod`` is added by ``masking.make_mask``."""
    for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a function, got {type(fn).__name__}")
    fields: dict[str, Any] = {"mod": mask_mod, "score_mod": score_mod}
    if segment_ids is not None:
        qs, ks = check_segments(B, segment_ids, batch, num_queries, num_keys, device)
        if qs is None:
            qs = query_segments(
                B, ks, num_queries, num_keys - num_queries if offset is None else offset, device
            )
        fields["segments"] = (qs, ks)
        if B.is_concrete(qs) and B.is_concrete(ks):
            fields["segments_known"] = (
                B.to_numpy(qs).astype(np.int64),
                B.to_numpy(ks).astype(np.int64),
            )
    fields["bases"] = (0, 0 if offset is None else offset, 0)
    fields["backend"] = B
    return fields
