"""Type aliases shared by the backends and the library (``attention_multi.types``
re-exports them).

Arrays are typed loosely: an array of any framework (``numpy.ndarray``,
``torch.Tensor``, ``jax.Array``, ``mxnet.numpy.ndarray``) is an ``Array``,
which is ``Any`` to a type checker. Names and choices are exact.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["Array", "DType", "DeviceKind", "FloatDType", "Shape"]

Array = Any
"""An array (or tracer) of any backend's framework; ``Any`` to a type checker."""

FloatDType = Literal["float16", "bfloat16", "float32", "float64"]
"""The floating dtypes a module may compute in (``dtype=``)."""

DType = str
"""A dtype name as NumPy spells it (``"float32"``, ``"int64"``, ``"bool"``...)."""

DeviceKind = Literal["cpu", "cuda"]
"""The kind of a parsed device name (``"gpu"`` is ``"cuda"``)."""

Shape = tuple[int, ...]
"""An array's shape."""
