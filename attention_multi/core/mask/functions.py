"""Programmable forms: ``mask_mod`` and ``score_mod``, functions the core
evaluates on index grids (FlexAttention's signatures and sense).

- ``mask_mod(b, h, q_idx, kv_idx) -> bool``: True where query ``q_idx`` of
  head ``h`` of batch element ``b`` may see key ``kv_idx``. The arguments are
  int32 arrays of the backend shaped (batch, 1, 1, 1), (1, heads, 1, 1),
  (1, 1, Q, 1) and (1, 1, 1, K), so ordinary operators broadcast them; a
  function may index arrays it closes over (``doc[b, q_idx] == doc[b, kv_idx]``).
  A ``BlockMask`` (``block_mask``) carries its states: its empty blocks are
  skipped and its full ones computed without a mask, with no evaluation.
- ``score_mod(score, b, h, q_idx, kv_idx) -> score``: the new scaled score
  (after ``bias``); differentiated through.

Indices are positions: ``q_idx`` counts from the query base (the KV cache's
length when decoding, else 0: flex's), ``kv_idx`` from 0. ``causal=``,
``window=`` and one ``segment_ids`` array place query ``i`` at ``i + K - Q``:
where the two differ (Q < K, no cache) a call may not combine them
(``build.one_query_position``). A region of a mask keeps the function and
shifts the bases, so every path evaluates the same function on its own
block's grid.

Answers are checked like arguments (``checked_mask``, ``checked_scores``) on
every evaluation, from their dtype and shape only (no pass over the values):
None, a ``mask_mod`` answer that is not boolean, or a shape that does not
broadcast to the grid's is an error naming the function and the shapes. A
function that fails on index arrays, or answers with a wrong shape, is
evaluated once per element of the grid by the backend's ``vmap`` (each index
a scalar, as flex evaluates it). NumPy arrays a function captures become
arrays of the backend (``native_captures``).
"""

from __future__ import annotations

import math
import types
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .blocks import BlockMask
from .spec import EMPTY, FULL, PARTIAL, Form, Mask, Region

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array, BackendLike, DeviceLike

Bases = tuple[Any, Any, Any]  # where the grid's batch, query and key indices start


def index_grid(
    xp: Backend, shape: tuple[int, int, int, int], bases: Bases, device: Any
) -> tuple[Array, ...]:
    """``(b, h, q_idx, kv_idx)`` int32 arrays broadcasting to ``shape``
    (batch, heads, Q, K), positions counted from ``bases``."""
    batch, heads, nq, nk = shape
    b = xp.arange(batch, device).reshape((batch, 1, 1, 1)) + bases[0]
    h = xp.arange(heads, device).reshape((1, heads, 1, 1))
    q = xp.arange(nq, device).reshape((1, 1, nq, 1)) + bases[1]
    kv = xp.arange(nk, device).reshape((1, 1, 1, nk)) + bases[2]
    if xp.dense_index_grids:  # (boolean operators there do not broadcast)
        return tuple(xp.broadcast_to(x, shape) for x in (b, h, q, kv))
    return b, h, q, kv


def as_bool(xp: Backend, x: Any, device: Any) -> Array:
    """A mask_mod's answer as a bool array of rank 4."""
    if not xp.is_array(x):
        x = xp.asarray(np.asarray(x, bool), device=device)
    if xp.dtype_name(x) != "bool":
        x = xp.astype(x, "bool")
    while len(x.shape) < 4:
        x = x.reshape((1,) + tuple(x.shape))
    return x


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (no axis of the target grows)."""
    if len(shape) > len(target):
        return False
    return all(n in (1, t) for n, t in zip(shape[::-1], target[::-1]))


class _WrongShape(Exception):
    """An answer whose shape does not broadcast to the grid's."""


