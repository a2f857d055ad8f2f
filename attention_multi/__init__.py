"""attention-multi: d2l's attention mechanisms, written once, native on
NumPy, PyTorch, JAX and MXNet."""

from __future__ import annotations

from typing import Any

from attention_multi.backends import available_backends

from . import port
from .config import get_backend, set_backend, use_backend
from .core.mask import (
    BlockMask,
    block_mask,
    segments_from_cu_seqlens,
    segments_from_lengths,
)
from .core.paths.call import Result
from .functional import (
    attention,
    dot_product_attention,
    masked_softmax,
    nadaraya_watson,
    ring_attention,
    ring_gather,
    ring_order,
    ring_shard,
    sequence_mask,
    transpose_output,
    transpose_qkv,
)
from .modules import (
    AdditiveAttention,
    DotProductAttention,
    KVCache,
    Linear,
    Module,
    MultiHeadAttention,
    NWKernelRegression,
    PositionalEncoding,
    train_kernel_regression,
)
from .params import get_params, keras_params, set_keras_params, set_params
from .plotting import show_heatmaps
from .types import Array, BackendLike, DeviceLike, Path

__version__ = "0.1.0"

__all__ = [
    "AdditiveAttention",
    "BlockMask",
    "DotProductAttention",
    "KVCache",
    "Linear",
    "Module",
    "MultiHeadAttention",
    "NWKernelRegression",
    "Path",
    "PositionalEncoding",
    "Result",
    "asarray",
    "attention",
    "available_backends",
    "block_mask",
    "dot_product_attention",
    "get_backend",
    "get_params",
    "keras_params",
    "masked_softmax",
    "nadaraya_watson",
    "port",
    "ring_attention",
    "ring_gather",
    "ring_order",
    "ring_shard",
    "segments_from_cu_seqlens",
    "segments_from_lengths",
    "sequence_mask",
    "set_backend",
    "set_keras_params",
    "set_params",
    "show_heatmaps",
    "train_kernel_regression",
    "transpose_output",
    "transpose_qkv",
    "use_backend",
]


def asarray(
    data: Any, dtype: str | None = None, backend: BackendLike = None, device: DeviceLike = None
) -> Array:
    """``data`` as an array of ``backend`` (default: the current one) on ``device``."""
    from .config import native_device

    xp = get_backend(backend)
    return xp.asarray(data, dtype, native_device(xp, device))
