"""The attention modules of d2l: additive, scaled dot-product and multi-head."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core import (DEFAULT_MEMORY_BUDGET, attend, check_path_options, make_mask,
                    masked_softmax, zeros_for_empty)
from ..core.checks import check_array, check_float
from ..core.paths import work_itemsize
from ..functional import check_heads
from ..types import Array, AttentionPath, ModuleOptions, TakenPath, Window
from .base import Linear, Module

if TYPE_CHECKING:
    from typing_extensions import Unpack


class _Attention(Module):
    """Shared input checks of the (queries, keys, values, valid_lens) modules."""

    def _check_inputs(self, queries, keys, values, sizes=None):
        B = self._backend
        arrays = (("queries", queries), ("keys", keys), ("values", values))
        for name, x in arrays:
            check_array(B, name, x, 3, "(batch, n, features)")
            check_float(B, name, x)
        batch = {name: x.shape[0] for name, x in arrays}
        if len(set(batch.values())) > 1:
            raise ValueError(f"batch sizes differ: queries {tuple(queries.shape)}, "
                             f"keys {tuple(keys.shape)}, values {tuple(values.shape)}")
        if keys.shape[1] != values.shape[1]:
            raise ValueError(f"keys and values must have the same length (axis 1), "
                             f"got keys {tuple(keys.shape)} and values "
                             f"{tuple(values.shape)}")
        for (name, x), size in zip(arrays, sizes or ()):
            if size is not None and x.shape[2] != size:
                raise ValueError(f"{name} has feature size {x.shape[2]} (shape "
                                 f"{tuple(x.shape)}) but the module expects {size}")
        dtypes = {name: B.dtype_name(x) for name, x in arrays}
        if sizes is not None:
            dtypes["parameters"] = self._dtype_of_params()
        if len(set(dtypes.values())) > 1:
            listing = ", ".join(f"{n} {d}" for n, d in dtypes.items())
            raise TypeError(f"dtypes differ ({listing}); build the module with "
                            f"dtype= or cast the inputs")

    def _dtype_of_params(self):
        return self._backend.dtype_name(next(iter(self.named_arrays().values())))

    def _mask(self, queries, keys, heads=1, valid_lens=None, **forms):
        """The normalized mask of a call: ``valid_lens`` and ``forms``
        (``mask``, ``bias``, ``causal``, ``window``) for (batch, heads, Q, K)."""
        B = self._backend
        return make_mask(B, queries.shape[0], heads, queries.shape[1], keys.shape[1],
                         valid_lens=valid_lens, dtype=B.dtype_name(queries),
                         heads_axis=False, device=B.device_of(queries), **forms)

    def _empty(self, queries, keys, values):
        """Zeros (batch, Q, value size) and empty weights when an axis is
        empty (no framework kernel is called); None otherwise."""
        b, nq, nk = queries.shape[0], queries.shape[1], keys.shape[1]
        if b * nq * nk:
            return None
        B = self._backend
        self._keep_attention(zeros_for_empty(B, (b, nq, nk), queries))
        self.__dict__["_attention_path"] = "empty"
        return zeros_for_empty(B, (b, nq, values.shape[2]), queries, keys, values)

    @property
    def last_path(self) -> TakenPath | None:
        """The path the last call took: ``"fused"``, ``"chunked"`` or ``"full"``
        (None before the first call)."""
        return self.__dict__.get("_attention_path")


class AdditiveAttention(_Attention):
    """Additive attention: ``w_v^T tanh(W_q q + W_k k)`` as the score.

    The (batch, queries, keys, num_hiddens) features are computed a block of
    queries at a time so that they stay within ``memory_budget`` bytes
    (default ``DEFAULT_MEMORY_BUDGET``, 512 MiB; also a module attribute);
    results do not depend on the block size.
    """

    def __init__(self, key_size: int, query_size: int, num_hiddens: int,
                 dropout: float, *, memory_budget: int | None = None,
                 **options: Unpack[ModuleOptions]) -> None:
        self._start(**options)
        self.key_size, self.query_size, self.num_hiddens = key_size, query_size, num_hiddens
        self.dropout = float(dropout)
        self.memory_budget = check_path_options("auto", memory_budget, None)[1]
        self.W_k = Linear(key_size, num_hiddens, bias=False, **self._child_options())
        self.W_q = Linear(query_size, num_hiddens, bias=False, **self._child_options())
        self.w_v = Linear(num_hiddens, 1, bias=False, **self._child_options())

    def forward(self, queries: Array, keys: Array, values: Array,
                valid_lens: Array | None = None, *, key: Any = None) -> Array:
        """``queries`` (batch, Q, query_size), ``keys`` (batch, K, key_size),
        ``values`` (batch, K, v) -> (batch, Q, v); ``valid_lens`` (batch,) or
        (batch, Q); ``key``: the JAX dropout key in training mode."""
        self._check_inputs(queries, keys, values, (self.query_size, self.key_size, None))
        B = self._backend
        mask = self._mask(queries, keys, valid_lens=valid_lens)
        empty = self._empty(queries, keys, values)
        if empty is not None:
            return empty
        scores = self._scores(self.W_q(queries), self.W_k(keys))
        visible = mask.boolean(B, B.device_of(queries))
        if visible is not None:      # (batch, 1, Q|1, K) -> (batch, Q|1, K)
            visible = visible.reshape((visible.shape[0],) + tuple(visible.shape[2:]))
        weights = masked_softmax(B, scores, visible)
        values4 = values.reshape((values.shape[0], 1) + tuple(values.shape[1:]))
        _, values4 = mask.guard_unused(B, values4, values4)
        self._keep_attention(weights)
        self.__dict__["_attention_path"] = "full"
        return B.matmul(self._dropout(weights, self.dropout, key),
                        values4.reshape(tuple(values.shape)))

    def _scores(self, q, k):
        """(b, nq, nk) scores, over blocks of queries within the memory
        budget; under autodiff each block's features are recomputed in the
        backward pass (``Backend.checkpoint``) instead of kept."""
        B, h = self._backend, self.num_hiddens
        b, nq, nk = q.shape[0], q.shape[1], k.shape[1]
        itemsize = work_itemsize(B, q)
        budget = self.memory_budget or DEFAULT_MEMORY_BUDGET
        # features and their tanh, and in the backward pass their gradients:
        # 4 (b, block, nk, h) arrays
        block = max(1, budget // max(1, 4 * b * nk * h * itemsize))
        k = k.reshape((b, 1, nk, h))

        def scores(qb, k):
            features = B.tanh(qb.reshape((b, qb.shape[1], 1, h)) + k)
            return self.w_v(features).reshape((b, qb.shape[1], nk))

        chunks = [B.checkpoint(scores, q[:, q0:q0 + block], k)
                  for q0 in range(0, nq, block)]
        return chunks[0] if len(chunks) == 1 else B.concatenate(chunks, axis=1)


class DotProductAttention(_Attention):
    """Scaled dot-product attention: ``softmax(Q K^T / sqrt(d)) V``.

    How it is computed (keywords, also module attributes):

    - ``path="auto"``: the backend's fused kernel when dropout is inactive
      (eval mode or ``dropout=0``) and it fits in ``memory_budget``; else the
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
    after every call; after a fused or chunked call it is computed on first
    access from the kept queries and keys (this materializes the
    (batch, queries, keys) weights).
    """

    def __init__(self, dropout: float, *, path: AttentionPath = "auto",
                 memory_budget: int | None = None, chunk_size: int | None = None,
                 **options: Unpack[ModuleOptions]) -> None:
        self._start(**options)
        self.dropout = float(dropout)
        self.path, self.memory_budget, self.chunk_size = check_path_options(
            path, memory_budget, chunk_size)

    def forward(self, queries: Array, keys: Array, values: Array,
                valid_lens: Array | None = None, *, mask: Array | None = None,
                bias: Array | None = None, causal: bool = False, window: Window = None,
                key: Any = None) -> Array:
        """``queries`` (batch, Q, d), ``keys`` (batch, K, d), ``values``
        (batch, K, v) -> (batch, Q, v). ``valid_lens``, ``mask``, ``bias``,
        ``causal`` and ``window`` are those of ``dot_product_attention``;
        ``key``: the JAX dropout key in training mode."""
        self._check_inputs(queries, keys, values)
        if queries.shape[2] != keys.shape[2]:
            raise ValueError(f"queries and keys must have the same feature size, got "
                             f"queries {tuple(queries.shape)} and keys "
                             f"{tuple(keys.shape)}")
        m = self._mask(queries, keys, valid_lens=valid_lens, mask=mask, bias=bias,
                       causal=causal, window=window)
        q, k, v = (x.reshape((x.shape[0], 1) + tuple(x.shape[1:]))
                   for x in (queries, keys, values))
        out = self._attend(q, k, v, m, key)
        return out.reshape((out.shape[0],) + tuple(out.shape[2:]))

    def _attend(self, queries, keys, values, mask, key):
        """Attention on checked (batch, heads, n, d) inputs and a normalized mask."""
        out, kept, taken = attend(
            self._backend, queries, keys, values, mask,
            dropout=self.dropout if self.training else 0.0, key=key, path=self.path,
            memory_budget=self.memory_budget, chunk_size=self.chunk_size)
        self._keep_attention(kept)
        self.__dict__["_attention_path"] = taken
        return out


class MultiHeadAttention(_Attention):
    """Multi-head attention over ``num_heads`` scaled dot-product heads.

    The heads reach the attention as (batch, heads, n, head_size) views of the
    projections, so a fused kernel takes them without copies. ``path``,
    ``memory_budget`` and ``chunk_size`` are those of ``DotProductAttention``
    (the ``attention`` child; also readable and settable here).
    """

    def __init__(self, key_size: int, query_size: int, value_size: int, num_hiddens: int,
                 num_heads: int, dropout: float, bias: bool = False, *,
                 path: AttentionPath = "auto", memory_budget: int | None = None,
                 chunk_size: int | None = None, **options: Unpack[ModuleOptions]) -> None:
        self._start(**options)
        check_heads(num_hiddens, num_heads)
        self.key_size, self.query_size, self.value_size = key_size, query_size, value_size
        self.num_hiddens, self.num_heads = num_hiddens, num_heads
        self.attention = DotProductAttention(
            dropout, path=path, memory_budget=memory_budget, chunk_size=chunk_size,
            **self._child_options())
        self.W_q = Linear(query_size, num_hiddens, bias=bias, **self._child_options())
        self.W_k = Linear(key_size, num_hiddens, bias=bias, **self._child_options())
        self.W_v = Linear(value_size, num_hiddens, bias=bias, **self._child_options())
        self.W_o = Linear(num_hiddens, num_hiddens, bias=bias, **self._child_options())

    def forward(self, queries: Array, keys: Array, values: Array,
                valid_lens: Array | None = None, *, mask: Array | None = None,
                bias: Array | None = None, causal: bool = False, window: Window = None,
                key: Any = None) -> Array:
        """``queries`` (batch, Q, query_size), ``keys`` (batch, K, key_size),
        ``values`` (batch, K, value_size) -> (batch, Q, num_hiddens). The masks
        are those of ``dot_product_attention`` (``mask`` and ``bias``
        broadcastable to (batch, num_heads, Q, K)); ``key``: the JAX dropout
        key in training mode."""
        self._check_inputs(queries, keys, values,
                           (self.query_size, self.key_size, self.value_size))
        B, h = self._backend, self.num_heads
        m = self._mask(queries, keys, h, valid_lens=valid_lens, mask=mask, bias=bias,
                       causal=causal, window=window)

        def heads(x):   # (b, n, h * s) -> (b, h, n, s), a view where possible
            b, n, hidden = x.shape
            return B.transpose(x.reshape((b, n, h, hidden // h)), (0, 2, 1, 3))

        out = self.attention._attend(heads(self.W_q(queries)), heads(self.W_k(keys)),
                                     heads(self.W_v(values)), m, key)
        out = B.transpose(out, (0, 2, 1, 3))
        b, n = out.shape[0], out.shape[1]
        return self.W_o(out.reshape((b, n, self.num_hiddens)))

    @property
    def attention_weights(self) -> Array | None:
        """Weights of the last call, (batch * num_heads, queries, keys) as in d2l."""
        return self.attention.attention_weights

    @property
    def last_path(self) -> TakenPath | None:
        """The path the last call took (that of the ``attention`` child)."""
        return self.attention.last_path

    path = property(lambda self: self.attention.path,
                    lambda self, value: setattr(self.attention, "path", value))
    memory_budget = property(lambda self: self.attention.memory_budget,
                             lambda self, v: setattr(self.attention, "memory_budget", v))
    chunk_size = property(lambda self: self.attention.chunk_size,
                          lambda self, v: setattr(self.attention, "chunk_size", v))
