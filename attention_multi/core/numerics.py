"""Numerics every path shares: the compute dtype, the fill value of masked
scores, constants made once, and the arithmetic of empty rows.

- Half precision is computed in float32, the product with the values too:
  the output is rounded once (``weighted``).
- A masked score becomes ``fill_value``, the lowest finite number of the
  compute dtype (never ``-inf``, so nothing becomes NaN).
- A row that sees no key gives zeros, in the autodiff graph with exact zero
  gradients (``empty_rows``, ``zeros_for_empty``, ``normalize``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from attention_multi.backends.capabilities import opt
from attention_multi.backends.protocol import HALF_DTYPES

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ..types import Array

DEFAULT_MEMORY_BUDGET = 512 * 2**20
"""Default extra memory (bytes) one attention call may use for its score-sized
intermediates; modules take ``memory_budget=`` to change it per module."""


def compute_dtype(dtype: str) -> str:
    """The dtype scores are computed in: float32 for half precision."""
    return "float32" if dtype in HALF_DTYPES else dtype


# Filled at import: a dict that grows under torch.compile fails its guard on
# the next call (one recompile for nothing).
_FILL: dict[str, float] = {
    d: float(np.finfo(np.dtype(compute_dtype(d))).min)
    for d in ("float16", "bfloat16", "float32", "float64")
}


def fill_value(dtype: str) -> float:
    """What a masked score becomes: the lowest finite value of ``dtype``."""
    value = _FILL.get(dtype)
    if value is None:
        value = _FILL[dtype] = float(np.finfo(np.dtype(compute_dtype(dtype))).min)
    return value


_CONSTANTS: dict = {}  # (backend, what, device) -> array, made outside traces
_CONSTANTS_MAX = 64


def constant(xp: Backend, what: tuple[Any, ...], device: Any, make: Callable[[], Array]) -> Array:
    """``make()``, kept for the next calls outside traces (made once)."""
    if opt(xp).is_tracing():
        return make()
    cache_key = (xp.name, what, device)
    value = _CONSTANTS.get(cache_key)
    if value is None:
        if len(_CONSTANTS) >= _CONSTANTS_MAX:
            _CONSTANTS.clear()
        value = _CONSTANTS[cache_key] = make()
    return value


def scalar(xp: Backend, name: str, value: float, dtype: str, device: Any) -> Array:
    """``value`` as a 0-d array of ``dtype``, made once (``constant``)."""

    def make() -> Array:
        return xp.asarray(np.asarray(value, np.dtype(dtype)), device=device)

    return constant(xp, (name, dtype), device, make)


def fill(xp: Backend, dtype: str, device: Any) -> Array:
    """``fill_value`` as a 0-d array of the compute dtype (a Python float
    would promote float32 to float64 in NumPy 1.x)."""
    work = compute_dtype(dtype)
    return scalar(xp, "fill", fill_value(work), work, device)


def fill_against(xp: Backend, dtype: str, device: Any) -> Array | float:
    """``fill_value`` for ``where`` beside the compute dtype: a Python float
    where ``Dtypes.weak_scalars`` (torch's ``where`` is faster so), else ``fill``."""
    return fill_value(dtype) if opt(xp).weak_scalars else fill(xp, dtype, device)


def zero(xp: Backend, dtype: str, device: Any) -> Array:
    """0 as a 0-d array of ``dtype``."""
    return scalar(xp, "zero", 0.0, dtype, device)


def positions(
    xp: Backend, num_keys: int, device: Any, dtype: str = "int32", ndim: int = 4
) -> Array:
    """Key positions 0..K-1 of ``dtype``, shaped (1, ..., 1, K) with ``ndim`` axes."""

    def make() -> Array:
        keys = xp.arange(num_keys, device)
        keys = keys if dtype == "int32" else xp.astype(keys, dtype)
        return opt(xp).reshape(keys, (1,) * (ndim - 1) + (num_keys,))

    return constant(xp, ("positions", num_keys, dtype, ndim), device, make)


def size(x: Array) -> int:
    """The number of elements of ``x``."""
    return math.prod(x.shape)


def work_itemsize(xp: Backend, x: Array) -> int:
    """Bytes per element of score-sized work on ``x`` (half runs in float32)."""
    return 8 if xp.dtype_name(x) == "float64" else 4


def default_scale(features: int) -> float:
    """The default ``scale``: 1/sqrt(d) (d = 0 counts as 1: the scores are 0)."""
    return 1.0 / max(features, 1) ** 0.5


def scaled(xp: Backend, x: Array, scale: float, work: str) -> Array:
    """``x * scale`` in the compute dtype ``work``."""
    return (xp.astype(x, work) if xp.dtype_name(x) != work else x) * scale


def in_dtype(xp: Backend, x: Array, dtype: str) -> Array:
    """``x`` cast to ``dtype`` when it is not of it already."""
    return xp.astype(x, dtype) if xp.dtype_name(x) != dtype else x


def weighted(xp: Backend, weights: Array, values: Array, dtype: str) -> Array:
    """``weights @ values`` in the compute dtype of ``dtype``, rounded to
    ``dtype`` once."""
    out = xp.matmul(weights, in_dtype(xp, values, compute_dtype(dtype)))
    return in_dtype(xp, out, dtype)


def readable(xp: Backend, *arrays: Array) -> bool:
    """Whether the host may read what ``arrays`` hold: eager, and not on an
    accelerator (a read waits there for every kernel queued before it)."""
    return all(
        opt(xp).is_concrete(x) and not opt(xp).on_accelerator(xp.device_of(x)) for x in arrays
    )


def all_finite(xp: Backend, *arrays: Array) -> bool:
    """Whether every entry of ``arrays`` is known to be finite: one sum each,
    read on the host (False where the host does not read them, ``readable``,
    or when a sum overflows)."""
    if not readable(xp, *arrays):
        return False
    return all(np.isfinite(opt(xp).host_sum(x)) for x in arrays)


def normalize(xp: Backend, acc: Array, total: Array) -> Array:
    """``acc / total`` per row, 0 where the row saw no key (total exactly 0;
    else at least 1). NaN is not 0: NaN in what the row saw propagates."""
    has_keys = total != 0
    return xp.where(has_keys, acc / xp.where(has_keys, total, 1.0), 0.0)


def empty_rows(
    xp: Backend, shape: tuple[int, ...], dtype: str, device: Any, *inputs: Array
) -> Array:
    """Zeros of ``shape`` for rows that see no key, kept in the autodiff graph
    of ``inputs`` (``kept``)."""
    return kept(xp, xp.zeros(shape, dtype, device), *inputs)


def kept(xp: Backend, out: Array, *inputs: Array) -> Array:
    """``out`` unchanged, kept in the autodiff graph of ``inputs``: their
    gradients through it are exact zeros (a select of one element of each,
    never taken, so NaN there stays out)."""
    dtype, never = xp.dtype_name(out), xp.zeros((1,), "bool", xp.device_of(out))
    for x in inputs:
        out = out + xp.astype(xp.sum(xp.where(never, opt(xp).reshape(x, (-1,))[:1], 0.0), 0), dtype)
    return out


def zeros_for_empty(xp: Backend, shape: tuple[int, ...], like: Array, *inputs: Array) -> Array:
    """The answer when an axis is empty: zeros of ``shape`` in the dtype and on
    the device of ``like``, no kernel called (MXNet 1.9.1 crashes on some); in
    the graph of the empty ones among ``like`` and ``inputs``: no NaN gradient."""
    out = xp.zeros(shape, xp.dtype_name(like), xp.device_of(like))
    for x in (like, *inputs):
        if 0 in tuple(x.shape):
            out = out + xp.sum(opt(xp).reshape(x, (0,)), 0)
    return out
