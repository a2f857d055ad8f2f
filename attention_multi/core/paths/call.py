"""``Call``: one attention call, as every path plans and runs it; ``Plan``:
what a path would do with it, and what that costs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Literal, NamedTuple, TypeVar

import numpy as np

from attention_multi.backends.capabilities import opt

from ...types import Path
from ..numerics import DEFAULT_MEMORY_BUDGET, compute_dtype, work_itemsize

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ...types import Array
    from ..mask import Mask

R = TypeVar("R")
Weights = Literal["never", "later", "now"]
"""When the caller reads the weights: never (no copies kept), later (a function
of copies of the inputs), now (certain: a path that keeps them is worth it)."""

AUTODIFF_HELD = 4
"""Score-sized arrays a materialized softmax holds for its backward pass (JAX's
jitted gradient: 4.05): a call under autodiff counts its scores this often."""
# a call that waits more than this many idle calls: a busy machine (2 cores,
# after the packed forward: 5-17 idle, 70-120 beside one busy process)
BUSY_CALLS = 32


class Options(NamedTuple):
    """How a call is computed, beside its arrays, mask and scale (the
    keywords of ``select.attend``)."""

    dropout: float = 0.0  # the weights' dropout rate
    key: Any = None  # the PRNG key of dropout (JAX)
    path: str = "auto"  # ``"auto"`` or a ``Path`` (``"tiled"``: its family)
    budget: int | None = None  # bytes of score-sized intermediates (``memory_budget``)
    chunk_size: int | None = None  # queries and keys per block of the block paths
    weights: Weights = "later"  # when the caller reads the weights
    private: bool = False  # queries and keys only this call holds (kept as they are)
    lse: bool = False  # the result's ``lse`` computed (a path that gives none declines)


DEFAULTS = Options()


class Call:
    """One call: its arrays, ``Mask``, scale and ``Options``, and what every
    plan reads of them (each option is an attribute: ``call.path``...)."""

    def __init__(
        self,
        xp: Backend,
        queries: Array,
        keys: Array,
        values: Array,
        mask: Mask,
        scale: float,
        options: Options = DEFAULTS,
    ) -> None:
        self.xp, self.mask, self.scale = xp, mask, scale
        self.queries, self.keys, self.values = queries, keys, values
        self.dropout, self.key, self.path, budget, self.chunk_size = options[:5]
        self.weights, self.private, self.lse = options[5:]
        self.budget = DEFAULT_MEMORY_BUDGET if budget is None else budget
        self.batch, self.heads, self.num_queries = queries.shape[:3]
        self.num_keys = keys.shape[2]
        self.dtype, self.device = xp.dtype_name(queries), xp.device_of(queries)
        self.work = compute_dtype(self.dtype)
        self.scores = self.batch * self.heads * self.num_queries * self.num_keys
        self.itemsize = work_itemsize(xp, queries)
        self.held = AUTODIFF_HELD if opt(xp).is_differentiated(queries) else 1
        self.scores_bytes = self.scores * self.itemsize * self.held
        self.keyed_dropout = bool(self.dropout) and self.key is not None
        self.call_cost = opt(xp).call_cost(self.device)  # (in scores: one more framework call, now)
        self.compiled_call_cost = opt(xp).compiled_call_cost(self.device)  # (a branch under jit)

    def auto(self) -> Call:
        """This call with the path chosen by ``"auto"``."""
        return self._but(path="auto")

    def on(self, queries: Array, keys: Array, values: Array) -> Call:
        """This call on other arrays of the same shapes (views of its own)."""
        return self._but(queries=queries, keys=keys, values=values)

    def _but(self, **fields: Any) -> Call:
        call = Call.__new__(Call)
        call.__dict__.update(self.__dict__, **fields)
        return call

    def asks(self, path: Path) -> bool:
        """Whether the caller asked for ``path`` (by its name or its family's,
        ``"tiled"``) or for ``"auto"``."""
        return self.path == "auto" or self.named(path)

    def named(self, path: Path) -> bool:
        """Whether the caller asked for ``path`` by its name or its family's."""
        return self.path == path or self.path == path.family


