"""One implementation of the protocol for every framework with a NumPy-like
namespace (``numpy``, ``jax.numpy``, ``mxnet.numpy``, and ``torch``, which
takes NumPy's keywords): a subclass sets ``xp`` and overrides its quirks.

``NumpyArrays`` is the required part alone (the NumPy backend's base);
``NumpyLike`` adds every optional capability's generic default
(``defaults.Generic``) as a mixin, for backends that override a few of them
and call ``super()``."""

from __future__ import annotations

from typing import Any

import numpy as np

from .defaults import Generic
from .protocol import Backend
from .types import Array, DType, Shape

# Functions whose name and arguments are NumPy's in every ``xp``; a subclass
# that spells one differently defines a method of that name.
SAME_SPELLING = (
    "exp",
    "log",
    "tanh",
    "sqrt",
    "where",
    "max",
    "min",
    "sum",
    "any",
    "repeat",
    "transpose",
    "concatenate",
    "broadcast_to",
    "minimum",
    "maximum",
    "take",
)


def np_dtype(name: DType) -> np.dtype:
    """NumPy dtype for a dtype name (bfloat16 needs ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


_DTYPE_NAMES: dict[Any, str] = {}


class NumpyArrays(Backend):
    """The required members and the array math, from ``xp``."""

    xp: Any = None  # the framework's NumPy-like namespace
    array_type: Any = ()  # what ``is_array`` accepts (a type or a tuple of types)

    def __init__(self) -> None:
        # NumPy's functions of the same names, unless a subclass defines them.
        for name in SAME_SPELLING:
            if not hasattr(type(self), name):
                setattr(self, name, getattr(self.xp, name))

    # -- arrays -----------------------------------------------------------------
    def is_array(self, x: Any) -> bool:
        return isinstance(x, self.array_type)

    def asarray(self, x: Any, dtype: DType | None = None, device: Any = None) -> Array:
        x = self.xp.asarray(x, dtype=None if dtype is None else np_dtype(dtype))
        return x if device is None else self.to_device(x, device)

    def to_numpy(self, x: Array) -> np.ndarray:
        return np.asarray(x)

    def dtype_name(self, x: Array) -> str:
        dtype = x.dtype  # (NumPy 1.x computes ``.name`` in Python: once per dtype here)
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = np.dtype(dtype).name
        return name

    def astype(self, x: Array, dtype: DType) -> Array:
        return x.astype(np_dtype(dtype))

    def arange(self, n: int, device: Any = None) -> Array:
        """int32 ``[0, n)``."""
        return self.to_device(self.xp.arange(n, dtype=np.int32), device)

    def zeros(self, shape: Shape, dtype: DType, device: Any = None) -> Array:
        return self.to_device(self.xp.zeros(shape, dtype=np_dtype(dtype)), device)

    # -- math -------------------------------------------------------------------
    def logical_and(self, a: Array, b: Array) -> Array:
        """Elementwise AND of two boolean arrays (broadcasting)."""
        return a & b

    def split(self, x: Array, size: int | list[int], axis: int) -> list[Array]:
        """Pieces of ``size`` along ``axis`` (the last one shorter when it
        does not divide), or of each of the sizes ``size``; under autodiff
        their gradients are gathered by one concatenation, where a slice's is
        as large as ``x``."""
        if isinstance(size, int):
            size = [size] * -(-x.shape[axis] // size)
        return list(self.xp.split(x, np.cumsum(size)[:-1].tolist(), axis))

    def matmul(self, a: Array, b: Array, transpose_b: bool = False) -> Array:
        """Batched matrix product over the last two axes."""
        return self.xp.matmul(a, self.xp.swapaxes(b, -1, -2) if transpose_b else b)

    def linear(self, x: Array, weight: Array, bias: Array | None = None) -> Array:
        """``x @ weight.T + bias`` with ``weight`` laid out (out, in)."""
        out = self.xp.matmul(x, weight.T)
        return out if bias is None else out + bias

    def exp_inplace(self, x: Array) -> Array:
        """``exp(x)``, reusing ``x``'s memory where the framework can (``x`` is
        a temporary the caller owns)."""
        return self.exp(x)

    def softmax(self, x: Array, axis: int = -1) -> Array:
        e = self.exp(x - self.max(x, axis, keepdims=True))
        return e / self.sum(e, axis, keepdims=True)

    # -- devices ------------------------------------------------------------------
    def device(self, kind: str, index: int = 0) -> Any:
        if kind == "cpu":
            return "cpu"
        raise ValueError(f"device {kind}:{index} is not available to the {self.name} backend")

    def device_of(self, x: Array) -> Any:
        return "cpu"

    def to_device(self, x: Array, device: Any) -> Array:
        if device not in (None, "cpu"):
            raise ValueError(f"the {self.name} backend runs on the CPU only, not on {device!r}")
        return x

    # -- randomness -----------------------------------------------------------------
    def uniform(
        self, shape: Shape, low: float, high: float, dtype: DType = "float32", device: Any = None
    ) -> Array:
        """Drawn by NumPy's global generator (``np.random.seed`` applies)."""
        return self.asarray(np.random.uniform(low, high, size=shape), dtype, device)

    def seed(self, n: int) -> None:
        np.random.seed(n)

    def dropout(self, x: Array, p: float, key: Any = None) -> Array:
        if key is not None:
            raise ValueError(
                f"key= is only used by the jax backend; the {self.name} backend "
                f"draws dropout masks from its own random generator"
            )
        return self._dropout(x, p)

    def _dropout(self, x: Array, p: float) -> Array:
        """Dropout with the framework's global random generator."""
        keep = self.asarray(np.random.random_sample(tuple(x.shape)) >= p, device=self.device_of(x))
        scale = 1.0 / (1 - p) if p < 1 else 0.0  # p = 1: every element dropped
        return self.where(keep, x * scale, self.zeros((), self.dtype_name(x), self.device_of(x)))


class NumpyLike(NumpyArrays, Generic):
    """``NumpyArrays`` with the generic default of every optional member."""
