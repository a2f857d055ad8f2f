"""Optional capabilities: each a small declared ``Protocol``, which a backend
has by defining its members (``required.Required`` is the rest).

The core asks ``supports(backend, Fused)`` (``Distributed``, ``Autodiff``)
and takes its generic path where the answer is no; it reads every other
optional member through ``opt(backend)``: the backend's own where it has it,
else the generic default (``defaults.Generic``, written once). A backend may
write a whole group or only the members its framework does better (one flag
of ``Masking``): the rest fall back member by member.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

from .defaults import Generic
from .table import BACKENDS, listing
from .types import Array

__all__ = [
    "CAPABILITIES",
    "Arrays",
    "Autodiff",
    "Blocks",
    "Copies",
    "Costs",
    "Distributed",
    "Dtypes",
    "Fused",
    "Keys",
    "Masking",
    "Threads",
    "Tracing",
    "opt",
    "gradients",
    "supports",
    "value_and_grad",
]

T = TypeVar("T")
R = TypeVar("R")


@runtime_checkable
class Fused(Protocol):
    """The framework's own attention kernel."""

    fused_dropout: bool  # whether it takes ``dropout`` (its own generator)
    fused_causal: bool  # whether it skips the masked half of top-left causal
    # whether it keeps NaN as the masking contract says: a NaN query row or
    # visible key gives NaN, a NaN score the mask hides does not (the mask is
    # a select, not an addition); if not, the core restores it
    fused_keeps_nan: bool

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
        """``dropout(softmax(scale Q K^T + bias, masked)) V`` (batch, heads, Q,
        dv), or None when the case (dtype, layout, mask form, dropout, or
        extra memory beyond ``memory_budget`` bytes) is not supported.

        ``queries`` (batch, heads, Q, d); ``keys`` and ``values`` (batch,
        kv_heads, K, d|dv), ``heads`` a multiple of ``kv_heads``. ``mask`` is
        the core's normalized mask, read through ``protocol.MaskView`` alone.
        The core has already zeroed key and value rows that no query may see,
        and zeroes rows with no visible key afterwards. Dropout at rate
        ``dropout`` with the framework's own generator; softmax accumulated
        in float32 for half precision."""
        ...


@runtime_checkable
class Distributed(Protocol):
    """An exchange between participants, for ring attention."""

    def ring_exchange(self, group: Any) -> tuple[Any, int, Callable[[Array], Array]]:
        """``(rank, size, shift)`` over ``group`` (the framework's process
        group or mesh axis): this participant's index (an int, or traced),
        how many there are, and ``shift(x)``, which sends ``x`` to participant
        ``rank + 1`` and returns the array that ``rank - 1`` sent,
        differentiably where the framework can."""
        ...


@runtime_checkable
class Autodiff(Protocol):
    """The framework's automatic differentiation (without it: none; the
    other three members then default to no gradients)."""

    def gradients(
        self, loss_fn: Callable[..., Array], module: Any, *inputs: Array
    ) -> tuple[float, dict[str, Array], list[Array]]:
        """``(float loss, {param name: gradient}, [gradient of each input])``
        of ``loss_fn(module, *inputs)``."""
        ...

    def checkpoint(self, fn: Callable[..., R], *args: Any) -> R: ...
    def may_differentiate(self, x: Array) -> bool: ...
    def is_differentiated(self, x: Array) -> bool: ...


@runtime_checkable
class Blocks(Protocol):
    """Slices and scans for the tiled and block-sparse paths, traced where
    the framework compiles."""

    runtime_cond: bool
    sequential_scan: bool

    def scan(self, fn: Callable[[T, Any], T], carry: T, xs: Sequence[Array]) -> T: ...
    def cond(
        self, pred: Any, true_fn: Callable[[T], R], false_fn: Callable[[T], R], operand: T
    ) -> R: ...  # noqa: E501
    def read_slice(self, x: Array, start: Any, size: int, axis: int) -> Array: ...
    def write_slice(self, buffer: Array, update: Array, start: Any, axis: int) -> Array: ...
    def vmap(self, fn: Callable[..., Any]) -> Callable[..., Array] | None: ...


@runtime_checkable
class Tracing(Protocol):
    """Tracing and compilation hooks (``jax.jit``, ``torch.compile``)."""

    compiles_per_shape: bool
    traced_values_end: bool
    classes_by_name: bool

    def is_concrete(self, x: Array) -> bool: ...
    def is_tracing(self) -> bool: ...
    def host_code_traced(self) -> bool: ...
    def compiled(self, fn: Callable[..., R]) -> Callable[..., R]: ...
    def register_tree(
        self, cls: type, flatten: Callable[..., Any], unflatten: Callable[..., Any]
    ) -> None: ...  # noqa: E501
    def register_class(self, cls: type) -> None: ...


@runtime_checkable
class Copies(Protocol):
    """What a later read of an array sees (copies, or version counters)."""

    def snapshot(self, x: Array) -> Array: ...
    def keep(self, *arrays: Array) -> Callable[[], tuple[Array, ...]]: ...
    def can_keep(self, x: Array) -> bool: ...


