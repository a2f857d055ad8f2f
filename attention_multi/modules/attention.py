"""The attention modules of d2l: additive, scaled dot-product and multi-head."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from attention_multi.backends.capabilities import opt

from ..core import (
    DEFAULT_MEMORY_BUDGET,
    check_path_options,
    checked_forms,
    make_mask,
    masked_softmax,
    no_forms,
    straight_line,
    zeros_for_empty,
)
from ..core.checks import (
    _backend_name,
    check_array,
    check_bool,
    check_dropout,
    check_float,
    check_heads,
    check_kv_heads,
    check_positive_int,
)
from ..core.mask.rules import guard_unused
from ..core.numerics import work_itemsize
from ..core.paths import small
from ..core.paths.call import Options
from ..core.select import compute
from ..types import Array, AttentionPath, ModuleOptions, TakenPath
from .base import Linear, Module
from .cache import KVCache


def bind_editions(
    cls_name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    seeds: tuple[str, ...],
    seeds_required: int,
    d2l10: tuple[str, ...],
    defaults: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The constructor arguments of a module with two signatures: the seeds'
    (``seeds``, names in order, input sizes first, the first ``seeds_required``
    of them required) and d2l 1.0's (``d2l10``, the same without the input
    sizes). The number of positional arguments tells them apart: more than
    d2l 1.0's form has is the seeds' form; at most that many is d2l 1.0's
    form (the input sizes are then keywords, or come from the first call).
    Keywords fill the rest of either. Returns ``({name: value}, options)``,
    where ``options`` are the keywords that are not arguments of either form
    (``backend=``...)."""
    required = [n for n in seeds if n not in defaults]
    defaults_shown = {n: v for n, v in defaults.items() if n in d2l10}
    if len(d2l10) < len(args) <= len(seeds):
        names, form = seeds, "the seeds' form"
    elif len(args) <= len(d2l10):
        names, form = d2l10, "d2l 1.0's form"
    else:
        raise TypeError(
            f"{cls_name}() takes {_count(seeds_required, len(seeds))} positional "
            f"arguments ({_sig(seeds, defaults_shown)}: the seeds' form) or at most "
            f"{len(d2l10)} ({_sig(d2l10, defaults_shown)}: d2l 1.0's form, input sizes "
            f"from the first call or as keywords "
            f"{', '.join(n + '=' for n in seeds if n not in d2l10)}), got {len(args)}: "
            f"{', '.join(map(repr, args))}"
        )
    bound = dict(zip(names, args))
    options: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in bound:
            raise TypeError(
                f"{cls_name}() got multiple values for argument {name!r}: "
                f"{len(args)} positional arguments are {form} "
                f"({_sig(names, defaults_shown)}), where {name} is positional "
                f"number {names.index(name) + 1}"
            )
        (bound if name in seeds else options)[name] = value
    missing = [n for n in required if n not in bound and n in d2l10]
    if missing:
        raise TypeError(
            f"{cls_name}() missing required argument"
            f"{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(repr, missing))} (the seeds' form: "
            f"{_sig(seeds, defaults_shown)}; d2l 1.0's: "
            f"{_sig(d2l10, defaults_shown)})"
        )
    for name in seeds:
        bound.setdefault(name, defaults.get(name))
    return bound, options


def _sig(names: tuple[str, ...], defaults: dict[str, Any]) -> str:
    return ", ".join(f"{n}={defaults[n]!r}" if n in defaults else n for n in names)


def _count(low: int, high: int) -> str:
    return (
        str(low) if low == high else f"{low} or {high}" if high == low + 1 else f"{low} to {high}"
    )


if TYPE_CHECKING:
    from typing_extensions import Unpack

    from attention_multi.backends import Backend

    from ..core import Mask, MaskForms