def _mask_answer(xp: Backend, out: Any, shape: tuple[int, ...], device: Any) -> Array:
    """A ``mask_mod`` answer checked (TypeError: not boolean; _WrongShape) and
    made a rank-4 bool array."""
    if out is None:
        raise TypeError(
            f"mask_mod returned None; it must return booleans broadcasting to (batch, heads, "
            f"Q, K) = {shape} (a missing return?)"
        )
    if isinstance(out, (bool, np.bool_)):
        return as_bool(xp, out, device)
    if xp.is_array(out):
        dtype = xp.dtype_name(out)
    elif isinstance(out, np.ndarray):
        dtype = out.dtype.name
    else:
        raise TypeError(f"mask_mod must return a boolean array, got {type(out).__name__}")
    if dtype != "bool":
        raise TypeError(
            f"mask_mod must return booleans (True: may attend), got dtype {dtype}; "
            "compare to make a mask (x != 0), or give scores to score_mod"
        )
    if not _broadcasts(tuple(out.shape), shape):
        raise _WrongShape(f"mask_mod returned shape {tuple(out.shape)}")
    return as_bool(xp, out, device)


def _score_answer(xp: Backend, out: Any, shape: tuple[int, ...]) -> Array:
    """A ``score_mod`` answer checked (TypeError: not an array; _WrongShape:
    not the shape of the scores)."""
    if out is None:
        raise TypeError(
            f"score_mod returned None; it must return the scores, shape {shape} (a missing return?)"
        )
    if not xp.is_array(out):
        raise TypeError(f"score_mod must return an array of scores, got {type(out).__name__}")
    if tuple(out.shape) != shape:  # (one that broadcasts would copy a row's scores)
        raise _WrongShape(f"score_mod returned shape {tuple(out.shape)}, not the scores' {shape}")
    return out


def _evaluated(
    xp: Backend,
    name: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    shape: tuple[int, ...],
    answer: Callable[[Any], Array],
) -> Array:
    """``answer(fn(*args))`` on index arrays broadcasting to ``shape``; a
    function that fails on them or answers with a wrong shape (one written
    for scalar indices) is mapped over the grid's elements by ``xp.vmap``."""
    try:
        return answer(fn(*args))
    except _WrongShape as exc:
        why: BaseException = exc
    except TypeError as exc:
        if str(exc).startswith(name):  # (our own check: no second try)
            raise
        why = exc
    except Exception as exc:  # noqa: BLE001 (the framework's complaint, said again below)
        why = exc
    grids = ", ".join(str(tuple(a.shape)) for a in args if hasattr(a, "shape"))
    said = f"{name} failed on arguments of shapes {grids} (broadcasting to {shape}): {why}"
    mapped = xp.vmap(fn)
    if mapped is None:
        raise ValueError(
            f"{said}; a function written for scalar indices needs a vmap, which the "
            f"{xp.name} backend lacks: write it for index arrays"
        ) from why
    flat = tuple(xp.broadcast_to(a, shape).reshape((-1,)) for a in args)
    try:
        out = mapped(*flat)
    except Exception as exc:
        raise ValueError(f"{said}; evaluated per element (vmap): {exc}") from why
    if out is None or not xp.is_array(out) or math.prod(out.shape) != math.prod(shape):
        got = None if out is None else getattr(out, "shape", type(out).__name__)
        raise ValueError(
            f"{said}; evaluated per element (vmap) it answered {got}, not one value per "
            f"element of {shape}"
        ) from why
    return answer(out.reshape(shape))


def checked_mask(
    xp: Backend, mask_mod: Callable[..., Any], grid: tuple[Array, ...], device: Any
) -> Array:
    """``mask_mod(*grid)`` checked: a rank-4 bool array broadcasting to the grid."""
    b, h, q, kv = grid  # (b varies along axis 0, h along 1, ...)
    shape = (int(b.shape[0]), int(h.shape[1]), int(q.shape[2]), int(kv.shape[3]))
    return _evaluated(
        xp, "mask_mod", mask_mod, grid, shape, lambda out: _mask_answer(xp, out, shape, device)
    )


