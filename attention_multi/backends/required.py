"""The required surface of a backend: what the mechanisms need of every
framework (at most 25 members). Everything else is an optional capability
(``capabilities.py``), detected with ``supports``; the core falls back to
its generic path where a backend lacks one.

The math with NumPy's names and arguments (``exp``, ``log``, ``tanh``,
``sqrt``, ``maximum``, ``minimum``, ``min``, ``concatenate``, ``transpose``,
``broadcast_to``, ``repeat``, ``take``, ...) is the namespace ``xp``'s:
``numpy_like.NumpyLike`` binds each from ``xp`` (``numpy_like.SAME_SPELLING``),
so a framework with a NumPy-like namespace writes only the functions it
spells differently. ``tests/test_backends.py`` counts the members here and
checks that every backend has each.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy

from .types import Array, DeviceKind, DType, Shape


@runtime_checkable
class Required(Protocol):
    """What every backend implements (``numpy_like.NumpyArrays`` gives the
    defaults a NumPy-like framework needs; ``protocol.Backend`` declares them)."""

    # -- the framework -------------------------------------------------------
    name: str  # canonical name, a row of table.BACKENDS
    xp: Any  # its NumPy-like namespace: the math with NumPy's names
    module_base: Any  # the class that makes a module native (``NativeModule``)
    float_dtypes: tuple[str, ...]  # the float dtypes it computes in

    # -- arrays in and out, dtype ----------------------------------------------
    def is_array(self, x: Any) -> bool: ...
    def asarray(self, x: Any, dtype: DType | None = None, device: Any = None) -> Array: ...
    def to_numpy(self, x: Array) -> numpy.ndarray: ...
    def dtype_name(self, x: Array) -> str: ...
    def astype(self, x: Array, dtype: DType) -> Array: ...

    # -- devices -----------------------------------------------------------------
    def device(self, kind: DeviceKind, index: int = 0) -> Any: ...
    def device_of(self, x: Array) -> Any: ...
    def to_device(self, x: Array, device: Any) -> Array: ...

    # -- products, softmax, where, arange ------------------------------------------
    def matmul(self, a: Array, b: Array, transpose_b: bool = False) -> Array: ...
    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array: ...
    def softmax(self, x: Array, axis: int = -1) -> Array: ...
    def where(self, condition: Array, x: Any, y: Any) -> Array: ...
    def arange(self, n: int, device: Any = None) -> Array: ...
    def zeros(self, shape: Shape, dtype: DType, device: Any = None) -> Array: ...

    # -- reductions --------------------------------------------------------------
    def sum(self, x: Array, axis: Any = None, keepdims: bool = False) -> Array: ...
    def max(self, x: Array, axis: Any = None, keepdims: bool = False) -> Array: ...
    def any(self, x: Array, axis: Any = None) -> Array: ...

    # -- randomness and dropout ------------------------------------------------------
    def uniform(
        self, shape: Shape, low: float, high: float, dtype: DType = "float32", device: Any = None
    ) -> Array: ...
    def dropout(self, x: Array, p: float, key: Any = None) -> Array: ...
    def seed(self, n: int) -> None: ...


REQUIRED: tuple[str, ...] = tuple(
    n for n in (*Required.__annotations__, *vars(Required)) if not n.startswith("_")
)
"""The names of the required members (tests count them: at most 25)."""
