"""``attend``: scaled dot-product attention on checked arrays, on the path it picks."""
import math
import numbers

from . import paths

DEFAULT_MEMORY_BUDGET = 512 * 2**20
"""Default extra memory (bytes) one attention call may use for its score-sized
intermediates; modules take ``memory_budget=`` to change it per module."""

PATHS = ("auto", "fused", "tiled", "chunked", "full")


def check_path_options(path, memory_budget, chunk_size):
    """Validated ``(path, memory_budget, chunk_size)`` of an attention module."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(map(repr, PATHS))}, "
                         f"got {path!r}")
    checked = []
    for name, value in (("memory_budget", memory_budget), ("chunk_size", chunk_size)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
                    or value < 1:
                raise ValueError(f"{name} must be None or a positive int, got {value!r}")
            value = int(value)
        checked.append(value)
    return (path, *checked)


def zeros_for_empty(B, shape, like, *inputs):
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


def attend(B, queries, keys, values, mask, *, scale=None, dropout=None, path="auto",
           memory_budget=None, chunk_size=None):
    """Scaled dot-product attention on checked arrays, on the path it picks.

    ``queries`` (batch, heads, Q, d); ``keys``, ``values`` (batch, kv_heads,
    K, d|dv); ``mask`` the normalized ``Mask``; ``scale`` default
    ``1/sqrt(d)``; ``dropout`` None when inactive, else a function
    ``dropout(weights, index=None)``.

    Paths (``path=``):

    - ``"fused"``: the backend's own kernel (``Backend.fused_attention``),
      whatever its memory needs; taken only when dropout is inactive.
    - ``"tiled"``: one tile per batch element and block of queries over the
      keys that block may see (padding is skipped), each through the
      backend's kernel or the core's softmax-product; needs concrete lengths.
    - ``"chunked"``: the online-softmax recurrence over blocks of queries and
      keys; extra memory is O(Q d) plus one block of scores, whose size
      follows ``chunk_size`` or else ``memory_budget``.
    - ``"full"``: materializes the (batch, heads, Q, K) scores and keeps the weights.
    - ``"auto"`` (default): ``"fused"`` if dropout is inactive and the
      backend's kernel fits in ``memory_budget``; else ``"tiled"`` if dropout
      is inactive and the lengths are known; else ``"chunked"`` if the float32
      scores would exceed ``memory_budget`` (default 512 MiB); else ``"full"``.

    A forced ``"fused"`` or ``"tiled"`` falls back as ``"auto"`` does when it
    cannot run (no kernel for the case, traced lengths, dropout active). A
    query with no visible key gets a zero output; when an axis is empty
    (no batch, heads, queries or keys) no kernel is called: the path is
    ``"empty"`` and the output is zeros of the right shape.

    Returns ``(output (batch, heads, Q, dv), weights (batch * heads, Q, K) or
    a function computing them, path taken)``. Fused, tiled and chunked calls
    compute the weights only when the function is called.
    """
    if path not in PATHS:
        check_path_options(path, memory_budget, chunk_size)   # raises
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
    scale = 1.0 / math.sqrt(queries.shape[-1]) if scale is None else scale
    batch, heads, num_q = queries.shape[:3]
    num_k = keys.shape[2]

    def kept():
        return paths.weights(B, queries, keys, mask, scale)

    if 0 in (batch, heads, num_q, num_k):   # nothing to attend: no kernel is called
        out = zeros_for_empty(B, (batch, heads, num_q, values.shape[-1]), queries, keys,
                              values)
        weights = zeros_for_empty(B, (batch * heads, num_q, num_k), queries)
        return out, weights, "empty"
    if dropout is None and path in ("auto", "fused"):
        out = paths.fused(B, queries, keys, values, mask, scale,
                          None if path == "fused" else budget)
        if out is not None:
            return out, kept, "fused"
    if dropout is None and path in ("auto", "fused", "tiled"):
        out = paths.tiled(B, queries, keys, values, mask, scale, budget, chunk_size)
        if out is not None:
            return out, kept, "tiled"
    scores_bytes = batch * heads * num_q * num_k * paths.work_itemsize(B, queries)
    if path == "chunked" or (path != "full" and scores_bytes > budget):
        out = paths.chunked(B, queries, keys, values, mask, scale, dropout, budget,
                            chunk_size)
        return out, kept, "chunked"
    out, weights = paths.full(B, queries, keys, values, mask, scale, dropout)
    return out, weights, "full"
