"""Programmable forms: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and
``score_mod(score, b, h, q_idx, kv_idx) -> score``, functions the core
evaluates on index grids, with FlexAttention's signatures and sense (the
contract: docs/guide/masks.md). The indices are int32 arrays broadcasting to
(batch, heads, Q, K); ``q_idx`` counts from the query base (the KV cache's
length when decoding, else 0), ``kv_idx`` from 0; a region shifts the bases,
so every path evaluates the same function on its own block's grid. Answers
are checked from their dtype and shape on every evaluation (``checked_mask``,
``checked_scores``); a function that fails on index arrays, or answers with a
wrong shape, is evaluated per element by the backend's ``vmap`` (under
torch.compile, from the start); one that fails both ways raises its own
exception, with a note naming the function and the shapes. A
``BlockMask`` carries its block states: no evaluation."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from attention_multi.backends.capabilities import opt

from .blocks import BlockMask
from .captures import fingerprint, native_captures, remembered
from .spec import EMPTY, FULL, PARTIAL, Form, Mask, Region, is_int, least_state, state_of

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array, BackendLike, DeviceLike

USED_KEYS = "mask_mod used keys"  # (Mask._once: bool (batch|1, K) from the block states)
Bases = tuple[Any, Any, Any]  # where the grid's batch, query and key indices start
Shape = tuple[int, int, int, int]  # (batch, heads, Q, K)


def index_grid(xp: Backend, shape: Shape, bases: Bases, device: Any) -> tuple[Array, ...]:
    """``(b, h, q_idx, kv_idx)`` int32 arrays broadcasting to ``shape``
    (batch, heads, Q, K), positions counted from ``bases``."""
    host = on_host(xp, *bases)
    b, h, q, kv = (
        positions(xp, n, base, host, device, axis)
        for axis, (n, base) in enumerate(zip(shape, (bases[0], 0, bases[1], bases[2])))
    )
    if opt(xp).dense_index_grids:  # (boolean operators there do not broadcast)
        return tuple(xp.broadcast_to(x, shape) for x in (b, h, q, kv))
    return b, h, q, kv


def on_host(xp: Backend, *bases: Any) -> bool:
    """Whether to make positions on the host: where each new shape costs a
    compilation (eager JAX: no iota, reshape and add to compile per grid)."""
    return opt(xp).compiles_per_shape and is_int(*bases) and not opt(xp).is_tracing()


def positions(
    xp: Backend, n: int, base: Any, host: bool, device: Any, axis: int, last: int = 0
) -> Array:
    """int32 ``base + [0, n)`` along ``axis`` of a rank-4 array; ``last`` > 0:
    positions from ``last`` on are ``last - 1``."""
    shape = [1, 1, 1, 1]
    shape[axis] = n
    if host:
        x = np.minimum(np.arange(n), last - 1) if 0 < last < n else np.arange(n)
        return xp.asarray((x + base).astype(np.int32).reshape(shape), device=device)
    x = opt(xp).reshape(xp.arange(n, device), tuple(shape))
    x = xp.where(x < last, x, last - 1) if 0 < last < n else x
    return x + base if not is_int(base) or base else x


def as_bool(xp: Backend, x: Any, device: Any) -> Array:
    """A mask_mod's answer as a bool array of rank 4."""
    if not xp.is_array(x):
        x = xp.asarray(np.asarray(x, bool), device=device)
    if xp.dtype_name(x) != "bool":
        x = xp.astype(x, "bool")
    while len(x.shape) < 4:
        x = opt(xp).reshape(x, (1,) + tuple(opt(xp).shape(x)))
    return x


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (no axis of the target grows)."""
    if len(shape) > len(target):
        return False
    return all(n in (1, t) for n, t in zip(shape[::-1], target[::-1]))


class _WrongShape(Exception):
    """An answer whose shape does not broadcast to the grid's."""


def _mask_answer(xp: Backend, out: Any, shape: tuple[int, ...], device: Any) -> Array:
    """A ``mask_mod`` answer checked (TypeError, _WrongShape), as a rank-4 bool array."""
    if out is None:
        raise TypeError(
            f"mask_mod returned None; it must return booleans broadcasting to (batch, heads, "
            f"Q, K) = {shape} (a missing return?)"
        )
    if isinstance(out, (bool, np.bool_)):
        return as_bool(xp, out, device)
    if not xp.is_array(out) and not isinstance(out, np.ndarray):
        out = _foreign(xp, out, device)
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


