"""The backend protocol: what a framework provides to the attention core.

A new backend subclasses ``NumpyLike`` (``numpy_like.py``), sets ``xp`` to its
NumPy-like namespace, and implements the methods marked *required*; math with
NumPy's spelling then comes from ``xp``, and it overrides only its quirks.

Required: ``is_array``, ``asarray``, ``to_numpy``, ``dtype_name``,
``astype``, ``device``, ``device_of``, ``to_device``, ``uniform``,
``dropout``, ``seed``. Math (NumPy spelling, from ``xp`` unless overridden):
``matmul``, ``linear``, ``softmax``, ``where``, ``logical_and``, ``exp``, ``tanh``, ``sqrt``,
``max``, ``sum``, ``any``, ``repeat``, ``transpose``, ``concatenate``,
``broadcast_to``, ``take``, ``arange``, ``zeros``. Capabilities, with defaults here:
``autodiff``/``gradients``/``checkpoint``, ``is_concrete``/``is_tracing``,
``runtime_cond``/``cond``, ``enable_float64``,
``dropout_key``/``fold_key``, ``parallel_map``/``concurrency``,
``write_slice`` (KV caches), ``register_tree`` (containers traced through),
``fused_attention`` (with ``fused_causal``), ``ring_exchange``, and
``module_base``: the class that makes a module native to the framework.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, TypeVar

import numpy

from .devices import parse_device
from .types import Array, DeviceKind, DType, Shape

T = TypeVar("T")
R = TypeVar("R")

FLOAT_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES: tuple[str, ...] = ("float16", "bfloat16")


class Backend:
    """One framework, as the attention core sees it: arrays, devices,
    randomness, capabilities, and the class that makes modules native.

    The class attributes describe the framework; the methods are grouped as
    in the module's docstring (required, math from ``xp``, capabilities with
    defaults here).
    """

    name: str = ""  # canonical name, e.g. "torch"
    module_base: type | None = None  # base class that makes a module native
    float_dtypes: tuple[str, ...] = FLOAT_DTYPES  # float dtypes this framework supports
    autodiff: bool = False  # whether ``gradients`` works
    runtime_cond: bool = False  # whether ``cond`` decides at run time while traced
    dense_index_grids: bool = False  # mask_mod gets full-shape indices (no broadcast bool ops)
    compiles_per_shape: bool = False  # whether each new array shape costs a compilation
    kernel_call_cost: int = 16384  # one more kernel call costs as much as this many scores
    has_fused_attention: bool = False  # whether ``fused_attention`` is implemented
    fused_dropout: bool = False  # whether it takes ``dropout`` (its own generator)
    fused_causal: bool = False  # whether it skips the masked half of top-left causal

    # -- math (NumPy's names and arguments; ``NumpyLike`` binds most from ``xp``).
    # Declared, not defined, here: a subclass supplies them.
    matmul: Callable[..., Array]  # (a, b, transpose_b=False): over the last two axes
    linear: Callable[..., Array]  # (x, weight, bias=None): x @ weight.T + bias
    softmax: Callable[..., Array]  # (x, axis=-1)
    exp_inplace: Callable[..., Array]  # (x): exp, reusing x's memory where it can
    arange: Callable[..., Array]  # (n, device=None): int32 [0, n)
    zeros: Callable[..., Array]  # (shape, dtype, device=None)
    exp: Callable[..., Array]
    tanh: Callable[..., Array]
    sqrt: Callable[..., Array]
    where: Callable[..., Array]
    logical_and: Callable[..., Array]  # (a, b): elementwise AND of booleans
    max: Callable[..., Array]
    sum: Callable[..., Array]
    any: Callable[..., Array]
    repeat: Callable[..., Array]
    transpose: Callable[..., Array]
    concatenate: Callable[..., Array]
    broadcast_to: Callable[..., Array]
    minimum: Callable[..., Array]
    maximum: Callable[..., Array]
    take: Callable[..., Array]

    def __init__(self) -> None:
        self._native_classes: dict[type, type] = {}

    def __repr__(self) -> str:
        return f"<attention_multi backend {self.name!r}>"

    # -- arrays (required) ----------------------------------------------------
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

    # -- devices (required) -----------------------------------------------------
    def device(self, kind: DeviceKind, index: int = 0) -> Any:
        """Native device for ``("cpu"|"cuda", index)``; ValueError if absent."""
        raise NotImplementedError

    def device_of(self, x: Array) -> Any:
        """The native device ``x`` lives on."""
        raise NotImplementedError

    def to_device(self, x: Array, device: Any) -> Array:
        """``x`` on the native ``device`` (``x`` itself when ``device`` is None)."""
        raise NotImplementedError

    def native_device(self, device: Any) -> Any:
        """The framework's device for a name (``"cuda:0"``); a native device
        object passes through. ValueError if it is absent."""
        if device is not None and not isinstance(device, str):
            return device
        return self.device(*parse_device("cpu" if device is None else device))

    # -- randomness (required) --------------------------------------------------
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

    # -- capabilities -------------------------------------------------------------
    def is_concrete(self, x: Array) -> bool:
        """False while ``x`` is traced (values unknown: ``jax.jit``,
        ``torch.compile``...); value checks and host-side decisions then wait."""
        return True

    def is_tracing(self) -> bool:
        """True while the framework traces a function (``jax.jit``,
        ``jax.grad``, ``torch.compile``...), whatever the arrays at hand:
        lazily sized modules cannot create their parameters then."""
        return False

    def enable_float64(self) -> None:
        """Make float64 computable (JAX turns on x64; elsewhere nothing to do)."""

    def dropout_key(self, seed: int) -> Any:
        """What a training-mode call passes as ``key=``: None, or a PRNG key
        for frameworks without a global random generator (JAX)."""
        return None

    def fold_key(self, key: Any, index: int) -> Any:
        """A key for the ``index``-th of several dropout draws within one call
        (frameworks with a global RNG ignore keys: ``key`` is returned)."""
        return key

    def gradients(
        self, loss_fn: Callable[..., Array], module: Any, *inputs: Array
    ) -> tuple[float, dict[str, Array], list[Array]]:
        """``(float loss, {param name: gradient}, [gradient of each input])``
        of ``loss_fn(module, *inputs)``, by the framework's own autodiff."""
        raise NotImplementedError(
            f"the {self.name} backend has no automatic differentiation; "
            f"train with the torch, jax or mxnet backend"
        )

    def value_and_grad(
        self, module: Any, loss_fn: Callable[[Any], Array]
    ) -> tuple[float, dict[str, Array]]:
        """``(float loss, {param name: gradient})`` of ``loss_fn(module)``."""
        loss, grads, _ = self.gradients(loss_fn, module)
        return loss, grads

    def parallel_map(self, fn: Callable[[T], R], tasks: Sequence[T]) -> list[R]:
        """``[fn(t) for t in tasks]``, in parallel where the framework does not
        parallelize each operation itself."""
        return [fn(t) for t in tasks]

    def concurrency(self) -> int:
        """How many tasks ``parallel_map`` runs at once."""
        return 1

    def cond(
        self, pred: Any, true_fn: Callable[[T], R], false_fn: Callable[[T], R], operand: T
    ) -> R:
        """``true_fn(operand)`` if ``pred`` else ``false_fn(operand)``; with
        ``runtime_cond``, also while traced (decided when the program runs)."""
        return true_fn(operand) if bool(pred) else false_fn(operand)

    def checkpoint(self, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)``; under the framework's autodiff, recomputed in the
        backward pass instead of keeping its intermediates (where it can)."""
        return fn(*args)

    def write_slice(self, buffer: Array, update: Array, start: Any, axis: int) -> Array:
        """A copy of ``buffer`` with ``update`` written at ``start`` along
        ``axis`` (the other axes whole): out of place, so autodiff sees it.
        ``start`` is an int, or a 0-d int array that may be traced where the
        framework compiles (JAX: then the write is clamped to the buffer)."""
        out = buffer.copy()
        index: list[Any] = [slice(None)] * len(buffer.shape)
        index[axis] = slice(start, start + update.shape[axis])
        out[tuple(index)] = update
        return out

    def register_tree(
        self, cls: type, flatten: Callable[..., Any], unflatten: Callable[..., Any]
    ) -> None:
        """Let the framework trace through instances of ``cls`` (JAX: a
        pytree node, so that ``jax.jit`` takes and returns them); elsewhere
        nothing. ``flatten(obj) -> (children, aux)``, ``unflatten(aux,
        children) -> obj``. Registering a class twice is harmless."""

    def fused_attention(
        self,
        queries: Array,
        keys: Array,
        values: Array,
        mask: Any,
        scale: float,
        memory_budget: int | None = None,
        dropout: float = 0.0,
    ) -> Array | None:
        """The framework's own attention kernel (with ``has_fused_attention``
        True), or None to let the core's generic paths run.

        ``queries`` (batch, heads, Q, d); ``keys`` and ``values`` (batch,
        kv_heads, K, d|dv), ``heads`` a multiple of ``kv_heads``. ``mask`` is
        the core's normalized mask; a kernel reads it (``mask.only_lens``,
        ``mask.lens``, ``mask.top_left_causal``, ``mask.boolean(...)``,
        ``mask.additive(...)``, ``mask.bias``) and translates what its
        framework supports. The core has already zeroed key and value rows
        that no query may see, and zeroes rows with no visible key afterwards.
        Return ``dropout(softmax(scale Q K^T + bias, masked)) V`` (batch,
        heads, Q, dv), dropout at rate ``dropout`` with the framework's own
        generator, softmax accumulated in float32 for half precision; or None
        when the case (dtype, layout, mask form, dropout, or extra memory
        beyond ``memory_budget`` bytes, None meaning no limit) is not supported.
        """
        return None

    def ring_exchange(self, group: Any) -> tuple[Any, int, Callable[[Array], Array]]:
        """``(rank, size, shift)`` for ring attention over ``group`` (the
        framework's process group or mesh axis): this participant's index
        (an int, or traced), how many there are, and ``shift(x)``, which sends
        ``x`` to participant ``rank + 1`` and returns the array that ``rank -
        1`` sent, differentiably where the framework can."""
        raise NotImplementedError(
            f"ring attention needs a communicating framework; the {self.name} "
            f"backend has none (use torch.distributed or a JAX mesh)"
        )

    # -- modules ---------------------------------------------------------------
    def native_class(self, public_class: type) -> type:
        """The subclass of ``public_class`` that is native to this framework."""
        cls = self._native_classes.get(public_class)
        if cls is None:
            if self.module_base is None:
                raise NotImplementedError(f"the {self.name} backend sets no module_base")
            cls = type(
                public_class.__name__,
                (public_class, self.module_base),
                {
                    "_backend": self,
                    "__module__": public_class.__module__,
                    "__qualname__": public_class.__qualname__,
                },
            )
            self._register_class(cls)
            self._native_classes[public_class] = cls
        return cls

    def _register_class(self, cls: type) -> None:
        """Hook for frameworks that must know about new module classes."""