def fewer_threads(call: Call) -> bool:
    """Whether a path of many small calls runs them in fewer threads of the
    CPU pool (``Threads.in_fewer_threads``), forward and backward: where a call
    waits now (a busy machine), so that they wait for fewer descheduled
    threads. (2 cores beside one busy process: the tiles' training step in
    one thread 0.45x SDPA's against 1.1x in two; the packed forward 562 ms
    against 1088; idle, the training step took the same time in either.)
    Where the backend says so (``fewer_threads_always``), idle too."""
    xp = call.xp
    busy = call.call_cost > BUSY_CALLS * opt(xp).kernel_call_cost
    cpu = not opt(xp).on_accelerator(call.device)
    return opt(xp).fewer_threads and cpu and (busy or opt(xp).fewer_threads_always)


def many_calls_cost(call: Call) -> float:
    """What each call of a path of many calls costs: under autodiff in
    ``fewer_threads``, an idle call's (the training step above); else what a
    call costs now (a forward pass in fewer threads still gains by fewer calls)."""
    idle = call.held > 1 and fewer_threads(call)
    return opt(call.xp).kernel_call_cost if idle else call.call_cost


def in_fewer_threads(call: Call, run: Callable[[Call], R]) -> R:
    """``run(call)``, in fewer threads where ``fewer_threads``."""
    if not fewer_threads(call):
        return run(call)
    q, k, v = call.queries, call.keys, call.values
    return opt(call.xp).in_fewer_threads(lambda *qkv: run(call.on(*qkv)), q, k, v)


class Result(NamedTuple):
    """What a call gives, on any path: ``output`` (batch, heads, Q, dv) in
    the call's dtype; ``weights`` (batch * heads, Q, K) before dropout, a
    function computing them, or None; ``lse``, each row's log-sum-exp
    (batch, heads, Q, 1) in the compute dtype (``-inf``: no key), where the
    call asked for it (``Options.lse``), else None; ``path``, the ``Path``
    that ran (the chooser sets it)."""

    output: Array
    weights: Any = None
    lse: Array | None = None
    path: Path | None = None


class Plan(NamedTuple):
    """``cost`` in scores (a kernel call: ``Costs.call_cost()``) and the
    path's own ``detail`` for its ``run``."""

    cost: float
    detail: Any = None


def expand_kv(xp: Backend, keys: Array, values: Array, heads: int) -> tuple[Array, Array]:
    """Grouped-query attention: repeat each kv head for its query heads."""
    group = heads // keys.shape[1]
    if group == 1:
        return keys, values
    return xp.repeat(keys, group, 1), xp.repeat(values, group, 1)


class Pieces:
    """``x`` (batch, heads, n, d) cut along ``n`` at ``points`` by
    ``Backend.split`` where autodiff records it (``Autodiff.is_differentiated``):
    a slice's gradient is a buffer as large as ``x`` per slice, the pieces' are
    joined once. ``take(a, b)``: ``x[:, :, a:b]`` for points ``a``, ``b``
    (pieces side by side where it spans several)."""

    def __init__(self, xp: Backend, x: Array, points: Any) -> None:
        self.xp, self.x = xp, x
        self.parts: list[Array] | None = None
        if opt(xp).is_differentiated(x):
            points = sorted(set(int(p) for p in points) | {0, int(x.shape[2])})
            self.parts = xp.split(x, np.diff(points).tolist(), 2)
            self.at = {p: i for i, p in enumerate(points)}

    def take(self, a: int, b: int) -> Array:
        if self.parts is None:
            return self.x[:, :, a:b]
        parts = self.parts[self.at[a] : self.at[b]]
        return parts[0] if len(parts) == 1 else self.xp.concatenate(parts, 2)


def dropout_fn(xp: Backend, rate: float, key: Any) -> Any:
    """``drop(weights, index)``: dropout with the ``index``-th key folded from
    ``key`` (None when ``rate`` is 0)."""
    if not rate:
        return None
    return lambda w, index=None: xp.dropout(w, rate, opt(xp).fold_key(key, index))