class _Attention(Module):
    """Shared input checks of the (queries, keys, values, valid_lens) modules."""

    def _check_inputs(
        self,
        queries: Array,
        keys: Array,
        values: Array,
        sizes: tuple[int | None, int | None, int | None] | None = None,
    ) -> None:
        xp = self._backend
        arrays = (("queries", queries), ("keys", keys), ("values", values))
        dtypes = {}
        for name, x in arrays:
            check_array(xp, name, x, 3, "(batch, n, features)")
            dtype = dtypes[name] = xp.dtype_name(x)
            if dtype not in xp.float_dtypes:
                check_float(xp, name, x)  # raises
        if not queries.shape[0] == keys.shape[0] == values.shape[0]:
            raise ValueError(
                f"batch sizes differ: queries {tuple(queries.shape)}, "
                f"keys {tuple(keys.shape)}, values {tuple(values.shape)}"
            )
        if keys.shape[1] != values.shape[1]:
            raise ValueError(
                f"keys and values must have the same length (axis 1), "
                f"got keys {tuple(keys.shape)} and values "
                f"{tuple(values.shape)}"
            )
        for (name, x), size in zip(arrays, sizes or ()):
            if size is not None and x.shape[2] != size:
                raise ValueError(
                    f"{name} has feature size {x.shape[2]} (shape "
                    f"{tuple(x.shape)}) but the module expects {size}"
                )
        if sizes is not None:
            dtypes["parameters"] = self._dtype_of_params()
        if len(set(dtypes.values())) > 1:
            listing = ", ".join(f"{n} {d}" for n, d in dtypes.items())
            raise TypeError(
                f"dtypes differ ({listing}); build the module with dtype= or cast the inputs"
            )

    _SIZED_LAYER = (
        ""  # a Linear child that is never lazily sized: its weight's dtype is the module's
    )

    def _dtype_of_params(self) -> str:
        layer = getattr(self, self._SIZED_LAYER, None) if self._SIZED_LAYER else None
        if layer is not None:  # (one parameter read, not the whole list: every call asks)
            return self._backend.dtype_name(layer._param("weight"))
        arrays = self.named_arrays() if self.sized else {}
        if not arrays:  # lazily sized: the dtype the parameters will have
            return self._dtype
        return self._backend.dtype_name(next(iter(arrays.values())))

    def _line_key(self) -> tuple[Any, ...]:
        """What a kept straight line depends on beside the inputs' signature."""
        raise NotImplementedError

    def _kept_line(
        self, queries: Array, keys: Array, values: Array, valid_lens: Any, forms: Mapping[str, Any]
    ) -> small.Line | None:
        """The straight line (``core/paths/small.py``) kept from an earlier call
        with this call's signature (``small.signature``), which passed the
        same input checks: they are not repeated. None otherwise."""
        if not no_forms(forms) or opt(self._backend).is_tracing():
            return None
        kept = self.__dict__.get("_attention_line")
        if kept is None or kept[1] != small.signature(queries, keys, values, valid_lens):
            return None
        return kept[2] if kept[0] == self._line_key() else None

    def _keep_line(
        self, line: small.Line | None, queries: Array, keys: Array, values: Array, valid_lens: Any
    ) -> None:
        """Keep ``line``, the straight line of a call with these inputs,
        checked, for the next calls with their signature (outside traces)."""
        if line is None or not line.reusable or opt(self._backend).is_tracing():
            return
        sig = small.signature(queries, keys, values, valid_lens)
        if sig is not None:
            self.__dict__["_attention_line"] = (self._line_key(), sig, line)

    def _mask(
        self,
        queries: Array,
        num_keys: int,
        heads: int = 1,
        valid_lens: Array | None = None,
        **forms: Any,
    ) -> Mask:
        """The normalized mask of a call: ``valid_lens`` and ``forms``
        (``mask``, ``bias``, ``causal``, ``window``, ``offset``) for
        (batch, heads, Q, num_keys)."""
        xp = self._backend
        return make_mask(
            xp,
            queries.shape[0],
            heads,
            queries.shape[1],
            num_keys,
            valid_lens=valid_lens,
            dtype=xp.dtype_name(queries),
            heads_axis=False,
            device=xp.device_of(queries),
            **forms,
        )

    def _empty(self, queries: Array, keys: Array, values: Array) -> Array | None:
        """Zeros (batch, Q, value size) and empty weights when an axis is
        empty (no framework kernel is called); None otherwise."""
        b, nq, nk = queries.shape[0], queries.shape[1], keys.shape[1]
        if b * nq * nk:
            return None
        xp = self._backend
        self._keep_attention(zeros_for_empty(xp, (b, nq, nk), queries))
        self.__dict__["_attention_path"] = "empty"
        return zeros_for_empty(xp, (b, nq, values.shape[2]), queries, keys, values)

    @property
    def last_path(self) -> TakenPath | None:
        """The path the last call took: ``"fused"``, ``"tiled"``, ``"chunked"``,
        ``"full"``, or ``"empty"`` when an axis was empty (None before the first call)."""
        return self.__dict__.get("_attention_path")


