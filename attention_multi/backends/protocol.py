"""The backend protocol: what a framework provides to the attention core.

``Backend`` is the required part (``required.Required``: name, arrays,
devices, the products, softmax, where, arange, reductions, randomness) and
the math with NumPy's names that ``numpy_like.NumpyArrays`` binds from
``xp``. Everything else is an optional capability, declared in
``capabilities.py`` (a fused kernel, slices and scans, tracing hooks,
autodiff, threads, costs, mask habits...), each with its generic default
written once in ``defaults.Generic``; the core reads them through
``capabilities.opt(backend)`` and asks ``capabilities.supports``.

``MaskView`` is the surface of the core's mask a fused kernel may read, and
``NativeModule`` what a backend's ``module_base`` provides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy

from .types import Array, DeviceKind, DType, Shape

if TYPE_CHECKING:
    from typing_extensions import Self

FLOAT_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES: tuple[str, ...] = ("float16", "bfloat16")


class MaskView(Protocol):
    """The surface of the core's normalized mask that a backend may read in
    ``fused_attention``: what to translate into its framework's own kernel.
    Everything else about a mask is the core's."""

    @property
    def unmasked(self) -> bool:
        """Every query may see every key, and there is no bias."""

    @property
    def top_left_causal(self) -> bool:
        """Only causal, query ``i`` seeing keys ``j <= i``, Q == K: a
        kernel's ``is_causal``."""

    @property
    def per_batch_lens(self) -> Array | None:
        """int32 (batch,) key lengths when they are all there is, else None."""

    @property
    def bias(self) -> Array | None:
        """The float bias (4-D, broadcastable) added to the scaled scores, or None."""

    def boolean(self, backend: Any, device: Any) -> Array | None:
        """bool (batch|1, heads|1, Q, K), True where a query may see a key;
        None when every query sees every key."""

    def additive(self, backend: Any, dtype: str, device: Any) -> Array | None:
        """float: the bias (or 0) where a query may see a key, the lowest
        finite value of ``dtype`` where it may not; None when nothing is
        masked and there is no bias."""


class Backend:
    """One framework, as the attention core sees it: the required members
    (1) and the array math with NumPy's names (2); every optional member is
    a capability (``capabilities.py``)."""

    def __repr__(self) -> str:
        return f"<attention_multi backend {self.name!r}>"

    # == 1. Required: the framework's arrays, devices and randomness ===========
    float_dtypes: tuple[str, ...] = FLOAT_DTYPES  # float dtypes this framework supports
    name: str = ""  # canonical name, e.g. "torch" (a row of table.BACKENDS)
    module_base: type[NativeModule] | None = None  # base class that makes a module native
    xp: Any = None  # the framework's NumPy-like namespace (numpy, torch, jax.numpy, mxnet.np)

    def is_array(self, x: Any) -> bool:
        """True if ``x`` is an array (or tracer) of this framework."""
        raise NotImplementedError

    def asarray(self, x: Any, dtype: DType | None = None, device: Any = None) -> Array:
        """Array of this framework from array-like ``x``; dtype is a name."""
        raise NotImplementedError

    def to_numpy(self, x: Array) -> numpy.ndarray:
        """NumPy copy of ``x`` (bfloat16 becomes float32)."""
        raise NotImplementedError

    def dtype_name(self, x: Array) -> str:
        """The NumPy name of ``x``'s dtype (``"float32"``, ``"bfloat16"``...)."""
        raise NotImplementedError

    def astype(self, x: Array, dtype: DType) -> Array:
        """``x`` cast to the dtype named ``dtype``."""
        raise NotImplementedError

    def device(self, kind: DeviceKind, index: int = 0) -> Any:
        """Native device for ``("cpu"|"cuda", index)``; ValueError if absent."""
        raise NotImplementedError

    def device_of(self, x: Array) -> Any:
        """The native device ``x`` lives on."""
        raise NotImplementedError

    def to_device(self, x: Array, device: Any) -> Array:
        """``x`` on the native ``device`` (``x`` itself when ``device`` is None)."""
        raise NotImplementedError

    def uniform(
        self, shape: Shape, low: float, high: float, dtype: DType = "float32", device: Any = None
    ) -> Array:
        """Samples from U(low, high), drawn from the framework's own RNG."""
        raise NotImplementedError

    def dropout(self, x: Array, p: float, key: Any = None) -> Array:
        """Zero each element with probability p, scale survivors by 1/(1-p)."""
        raise NotImplementedError

    def seed(self, n: int) -> None:
        """Seed the global generators that ``uniform`` and ``dropout`` draw
        from (frameworks with explicit keys: only the initialization's)."""
        raise NotImplementedError

    # == 2. Array math: NumPy's names and arguments =============================
    # Declared, not defined, here: ``NumpyLike`` binds them from ``xp`` (the
    # same spelling in every framework: ``numpy_like.SAME_SPELLING``) or
    # writes them once; a backend overrides only what its framework spells
    # differently (torch: ``max = torch.amax``, ``min = torch.amin``).
    matmul: Callable[..., Array]  # (a, b, transpose_b=False): over the last two axes
    linear: Callable[..., Array]  # (x, weight, bias=None): x @ weight.T + bias
    softmax: Callable[..., Array]  # (x, axis=-1)
    exp_inplace: Callable[..., Array]  # (x): exp, reusing x's memory where it can
    arange: Callable[..., Array]  # (n, device=None): int32 [0, n)
    zeros: Callable[..., Array]  # (shape, dtype, device=None)
    logical_and: Callable[..., Array]  # (a, b): elementwise AND of booleans
    split: Callable[..., Array]  # (x, size, axis): pieces of size (or of each size of a list)
    exp: Callable[..., Array]
    log: Callable[..., Array]
    tanh: Callable[..., Array]
    sqrt: Callable[..., Array]
    where: Callable[..., Array]
    max: Callable[..., Array]
    min: Callable[..., Array]
    sum: Callable[..., Array]
    any: Callable[..., Array]
    repeat: Callable[..., Array]
    transpose: Callable[..., Array]
    concatenate: Callable[..., Array]
    broadcast_to: Callable[..., Array]
    minimum: Callable[..., Array]
    maximum: Callable[..., Array]
    take: Callable[..., Array]