@runtime_checkable
class Keys(Protocol):
    """Explicit PRNG keys for dropout (JAX's), where there is no global generator."""

    def dropout_key(self, seed: int) -> Any: ...
    def fold_key(self, key: Any, index: int) -> Any: ...


@runtime_checkable
class Dtypes(Protocol):
    """Dtype habits: float64 to enable, weak scalars, mixed int widths."""

    weak_scalars: bool
    mixed_int_ops: bool

    def enable_float64(self) -> None: ...


@runtime_checkable
class Threads(Protocol):
    """Threads of the host: a parallel map, fewer threads for small calls."""

    fewer_threads: bool
    fewer_threads_always: bool

    def parallel_map(self, fn: Callable[[T], R], tasks: Sequence[T]) -> list[R]: ...
    def in_fewer_threads(self, fn: Callable[..., R], *arrays: Array) -> R: ...
    def concurrency(self) -> int: ...


@runtime_checkable
class Costs(Protocol):
    """Tuning costs, in scores, that the path planner weighs."""

    kernel_call_cost: int
    accelerator_call_cost: int
    small_scores: int
    tile_host_cost: int
    copy_cost: float
    masked_score_cost: float

    def call_cost(self, device: Any = None) -> float: ...
    def compiled_call_cost(self, device: Any = None) -> float: ...
    def on_accelerator(self, device: Any) -> bool: ...


@runtime_checkable
class Masking(Protocol):
    """How the core's masks translate into this framework's operations."""

    masks_by_adding: bool
    masks_by_lengths: bool
    host_masks: bool
    host_mask_min_size: int
    dense_index_grids: bool
    finite_check_min: int

    def softmax_before_product(self, x: Array, axis: int = -1) -> Array: ...
    def nan_rows(self, weights: Array, axis: int = -1) -> Array: ...
    def below_lengths(self, x: Array, keep: Any, lens: Array, value: float, axis: int) -> Array: ...  # noqa: E501


@runtime_checkable
class Arrays(Protocol):
    """Host reads and messages about arrays; reshapes and shapes where the
    framework's arrays have no ``reshape`` method or may not know a
    dimension until they run (TensorFlow's)."""

    def near_miss(self, x: Any) -> str | None: ...
    def host_sum(self, x: Array) -> float: ...
    def reshape(self, x: Array, shape: Any) -> Array: ...
    def shape(self, x: Array) -> tuple[Any, ...]: ...


CAPABILITIES: tuple[type, ...] = (
    Fused,
    Distributed,
    Autodiff,
    Blocks,
    Tracing,
    Copies,
    Keys,
    Dtypes,
    Threads,
    Costs,
    Masking,
    Arrays,
)
"""Every optional group (tests count each one's members)."""


def members(capability: type) -> tuple[str, ...]:
    """The names of a capability's members."""
    return tuple(
        n for n in (*capability.__annotations__, *vars(capability)) if not n.startswith("_")
    )


_SUPPORTS: dict[tuple[type, type], bool] = {}


def supports(backend: Any, capability: type) -> bool:
    """Whether ``backend`` has ``capability`` (one of this module's
    ``Protocol`` classes): ``isinstance``, answered once per backend class
    (a call then costs a dictionary lookup, not the protocol's check)."""
    key = (type(backend), capability)
    found = _SUPPORTS.get(key)
    if found is None:
        found = isinstance(backend, capability)
        if not _compiling():  # (a dict changed under torch.compile is a guard: a recompile)
            _SUPPORTS[key] = found
    return found


def _compiling() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.compiler.is_compiling())


_FULL: dict[Any, Any] = {}
_FULL_CLASSES: dict[type, type] = {}


def opt(backend: Any) -> Any:
    """``backend`` with every optional member: its own where it has one, the
    generic default (``defaults.Generic``) where it does not. A backend that
    takes the defaults as a mixin is returned as it is; another is seen
    through a view of the same state (``__dict__`` shared: its instance
    attributes, and later changes to them, are the view's too)."""
    if isinstance(backend, Generic):
        return backend
    view = _FULL.get(backend)
    if view is None:
        cls = type(backend)
        made = _FULL_CLASSES.get(cls)
        if made is None:
            made = type(cls.__name__, (cls, Generic), {"__module__": cls.__module__})
            _FULL_CLASSES[cls] = made
        view = object.__new__(made)
        view.__dict__ = backend.__dict__
        if not _compiling():
            _FULL[backend] = view
    return view


def gradients(
    backend: Any, loss_fn: Callable[..., Array], module: Any, *inputs: Array
) -> tuple[float, dict[str, Array], list[Array]]:
    """``backend.gradients(...)`` (``Autodiff``), or a clear error naming
    the backends that have it."""
    if not supports(backend, Autodiff):
        raise NotImplementedError(
            f"the {backend.name} backend has no automatic differentiation; "
            f"train with the {listing(s.name for s in BACKENDS if s.autodiff)} backend"
        )
    return backend.gradients(loss_fn, module, *inputs)


def value_and_grad(
    backend: Any, module: Any, loss_fn: Callable[[Any], Array]
) -> tuple[float, dict[str, Array]]:
    """``(float loss, {param name: gradient})`` of ``loss_fn(module)``."""
    loss, grads, _ = gradients(backend, loss_fn, module)
    return loss, grads