def _foreign(xp: Backend, out: Any, device: Any) -> Any:
    """A mask answer in another framework's arrays (a function that builds
    its own, ``mx.np.array(seg)[b, i]`` on a NumPy call) as ``xp``'s; else as it is."""
    from attention_multi.backends import backend_of_array

    try:
        other = backend_of_array(out)
    except TypeError:
        return out
    return xp.asarray(np.asarray(other.to_numpy(out)), device=device)


def _score_answer(xp: Backend, out: Any, shape: tuple[int, ...]) -> Array:
    """A ``score_mod`` answer checked (TypeError, _WrongShape: not the scores' shape)."""
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
    for scalar indices) is mapped over the grid's elements by ``opt(xp).vmap``
    (FlexAttention's definition: the function of one element). Where the
    host code is traced (torch.compile), a failing framework call ends the
    trace rather than raising, so the function is mapped there from the
    start. A function that fails both ways raises its own exception (the
    one on the arrays), with a note saying which function, on which shapes;
    one whose answer on the arrays has a wrong shape, a ValueError."""
    first: BaseException | None = None
    if not opt(xp).host_code_traced():
        try:
            return answer(fn(*args))
        except TypeError as exc:
            if str(exc).startswith(name):  # (our own check: no second try)
                raise
            first = exc
        except Exception as exc:  # noqa: BLE001 (_WrongShape, or the function's own)
            first = exc

    def one(*element: Any) -> Any:  # (a function: vmap names it, a BlockMask's repr is long)
        return fn(*element)

    mapped = opt(xp).vmap(one)
    grids = [tuple(a.shape) for a in args if hasattr(a, "shape")]  # (no str.join: dynamo)
    said = f"{name} failed on arguments of shapes {grids} (broadcasting to {shape})"
    if mapped is None:
        if first is None or isinstance(first, _WrongShape):
            raise ValueError(
                f"{said}: {first}; a function written for scalar indices needs a vmap, "
                f"which the {xp.name} backend lacks: write it for index arrays"
            ) from first
        first.add_note(f"{said}; the {xp.name} backend has no vmap to try per element")
        raise first
    flat = tuple(opt(xp).reshape(xp.broadcast_to(a, shape), (-1,)) for a in args)
    try:
        out = mapped(*flat)
    except Exception as exc:
        if isinstance(first, _WrongShape):  # (it ran on the arrays: its answer is the bug)
            raise ValueError(
                f"{said}: {first}; evaluated per element (vmap) it raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if first is None:
            exc.add_note(f"raised by {name} evaluated per element (vmap) over {shape}")
            raise
        first.add_note(
            f"{said} (this exception); evaluated per element (vmap) it raised "
            f"{type(exc).__name__}: {exc}"
        )
        raise first from None
    if out is None or not xp.is_array(out) or math.prod(out.shape) != math.prod(shape):
        got = None if out is None else getattr(out, "shape", type(out).__name__)
        raise ValueError(
            f"{said}: {first}; evaluated per element (vmap) it answered {got}, not one "
            f"value per element of {shape}"
        ) from first
    return answer(opt(xp).reshape(out, shape))


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


def _shape(mask: Mask) -> Shape:
    return (mask.batch, mask.heads, mask.num_queries, mask.num_keys)


def _shifted(bases: Bases, r: Region) -> Bases:
    return (bases[0] + r.b0, bases[1] + r.q0, bases[2] + r.k0)


class MaskMod(Form):
    """``mask_mod`` (a function or a ``BlockMask``) at ``bases``; ``xp`` evaluates
    block states on ``device`` (the call's: the function may capture arrays there)."""

    kind = "mask_mod"
    cuts_traced = True

    def __init__(
        self,
        mask_mod: Callable[..., Array],
        bases: Bases,
        xp: Backend | None,
        device: Any = None,
        call: dict[str, Any] | None = None,
    ) -> None:
        self.mask_mod, self.bases, self.xp, self.device = mask_mod, bases, xp, device
        self.block_mask = mask_mod if isinstance(mask_mod, BlockMask) else None
        self.call = {} if call is None else call  # (shared by its regions: one call's)

    def _on(self, xp: Backend, mask: Mask, r: Region, device: Any) -> Array:
        """The function's checked answer on the grid of the region ``r``."""
        shape = (r.b1 - r.b0, mask.heads, r.q1 - r.q0, r.k1 - r.k0)
        grid = index_grid(xp, shape, _shifted(self.bases, r), device)
        return checked_mask(xp, self.mask_mod, grid, device)

    def visible(self, xp: Backend, mask: Mask, device: Any) -> Array:
        def make() -> Array:
            grid = index_grid(xp, _shape(mask), self.bases, device)
            return checked_mask(xp, self.mask_mod, grid, device)

        bm = self.block_mask
        if bm is None or not is_int(*self.bases) or opt(xp).is_tracing():
            return make()
        if "mark" not in self.call:  # (what the function captures: read once a call)
            self.call["mark"] = fingerprint(xp, bm.memo["fn"])  # (as given: NumPy's too)
        key = (xp.name, str(device), _shape(mask), self.bases)
        return remembered(xp, bm.memo, key, self.call["mark"], make)

    def seen(self, xp: Backend, mask: Mask, r: Region, device: Any) -> Array:
        return xp.any(self._on(xp, mask, r, device))

    def region_state(self, mask: Mask, r: Region) -> int:
        (b, q, k), bm = self.bases, self.block_mask
        if bm is not None:
            if not is_int(q, k):
                return PARTIAL
            return bm.lookup(b + r.b0, b + r.b1, q + r.q0, q + r.q1, k + r.k0, k + r.k1)
        xp = self.xp
        if xp is None:
            return PARTIAL
        v = self._on(xp, mask, r, self.device)
        if not opt(xp).is_concrete(v):
            return PARTIAL
        v = xp.to_numpy(v)
        return EMPTY if not v.any() else FULL if v.all() else PARTIAL

    def states(self, mask: Mask, block_q: int, block_k: int) -> np.ndarray:
        """(batch|1, Q blocks, K blocks) states, the union over heads."""
        nqb, nkb = -(-mask.num_queries // block_q), -(-mask.num_keys // block_k)
        bm, xp = self.block_mask, self.xp
        if bm is not None and bm.BLOCK_SIZE == (block_q, block_k) and self.bases == (0, 0, 0):
            s = bm.states[: mask.batch] if bm.states.shape[0] > 1 else bm.states
            return least_state(s[:, :, :nqb], 1)
        unknown = np.full((1, nqb, nkb), PARTIAL, np.int8)
        if xp is None or not is_int(*self.bases):
            return unknown
        found = evaluate(xp, self.mask_mod, _shape(mask), block_q, block_k, self.device, self.bases)
        if found is None:
            return unknown
        mask._once(USED_KEYS, lambda: found[1])  # (rules.used_keys: no second evaluation)
        return least_state(found[0], 1)

    def region(self, mask: Mask, r: Region) -> Form:
        return MaskMod(self.mask_mod, _shifted(self.bases, r), self.xp, self.device, self.call)


class ScoreMod(Form):
    """``score_mod`` at ``bases``: it changes scores and hides nothing."""

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
    shape: Shape,
    bq: int,
    bk: int,
    dev: Any,
    bases: Bases = (0, 0, 0),
) -> tuple[np.ndarray, np.ndarray] | None:
    """int8 (batch|1, heads|1, Q blocks, K blocks) states of ``mask_mod``,
    evaluated on whole block rows (bq x K indices, one or a few at a time):
    per key of a block row, whether some query sees it and whether all do;
    then per block. With them, bool (batch|1, K): whether some query of
    some head sees each key. None when its answers are traced (it captures
    arrays of a trace: known only when the program runs)."""
    batch, heads, num_queries, num_keys = shape
    nqb, nkb = -(-num_queries // bq), -(-num_keys // bk)
    width = nkb * bk
    host = on_host(xp, *bases)
    # (a last block of keys past K: the last key again, as a function may index arrays)
    kv = positions(xp, width, bases[2], host, dev, 3, num_keys)
    b, h = positions(xp, batch, bases[0], host, dev, 0), positions(xp, heads, 0, host, dev, 1)
    per_row = batch * heads * bq * width
    per_group = min(nqb, max(1, min(int(_CALLS * opt(xp).call_cost(dev)), _MOST) // per_row))
    per_group = -(-nqb // -(-nqb // per_group))  # (as many groups, the fewest rows past Q)

    def group(i: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(b|1, h|1, rows, keys) of ``rows`` block rows from row ``i``:
        whether some query of the row sees each key, whether all do.
        Positions past Q are the last query again, which its block holds;
        where each new shape compiles, every group has one shape (the
        function's operations compile once), else the last may be shorter."""
        rows = per_group if opt(xp).compiles_per_shape else min(per_group, nqb - i)
        q = positions(xp, rows * bq, bases[1] + i * bq, host, dev, 2, num_queries - i * bq)
        grid = (b, h, q, kv)
        if opt(xp).dense_index_grids:  # (boolean operators there do not broadcast)
            grid = tuple(xp.broadcast_to(x, (batch, heads, rows * bq, width)) for x in grid)
        v = checked_mask(xp, mask_mod, grid, dev)
        if not opt(xp).is_concrete(v):
            return None
        v = xp.astype(v, "uint8")  # (torch reduces bytes ~7x faster than booleans)
        at = (v.shape[0], v.shape[1], rows, width)
        if v.shape[2] > 1 and rows > 1:
            v = opt(xp).reshape(v, (at[0], at[1], rows, bq, v.shape[3]))
        some, every = (xp.to_numpy(f(v, -2)) for f in (xp.max, xp.min))
        some, every = (
            np.broadcast_to(x.reshape(at[:2] + (-1, x.shape[-1])), at) for x in (some, every)
        )
        return some, every

    done = []
    for i in range(0, nqb, per_group):  # (in turn: a user's function may not be thread-safe)
        part = group(i)
        if part is None:
            return None
        done.append(part)
    # (b|1, h|1, Q blocks, K blocks, bk); keys past K are seen by none and by all
    some, every = (
        np.concatenate(x, 2)[:, :, :nqb].reshape(x[0].shape[:2] + (nqb, nkb, bk))
        for x in zip(*done)
    )
    pad = np.arange(width).reshape(nkb, bk) >= num_keys
    seen = np.any(some & ~pad, 4)
    full = np.all(every | pad, 4)
    used = np.any(some, (1, 2)).reshape((some.shape[0], width))[:, :num_keys]
    return state_of(~seen, full), used


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

    shape = (1 if batch is None else batch, 1 if heads is None else heads, num_queries, num_keys)
    xp = get_backend(backend)
    dev = native_device(xp, device)
    bq, bk = (block[0], block[1]) if isinstance(block, (tuple, list)) else (block, block)
    bq, bk = int(bq), int(bk)
    if min(bq, bk) < 1:
        raise ValueError(f"block must be positive, got {block!r}")
    run = native_captures(xp, "mask_mod", mask_mod, dev)  # (the BlockMask keeps the function given)
    found = evaluate(xp, run, shape, bq, bk, dev)
    if found is None:
        raise ValueError(
            "block_mask evaluates mask_mod when it is called, but mask_mod's answers are "
            "traced (it captures arrays of a trace, such as jax.jit's): build the BlockMask "
            "outside the trace, or pass the function itself as mask_mod="
        )
    causal = is_causal(xp, run, found[0], shape, bq, bk, dev)
    return BlockMask(mask_mod, found[0], shape, bq, bk, causal)


def is_causal(
    xp: Backend,
    mask_mod: Callable[..., Any],
    states: np.ndarray,
    shape: Shape,
    bq: int,
    bk: int,
    dev: Any,
) -> bool:
    """Whether ``mask_mod`` over ``shape`` (Q = K) is exactly ``kv_idx <= q_idx``:
    its block ``states`` are causal's, and so is every element of the partial
    blocks, evaluated a row of them at a time (nothing else is evaluated)."""
    batch, heads, nq, nk = shape
    if nq != nk:
        return False
    q_first, q_last = np.arange(0, nq, bq), np.minimum(np.arange(bq, nq + bq, bq), nq) - 1
    k_first, k_last = np.arange(0, nk, bk), np.minimum(np.arange(bk, nk + bk, bk), nk) - 1
    want = state_of(k_first[None] > q_last[:, None], k_last[None] <= q_first[:, None])
    if states.shape[2:] != want.shape or (states != want).any():
        return False
    for i, row in enumerate(want):
        js = np.flatnonzero(row == PARTIAL)
        if not len(js):
            continue
        k0, k1 = int(k_first[js[0]]), int(k_last[js[-1]]) + 1
        q0, q1 = int(q_first[i]), int(q_last[i]) + 1
        grid = index_grid(xp, (batch, heads, q1 - q0, k1 - k0), (0, q0, k0), dev)
        try:
            seen = xp.to_numpy(checked_mask(xp, mask_mod, grid, dev))
        except Exception:  # noqa: BLE001 (a function the states' evaluation took: not causal-checked)
            return False
        causal = np.arange(k0, k1)[None] <= np.arange(q0, q1)[:, None]
        if not (seen == causal).all():
            return False
    return True
