"""The modules of d2l, written once; native on every backend.

Each takes the keywords ``backend=`` (default: the current backend),
``device=`` (default: ATTENTION_MULTI_DEVICE or cpu) and ``dtype=``
(default ``"float32"``). Parameters are initialized as PyTorch's
``nn.Linear`` does, with weights laid out (out, in). Constructor arguments
are checked before anything is built (``core/checks.py``).
``MultiHeadAttention`` and ``AdditiveAttention`` also take d2l 1.0's
signatures, whose input projections are lazily sized (``Linear(None, out)``:
the first call gives the input size).

Files: ``base.py`` (``Module``, ``Linear``), ``attention.py``,
``encoding.py``, ``regression.py``, ``cache.py`` (``KVCache``).
"""

from .attention import AdditiveAttention, DotProductAttention, MultiHeadAttention
from .base import Linear, Module
from .cache import KVCache
from .encoding import PositionalEncoding, sinusoid_table
from .regression import NWKernelRegression, train_kernel_regression

__all__ = [
    "AdditiveAttention",
    "DotProductAttention",
    "KVCache",
    "Linear",
    "Module",
    "MultiHeadAttention",
    "NWKernelRegression",
    "PositionalEncoding",
    "sinusoid_table",
    "train_kernel_regression",
]
