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

from . import paths
from .checks import check_choice, check_positive_int
from .mask import no_forms
from .numerics import DEFAULT_MEMORY_BUDGET, default_scale, work_itemsize, zeros_for_empty
from .paths import PATHS, full, online, small
from .paths.call import AUTODIFF_HELD, Call, Weights

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ..types import Array, TakenPath
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
) -> tuple[Array, Any, TakenPath]:
    """Scaled dot-product attention on checked arrays, on the path it picks.

    ``queries`` (batch, heads, Q, d); ``keys``, ``values`` (batch, kv_heads,
    K, d|dv); ``mask`` the normalized ``Mask``; ``scale`` default 1/sqrt(d);
    ``dropout`` the weights' rate, ``key`` the PRNG key (JAX). ``path``:
    ``"auto"``, or a path's name (tried first; ``"auto"`` chooses when it
    cannot run). ``weights``: ``"now"`` (read: the full path is worth it),
    ``"later"`` (a function of copies of the inputs; ``private``: of the
    inputs as they are), ``"never"``. ``lse``: each row's log-sum-exp
    (batch, heads, Q, 1) in the compute dtype (``-inf``: no key) in place of
    the weights.

    Returns ``(output (batch, heads, Q, dv), weights (batch * heads, Q, K)
    before dropout, a function computing them, or None; path taken)``. An
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
            return out, rows, "empty"
        return out, zeros_for_empty(xp, (batch * heads, num_q, num_k), queries), "empty"
    options = (path, memory_budget, chunk_size, weights, private, lse)
    call = Call(xp, queries, keys, values, mask, scale, dropout, key, *options)
    plain = mask.unmasked or mask.only_lens
    if (
        path == "auto"
        and full.fits(call)
        and (weights == "now" or is_small(xp, call.scores, num_k, queries, plain))
    ):
        ran = full.run(call)
        return ran[0], ran[-1], "full"
    done = _cheapest(call) or _cheapest(call.auto())
    assert done is not None  # (the full or chunked path always has a plan under "auto")
    out, kept, taken = done
    if kept is None and weights != "never" and not lse:
        kept = _kept_weights(call)
    return out, kept, taken


def _cheapest(call: Call) -> tuple[Array, Any, TakenPath] | None:
    """The cheapest plan that runs: ``(output, weights or None, its NAME)``. A
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
        if done is not None:  # (the log-sum-exp in place of the weights, when asked for)
            return done[0], done[2] if call.lse else done[1], module.NAME
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
