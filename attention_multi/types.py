"""Type aliases of the public API.

Arrays are typed loosely (``Array`` is ``Any``: a NumPy, PyTorch, JAX or
MXNet array); names, options and choices are exact ``Literal`` types.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict, Union

from attention_multi.backends import Backend
from attention_multi.backends.types import Array, DeviceKind, DType, FloatDType, Shape

__all__ = [
    "Array",
    "AttentionPath",
    "BackendLike",
    "DType",
    "DeviceKind",
    "DeviceLike",
    "FloatDType",
    "ModuleOptions",
    "Shape",
    "TakenPath",
    "Window",
]

AttentionPath = Literal["auto", "fused", "tiled", "chunked", "full"]
"""The ``path=`` of ``DotProductAttention``, ``MultiHeadAttention`` and ``attend``."""

TakenPath = Literal["fused", "tiled", "chunked", "full", "empty"]
"""What ``module.last_path`` reports after a call (``"empty"``: an axis was
empty and no kernel ran)."""

BackendLike = Union[str, Backend, None]
"""``backend=``: a name (``"torch"``, alias ``"pytorch"``), a ``Backend``, or
None for the current default."""

DeviceLike = Union[str, Any, None]
"""``device=``: a name (``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"gpu"``), a
framework's own device object, or None for ``ATTENTION_MULTI_DEVICE``."""

Window = Union[int, tuple[Union[int, None], Union[int, None]], None]
"""``window=``: ``w`` (``w`` keys either side) or ``(left, right)``, a side
None meaning unbounded."""


class ModuleOptions(TypedDict, total=False):
    """The keywords every module takes (``**options: Unpack[ModuleOptions]``)."""

    backend: BackendLike
    """Default: the current backend (``use_backend`` > ``set_backend`` >
    ``ATTENTION_MULTI_BACKEND`` > ``"numpy"``)."""
    device: DeviceLike
    """Default: ``ATTENTION_MULTI_DEVICE``, else ``"cpu"``."""
    dtype: FloatDType
    """Default ``"float32"``; bfloat16 on torch and JAX only."""
