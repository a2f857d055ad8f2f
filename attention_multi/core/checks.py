"""Argument checks: errors name the argument and show shapes and values."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

import attention_multi.backends as backends
from attention_multi.backends.capabilities import opt

if TYPE_CHECKING:
    from attention_multi.backends import Backend

    from ..types import Array

INT32_MAX = 2**31 - 1


def backend_of(**arrays: Any) -> Backend:
    """The one backend of the given arrays; TypeError if they are mixed."""
    found = {}
    for name, x in arrays.items():
        if x is None:
            continue
        try:
            found[name] = backends.backend_of_array(x)
        except TypeError:
            raise TypeError(
                f"{name} must be a {backends.listing(backends.BACKEND_NAMES)} array, "
                f"got {type(x).__name__}{backends.near_miss(x)}"
            ) from None
    names = sorted({b.name for b in found.values()})
    if len(names) > 1:
        listing = ", ".join(f"{n} is {b.name}" for n, b in found.items())
        raise TypeError(
            f"arrays of different backends in one call ({listing}); "
            f"convert them to one backend first"
        )
    return next(iter(found.values()))


def check_array(
    backend: Backend, name: str, x: Any, ndim: int | None = None, what: str = ""
) -> None:
    """TypeError unless ``x`` belongs to ``backend``; ValueError on wrong rank."""
    if not backend.is_array(x):
        other = _backend_name(x)
        raise TypeError(
            f"{name} must be a {backend.name} array (the backend of this call), got {other}"
        )
    if ndim is not None and len(x.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D {what}, got shape {tuple(x.shape)}")


def _backend_name(x: Any) -> str:
    try:
        return f"a {backends.backend_of_array(x).name} array"
    except TypeError:
        return f"an object of type {type(x).__name__}"


def check_float(backend: Backend, name: str, x: Array) -> None:
    dtype = backend.dtype_name(x)
    if dtype not in backend.float_dtypes:
        raise TypeError(f"{name} must have a floating dtype, got {dtype}")


def valid_lens_checked(
    backend: Backend,
    valid_lens: Any,
    batch: int,
    queries: int,
    name: str = "valid_lens",
    device: Any = None,
    num_keys: int | None = None,
) -> tuple[Array, np.ndarray | None]:
    """``(lengths, their int64 host copy or None while traced)``: ``valid_lens``
    (the call's arrays, NumPy arrays or lists, placed on ``device``) as int32 of
    shape (batch,) or (batch, queries); values checked (>= 0, whole) unless
    traced; clamped to ``num_keys`` (or the int32 range) on the host before a
    framework could wrap them, on the device while traced."""
    limit = key_limit(num_keys)
    fast = _well_formed_lens(backend, valid_lens, batch, queries, limit)
    if fast is not None:
        if backend.dtype_name(valid_lens) != "int32":
            valid_lens = backend.astype(valid_lens, "int32")
        return valid_lens, fast[0].astype(np.int64)
    if not backend.is_array(valid_lens):
        if isinstance(valid_lens, (list, tuple, np.ndarray, np.generic, int, float)):
            host = np.asarray(valid_lens)
            if host.dtype.kind not in "iuf":
                raise TypeError(f"{name} must have an integer or float dtype, got {host.dtype}")
            _check_lens_values(name, host, host.dtype.kind)
            if host.size and host.max() > limit:
                host = np.minimum(host, limit)
            if host.dtype.kind in "iu":  # (what does not fit in int32 was clamped)
                host = host.astype(np.int32)
            valid_lens = backend.asarray(host, device=device)
        elif callable(valid_lens):  # (a function given by position lands here)
            raise TypeError(
                f"{name} got a function: mask functions are keywords, "
                f"score_mod=... or mask_mod=... (the fourth argument is d2l's {name})"
            )
        else:
            raise TypeError(
                f"{name} must be a {backend.name} array, a NumPy array "
                f"or a list, got {_backend_name(valid_lens)}"
            )
    shape = tuple(valid_lens.shape)
    if shape not in ((batch,), (batch, queries)):
        raise ValueError(
            f"{name} must have shape ({batch},) (one length per batch element) or "
            f"({batch}, {queries}) (one per query), got {shape}"
        )
    dtype = backend.dtype_name(valid_lens)
    kind: str
    try:
        kind = np.dtype("float32" if dtype == "bfloat16" else dtype).kind
    except TypeError:  # a name NumPy does not know (MXNet's or a string array's)
        kind = "?"
    if kind not in "iuf":
        raise TypeError(f"{name} must have an integer or float dtype, got {dtype}")
    known = None
    if opt(backend).is_concrete(valid_lens):
        values = backend.to_numpy(valid_lens)
        _check_lens_values(name, values, kind)
        if values.size and values.max() > limit:  # would wrap, or round past it, in int32
            # (in their own integer dtype: uint64 past int64's range is no negative length)
            clamped = np.minimum(values.astype(np.float64) if kind == "f" else values, limit)
            clamped = clamped.astype(np.int32)
            device = backend.device_of(valid_lens)
            return backend.asarray(clamped, device=device), clamped.astype(np.int64)
        known = values.astype(np.int64)
    elif not isinstance(limit, int):  # traced, keys known when it runs (TensorFlow's None)
        valid_lens = backend.minimum(backend.astype(valid_lens, "int32"), limit)
    elif dtype != "int32":  # traced: clamp before the cast (in float32 for half lengths)
        if kind == "f" and dtype != "float64":
            valid_lens = backend.astype(valid_lens, "float32")
        valid_lens = backend.where(valid_lens > limit, limit, valid_lens)
    if dtype != "int32":
        valid_lens = backend.astype(valid_lens, "int32")
    return valid_lens, known


def key_limit(num_keys: Any) -> Any:
    """The largest length that means something: ``num_keys`` within int32
    (any without it); a size known only when a traced program runs
    (TensorFlow's dynamic shape) as it is."""
    if num_keys is None:
        return INT32_MAX
    if isinstance(num_keys, numbers.Integral):
        return min(int(num_keys), INT32_MAX)
    return num_keys


def lengths_for_compare(
    backend: Backend, valid_lens: Any, batch: int, queries: int, num_keys: int, device: Any
) -> tuple[Array, int | None]:
    """``(lengths, least)`` for a caller that only compares key positions with
    them: checked as ``valid_lens_checked``, a well-formed int32/int64/float32/
    float64 array as it is (exact, no cast); ``least`` None while traced."""
    limit = key_limit(num_keys)
    fast = _well_formed_lens(backend, valid_lens, batch, queries, limit)
    if fast is not None:
        return valid_lens, fast[1]
    lens, known = valid_lens_checked(
        backend, valid_lens, batch, queries, device=device, num_keys=num_keys
    )
    return lens, None if known is None else (int(known.min()) if known.size else 0)


_EXACT_LENS = {"int32": "i", "int64": "i", "float32": "f", "float64": "f"}
_SMALL_HOST = 64  # up to this many values, Python's min/max beat NumPy's reductions


def _well_formed_lens(
    backend: Backend, lens: Any, batch: int, queries: int, limit: int
) -> tuple[np.ndarray, int] | None:
    """``(host values, least)`` of concrete lengths that need no conversion
    (``lens_kind``), all whole numbers in [0, limit]; else None (full checks)."""
    if not (backend.is_array(lens) and opt(backend).is_concrete(lens)):
        return None
    kind = lens_kind(backend, lens, batch, queries)
    if kind is None:
        return None
    values = backend.to_numpy(lens)
    least = least_length(values, kind, limit)
    return None if least is None else (values, least)


def lens_kind(backend: Backend, lens: Array, batch: int, queries: int) -> str | None:
    """``"i"`` or ``"f"`` for int32/int64 or float32/float64 lengths of shape
    (batch,) or (batch, queries), not empty; None otherwise."""
    kind = _EXACT_LENS.get(backend.dtype_name(lens))
    shape = tuple(lens.shape)
    if kind is None or shape not in ((batch,), (batch, queries)) or 0 in shape:
        return None
    return kind


def least_length(values: np.ndarray, kind: str, limit: int) -> int | None:
    """The least of host lengths of ``kind`` (``lens_kind``) when every one is
    a whole number in [0, limit]; None otherwise."""
    if values.size <= _SMALL_HOST:
        listed = values.ravel().tolist()
        if kind == "f":  # (NaN fails every comparison; min and max would skip it)
            if not all(0 <= x <= limit and x == int(x) for x in listed):
                return None
        elif not (0 <= min(listed) and max(listed) <= limit):
            return None
        return int(min(listed))
    least = values.min()
    if 0 <= least and values.max() <= limit:
        if kind == "i" or bool((values == np.round(values)).all()):
            return int(least)
    return None


def _check_lens_values(name: str, values: np.ndarray, kind: str) -> None:
    if kind == "f" and np.isnan(values).any():
        raise ValueError(f"{name} contains NaN: {values.tolist()}")
    if kind not in "iuf":
        return  # (the dtype is refused by name afterwards)
    if (values < 0).any():
        raise ValueError(f"{name} must be >= 0, got {values.tolist()}")
    if kind == "f" and (values[np.isfinite(values)] != np.round(values[np.isfinite(values)])).any():
        raise ValueError(f"{name} must hold whole numbers, got {values.tolist()}")


def check_window(window: Any) -> tuple[int | None, ...] | None:
    """``window`` as None or (left, right), each a non-negative int or None
    (unbounded); an int ``w`` means (w, w)."""
    if window is None:
        return None
    sides = (window, window) if not isinstance(window, (tuple, list)) else tuple(window)
    if len(sides) != 2:
        raise ValueError(f"window must be an int or a pair (left, right), got {window!r}")
    for side in sides:
        if side is not None and (
            _is_bool(side) or not isinstance(side, numbers.Integral) or side < 0
        ):
            raise ValueError(
                f"window must be a non-negative int or a pair (left, "
                f"right) of non-negative ints or None, got {window!r}"
            )
    return tuple(None if s is None else int(s) for s in sides)


def check_mask_array(
    backend: Backend,
    name: str,
    x: Any,
    shape: tuple[int, int, int, int],
    heads_axis: bool,
    kind: str,
    device: Any = None,
) -> Array:
    """A boolean ``mask`` or float ``bias`` as a 4-D array broadcastable to
    ``shape`` (batch, heads, Q, K): with ``heads_axis`` (4-D inputs) as NumPy
    broadcasts, else against (batch, Q, K) unless ``x`` is 4-D."""
    if not backend.is_array(x):
        if isinstance(x, (np.ndarray, np.generic, list, tuple)):
            x = backend.asarray(np.asarray(x), device=device)
        else:
            raise TypeError(
                f"{name} must be a {backend.name} array or a NumPy array, got {_backend_name(x)}"
            )
    dtype = backend.dtype_name(x)
    if kind == "bool" and dtype != "bool":
        raise TypeError(
            f"{name} must be boolean (True = may attend), got dtype {dtype}; "
            f"for an additive float mask use bias="
        )
    if kind == "float" and dtype not in backend.float_dtypes:
        raise TypeError(f"{name} must have a floating dtype, got {dtype}")
    batch, heads, q, k = shape
    against = shape if heads_axis or len(x.shape) == 4 else (batch, q, k)
    got = tuple(x.shape)
    if heads_axis and len(got) == 3 and got[0] == batch == heads > 1:
        # NumPy's rule would read the first axis as the heads; with 3-D inputs
        # (a module's) it is the batch: refuse rather than guess
        raise ValueError(
            f"{name} of shape {got} is ambiguous with 4-D inputs of batch {batch} and "
            f"{heads} heads: its first axis may be either; give it 4 axes, "
            f"{(batch, 1, q, k)} for each batch element or {(1, heads, q, k)} for each head"
        )
    if len(got) > len(against) or any(g not in (1, w) for g, w in zip(got[::-1], against[::-1])):
        names: tuple[str, ...] = ("batch", "heads", "queries", "keys")
        if len(against) == 3:
            names = ("batch", "queries", "keys")
        raise ValueError(
            f"{name} of shape {got} does not broadcast to "
            f"({', '.join(f'{n}={s}' for n, s in zip(names, against))})"
        )
    full = (1,) * (len(against) - len(got)) + got
    if len(full) == 3:
        full = (full[0], 1) + full[1:]
    return opt(backend).reshape(x, full)


# Constructor arguments: TypeError for a wrong type, ValueError out of range.


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def _type_error(name: str, what: str, value: Any) -> TypeError:
    return TypeError(f"{name} must be {what}, got {value!r} (type {type(value).__name__})")


def _check_int(name: str, value: Any, least: int, what: str, allow_none: bool) -> Any:
    """``value`` as a Python int >= ``least``; ``what`` names that range."""
    if value is None and allow_none:
        return None
    what = f"None or {what}" if allow_none else what
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise _type_error(name, what, value)
    if value < least:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value)


def check_positive_int(name: str, value: Any, *, allow_none: bool = False) -> Any:
    """``value`` as a Python int >= 1 (NumPy integers accepted; bools, floats
    and strings refused). With ``allow_none``, None passes through."""
    return _check_int(name, value, 1, "a positive int", allow_none)


def check_nonnegative_int(name: str, value: Any, *, allow_none: bool = False) -> Any:
    """``value`` as a Python int >= 0 (as ``check_positive_int`` otherwise)."""
    return _check_int(name, value, 0, "an int >= 0", allow_none)


def check_dropout(name: str, value: Any) -> float:
    """``value`` as a float in [0, 1] (a rate: bools, strings and NaN refused)."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise _type_error(name, "a real number in [0, 1]", value)
    rate = float(value)
    if not 0.0 <= rate <= 1.0:  # NaN fails both comparisons
        raise ValueError(f"{name} must be a real number in [0, 1], got {value!r}")
    return rate


def check_scale(value: Any) -> float | None:
    """``scale=``: None (1/sqrt(d)) or a finite real number > 0, as a float."""
    if value is None:
        return None
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise _type_error("scale", "None or a positive real number", value)
    scale = float(value)
    if not 0.0 < scale < float("inf"):  # NaN fails too
        raise ValueError(f"scale must be None or a finite real number > 0, got {value!r}")
    return scale


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a Python bool (NumPy bools accepted; 0/1 and strings refused)."""
    if not _is_bool(value):
        raise _type_error(name, "True or False", value)
    return bool(value)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value``, one of the strings ``choices``."""
    what = f"one of {', '.join(map(repr, choices))}"
    if not isinstance(value, str):
        raise _type_error(name, what, value)
    if value not in choices:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def check_divides(name: str, value: int, of_name: str, of_value: int) -> None:
    """ValueError unless ``value`` divides ``of_value`` (both positive ints)."""
    if of_value % value:
        raise ValueError(f"{of_name}={of_value!r} is not divisible by {name}={value!r}")


def check_heads(num_hiddens: int, num_heads: Any) -> int:
    """``num_heads`` (a positive int) dividing ``num_hiddens``, as an int."""
    num_heads = check_positive_int("num_heads", num_heads)
    check_divides("num_heads", num_heads, "num_hiddens", num_hiddens)
    return num_heads


def check_kv_heads(num_heads: int, num_kv_heads: Any) -> int:
    """``num_kv_heads`` (None: ``num_heads``) as an int dividing ``num_heads``."""
    num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads, allow_none=True)
    if num_kv_heads is None:
        return num_heads
    check_divides("num_kv_heads", num_kv_heads, "num_heads", num_heads)
    return num_kv_heads
