"""Parity checks across frameworks, for your own tests.

- ``assert_close(actual, expected)``: arrays of any backend (NumPy, PyTorch,
  JAX, MXNet, or plain lists), with a message that says where they differ.
- a pytest plugin (``attention_multi.testing.plugin``, registered by an entry
  point when attention-multi is installed): a ``backend`` fixture that runs a
  test once per installed backend; ``--am-backends=torch,jax`` chooses them.
- the conformance grid (``conformance``): ``conformance_cases()`` and
  ``run_case(case, attention)`` grade your attention function against the
  float64 oracle, case by case (docs/guide/conformance.md).

Nothing here imports a framework or pytest.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attention_multi import backends

from .conformance import Case, NotSupported, Result, conformance_cases, run_case

__all__ = [
    "Case",
    "NotSupported",
    "Result",
    "assert_close",
    "conformance_cases",
    "default_tolerances",
    "run_case",
]

# (rtol, atol) by dtype, as torch.testing.assert_close chooses them.
_TOLERANCES = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
}


def default_tolerances(*dtypes: str) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing arrays of these dtype names: those of the
    least precise floating dtype; (0, 0) when none is floating."""
    found = [_TOLERANCES[d] for d in dtypes if d in _TOLERANCES]
    return max(found) if found else (0.0, 0.0)


def _as_numpy(x: Any) -> tuple[np.ndarray, str, str]:
    """``(numpy array, framework name, dtype name)`` of an array of any backend."""
    if isinstance(x, (list, tuple, int, float, bool, np.ndarray, np.generic)):
        a = np.asarray(x)
        return a, "numpy", a.dtype.name
    xp = backends.backend_of_array(x)
    return xp.to_numpy(x), xp.name, xp.dtype_name(x)


def assert_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    equal_nan: bool = False,
    check_dtype: bool = False,
    msg: str | None = None,
) -> None:
    """Raise AssertionError unless ``|actual - expected| <= atol + rtol * |expected|``
    everywhere (the same shape; equal infinities match; NaN matches NaN only
    with ``equal_nan``). Integers are compared exactly (int64 past 2**53 too),
    complex numbers by their distance (both parts).

    ``actual`` and ``expected`` may be arrays of different frameworks. The
    default ``rtol``/``atol`` are ``default_tolerances`` of their dtypes
    (float32: 1.3e-6, 1e-5). ``check_dtype=True`` also requires the same
    dtype. The message, headed by ``msg``, gives the number of mismatched
    elements, the worst one's index and both values, the largest absolute
    and relative differences, and the shapes or dtypes where they differ.
    """
    a, a_framework, a_dtype = _as_numpy(actual)
    e, e_framework, e_dtype = _as_numpy(expected)
    default_rtol, default_atol = default_tolerances(a_dtype, e_dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    head = f"{msg}: " if msg else ""
    kinds = (
        f"actual: {a_framework} {a_dtype} {a.shape}; expected: {e_framework} {e_dtype} {e.shape}"
    )
    if a.shape != e.shape:
        raise AssertionError(f"{head}shapes differ: actual {a.shape}, expected {e.shape}\n{kinds}")
    if check_dtype and a_dtype != e_dtype:
        raise AssertionError(f"{head}dtypes differ: actual {a_dtype}, expected {e_dtype}\n{kinds}")
    if a.dtype.kind in "iub" and e.dtype.kind in "iub":
        # integers exactly, as Python ints (int64 past 2**53 is not a float)
        a_obj, e_obj = a.astype(object), e.astype(object)
        exact = np.abs(a_obj - e_obj)
        close = np.asarray(exact <= atol + rtol * np.abs(e_obj), bool)
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        diff, allowed = exact.astype(np.float64), atol + rtol * np.abs(e64)
    else:
        # complex: the distance in the plane, so both parts count
        wide = np.complex128 if "c" in (a.dtype.kind, e.dtype.kind) else np.float64
        a64, e64 = a.astype(wide), e.astype(wide)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(a64 - e64)
            allowed = atol + rtol * np.abs(e64)
            close = np.where(np.isfinite(a64) & np.isfinite(e64), diff <= allowed, a64 == e64)
            if equal_nan:
                close |= np.isnan(a64) & np.isnan(e64)
    bad = ~close
    count = int(bad.sum())
    if count == 0:
        return
    ranked = np.where(bad, np.nan_to_num(diff, nan=np.inf, posinf=np.inf), -1.0)
    worst = np.unravel_index(int(np.argmax(ranked)), a.shape)
    finite = np.isfinite(diff)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        rel = np.where(finite & (e64 != 0), diff / np.abs(e64), 0.0)
    lines = [
        f"{head}arrays are not close (rtol={rtol:g}, atol={atol:g}): {count} of {a.size} "
        f"elements differ ({100.0 * count / a.size:.3g}%)",
        f"worst at index {tuple(int(i) for i in worst)}: actual {a[worst]}, expected "
        f"{e[worst]} (abs diff {diff[worst]:.3g}, allowed {allowed[worst]:.3g})",
        f"max abs diff {np.max(np.where(finite, diff, 0.0)):.3g}, max rel diff {np.max(rel):.3g}"
        + ("" if finite.all() else f"; {int((~finite).sum())} NaN or infinite differences"),
    ]
    if a_dtype != e_dtype or a_framework != e_framework:
        lines.append(kinds)
    raise AssertionError("\n".join(lines))
