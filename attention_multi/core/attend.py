"""``attend``: scaled dot-product attention on checked arrays, on the path it picks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from . import blocked, paths
from .checks import check_choice, check_positive_int

if TYPE_CHECKING:
    from backends import Backend

    from ..types import Array, TakenPath
    from .masking import Mask

DEFAULT_MEMORY_BUDGET = 512 * 2**20
"""Default extra memory (bytes) one attention call may use for its score-sized
intermediates; modules take ``memory_budget=`` to change it per module."""

PATHS = ("auto", "fused", "tiled", "chunked", "full")


def check_path_options(
    path: str, memory_budget: int | None, chunk_size: int | None
) -> tuple[str, int | None, int | None]:
    """Validated ``(path, memory_budget, chunk_size)`` of an attention module."""
    return (
        check_choice("path", path, PATHS),
        check_positive_int("memory_budget", memory_budget, allow_none=True),
        check_positive_int("chunk_size", chunk_size, allow_none=True),
    )


def zeros_for_empty(B: Backend, shape: tuple[int, ...], like: Array, *inputs: Array) -> Array:
    """The answer when an axis is empty: zeros of ``shape`` in the dtype and
    on the device of ``like``. No framework kernel sees a zero-size array (MXNet
    1.9.1 crashes on some); the zeros stay in the autodiff graph through the
    empty ones among ``like`` and ``inputs`` (whose sums are exactly 0), so
    gradients are zero or empty, never NaN."""
    out = B.zeros(shape, B.dtype_name(like), B.device_of(like))
    for x in (like, *inputs):
        if 0 in tuple(x.shape):
            out = out + B.sum(x.reshape((0,)), 0)
    return out


AUTODIFF_HELD = 4
"""Score-sized arrays a materialized softmax holds for its backward pass
(measured: JAX's jitted gradient keeps 4.05 for one of scores); a call under
autodiff counts its scores this many times against ``memory_budget`` before
taking a path that materializes them (``Backend.is_differentiated``)."""


def held(B: Backend, queries: Array) -> int:
    """How many times a path that materializes the scores holds them."""
    return AUTODIFF_HELD if B.is_differentiated(queries) else 1


SMALL_SCORES = 1 << 15
"""``"auto"`` takes the full path at once for calls with at most this many
(batch * heads * Q * K) scores: there, planning tiles and dispatching to a
kernel cost more host time than the arithmetic they could save (the d2l
examples and chapter-11 training batches are far below it), and the full
path keeps the weights. Those with lengths or nothing take it as a straight
line (``small.py``)."""

TILED_WORK_MAX = 0.9
"""``"auto"`` takes the tiled path first when its tiles cost at most 0.9 of
one kernel call over all the scores: they skip padding, causal or window
blocks no query sees, and each tile costs ``Backend.kernel_call_cost`` more."""


def _kept_weights(
    B: Backend, queries: Array, keys: Array, mask: Mask, scale: float, private: bool
) -> Callable[[], Array]:
    """The weights of this call as a function, from copies of its inputs."""
    q_kept, k_kept = (queries, keys) if private else (B.snapshot(queries), B.snapshot(keys))
    mask_kept = mask.frozen(B)
    return lambda: paths.weights(B, q_kept, k_kept, mask_kept, scale)


def attend(
    B: Backend,
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
    want_weights: bool = False,
    private: bool = False,
    weights_later: bool = True,
) -> tuple[Array, Any, TakenPath]:
    """Scaled dot-product attention on checked arrays, on the path it picks.

    ``queries`` (batch, heads, Q, d); ``keys``, ``values`` (batch, kv_heads,
    K, d|dv); ``mask`` the normalized ``Mask``; ``scale`` default
    ``1/sqrt(d)``; ``dropout`` the rate on the weights (0: none), ``key`` the
    PRNG key where the framework needs one (JAX).

    Paths (``path=``):

    - ``"fused"``: the backend's own kernel (``Backend.fused_attention``),
      whatever its memory needs; with dropout only where the kernel has it.
    - ``"tiled"``: one tile per batch element and block of queries over the
      keys that block may see (padding is skipped), each through the
      backend's kernel or the core's softmax-product. While the lengths are
      traced (``jax.jit``), blocks of keys per batch element that
      ``Backend.cond`` skips at run time, where the framework has it.
    - ``"chunked"``: the online-softmax recurrence over blocks of queries and
      keys; extra memory is O(Q d) plus one block of scores, whose size
      follows ``chunk_size`` or else ``memory_budget``; under autodiff the
      blocks are recomputed in the backward pass.
    - ``"full"``: materializes the (batch, heads, Q, K) scores and keeps the weights.
    - ``"auto"`` (default): ``"full"`` when the float32 scores fit in
      ``memory_budget`` and there are at most ``SMALL_SCORES`` of them or
      ``want_weights`` (the caller will read the weights); else
      ``"tiled"`` when the lengths are known and its tiles, each call
      counted, cost at most ``TILED_WORK_MAX`` of one kernel call over all
      the scores (unless the mask is top-left causal and the backend's
      kernel skips that work itself,
      ``Backend.fused_causal``), or when the lengths are traced and
      the backend skips blocks at run time; else ``"fused"`` if the backend's
      kernel takes the case within ``memory_budget``; else ``"tiled"`` if the
      lengths are known; else ``"chunked"`` if the float32 scores would
      exceed ``memory_budget`` (default 512 MiB); else ``"full"``. Under
      autodiff (``Backend.is_differentiated``) the scores count
      ``AUTODIFF_HELD`` times against the budget wherever they would be
      materialized (full, tiles): the backward pass holds them (a kernel
      counts what its own backward holds).

    A forced ``"fused"`` or ``"tiled"`` falls back as ``"auto"`` does when it
    cannot run (no kernel for the case, traced lengths, too small a budget;
    with dropout and a PRNG key the tiled path is not taken, so that a call
    under ``jax.jit`` draws what an eager call draws). A
    query with no visible key gets a zero output; when an axis is empty (no
    batch, heads, queries or keys) no kernel is called: the path is
    ``"empty"`` and the output is zeros of the right shape.

    Returns ``(output (batch, heads, Q, dv), weights (batch * heads, Q, K) or
    a function computing them, path taken)``. A feature size d of 0 gives
    scores of 0: uniform weights over the visible keys. The weights are those before
    dropout; fused, tiled and chunked calls compute them only when the
    function is called, from this call's queries, keys and mask: from
    copies taken now (``Backend.snapshot``; with ``private``, queries and
    keys that nobody else can write, such as projections made for the
    call, are kept as they are), so that writes into the caller's arrays
    after the call do not change them. With ``weights_later=False`` (the
    caller never reads them) no copies are taken and the weights are None
    on those paths.
    """
    if path not in PATHS:
        check_path_options(path, memory_budget, chunk_size)  # raises
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
    if queries.shape[-1] == 0:  # no features: every score is 0 (no kernel sees d = 0)
        queries, keys = (zeros_for_empty(B, tuple(x.shape[:-1]) + (1,), x) for x in (queries, keys))
    scale = paths.default_scale(queries.shape[-1]) if scale is None else scale
    batch, heads, num_q = queries.shape[:3]
    num_k = keys.shape[2]

    if 0 in (batch, heads, num_q, num_k):  # nothing to attend: no kernel is called
        out = zeros_for_empty(B, (batch, heads, num_q, values.shape[-1]), queries, keys, values)
        weights = zeros_for_empty(B, (batch * heads, num_q, num_k), queries)
        return out, weights, "empty"
    scores = batch * heads * num_q * num_k
    times = held(B, queries)
    scores_bytes = scores * paths.work_itemsize(B, queries) * times
    kernel_budget = max(1, budget // times)  # (for the tiles, which materialize)
    if path == "auto" and scores_bytes <= budget and (scores <= SMALL_SCORES or want_weights):
        out, weights = paths.full(B, queries, keys, values, mask, scale, dropout, key)
        return out, weights, "full"
    kept = _kept_weights(B, queries, keys, mask, scale, private) if weights_later else None

    if blocked.takes(B, mask, path, dropout, key):
        block = (chunk_size, chunk_size) if chunk_size else None
        out = blocked.blocked(B, queries, keys, values, mask, scale, block, dropout, key)
        return out, kept, "tiled"
    plan = None
    # (keyed dropout draws differ by path: with a key, the path must not depend
    # on whether values are traced, so that jit and eager calls agree)
    # (a framework that compiles per shape would compile each tile's shape:
    # "auto" takes its tiles only while traced, where their shapes are static)
    if (
        path in ("auto", "fused", "tiled")
        and not (dropout and key is not None)
        and (path == "tiled" or not B.compiles_per_shape)
    ):
        plan = paths.plan_tiles(B, queries, mask, kernel_budget, chunk_size)
        # (under autodiff every tile's scores are held at once: all must fit)
        if plan is not None and times > 1 and path != "tiled":
            if plan.scores * paths.work_itemsize(B, queries) * times > budget:
                plan = None
    # (a kernel that skips the masked half of top-left causal attention
    # itself beats tiles that each carry a mask)
    kernel_causal = mask.top_left_causal and B.fused_causal
    if plan is not None and (
        path == "tiled" or (path == "auto" and not kernel_causal and plan.cost <= TILED_WORK_MAX)
    ):
        return paths.tiled(B, queries, keys, values, mask, scale, plan, dropout, key), kept, "tiled"
    if (
        path in ("auto", "tiled")
        and not dropout
        and mask.intervals
        and not mask.known_on_host()
        and B.runtime_cond
    ):
        return (
            paths.tiled_traced(B, queries, keys, values, mask, scale, budget, chunk_size),
            kept,
            "tiled",
        )
    if path in ("auto", "fused") and (not dropout or B.fused_dropout):
        out = paths.fused(
            B,
            queries,
            keys,
            values,
            mask,
            scale,
            None if path == "fused" else budget,
            dropout,
        )
        if out is not None:
            return out, kept, "fused"
    if plan is not None:
        return paths.tiled(B, queries, keys, values, mask, scale, plan, dropout, key), kept, "tiled"
    if path == "chunked" or (path != "full" and scores_bytes > budget):
        out = paths.chunked(B, queries, keys, values, mask, scale, budget, chunk_size, dropout, key)
        return out, kept, "chunked"
    out, weights = paths.full(B, queries, keys, values, mask, scale, dropout, key)
    return out, weights, "full"
