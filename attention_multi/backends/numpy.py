"""NumPy backend: CPU only, plain-object modules, no autodiff. The required
part (``NumpyArrays``) and one capability, ``Threads``; every other optional
member is the core's generic default."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, TypeVar

import numpy as np

from . import numpy_threads
from .numpy_like import NumpyArrays, np_dtype
from .plain_module import PlainModule
from .types import Array, DType

T = TypeVar("T")
R = TypeVar("R")

# NumPy 1.x: a ufunc's own error settings (buffer size, no warnings), 1 us a
# call where ``np.errstate`` takes 7; NumPy 2 has no ``extobj``, and a cheap errstate
_QUIET = [np.getbufsize(), 0, None] if np.lib.NumpyVersion(np.__version__) < "2.0.0" else None


class NumpyBackend(NumpyArrays):
    name = "numpy"
    xp = np
    array_type = (np.ndarray, np.generic)
    module_base = PlainModule
    float_dtypes = ("float16", "float32", "float64")
    threads: int | None = None  # workers of parallel_map (None: one per core; 1: none)
    # (its blocks and tiles: many small products, for which OpenBLAS's own
    # threads cost more than they gain; the packed forward, B=4, T=4096, 2 cores:
    # 785 ms against 825 idle, 846-859 ms against 3120-3190 beside one busy process)
    fewer_threads = fewer_threads_always = True

    def astype(self, x: Array, dtype: DType) -> Array:
        return x.astype(np_dtype(dtype), copy=False)

    def exp_inplace(self, x: Array) -> Array:
        return np.exp(x, out=x)

    def softmax(self, x: Array, axis: int = -1) -> Array:
        # (the ufuncs' own reduce: the array methods add a microsecond of Python)
        out = x - np.maximum.reduce(x, axis=axis, keepdims=True)  # in place on a fresh array
        np.exp(out, out=out)
        out /= np.add.reduce(out, axis=axis, keepdims=True)
        return out

    def matmul(self, a: Array, b: Array, transpose_b: bool = False) -> Array:
        # (inf or NaN in a masked key or value row: the scores it makes are hidden
        # afterwards; no RuntimeWarning for what the contract handles)
        b = b.swapaxes(-1, -2) if transpose_b else b
        if _QUIET is not None:
            return np.matmul(a, b, extobj=_QUIET)  # type: ignore[call-overload]
        with np.errstate(invalid="ignore", over="ignore"):
            return np.matmul(a, b)

    def parallel_map(self, fn: Callable[[T], R], tasks: Sequence[T]) -> list[R]:
        """On ``threads`` worker threads (default: one per core), each with
        single-threaded BLAS: NumPy runs one operation on one core."""
        return numpy_threads.parallel_map(fn, tasks, self.threads)

    def in_fewer_threads(self, fn: Callable[..., R], *arrays: Array) -> R:
        """``fn(*arrays)`` with one BLAS thread (``parallel_map``'s workers have one each)."""
        with numpy_threads.openblas().single_threaded():
            return fn(*arrays)

    def concurrency(self) -> int:
        return self.threads or numpy_threads.cores()