def checked_scores(
    xp: Backend, score_mod: Callable[..., Any], s: Array, grid: tuple[Array, ...]
) -> Array:
    """``score_mod(s, *grid)`` checked: scores of the shape of ``s``."""
    shape = tuple(s.shape)
    return _evaluated(
        xp, "score_mod", score_mod, (s, *grid), shape, lambda out: _score_answer(xp, out, shape)
    )


def native_captures(xp: Backend, name: str, fn: Any, device: Any) -> Any:
    """``fn`` with the NumPy arrays it captures (closure variables, default
    arguments, the globals it names) as arrays of ``xp`` on ``device``; ``fn``
    itself when it captures none, or when ``xp`` takes NumPy arrays."""
    if not isinstance(fn, types.FunctionType) or xp.is_array(np.zeros(0)):
        return fn
    code, cells, defaults = fn.__code__, fn.__closure__ or (), fn.__defaults__ or ()
    held = {}
    for var, cell in zip(code.co_freevars, cells):
        try:
            held[var] = cell.cell_contents
        except ValueError:  # (an empty cell: a name bound later)
            continue
    names = [n for n in code.co_names if isinstance(fn.__globals__.get(n), np.ndarray)]
    if not (
        names
        or any(isinstance(x, np.ndarray) for x in held.values())
        or any(isinstance(x, np.ndarray) for x in defaults)
    ):
        return fn

    def native(var: str, x: Any) -> Any:
        if not isinstance(x, np.ndarray):
            return x
        try:
            return xp.asarray(x, device=device)
        except Exception as exc:
            raise TypeError(
                f"{name} captures the NumPy array {var!r} (dtype {x.dtype}, shape {x.shape}), "
                f"which the {xp.name} backend cannot hold ({exc}); capture a {xp.name} array"
            ) from exc

    new_cells = tuple(
        types.CellType(native(var, held[var])) if var in held else cell
        for var, cell in zip(code.co_freevars, cells)
    )
    space = fn.__globals__
    if names:
        space = {**space, **{n: native(n, space[n]) for n in names}}
    argnames = code.co_varnames[code.co_argcount - len(defaults) : code.co_argcount]
    new_defaults = tuple(native(a, d) for a, d in zip(argnames, defaults)) or None
    out = types.FunctionType(code, space, fn.__name__, new_defaults, new_cells or None)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def _ints(*xs: Any) -> bool:
    return all(isinstance(x, (int, np.integer)) for x in xs)


def _shape(mask: Mask) -> tuple[int, int, int, int]:
    return (mask.batch, mask.heads, mask.num_queries, mask.num_keys)


def _shifted(bases: Bases, r: Region) -> Bases:
    return (bases[0] + r.b0, bases[1] + r.q0, bases[2] + r.k0)