_GROUPED: dict[tuple, list[tuple[np.ndarray, int, int, bool]]] = {}  # (recent plans)
_GROUPED_KEPT = 64


def grouped(
    starts: np.ndarray,
    stops: np.ndarray,
    whole: np.ndarray,
    rows: int,
    call_cost: float,
    most: int,
    gather: bool,
    masked_cost: float = 0.0,
    copies: tuple[float, float] = (0.0, 0.0),
) -> list[tuple[np.ndarray, int, int, bool]]:
    """``(elements, k0, k1, whole)`` groups of at most ``most`` elements, each
    one kernel call over the keys its elements see (``starts``, ``stops``), at
    least cost (``rows`` scores per element and key, ``call_cost`` per group,
    ``masked_cost`` more per score where its elements see different keys: the
    mask's pass; when ``gather``, three calls more per group, and ``copies``
    per element and per element and key where its elements are not a range);
    consecutive, or sorted by keys when ``gather``; those that see none last.
    The plans of the last calls are kept: every layer of a model plans the
    same lengths again."""
    arrays = (starts.tobytes(), stops.tobytes(), whole.tobytes(), starts.dtype, stops.dtype)
    plan = (*arrays, rows, call_cost, most, gather, masked_cost, copies)
    if plan in _GROUPED:
        return list(_GROUPED[plan])
    empty = stops <= starts
    order = np.arange(len(starts))[~empty]
    if gather:
        order = order[np.lexsort((starts[order], stops[order]))]
    n = len(order)
    keys = list(zip(starts[order].tolist(), stops[order].tolist()))
    # A best grouping never splits a run of elements that see the same keys (the
    # group before takes the rest at no cost): a run is one step, unless most binds.
    bounds = [i for i in range(n) if i == 0 or most < n or keys[i] != keys[i - 1]] + [n]
    best, cut = [0.0] * len(bounds), [0] * len(bounds)
    run_keys = [keys[b] for b in bounds[:-1]]  # (a run's elements share its keys)
    firsts = [int(order[a:b].min()) for a, b in zip(bounds, bounds[1:])]
    lasts = [int(order[a:b].max()) for a, b in zip(bounds, bounds[1:])]
    plain, masked = 1.0, 1.0 + masked_cost
    per_group = call_cost * (4 if gather else 1)  # (a kernel call, and gathers: see calls)
    per_element, per_key = copies
    for j in range(1, len(bounds)):  # best[j]: the elements before bounds[j], grouped
        lo, hi, least, mixed, end, last = np.inf, -np.inf, np.inf, False, bounds[j], run_keys[j - 1]
        first, final = n, -1
        for i in range(j - 1, -1, -1):  # the last group: from bounds[i]
            size = end - bounds[i]
            start, stop = key = run_keys[i]
            lo, hi = (start if start < lo else lo), (stop if stop > hi else hi)
            first, final = min(first, firsts[i]), max(final, lasts[i])
            mixed = mixed or key != last
            group = size * rows * (hi - lo) * (masked if mixed else plain) + per_group
            if size > most or group >= least:  # (an earlier start only adds to it)
                break
            if final - first + 1 != size:  # (not a range: its rows copied)
                group += size * (per_element + per_key * (hi - lo))
            if best[i] + group <= least:
                least, cut[j] = best[i] + group, i
        best[j] = least
    out, j = [], len(bounds) - 1
    while j > 0:
        # (sorted: a whole range is sliced, not gathered)
        members = np.sort(order[bounds[cut[j]] : bounds[j]])
        k0, k1 = int(starts[members].min()), int(stops[members].max())
        same = (starts[members] == k0).all() and (stops[members] == k1).all()
        out.append((members, k0, k1, bool(same and whole[members].all())))
        j = cut[j]
    if empty.any():
        out.append((np.flatnonzero(empty), 0, 0, False))
    if len(_GROUPED) >= _GROUPED_KEPT:
        del _GROUPED[next(iter(_GROUPED))]
    _GROUPED[plan] = out[::-1]
    return out[::-1]
