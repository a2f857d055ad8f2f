"""The one chooser: which path computes a call.

Small calls with lengths or nothing take the straight line (``straight_line``,
decided before any ``Mask`` is built). Else ``attend``: the full path at once
for at most ``SMALL_SCORES`` scores or weights read now, within the budget;
otherwise the cheapest plan of ``paths.REGISTRY`` runs (scores computed plus
``Costs.call_cost()`` per kernel call), a kernel that declines handing the
call to the next. A path asked for by name is tried alone first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

from attention_multi.backends.capabilities import opt

from ..types import Path
from . import paths
from .checks import check_choice, check_positive_int
from .mask import no_forms
from .numerics import DEFAULT_MEMORY_BUDGET, default_scale, work_itemsize, zeros_for_empty
from .paths import PATHS, full, online, small
from .paths.call import AUTODIFF_HELD, DEFAULTS, Call, Options, Result, Weights

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ..types import Array
    from .mask import Mask

SMALL_SCORES = 1 << 15
"""``"auto"`` takes the full path at once for calls with at most this many
(batch * heads * Q * K) scores: planning and dispatching to a kernel would
cost more host time than they save (d2l's examples are far below it). With
lengths or no mask, on a CPU, up to ``Costs.small_scores`` over at most
``SMALL_KEYS`` keys."""
SMALL_KEYS = 256


def is_small(xp: Backend, scores: int, num_keys: int, queries: Array, plain: bool) -> bool:
    """Whether a call is small (``SMALL_SCORES``); ``plain``: its mask is
    lengths or nothing."""
    if scores <= SMALL_SCORES:
        return True
    if not plain or scores > opt(xp).small_scores or num_keys > SMALL_KEYS:
        return False
    return not opt(xp).on_accelerator(xp.device_of(queries))


def check_path_options(
    path: str, memory_budget: int | None, chunk_size: int | None
) -> tuple[str, int | None, int | None]:
    """Validated ``(path, memory_budget, chunk_size)`` of an attention module."""
    return (
        check_choice("path", path, PATHS),
        check_positive_int("memory_budget", memory_budget, allow_none=True),
        check_positive_int("chunk_size", chunk_size, allow_none=True),
    )


def straight_line(
    xp: Backend,
    path: str,
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Any,
    forms: Mapping[str, Any],
    weights_read: bool = False,
    memory_budget: int | None = None,
) -> small.Line | None:
    """The straight line's ``Line`` when it applies, else None: ``path`` "auto"
    or "full", no mask form but ``valid_lens`` (``forms``), no empty axis, and
    "auto" would take the full path (within ``memory_budget``, at most
    ``SMALL_SCORES`` scores or the weights read). A module keeps a ``reusable``
    line for the next calls of the same signature."""
    if path not in ("auto", "full") or not no_forms(forms):
        return None
    qs, ks = queries.shape, keys.shape
    if None in qs or None in ks:  # (traced, sizes known when it runs: no plan, the line)
        return small.Line(xp, queries, keys, values, valid_lens, False)
    scores = qs[-2] * ks[-2]
    for n in qs[:-2]:
        scores *= n
    if scores == 0 or qs[-1] == 0:
        return None
    if path == "auto":
        budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
        held = AUTODIFF_HELD if opt(xp).is_differentiated(queries) else 1
        if scores * work_itemsize(xp, queries) * held > budget:
            return None
        if not weights_read and not is_small(xp, scores, ks[-2], queries, True):
            return None
    reusable = path == "full" or is_small(xp, scores, ks[-2], queries, True)
    return small.Line(xp, queries, keys, values, valid_lens, reusable)


def attend(
    xp: Backend,
    queries: Array,
    keys: Array,
    values: Array,
    mask: Mask,
    *,
    scale: float | None = None,
    dropout: float = 0.0,
    key: Any = None,
    path: str = "auto",
    memory_budget: int | None = None,
    chunk_size: int | None = None,
    weights: Weights = "later",
    private: bool = False,
    lse: bool = False,
) -> Result:
    """Scaled dot-product attention on checked arrays, on the path it picks.

    ``queries`` (batch, heads, Q, d); ``keys``, ``values`` (batch, kv_heads,
    K, d|dv); ``mask`` the normalized ``Mask``; ``scale`` default 1/sqrt(d);
    ``dropout`` the weights' rate, ``key`` the PRNG key (JAX). ``path``:
    ``"auto"``, or a path's name (tried first; ``"auto"`` chooses when it
    cannot run). ``weights``: ``"now"`` (read: the full path is worth it),
    ``"later"`` (a function of copies of the inputs; ``private``: of the
    inputs as they are), ``"never"``. ``lse``: compute each row's
    log-sum-exp too (the result's ``lse``; only paths that give it run).

    Returns a ``Result``: output (batch, heads, Q, dv); weights (batch *
    heads, Q, K) before dropout, a function computing them, or None (with
    ``lse``: None); lse (batch, heads, Q, 1) or None; the ``Path`` taken. An
    empty axis calls no kernel: path ``"empty"``, zeros. d = 0 gives scores
    of 0: uniform weights over the visible keys.
    """
    if path not in PATHS:
        check_path_options(path, memory_budget, chunk_size)  # raises
    if queries.shape[-1] == 0:  # no features: every score is 0 (no kernel sees d = 0)
        queries, keys = (
            zeros_for_empty(xp, tuple(x.shape[:-1]) + (1,), x) for x in (queries, keys)
        )
    scale = default_scale(queries.shape[-1]) if scale is None else scale
    batch, heads, num_q = queries.shape[:3]
    num_k = keys.shape[2]
    if 0 in (batch, heads, num_q, num_k):  # nothing to attend: no kernel is called
        out = zeros_for_empty(xp, (batch, heads, num_q, values.shape[-1]), queries, keys, values)
        if lse:
            rows = zeros_for_empty(xp, (batch, heads, num_q, 1), queries)
            if batch * heads * num_q:  # (no key: -inf; no kernel sees a zero-size array)
                rows = rows + online.minus_inf(xp, xp.dtype_name(rows), xp.device_of(rows))
            return Result(out, None, rows, Path.EMPTY)
        weights_empty = zeros_for_empty(xp, (batch * heads, num_q, num_k), queries)
        return Result(out, weights_empty, None, Path.EMPTY)
    options = Options(dropout, key, path, memory_budget, chunk_size, weights, private, lse)
    call = Call(xp, queries, keys, values, mask, scale, options)
    plain = mask.unmasked or mask.only_lens
    if (
        path == "auto"
        and full.fits(call)
        and (weights == "now" or is_small(xp, call.scores, num_k, queries, plain))
    ):
        return full.run(call)._replace(path=Path.FULL)
    done = _cheapest(call) or _cheapest(call.auto())
    assert done is not None  # (the full or chunked path always has a plan under "auto")
    if done.weights is None and weights != "never" and not lse:
        done = done._replace(weights=_kept_weights(call))
    return done


def _cheapest(call: Call) -> Result | None:
    """The ``Result`` of the cheapest plan that runs, its ``path`` set. A
    path with a ``bound`` (a lower bound of its cost, cheaper than its plan)
    is planned only once no cheaper plan is left to run."""
    plans: list[tuple[float, int, Any, Any]] = []
    later: list[tuple[float, int, Any]] = []
    for order, module in enumerate(paths.REGISTRY):
        if hasattr(module, "bound"):
            later.append((module.bound(call), order, module))
        else:
            planned = _plan(call, order, module)
            plans += [] if planned is None else [planned]
    while plans or later:
        best = min(plans, key=lambda p: p[:2], default=None)
        waiting = min(later, key=lambda m: m[:2], default=None)
        if waiting is not None and (best is None or waiting[:2] <= best[:2]):
            later.remove(waiting)
            planned = _plan(call, *waiting[1:])
            plans += [] if planned is None else [planned]
            continue
        assert best is not None
        plans.remove(best)
        _, _, module, plan = best
        done = module.run(call, plan)
        if done is not None:
            return done._replace(path=module.NAME)
    return None


def _plan(call: Call, order: int, module: Any) -> tuple[float, int, Any, Any] | None:
    plan = module.plan(call)
    return None if plan is None else (plan.cost, order, module, plan)


def _kept_weights(call: Call) -> Callable[[], Array]:
    """The weights of this call as a function of its inputs as they are now
    (``Copies.keep``; private ones as they are)."""
    xp = call.xp
    q, k = call.queries, call.keys
    kept = (lambda: (q, k)) if call.private else opt(xp).keep(q, k)
    mask = call.mask.snapshot(xp)

    def read() -> Array:
        q, k = kept()
        return full.weights(xp, q, k, mask, call.scale)

    return read


def compute(
    xp: Backend,
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Any,
    mask: Callable[[], Mask] | None,
    line: small.Line | None,
    *,
    scale: float | None = None,
    options: Options = DEFAULTS,
) -> Result:
    """One call, for the functions and the modules alike: on the straight
    line ``line`` (``straight_line``'s, or a module's kept one) where there is
    one, else the call's ``Mask`` (``mask()``) on the path ``attend`` picks.
    ``queries`` (batch, heads, Q, d) (the straight line takes (batch, Q, d)
    too), ``scale`` default 1/sqrt(d). A ``Result``, its ``path`` set."""
    if line is not None:
        out, weights = small.attention(
            xp,
            queries,
            keys,
            values,
            valid_lens,
            line.scale if scale is None else scale,
            options.dropout,
            options.key,
            line,
        )
        return Result(out, weights, None, Path.FULL)
    assert mask is not None
    dropout, key, path, budget, chunk_size, weights, private, lse = options
    return attend(
        xp,
        queries,
        keys,
        values,
        mask(),
        scale=scale,
        dropout=dropout,
        key=key,
        path=path,
        memory_budget=budget,
        chunk_size=chunk_size,
        weights=weights,
        private=private,
        lse=lse,
    )
