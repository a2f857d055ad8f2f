"""The backend protocol: what a framework provides to the attention core.

``Backend`` reads in six groups, in this order (``NativeModule``, below, is
what the framework's module base provides):

1. **Required**: ``name``, ``module_base``, and arrays, devices and randomness
   in the framework's terms (11 methods). No defaults here.
2. **Array math**: 22 functions with NumPy's names and arguments, declared here;
   ``NumpyLike`` binds them from ``xp``.
3. **Capability flags**: class attributes the core reads to choose a path;
   the defaults describe a framework without the capability.
4. **Kernels**: autodiff,
   recomputation, run-time branch, slice read and write, compiled functions
   and parallel map; each default
   is the core's generic way, or a clear refusal.
5. **Tracing and key hooks**: for frameworks that trace (``jax.jit``,
   ``torch.compile``) or take explicit PRNG keys; defaults for eager ones.
6. **Provided here**: derived from the above; not overridden.

A new backend subclasses ``NumpyLike`` (``numpy_like.py``), sets ``name``,
``xp`` (its NumPy-like namespace), ``array_type`` and ``module_base``,
overrides the required methods where NumPy's CPU-only versions do not fit
and the math its framework spells differently, then sets the flags and
writes the kernels it has. Everything in groups 3-5 is optional.

The required part alone is ``required.Required`` (at most 25 members); the
framework's own attention kernel and a distributed exchange are optional
capabilities, declared in ``capabilities.py`` (``Fused``, ``Distributed``)
and detected with ``capabilities.supports``: a backend without them has no
such members at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

import numpy

from .devices import parse_device
from .table import BACKENDS, listing
from .types import Array, DeviceKind, DType, Shape

if TYPE_CHECKING:
    from typing_extensions import Self

T = TypeVar("T")
R = TypeVar("R")

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
    """One framework, as the attention core sees it, in the six groups of
    this module's docstring: required, array math, capability flags,
    kernels, tracing and key hooks, provided here."""

    def __init__(self) -> None:
        self._native_classes: dict[type, type] = {}

    def __repr__(self) -> str:
        return f"<attention_multi backend {self.name!r}>"

    # == 1. Required: the framework's arrays, devices and randomness ===========
    name: str = ""  # canonical name, e.g. "torch" (a row of table.BACKENDS)
    module_base: type[NativeModule] | None = None  # base class that makes a module native
    xp: Any = None  # the framework's NumPy-like namespace (numpy, torch, jax.numpy, mxnet.np)

    def is_array(self, x: Any) -> bool:
        """True if ``x`` is an array (or tracer) of this framework."""
        raise NotImplementedError

    def near_miss(self, x: Any) -> str | None:
        """How to make an array of ``x`` when it is this framework's object of
        another kind (MXNet's ``mx.nd`` arrays), else None."""
        return None

    def asarray(self, x: Any, dtype: DType | None = None, device: Any = None) -> Array:
        """Array of this framework from array-like ``x``; dtype is a name."""
        raise NotImplementedError

    def to_numpy(self, x: Array) -> numpy.ndarray:
        """NumPy copy of ``x`` (bfloat16 becomes float32)."""
        raise NotImplementedError

    def dtype_name(self, x: Array) -> str:
        """The NumPy name of ``x``'s dtype (``"float32"``, ``"bfloat16"``...)."""
        raise NotImplementedError

    def host_sum(self, x: Array) -> float:
        """The sum of every entry of a concrete ``x``, read on the host."""
        return float(self.to_numpy(self.sum(x.reshape((-1,)), 0)))

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

    # == 3. Capability flags: what the core may ask of this framework ==========
    float_dtypes: tuple[str, ...] = FLOAT_DTYPES  # float dtypes this framework supports
    autodiff: bool = False  # whether ``gradients`` works
    runtime_cond: bool = False  # whether ``cond`` decides at run time while traced
    compiles_per_shape: bool = False  # whether each new array shape costs a compilation
    # whether ``scan`` compiles to one loop: the compiler keeps one step's
    # work alive at a time, where unrolled independent steps may all be live
    sequential_scan: bool = False
    kernel_call_cost: int = 16384  # one more kernel call costs as much as this many scores, idle
    # on an accelerator (a GPU): a launch and its host dispatch cost as much as
    # this many scores (an H200 computes 1e11-5e11 scores a second; a call from
    # Python takes 20-50 us), so one fused call over every score beats a few
    accelerator_call_cost: int = 1 << 23
    # on a CPU, calls of up to this many scores over at most 256 keys, with
    # lengths or no mask, take the full path at once: its few plain calls beat
    # planning and a kernel's own fixed cost (every call: at most 32768)
    small_scores: int = 1 << 15
    # what a tile of the tiled path costs beyond its kernel call, in scores:
    # its host work (its slices, its rows put back)
    tile_host_cost: int = 0
    # what copying one element costs, in scores (a tile's gathered rows, the
    # output put back in batch order)
    copy_cost: float = 0.0
    # what a mask costs a kernel per score it computes, in scores (a pass of
    # ``where``): a tile of elements that see different keys is masked
    masked_score_cost: float = 1.0
    # whether ``in_fewer_threads`` runs a function and its backward pass in
    # fewer threads of the framework's CPU pool (where each op is a parallel region)
    fewer_threads: bool = False
    # whether many small calls run faster in fewer threads on an idle machine too
    # (NumPy: OpenBLAS's threads slow its small products), not only on a busy one
    fewer_threads_always: bool = False
    # whether a mask known on the host is made with NumPy and handed over in
    # one ``asarray`` (torch's CPU tensors share NumPy's memory: no parallel
    # region; eager JAX compiles no program for it), from this many entries
    host_masks: bool = False
    host_mask_min_size: int = 1 << 15
    # (with ``capabilities.Fused``: a kernel that takes dropout, one that skips
    # the masked half of top-left causal, one that keeps NaN by itself)
    fused_dropout: bool = False
    fused_causal: bool = False
    weak_scalars: bool = False  # whether ``where(c, x, python float)`` keeps x's dtype
    # whether adding a broadcast (..., 1, K) array beats ``where`` over the
    # scores (torch's and MXNet's CPU ``where`` cost several additions)
    masks_by_adding: bool = False
    masks_by_lengths: bool = False  # below_lengths is cheaper than where (MXNet's SequenceMask)
    # keys and values with at least this many elements (together) are read
    # for non-finite entries on the host before their unused rows are zeroed
    # (a finite pair skips the zeroing); below it the zeroing costs less
    finite_check_min: int = 1 << 16
    fused_keeps_nan: bool = False
    dense_index_grids: bool = False  # mask_mod gets full-shape indices (no broadcast bool ops)
    mixed_int_ops: bool = True  # whether int32 and int64 arrays meet in one operation
    traced_values_end: bool = False  # values made under a trace are gone when it ends (JAX's)

    # == 4. Kernels: the framework's own way, where it has one ===================
    def gradients(
        self, loss_fn: Callable[..., Array], module: Any, *inputs: Array
    ) -> tuple[float, dict[str, Array], list[Array]]:
        """``(float loss, {param name: gradient}, [gradient of each input])``
        of ``loss_fn(module, *inputs)``, by the framework's own autodiff."""
        raise NotImplementedError(
            f"the {self.name} backend has no automatic differentiation; "
            f"train with the {listing(s.name for s in BACKENDS if s.autodiff)} backend"
        )

    def checkpoint(self, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)``; under the framework's autodiff, recomputed in the
        backward pass instead of keeping its intermediates (where it can)."""
        return fn(*args)

    def scan(self, fn: Callable[[T, Any], T], carry: T, xs: Sequence[Array]) -> T:
        """The final carry of ``carry = fn(carry, [x[i] for x in xs])`` for each
        ``i`` along the first axis of the arrays ``xs``; with ``sequential_scan``
        one compiled loop (the framework's own scan), not one step per ``i``."""
        for i in range(xs[0].shape[0]):
            carry = fn(carry, [x[i] for x in xs])
        return carry

    def cond(
        self, pred: Any, true_fn: Callable[[T], R], false_fn: Callable[[T], R], operand: T
    ) -> R:
        """``true_fn(operand)`` if ``pred`` else ``false_fn(operand)``; with
        ``runtime_cond``, also while traced (decided when the program runs)."""
        return true_fn(operand) if bool(pred) else false_fn(operand)

    def read_slice(self, x: Array, start: Any, size: int, axis: int) -> Array:
        """``x`` at ``start, ..., start + size - 1`` along ``axis`` (the other
        axes whole). ``start`` is an int, or a 0-d int array that may be
        traced where the framework compiles (JAX: then the read is clamped to
        ``x``)."""
        index: list[Any] = [slice(None)] * len(x.shape)
        index[axis] = slice(start, start + size)
        return x[tuple(index)]

    def vmap(self, fn: Callable[..., Any]) -> Callable[..., Array] | None:
        """``fn`` mapped over axis 0 of its array arguments, each call seeing
        one element of each (FlexAttention evaluates a mask function so); a
        framework's own ``vmap`` where it has one (traced, differentiable),
        else one call per element, stacked; None where that cannot work."""

        def mapped(*args: Array) -> Array:
            parts = []
            for i in range(args[0].shape[0]):
                out = fn(*(a[i] for a in args))
                if not self.is_array(out):
                    out = self.asarray(numpy.asarray(out), device=self.device_of(args[0]))
                parts.append(out.reshape((1,)))  # (an answer of several values fails here)
            return self.concatenate(parts, 0)

        return mapped

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

    def compiled(self, fn: Callable[..., R]) -> Callable[..., R]:
        """``fn``, a function of arrays (and tuples of them, and None), as
        one compiled program per shapes of its arguments, reused by every
        later call of those shapes (JAX: ``jax.jit``); elsewhere ``fn``."""
        return fn

    def parallel_map(self, fn: Callable[[T], R], tasks: Sequence[T]) -> list[R]:
        """``[fn(t) for t in tasks]``, in parallel where the framework does not
        parallelize each operation itself."""
        return [fn(t) for t in tasks]

    def in_fewer_threads(self, fn: Callable[..., R], *arrays: Array) -> R:
        """``fn(*arrays)``, its operations, and under autodiff their backward
        pass, in half the threads of the CPU pool, at least one
        (``fewer_threads``): on a busy machine its many small operations then
        wait for fewer descheduled threads; else just the call."""
        return fn(*arrays)

    def call_cost(self, device: Any = None) -> float:
        """What one more framework call on ``device`` (``device_of``) costs
        now, in scores: ``accelerator_call_cost`` on an accelerator;
        ``kernel_call_cost`` on the CPU. Only where the user opts in with
        ``ATTENTION_MULTI_CALL_COST=measured`` may a backend add what its calls
        wait now (a parallel region waits for the threads the OS has
        descheduled on a busy machine): the choice of path then follows the
        load, and paths round differently, so the same call may give other
        bits in another process. By default the load changes speed, never
        answers."""
        return self.accelerator_call_cost if self.on_accelerator(device) else self.kernel_call_cost

    def compiled_call_cost(self, device: Any = None) -> float:
        """What one more branch or loop step inside a compiled program
        (``jax.jit``) costs, in scores: nothing on the CPU (the program runs
        on); on an accelerator, launches and a host round trip for the branch."""
        return self.accelerator_call_cost if self.on_accelerator(device) else 0.0

    def on_accelerator(self, device: Any) -> bool:
        """Whether ``device`` (``device_of``: None where the framework places
        arrays itself) is an accelerator, not the CPU."""
        return False

    def concurrency(self) -> int:
        """How many tasks ``parallel_map`` runs at once."""
        return 1

    # == 5. Tracing and key hooks: defaults for an eager framework ===============
    def is_concrete(self, x: Array) -> bool:
        """False while ``x`` is traced (values unknown: ``jax.jit``,
        ``torch.compile``...); value checks and host-side decisions then wait."""
        return True

    def is_tracing(self) -> bool:
        """True while the framework traces a function (``jax.jit``,
        ``jax.grad``, ``torch.compile``...), whatever the arrays at hand:
        lazily sized modules cannot create their parameters then."""
        return False

    def host_code_traced(self) -> bool:
        """True while host NumPy code is itself being traced into the graph
        (``torch.compile``'s dynamo turns NumPy calls into graph operations):
        the core then decides nothing from arrays it computes on the host."""
        return False

    def may_differentiate(self, x: Array) -> bool:
        """False when no gradient can flow through ``x`` in this call (no
        autodiff recording it): work done only for gradients is skipped."""
        return self.autodiff

    def is_differentiated(self, x: Array) -> bool:
        """True when autodiff is known to record ``x`` in this call, so the
        backward pass will hold what the forward makes (memory planning
        counts it); False when unknown (a trace that may be differentiated
        later, such as ``grad(jit(f))``)."""
        return False

    def snapshot(self, x: Array) -> Array:
        """A copy of ``x`` that later in-place writes to ``x`` do not reach
        (an immutable framework's array is returned as it is)."""
        return x.copy()

    def snapshots(self, *arrays: Array) -> tuple[Array, ...]:
        """``snapshot`` of each array, in as few framework calls as it can."""
        return tuple(self.snapshot(x) for x in arrays)

    def keep(self, *arrays: Array) -> Callable[[], tuple[Array, ...]]:
        """The arrays as they are now, for a later read: a function that
        returns them. Here copies (``snapshots``); a framework that counts
        in-place writes may keep the arrays themselves and refuse a read after
        a write, as its autodiff does with what it saves."""
        kept = self.snapshots(*arrays)
        return lambda: kept

    def can_keep(self, x: Array) -> bool:
        """Whether ``x``, made during a call, may be kept for later calls in
        any mode (torch: not when made under ``inference_mode``, which
        autograd refuses afterwards)."""
        return True

    def register_tree(
        self, cls: type, flatten: Callable[..., Any], unflatten: Callable[..., Any]
    ) -> None:
        """Let the framework trace through instances of ``cls`` (JAX: a
        pytree node, so that ``jax.jit`` takes and returns them); elsewhere
        nothing. ``flatten(obj) -> (children, aux)``, ``unflatten(aux,
        children) -> obj``. Registering a class twice is harmless."""

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

    def _register_class(self, cls: type) -> None:
        """Hook for frameworks that must know about new module classes."""

    # == 6. Provided here, from the members above ===============================
    def softmax_before_product(self, x: Array, axis: int = -1) -> Array:
        """A softmax whose output is multiplied by the values next: where the
        framework's own softmax leaves a NaN row's other entries finite (the
        NaN stays in its entry), this may too, since the product spreads it
        over the output row. ``softmax`` unless a backend saves work here."""
        return self.softmax(x, axis)

    def below_lengths(self, x: Array, keep: Any, lens: Array, value: float, axis: int) -> Array:
        """``where(keep, x, value)`` (``value`` replaces NaN too) where ``keep``
        is the key lengths' rule along ``axis`` of ``x`` (batch, [heads,] Q|K,
        K|d): -1, key ``j`` of a query's row below its length; -2, key row
        ``j`` below the largest length of the batch element. ``lens`` (batch,)
        or (batch, Q). ``keep``: the array, or a function that makes it. A
        framework with an operator for lengths (``masks_by_lengths``) uses it
        instead of the broadcast ``keep``, which it then need not make."""
        return self.where(keep() if callable(keep) else keep, x, value)

    def nan_rows(self, weights: Array, axis: int = -1) -> Array:
        """Weights from ``softmax_before_product`` as ``softmax`` gives them
        (a row with a NaN entry is all NaN)."""
        return weights

    def native_device(self, device: Any) -> Any:
        """The framework's device for a name (``"cuda:0"``); a native device
        object passes through. ValueError if it is absent."""
        if device is not None and not isinstance(device, str):
            return device
        return self.device(*parse_device("cpu" if device is None else device))

    def value_and_grad(
        self, module: Any, loss_fn: Callable[[Any], Array]
    ) -> tuple[float, dict[str, Array]]:
        """``(float loss, {param name: gradient})`` of ``loss_fn(module)``."""
        loss, grads, _ = self.gradients(loss_fn, module)
        return loss, grads

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


def _missing(member: str) -> NotImplementedError:
    return NotImplementedError(f"a backend's module_base must provide {member}")


class NativeModule(Protocol):
    """The native-module contract: what a backend's ``module_base`` provides.

    Every module (``attention_multi.modules.Module``) is an instance of a
    subclass of its public class and of ``module_base`` (``Backend.native_class``),
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