class AdditiveAttention(_Attention):
    """Additive attention: ``w_v^T tanh(W_q q + W_k k)`` as the score.

    Two signatures (see
    [`bind_editions`][attention_multi.modules.attention.bind_editions]): the seeds'
    ``AdditiveAttention(key_size, query_size, num_hiddens, dropout)`` (3 or 4
    positional arguments) and d2l 1.0's ``AdditiveAttention(num_hiddens,
    dropout)`` (at most 2), whose ``W_k`` and ``W_q`` are lazily sized unless
    ``key_size=`` and ``query_size=`` are given.

    The (batch, queries, keys, num_hiddens) features are computed a block of
    queries at a time so that they stay within ``memory_budget`` bytes
    (default ``DEFAULT_MEMORY_BUDGET``, 512 MiB; also a module attribute);
    results do not depend on the block size.
    """

    _SEEDS = ("key_size", "query_size", "num_hiddens", "dropout")
    _D2L10 = ("num_hiddens", "dropout")

    # The two forms, for type checkers and IDEs (bind_editions tells them apart)
    @overload
    def __init__(
        self,
        key_size: int | None,
        query_size: int | None,
        num_hiddens: int,
        dropout: float,
        *,
        memory_budget: int | None = None,
        **options: Unpack[ModuleOptions],
    ) -> None: ...

    @overload
    def __init__(
        self,
        num_hiddens: int,
        dropout: float,
        *,
        key_size: int | None = None,
        query_size: int | None = None,
        memory_budget: int | None = None,
        **options: Unpack[ModuleOptions],
    ) -> None: ...

    def __init__(self, *args: Any, memory_budget: int | None = None, **kwargs: Any) -> None:
        a, options = bind_editions(
            "AdditiveAttention",
            args,
            kwargs,
            self._SEEDS,
            4,
            self._D2L10,
            {"key_size": None, "query_size": None},
        )
        key_size = check_positive_int("key_size", a["key_size"], allow_none=True)
        query_size = check_positive_int("query_size", a["query_size"], allow_none=True)
        num_hiddens = check_positive_int("num_hiddens", a["num_hiddens"])
        dropout = check_dropout("dropout", a["dropout"])
        memory_budget = check_path_options("auto", memory_budget, None)[1]
        self._start(**options)
        self.num_hiddens, self.dropout = num_hiddens, dropout
        self.memory_budget = memory_budget
        self.W_k = Linear(key_size, num_hiddens, bias=False, **self._child_options())
        self.W_q = Linear(query_size, num_hiddens, bias=False, **self._child_options())
        self.w_v = Linear(num_hiddens, 1, bias=False, **self._child_options())

    key_size = property(
        lambda self: self.W_k.in_features,
        doc="Feature size of the keys (None until the first call when lazily sized).",
    )
    query_size = property(
        lambda self: self.W_q.in_features, doc="Feature size of the queries (None until known)."
    )

    def forward(
        self,
        queries: Array,
        keys: Array,
        values: Array,
        valid_lens: Array | None = None,
        *,
        key: Any = None,
    ) -> Array:
        """``queries`` (batch, Q, query_size), ``keys`` (batch, K, key_size),
        ``values`` (batch, K, v) -> (batch, Q, v); ``valid_lens`` (batch,) or
        (batch, Q); ``key``: the JAX dropout key in training mode."""
        self._check_inputs(queries, keys, values, (self.query_size, self.key_size, None))
        xp = self._backend
        mask = self._mask(queries, keys.shape[1], valid_lens=valid_lens)
        empty = self._empty(queries, keys, values)
        if empty is not None:
            return empty
        scores = self._scores(self.W_q(queries), self.W_k(keys))
        weights = masked_softmax(xp, scores, mask.boolean_one_head(xp, xp.device_of(queries)))
        rs = opt(xp).reshape
        shape = opt(xp).shape(values)
        values4 = rs(values, shape[:1] + (1,) + shape[1:])
        _, values4 = guard_unused(xp, mask, values4, values4)
        self._keep_attention(weights)
        self.__dict__["_attention_path"] = "full"
        return xp.matmul(
            self._dropout(weights, self.dropout, key), rs(values4, opt(xp).shape(values))
        )

    def _scores(self, q: Array, k: Array) -> Array:
        """(b, nq, nk) scores, over blocks of queries within the memory
        budget; under autodiff each block's features are recomputed in the
        backward pass (``Autodiff.checkpoint``) instead of kept."""
        xp, h = self._backend, self.num_hiddens
        b, nq, nk = opt(xp).shape(q)[0], q.shape[1], k.shape[1]
        itemsize = work_itemsize(xp, q)
        budget = self.memory_budget or DEFAULT_MEMORY_BUDGET
        # features and their tanh, and in the backward pass their gradients:
        # 4 (b, block, nk, h) arrays
        block = max(1, budget // max(1, 4 * b * nk * h * itemsize))
        rs = opt(xp).reshape
        k = rs(k, (b, 1, nk, h))

        def scores(qb: Array, k: Array) -> Array:
            features = xp.tanh(rs(qb, (b, qb.shape[1], 1, h)) + k)
            return rs(self.w_v(features), (b, qb.shape[1], nk))

        chunks = [
            opt(xp).checkpoint(scores, q[:, q0 : q0 + block], k) for q0 in range(0, nq, block)
        ]
        return chunks[0] if len(chunks) == 1 else xp.concatenate(chunks, axis=1)


class DotProductAttention(_Attention):
    """Scaled dot-product attention: ``softmax(Q K^T / sqrt(d)) V``.

    How it is computed (keywords, also module attributes):

    - ``path="auto"``: the full path for small calls (at most
      ``SMALL_SCORES`` scores, on a CPU ``Costs.small_scores``); else the
      backend's fused kernel when dropout is inactive (eval mode or
      ``dropout=0``) and it fits in ``memory_budget``; else the
      chunked online-softmax path when the float32 (batch, queries, keys)
      scores would exceed ``memory_budget``; else the full path, which
      materializes the scores. ``"fused"``, ``"chunked"`` and ``"full"``
      force a path (``"fused"`` still falls back when the backend has no
      kernel for the case or dropout is active). ``last_path`` tells which
      one the last call took.
    - ``memory_budget``: bytes of score-sized intermediates one call may use
      (default ``DEFAULT_MEMORY_BUDGET``, 512 MiB).
    - ``chunk_size``: queries and keys per block on the chunked path
      (default: up to 1024 keys, as many queries as fit the budget).

    All paths agree up to float rounding. ``attention_weights`` is available
    after every call: the weights (before dropout) of the call that produced
    them. Small calls take the full path, which keeps
    them; after a fused, tiled or chunked call they are computed on first
    access from copies of the call's queries, keys and mask, which later
    writes into the caller's arrays do not reach. Reading them makes the
    next call take the full path while its scores fit in
    ``memory_budget`` (weights read after every call, as d2l's Transformer
    does, cost no second pass); a call whose weights are not read lets the
    one after it go back to ``"auto"``'s choice.
    """

    def __init__(
        self,
        dropout: float,
        *,
        path: AttentionPath = "auto",
        memory_budget: int | None = None,
        chunk_size: int | None = None,
        **options: Unpack[ModuleOptions],
    ) -> None:
        dropout = check_dropout("dropout", dropout)
        checked = check_path_options(path, memory_budget, chunk_size)
        self._start(**options)
        self.dropout = dropout
        self.path, self.memory_budget, self.chunk_size = checked

    def forward(
        self,
        queries: Array,
        keys: Array,
        values: Array,
        valid_lens: Array | None = None,
        *,
        key: Any = None,
        **forms: Unpack[MaskForms],
    ) -> Array:
        """``queries`` (batch, Q, d), ``keys`` (batch, K, d), ``values``
        (batch, K, v) -> (batch, Q, v). ``valid_lens`` and the mask keywords
        (``mask``, ``bias``, ``causal``, ``window``, ``mask_mod``,
        ``score_mod``, ``segment_ids``: ``MaskForms``) are those of
        ``dot_product_attention``; ``key``: the JAX dropout key in training
        mode."""
        checked_forms("DotProductAttention.forward", forms)
        line = self._kept_line(queries, keys, values, valid_lens, forms)
        if line is None:
            self._check_inputs(queries, keys, values)
            if queries.shape[2] != keys.shape[2]:
                raise ValueError(
                    f"queries and keys must have the same feature size, got "
                    f"queries {tuple(queries.shape)} and keys "
                    f"{tuple(keys.shape)}"
                )
            line = self._new_line(queries, keys, values, valid_lens, forms)
            self._keep_line(line, queries, keys, values, valid_lens)
        if line is not None:
            return self._straight(queries, keys, values, valid_lens, key, line)
        m = self._mask(queries, keys.shape[1], valid_lens=valid_lens, **forms)
        rs, xp = opt(self._backend).reshape, self._backend
        q, k, v = (
            rs(x, shape[:1] + (1,) + shape[1:])
            for x, shape in ((x, opt(xp).shape(x)) for x in (queries, keys, values))
        )
        out = self._attend(q, k, v, m, key)
        # (an index, not a reshape: its backward hands the kernel a contiguous
        # gradient; a reshape passes out.sum()'s broadcast one, which torch's
        # CPU matrix products take element by element, 3x the step here)
        return out[:, 0]

    def _line_key(self) -> tuple[Any, ...]:
        return (self.path, self.memory_budget)

    def _new_line(
        self, queries: Array, keys: Array, values: Array, valid_lens: Any, forms: Mapping[str, Any]
    ) -> small.Line | None:
        """The straight line (``core/paths/small.py``) of a call whose inputs
        were checked; None when the call does not take it."""
        return straight_line(
            self._backend,
            self.path,
            queries,
            keys,
            values,
            valid_lens,
            forms,
            self.__dict__.get("_attention_read", False),
            self.memory_budget,
        )

    def _straight(
        self,
        queries: Array,
        keys: Array,
        values: Array,
        valid_lens: Any,
        key: Any,
        line: small.Line,
    ) -> Array:
        """The full path of a small call with lengths or nothing (``core/small.py``)."""
        self.__dict__.pop("_attention_read", None)
        options = Options(self.dropout if self.training else 0.0, key)
        done = compute(
            self._backend, queries, keys, values, valid_lens, None, line, options=options
        )
        self._keep_attention(done.weights)
        self.__dict__["_attention_path"] = done.path
        return done.output

    def _attend(
        self,
        queries: Array,
        keys: Array,
        values: Array,
        mask: Mask,
        key: Any,
        private: bool = False,
    ) -> Array:
        """Attention on checked (batch, heads, n, d) inputs and a normalized
        mask; ``private``: queries and keys that only this call holds."""
        read = self.__dict__.pop("_attention_read", False)  # the last call's weights
        options = Options(
            self.dropout if self.training else 0.0,
            key,
            self.path,
            self.memory_budget,
            self.chunk_size,
            "now" if read else "later",
            private,
        )
        done = compute(
            self._backend, queries, keys, values, None, lambda: mask, None, options=options
        )
        self._keep_attention(done.weights)
        self.__dict__["_attention_path"] = done.path
        return done.output


def _heads(xp: Backend, x: Array, h: int) -> Array:
    """(b, n, h * s) -> (b, h, n, s), a view where possible."""
    b, n, hidden = opt(xp).shape(x)
    return xp.transpose(opt(xp).reshape(x, (b, n, h, hidden // h)), (0, 2, 1, 3))


class MultiHeadAttention(_Attention):
    """Multi-head attention over ``num_heads`` scaled dot-product heads.

    Two signatures (see
    [`bind_editions`][attention_multi.modules.attention.bind_editions]): the seeds'
    ``MultiHeadAttention(key_size, query_size, value_size, num_hiddens,
    num_heads, dropout, bias=False)`` (5 to 7 positional arguments) and d2l
    1.0's ``MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False)``
    (at most 4), whose ``W_q``, ``W_k``, ``W_v`` are lazily sized
    (``Linear(None, num_hiddens)``: the first call gives their input sizes)
    unless ``key_size=``, ``query_size=``, ``value_size=`` are given.

    The heads reach the attention as (batch, heads, n, head_size) views of the
    projections, so a fused kernel takes them without copies. ``path``,
    ``memory_budget`` and ``chunk_size`` are those of ``DotProductAttention``
    (the ``attention`` child; also readable and settable here).
    """

    _SEEDS = ("key_size", "query_size", "value_size", "num_hiddens", "num_heads", "dropout", "bias")
    _SIZED_LAYER = "W_o"
    _D2L10 = ("num_hiddens", "num_heads", "dropout", "bias")

    # The two forms, for type checkers and IDEs (bind_editions tells them apart)
    @overload
    def __init__(
        self,
        key_size: int | None,
        query_size: int | None,
        value_size: int | None,
        num_hiddens: int,
        num_heads: int,
        dropout: float,
        bias: bool = False,
        *,
        num_kv_heads: int | None = None,
        path: AttentionPath = "auto",
        memory_budget: int | None = None,
        chunk_size: int | None = None,
        **options: Unpack[ModuleOptions],
    ) -> None: ...

    @overload
    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float,
        bias: bool = False,
        *,
        key_size: int | None = None,
        query_size: int | None = None,
        value_size: int | None = None,
        num_kv_heads: int | None = None,
        path: AttentionPath = "auto",
        memory_budget: int | None = None,
        chunk_size: int | None = None,
        **options: Unpack[ModuleOptions],
    ) -> None: ...

    def __init__(
        self,
        *args: Any,
        num_kv_heads: int | None = None,
        path: AttentionPath = "auto",
        memory_budget: int | None = None,
        chunk_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        a, options = bind_editions(
            "MultiHeadAttention",
            args,
            kwargs,
            self._SEEDS,
            6,
            self._D2L10,
            {"key_size": None, "query_size": None, "value_size": None, "bias": False},
        )
        sizes = {
            n: check_positive_int(n, a[n], allow_none=True)
            for n in ("key_size", "query_size", "value_size")
        }
        num_hiddens = check_positive_int("num_hiddens", a["num_hiddens"])
        num_heads = check_heads(num_hiddens, a["num_heads"])
        num_kv_heads = check_kv_heads(num_heads, num_kv_heads)
        dropout = check_dropout("dropout", a["dropout"])
        bias = check_bool("bias", a["bias"])
        check_path_options(path, memory_budget, chunk_size)
        self._start(**options)
        self.num_kv_heads = num_kv_heads
        self.num_hiddens, self.num_heads = num_hiddens, num_heads
        self.attention = DotProductAttention(
            dropout,
            path=path,
            memory_budget=memory_budget,
            chunk_size=chunk_size,
            **self._child_options(),
        )
        kv_hiddens = self.num_kv_heads * (num_hiddens // num_heads)
        self.W_q = Linear(sizes["query_size"], num_hiddens, bias=bias, **self._child_options())
        self.W_k = Linear(sizes["key_size"], kv_hiddens, bias=bias, **self._child_options())
        self.W_v = Linear(sizes["value_size"], kv_hiddens, bias=bias, **self._child_options())
        self.W_o = Linear(num_hiddens, num_hiddens, bias=bias, **self._child_options())

    key_size = property(
        lambda self: self.W_k.in_features,
        doc="Feature size of the keys (None until the first call when lazily sized).",
    )
    query_size = property(
        lambda self: self.W_q.in_features, doc="Feature size of the queries (None until known)."
    )
    value_size = property(
        lambda self: self.W_v.in_features, doc="Feature size of the values (None until known)."
    )

    def forward(
        self,
        queries: Array,
        keys: Array,
        values: Array,
        valid_lens: Array | None = None,
        *,
        key: Any = None,
        cache: Any = None,
        **forms: Unpack[MaskForms],
    ) -> Any:
        """Multi-head attention of ``queries`` (batch, Q, query_size) over
        ``keys`` and ``values`` (batch, K, key_size|value_size); the masking
        forms are those of ``am.dot_product_attention`` (``mask``/``bias``
        may carry a heads axis: (batch, heads, Q, K)).

        With ``cache`` (from ``init_cache``): this step's keys and values are
        projected and written at the cache's length, and the queries attend
        causally (bottom-right) over every cached position so far; the keys
        axis of ``valid_lens``, ``mask``, ``bias``, ``segment_ids`` is then
        the cache's (``max_len``), and a ``mask_mod``'s ``q_idx`` is the
        query's position in the cache. Returns ``(output, new cache)``.
        """
        checked_forms("MultiHeadAttention.forward", forms)
        line = (
            None if cache is not None else self._kept_line(queries, keys, values, valid_lens, forms)
        )
        if line is None:
            sizes = (self.query_size, self.key_size, self.value_size)
            self._check_inputs(queries, keys, values, sizes)
        xp, h = self._backend, self.num_heads
        q = _heads(xp, self.W_q(queries), h)
        k = _heads(xp, self.W_k(keys), self.num_kv_heads)
        v = _heads(xp, self.W_v(values), self.num_kv_heads)
        if cache is None:
            if line is None:
                line = self.attention._new_line(q, k, v, valid_lens, forms)
                self._keep_line(line, queries, keys, values, valid_lens)
            if line is not None:
                out = self.attention._straight(q, k, v, valid_lens, key, line)
                b, n = opt(xp).shape(queries)[:2]
                out = xp.transpose(out, (0, 2, 1, 3))
                return self.W_o(opt(xp).reshape(out, (b, n, self.num_hiddens)))
        num_keys, offset = keys.shape[1], None
        if cache is not None:
            start = self._check_cache(cache, queries, keys)
            k = opt(xp).write_slice(cache.keys, k, start, 2)
            v = opt(xp).write_slice(cache.values, v, start, 2)
            end = start + keys.shape[1]  # an int, or traced (jax.jit)
            num_keys, offset = cache.max_len, end - queries.shape[1]
            forms = {**forms, "causal": True}
            length = (
                end
                if xp.is_array(end)
                else xp.asarray(np.asarray(end, np.int32), device=xp.device_of(cache.keys))
            )
            cache = KVCache(k, v, length)
        m = self._mask(queries, num_keys, h, valid_lens, offset=offset, **forms)
        out = self.attention._attend(q, k, v, m, key, private=cache is None)
        out = xp.transpose(out, (0, 2, 1, 3))
        b, n = opt(xp).shape(out)[:2]
        out = self.W_o(opt(xp).reshape(out, (b, n, self.num_hiddens)))
        return out if cache is None else (out, cache)

    def _line_key(self) -> tuple[Any, ...]:
        # (the parameters' dtype is checked against the inputs')
        return (self.path, self.memory_budget, self._dtype_of_params())

    def init_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty ``KVCache`` for decoding ``batch_size`` sequences of up to
        ``max_len`` positions: zeros (batch_size, num_kv_heads, max_len,
        head_size) in the dtype and on the device of the parameters, length 0."""
        for name, n in (("batch_size", batch_size), ("max_len", max_len)):
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        xp = self._backend
        weight = self.W_o.named_arrays()["weight"]  # (never lazily sized)
        dtype, device = xp.dtype_name(weight), xp.device_of(weight)
        shape = (
            int(batch_size),
            self.num_kv_heads,
            int(max_len),
            self.num_hiddens // self.num_heads,
        )
        opt(xp).register_tree(KVCache, KVCache._flatten, KVCache._unflatten)
        return KVCache(
            xp.zeros(shape, dtype, device),
            xp.zeros(shape, dtype, device),
            xp.asarray(np.asarray(0, np.int32), device=device),
        )

    def _check_cache(self, cache: Any, queries: Array, keys: Array) -> Array | int:
        """The cache's length (an int, or a traced 0-d array under jax.jit),
        after checking that ``cache`` belongs to this module and the call."""
        xp = self._backend
        if not isinstance(cache, KVCache):
            raise TypeError(
                f"cache must be a KVCache from this module's init_cache(), "
                f"got {type(cache).__name__}"
            )
        if not all(xp.is_array(x) for x in (cache.keys, cache.values, cache.length)):
            raise TypeError(
                f"cache holds {_backend_name(cache.keys)} but this module runs on "
                f"the {xp.name} backend; make the cache with its init_cache()"
            )
        size = self.num_hiddens // self.num_heads
        shape = tuple(cache.keys.shape)
        if (
            len(shape) != 4
            or shape[1] != self.num_kv_heads
            or shape[3] != size
            or tuple(cache.values.shape) != shape
        ):
            raise ValueError(
                f"cache of another module: its keys {shape} and values "
                f"{tuple(cache.values.shape)} are not (batch, num_kv_heads="
                f"{self.num_kv_heads}, max_len, head_size={size}); make it "
                f"with this module's init_cache()"
            )
        if shape[0] != queries.shape[0]:
            raise ValueError(
                f"cache was made for batch_size={shape[0]} but the queries "
                f"{tuple(queries.shape)} have batch size {queries.shape[0]}"
            )
        dtype, want = xp.dtype_name(cache.keys), xp.dtype_name(queries)
        if dtype != want:
            raise TypeError(f"cache has dtype {dtype} but the queries have {want}")
        if not opt(xp).is_concrete(cache.length):
            return cache.length
        start = int(xp.to_numpy(cache.length))
        if start + keys.shape[1] > shape[2]:
            raise ValueError(
                f"decoding past max_len: the cache holds {start} of "
                f"max_len={shape[2]} positions and this step adds "
                f"{keys.shape[1]} (keys {tuple(keys.shape)}); make a "
                f"larger cache with init_cache(batch_size, max_len)"
            )
        return start

    @property
    def attention_weights(self) -> Array | None:
        """Weights of the last call, (batch * num_heads, queries, keys) as in d2l."""
        return self.attention.attention_weights

    @property
    def last_path(self) -> TakenPath | None:
        """The path the last call took (that of the ``attention`` child)."""
        return self.attention.last_path

    path = property(
        lambda self: self.attention.path, lambda self, value: setattr(self.attention, "path", value)
    )
    memory_budget = property(
        lambda self: self.attention.memory_budget,
        lambda self, v: setattr(self.attention, "memory_budget", v),
    )
    chunk_size = property(
        lambda self: self.attention.chunk_size,
        lambda self, v: setattr(self.attention, "chunk_size", v),
    )
