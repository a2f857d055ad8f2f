"""Type aliases of the public API.

Arrays are typed loosely (``Array`` is ``Any``: a NumPy, PyTorch, JAX or
MXNet array); names, options and choices are exact ``Literal`` types.
"""

from __future__ import annotations

from enum import StrEnum
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
    "Path",
    "Shape",
    "TakenPath",
    "Window",
]


class Path(StrEnum):
    """Every path, each by its own name: what ``module.last_path`` reports
    (a ``str``: ``m.last_path == "tiled"`` reads as before) and what
    ``path=`` asks for. ``"tiled"`` asks for the three tile paths (``family``)."""

    FULL = "full"  # the scores materialized (small calls: the straight line)
    FUSED = "fused"  # the framework's own kernel
    TILED = "tiled"  # groups of batch elements, each one kernel call over the keys it sees
    BLOCKED = "blocked"  # blocks of queries and keys, the empty ones skipped
    TRACED = "traced"  # under a trace: blocks of keys skipped at run time
    CHUNKED = "chunked"  # the online softmax over blocks, within the memory budget
    EMPTY = "empty"  # an axis was empty: no kernel ran

    @property
    def family(self) -> str:
        """What ``path=`` names it by as well: ``"tiled"`` for the tile paths."""
        return "tiled" if self in (Path.BLOCKED, Path.TRACED) else self.value


AttentionPath = Literal["auto", "fused", "tiled", "blocked", "traced", "chunked", "full"]
"""The ``path=`` of ``DotProductAttention``, ``MultiHeadAttention`` and ``attend``:
``"auto"`` or a ``Path`` (``"tiled"``: any of the tile paths)."""

TakenPath = Literal["fused", "tiled", "blocked", "traced", "chunked", "full", "empty"]
"""What ``module.last_path`` reports after a call: a ``Path`` (``"empty"``: an
axis was empty and no kernel ran)."""

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