def _missing(member: str) -> NotImplementedError:
    return NotImplementedError(f"a backend's module_base must provide {member}")


class NativeModule(Protocol):
    """The native-module contract: what a backend's ``module_base`` provides.

    Every module (``attention_multi.modules.Module``) is an instance of a
    subclass of its public class and of ``module_base`` (``modules.base.native_class``),
    and calls these members; the mechanism itself is written once, in the
    public class. The base may in turn read ``_backend``, ``_device`` (the
    native device), ``_dtype`` (a dtype name) and ``forward`` from the public
    class, and call ``_size_lazy_params(name, shape)`` when loading a
    parameter into a lazily sized layer sizes it. ``tests/test_backends.py``
    checks that every backend's ``module_base`` provides each member.

    (The bodies only raise: ``attention_multi.modules.Module`` names this
    class as its base for type checkers alone, at run time it is
    ``module_base`` that provides the members.)
    """

    training: bool  # train/eval mode, read by dropout

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``forward(*args, **kwargs)``, through the framework's call machinery."""
        raise _missing("__call__")

    def train(self, mode: bool = True) -> Self:
        """Set ``training`` here and in every child; returns ``self``."""
        raise _missing("train")

    def eval(self) -> Self:
        """``train(False)``."""
        raise _missing("eval")

    def to_device(self, device: Any) -> Self:
        """Move parameters and buffers to ``device`` (a name or a native device)."""
        raise _missing("to_device")

    def named_arrays(self) -> dict[str, Array]:
        """``{dotted name: parameter array}`` over this module and its children."""
        raise _missing("named_arrays")

    def _native_init(self) -> None:
        """Set up the native base; the first thing a module's ``__init__`` does."""
        raise _missing("_native_init")

    def _add_param(self, name: str, value: Array) -> None:
        """Register the trainable parameter ``name`` with initial ``value``."""
        raise _missing("_add_param")

    def _add_buffer(self, name: str, value: Array) -> None:
        """Register ``name`` as a constant array that moves with the module
        (not a parameter, not saved)."""
        raise _missing("_add_buffer")

    def _param(self, name: str) -> Array:
        """The array of parameter ``name``, as the math takes it."""
        raise _missing("_param")

    def _assign_param(self, dotted_name: str, value: Array) -> None:
        """Overwrite the parameter ``dotted_name`` (``"W_q.weight"``) in place."""
        raise _missing("_assign_param")

    def _add_lazy_param(self, name: str, shape: tuple) -> None:
        """Register a parameter whose size is not known yet (``None`` in
        ``shape``), the framework's own "not yet sized" kind where it has one."""
        raise _missing("_add_lazy_param")

    def _fill_lazy_param(self, name: str, value: Array) -> None:
        """Give a lazily sized parameter its shape and first ``value``."""
        raise _missing("_fill_lazy_param")

    def _unsized(self) -> list[str]:
        """Dotted names of the parameters not sized yet (empty once sized)."""
        raise _missing("_unsized")