class MaskMod(Form):
    """``mask_mod`` (a function, or a ``BlockMask``, which is callable) with
    the ``bases`` of its grid; ``xp`` evaluates it for block states."""

    kind = "mask_mod"
    cuts_traced = True

    def __init__(self, mask_mod: Callable[..., Array], bases: Bases, xp: Backend | None) -> None:
        self.mask_mod, self.bases, self.xp = mask_mod, bases, xp
        self.block_mask = mask_mod if isinstance(mask_mod, BlockMask) else None

    def _at(self, mask: Mask, r: Region) -> tuple[tuple[int, int, int, int], Bases]:
        """The shape and bases of a region's grid."""
        return (r.b1 - r.b0, mask.heads, r.q1 - r.q0, r.k1 - r.k0), _shifted(self.bases, r)

    def visible(self, xp: Backend, mask: Mask, device: Any) -> Array:
        grid = index_grid(xp, _shape(mask), self.bases, device)
        return checked_mask(xp, self.mask_mod, grid, device)

    def seen(self, xp: Backend, mask: Mask, r: Region, device: Any) -> Array:
        shape, bases = self._at(mask, r)
        return xp.any(checked_mask(xp, self.mask_mod, index_grid(xp, shape, bases, device), device))

    def region_state(self, mask: Mask, r: Region) -> int:
        bm = self.block_mask
        if bm is not None:
            if not _ints(self.bases[1], self.bases[2]):
                return PARTIAL
            b, q, k = self.bases
            return bm.lookup(b + r.b0, b + r.b1, q + r.q0, q + r.q1, k + r.k0, k + r.k1)
        xp = self.xp
        if xp is None:
            return PARTIAL
        shape, bases = self._at(mask, r)
        v = checked_mask(xp, self.mask_mod, index_grid(xp, shape, bases, None), None)
        if not xp.is_concrete(v):
            return PARTIAL
        v = xp.to_numpy(v)
        return EMPTY if not v.any() else FULL if v.all() else PARTIAL

    def states(self, mask: Mask, block_q: int, block_k: int) -> np.ndarray:
        """(batch|1, Q blocks, K blocks) states, the union over heads."""
        nqb, nkb = -(-mask.num_queries // block_q), -(-mask.num_keys // block_k)
        bm = self.block_mask
        if (
            bm is not None
            and (bm.block_q, bm.block_k) == (block_q, block_k)
            and self.bases == (0, 0, 0)
        ):
            s = bm.states
            s = (s[: mask.batch] if s.shape[0] > 1 else s)[:, :, :nqb]
        else:
            xp = self.xp
            if xp is None or not _ints(*self.bases):
                return np.full((1, nqb, nkb), PARTIAL, np.int8)
            probe = checked_mask(
                xp, self.mask_mod, index_grid(xp, (1, 1, 1, 1), (0, 0, 0), None), None
            )
            if xp.is_array(probe) and not xp.is_concrete(probe):  # traced closures
                return np.full((1, nqb, nkb), PARTIAL, np.int8)
            s = evaluate(xp, self.mask_mod, _shape(mask), block_q, block_k, None, self.bases)
        empty = (s == EMPTY).all(1)
        full = (s == FULL).all(1)
        return np.where(empty, EMPTY, np.where(full, FULL, PARTIAL)).astype(np.int8)

    def region(self, mask: Mask, r: Region) -> Form:
        return MaskMod(self.mask_mod, _shifted(self.bases, r), self.xp)


class ScoreMod(Form):
    """``score_mod`` with the ``bases`` of its grid: it changes scores, and
    hides nothing."""

    kind = "score_mod"
    restricts = False
    cuts_traced = True

    def __init__(self, score_mod: Callable[..., Array], bases: Bases) -> None:
        self.score_mod, self.bases = score_mod, bases

    def scores(self, xp: Backend, mask: Mask, s: Array, work: str) -> Array:
        grid = index_grid(xp, _shape(mask), self.bases, xp.device_of(s))
        s = checked_scores(xp, self.score_mod, s, grid)
        return xp.astype(s, work) if xp.dtype_name(s) != work else s

    def region(self, mask: Mask, r: Region) -> Form:
        return ScoreMod(self.score_mod, _shifted(self.bases, r))


# -- block states of a mask_mod, evaluated on whole block rows ------------------------------


# Block rows evaluated together when framework calls cost more than elements
# (a busy machine: torch's parallel regions wait), in calls per evaluation
# (the function's, the reductions'), and at most this many elements at once.
_CALLS, _MOST = 8, 1 << 23


def evaluate(
    xp: Backend,
    mask_mod: Callable[..., Array],
    shape: tuple[int, int, int, int],
    bq: int,
    bk: int,
    dev: Any,
    bases: Bases = (0, 0, 0),
) -> np.ndarray:
    """int8 (batch|1, heads|1, Q blocks, K blocks) states of ``mask_mod``,
    evaluated on whole block rows (bq x K indices, one or a few at a time):
    per key of a block row, whether some query sees it and whether all do;
    then per block."""
    batch, heads, num_queries, num_keys = shape
    nqb, nkb = -(-num_queries // bq), -(-num_keys // bk)
    width = nkb * bk
    kv = xp.arange(width, dev).reshape((1, 1, 1, width))
    if width > num_keys:  # (a last block of keys past K: a function may index arrays)
        kv = xp.where(kv < num_keys, kv, num_keys - 1)
    kv = kv + bases[2]
    b = xp.arange(batch, dev).reshape((batch, 1, 1, 1)) + bases[0]
    h = xp.arange(heads, dev).reshape((1, heads, 1, 1))
    whole = num_queries // bq  # (block rows with no query past Q)
    per_row = batch * heads * bq * width
    m = max(1, min(int(_CALLS * xp.call_cost()), _MOST) // per_row)
    groups = [(i, min(m, whole - i)) for i in range(0, whole, m)]
    groups += [(whole, 1)] if whole < nqb else []

    def group(g: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """(b|1, h|1, rows, keys) of ``rows`` block rows from row ``i``:
        whether some query of the row sees each key, whether all do."""
        i, rows = g
        q = xp.arange(rows * bq, dev).reshape((1, 1, rows * bq, 1)) + i * bq
        n = min(rows * bq, num_queries - i * bq)  # (a last row may end before bq)
        if n < rows * bq:
            q = xp.where(q < num_queries, q, num_queries - 1)
        grid = (b, h, q + bases[1], kv)
        if xp.dense_index_grids:  # (boolean operators there do not broadcast)
            grid = tuple(xp.broadcast_to(x, (batch, heads, rows * bq, width)) for x in grid)
        # (torch reduces bytes ~7x faster than booleans)
        v = xp.astype(checked_mask(xp, mask_mod, grid, dev), "uint8")
        if v.shape[2] > n:
            v = v[:, :, :n]
        at = (v.shape[0], v.shape[1], rows, width)
        if v.shape[2] > 1 and rows > 1:  # (whole rows only)
            v = v.reshape((at[0], at[1], rows, bq, v.shape[3]))
        some, every = (xp.to_numpy(f(v, -2)) for f in (xp.max, xp.min))
        some, every = (
            np.broadcast_to(x.reshape(at[:2] + (-1, x.shape[-1])), at) for x in (some, every)
        )
        return some, every

    done = zip(*xp.parallel_map(group, groups))
    # (b|1, h|1, Q blocks, K blocks, bk); keys past K are seen by none and by all
    some, every = (np.concatenate(x, 2).reshape(x[0].shape[:2] + (nqb, nkb, bk)) for x in done)
    pad = np.arange(width).reshape(nkb, bk) >= num_keys
    seen = np.any(some & ~pad, 4)
    full = np.all(every | pad, 4)
    return np.where(seen, np.where(full, FULL, PARTIAL), EMPTY).astype(np.int8)


def _split(block: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(block, (tuple, list)):
        return int(block[0]), int(block[1])
    return int(block), int(block)


def block_mask(
    mask_mod: Callable[..., Array],
    batch: int | None,
    heads: int | None,
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
    block row (block_q x K indices) at a time (a few where calls cost more,
    on a busy machine), on ``backend`` (default: the current one); host
    memory is the (batch, heads, blocks) states. ``batch``
    or ``heads`` None is 1, broadcast (flex's)."""
    from ...config import get_backend, native_device

    batch, heads = 1 if batch is None else batch, 1 if heads is None else heads
    xp = get_backend(backend)
    dev = native_device(xp, device)
    bq, bk = _split(block)
    if min(bq, bk) < 1:
        raise ValueError(f"block must be positive, got {block!r}")
    states = evaluate(xp, mask_mod, (batch, heads, num_queries, num_keys), bq, bk, dev)
    return BlockMask(mask_mod, states, (batch, heads, num_queries, num_keys), bq, bk)
