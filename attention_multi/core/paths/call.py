"""``Call``: one attention call, as every path plans and runs it; ``Plan``:
what a path would do with it, and what that costs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from ..numerics import DEFAULT_MEMORY_BUDGET, compute_dtype, work_itemsize

if TYPE_CHECKING:
    from backends import Backend

    from ...types import Array
    from ..mask import Mask

Weights = Literal["never", "later", "now"]
"""When the caller reads the weights: never (no copies kept), later (kept as
a function of copies of the inputs), now (the next read is certain: a path
that keeps them is worth a second pass)."""

AUTODIFF_HELD = 4
"""Score-sized arrays a materialized softmax holds for its backward pass
(measured: JAX's jitted gradient keeps 4.05 for one of scores); a call under
autodiff counts its scores this many times against ``memory_budget`` before
taking a path that materializes them (``Backend.is_differentiated``)."""


class Call:
    """``queries`` (batch, heads, Q, d); ``keys``, ``values`` (batch,
    kv_heads, K, d|dv); ``mask`` the normalized ``Mask``; ``scale``;
    ``dropout`` the rate on the weights (0: none), ``key`` the PRNG key
    where the framework needs one (JAX); ``path`` the one asked for
    (``"auto"``: the cheapest plan); ``budget`` bytes of score-sized
    intermediates; ``chunk_size`` queries and keys per block, or None;
    ``weights``: when the caller reads them; ``private``: queries and keys
    only this call holds (projections), kept for the weights without copies."""

    def __init__(
        self,
        xp: Backend,
        queries: Array,
        keys: Array,
        values: Array,
        mask: Mask,
        scale: float,
        dropout: float = 0.0,
        key: Any = None,
        path: str = "auto",
        budget: int | None = None,
        chunk_size: int | None = None,
        weights: Weights = "later",
        private: bool = False,
    ) -> None:
        self.xp, self.mask, self.scale = xp, mask, scale
        self.queries, self.keys, self.values = queries, keys, values
        self.dropout, self.key, self.path = dropout, key, path
        self.budget = DEFAULT_MEMORY_BUDGET if budget is None else budget
        self.chunk_size, self.weights, self.private = chunk_size, weights, private
        self.batch, self.heads, self.num_queries = queries.shape[:3]
        self.num_keys = keys.shape[2]
        self.dtype = xp.dtype_name(queries)
        self.work = compute_dtype(self.dtype)
        self.device = xp.device_of(queries)
        self.scores = self.batch * self.heads * self.num_queries * self.num_keys
        self.itemsize = work_itemsize(xp, queries)
        self.held = AUTODIFF_HELD if xp.is_differentiated(queries) else 1
        self.scores_bytes = self.scores * self.itemsize * self.held
        self.keyed_dropout = bool(dropout) and key is not None

    def auto(self) -> Call:
        """This call with the path chosen by ``"auto"``."""
        call = Call.__new__(Call)
        call.__dict__.update(self.__dict__)
        call.path = "auto"
        return call

    def asks(self, *paths: str) -> bool:
        """Whether the caller asked for one of ``paths`` (or ``"auto"``)."""
        return self.path == "auto" or self.path in paths


class Plan(NamedTuple):
    """What a path would do: ``cost`` in scores' worth of work (each kernel
    call counting ``Backend.kernel_call_cost``), and the path's own
    ``detail`` for its ``run``."""

    cost: float
    detail: Any = None


def expand_kv(xp: Backend, keys: Array, values: Array, heads: int) -> tuple[Array, Array]:
    """Grouped-query attention: repeat each kv head for its query heads."""
    group = heads // keys.shape[1]
    if group == 1:
        return keys, values
    return xp.repeat(keys, group, 1), xp.repeat(values, group, 1)


def dropout_fn(xp: Backend, rate: float, key: Any) -> Any:
    """``drop(weights, index)``: dropout at ``rate`` with the ``index``-th key
    folded from ``key`` (None when the rate is 0)."""
    if not rate:
        return None

    def drop(w: Array, index: Any = None) -> Array:  # (callers pass an int index)
        return xp.dropout(w, rate, xp.fold_key(key, index))

    return drop
