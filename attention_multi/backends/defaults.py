"""The generic defaults of every optional capability, written once: what the
core does where a backend lacks a member of ``capabilities.py``'s groups.

The core reads optional members through ``capabilities.opt(backend)``: the
backend's own member where it has one, the default here otherwise. Today's
built-in backends other than NumPy take these as a mixin (``NumpyLike``), and
a backend that subclasses ``NumpyLike`` keeps them (``super()`` calls too);
one that does not need not: the core falls back to them all the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, TypeVar

import numpy

from .types import Array

T = TypeVar("T")
R = TypeVar("R")


class Generic:
    """The defaults, by group (``capabilities.Blocks``, ``Tracing``,
    ``Copies``, ``Autodiff``, ``Keys``, ``Dtypes``, ``Threads``, ``Costs``,
    ``Masking``, ``Arrays``): each describes a framework without the
    capability, or is the core's generic way."""

    # == Fused: the kernel's flags (read only with ``capabilities.Fused``) =======
    fused_dropout: bool = False
    fused_causal: bool = False
    fused_keeps_nan: bool = False

    # == Blocks: slices and scans (the tiled and block-sparse paths) ============
    runtime_cond: bool = False  # whether ``cond`` decides at run time while traced
    # whether ``scan`` compiles to one loop: the compiler keeps one step's
    # work alive at a time, where unrolled independent steps may all be live
    sequential_scan: bool = False

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

    def vmap(self, fn: Callable[..., Any]) -> Callable[..., Array] | None:
        """``fn`` mapped over axis 0 of its array arguments, each call seeing
        one element of each (FlexAttention evaluates a mask function so); a
        framework's own ``vmap`` where it has one (traced, differentiable),
        else one call per element, stacked; None where that cannot work."""
        backend: Any = self

        def mapped(*args: Array) -> Array:
            parts = []
            for i in range(args[0].shape[0]):
                out = fn(*(a[i] for a in args))
                if not backend.is_array(out):
                    out = backend.asarray(numpy.asarray(out), device=backend.device_of(args[0]))
                parts.append(backend.reshape(out, (1,)))  # (several values fail here)
            return backend.concatenate(parts, 0)

        return mapped

    # == Tracing: tracing and compilation hooks (defaults: an eager framework) ==
    compiles_per_shape: bool = False  # whether each new array shape costs a compilation
    traced_values_end: bool = False  # values made under a trace are gone when it ends (JAX's)
    # whether every public module's native class is made (``register_class``)
    # when the backend loads: the framework's loading finds a saved module's
    # class by its name, in a fresh process too (Keras' ``load_model``)
    classes_by_name: bool = False

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

    def compiled(self, fn: Callable[..., R]) -> Callable[..., R]:
        """``fn``, a function of arrays (and tuples of them, and None), as
        one compiled program per shapes of its arguments, reused by every
        later call of those shapes (JAX: ``jax.jit``); elsewhere ``fn``."""
        return fn

    def register_tree(
        self, cls: type, flatten: Callable[..., Any], unflatten: Callable[..., Any]
    ) -> None:
        """Let the framework trace through instances of ``cls`` (JAX: a
        pytree node, so that ``jax.jit`` takes and returns them); elsewhere
        nothing. ``flatten(obj) -> (children, aux)``, ``unflatten(aux,
        children) -> obj``. Registering a class twice is harmless."""

    def register_class(self, cls: type) -> None:
        """Hook for frameworks that must know about new native module classes."""

    # == Copies: what a later read of an array sees ==============================
    def snapshot(self, x: Array) -> Array:
        """A copy of ``x`` that later in-place writes to ``x`` do not reach
        (an immutable framework's array is returned as it is)."""
        return x.copy()

    def keep(self, *arrays: Array) -> Callable[[], tuple[Array, ...]]:
        """The arrays as they are now, for a later read: a function that
        returns them. Here copies (``snapshot``); a framework that counts
        in-place writes may keep the arrays themselves and refuse a read after
        a write, as its autodiff does with what it saves."""
        kept = tuple(self.snapshot(x) for x in arrays)
        return lambda: kept

    def can_keep(self, x: Array) -> bool:
        """Whether ``x``, made during a call, may be kept for later calls in
        any mode (torch: not when made under ``inference_mode``, which
        autograd refuses afterwards)."""
        return True

    # == Autodiff (``gradients`` has no default: without it, no autodiff) ======
    def checkpoint(self, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)``; under the framework's autodiff, recomputed in the
        backward pass instead of keeping its intermediates (where it can)."""
        return fn(*args)

    def may_differentiate(self, x: Array) -> bool:
        """False when no gradient can flow through ``x`` in this call (no
        autodiff recording it): work done only for gradients is skipped."""
        return callable(getattr(self, "gradients", None))

    def is_differentiated(self, x: Array) -> bool:
        """True when autodiff is known to record ``x`` in this call, so the
        backward pass will hold what the forward makes (memory planning
        counts it); False when unknown (a trace that may be differentiated
        later, such as ``grad(jit(f))``)."""
        return False

    # == Keys: explicit PRNG keys ==================================================
    def dropout_key(self, seed: int) -> Any:
        """What a training-mode call passes as ``key=``: None, or a PRNG key
        for frameworks without a global random generator (JAX)."""
        return None

    def fold_key(self, key: Any, index: int) -> Any:
        """A key for the ``index``-th of several dropout draws within one call
        (frameworks with a global RNG ignore keys: ``key`` is returned)."""
        return key

    # == Dtypes ======================================================================
    weak_scalars: bool = False  # whether ``where(c, x, python float)`` keeps x's dtype
    mixed_int_ops: bool = True  # whether int32 and int64 arrays meet in one operation

    def enable_float64(self) -> None:
        """Make float64 computable (JAX turns on x64; elsewhere nothing to do)."""

    # == Threads ========================================================================
    # whether ``in_fewer_threads`` runs a function and its backward pass in
    # fewer threads of the framework's CPU pool (where each op is a parallel region)
    fewer_threads: bool = False
    # whether many small calls run faster in fewer threads on an idle machine too
    # (NumPy: OpenBLAS's threads slow its small products), not only on a busy one
    fewer_threads_always: bool = False

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

    def concurrency(self) -> int:
        """How many tasks ``parallel_map`` runs at once."""
        return 1

    # == Costs: tuning the choice of path ================================================
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

    # == Masking: how the core's masks translate into this framework's ops ==========
    # whether adding a broadcast (..., 1, K) array beats ``where`` over the
    # scores (torch's and MXNet's CPU ``where`` cost several additions)
    masks_by_adding: bool = False
    masks_by_lengths: bool = False  # below_lengths is cheaper than where (MXNet's SequenceMask)
    # whether a mask known on the host is made with NumPy and handed over in
    # one ``asarray`` (torch's CPU tensors share NumPy's memory: no parallel
    # region; eager JAX compiles no program for it), from this many entries
    host_masks: bool = False
    host_mask_min_size: int = 1 << 15
    dense_index_grids: bool = False  # mask_mod gets full-shape indices (no broadcast bool ops)
    # keys and values with at least this many elements (together) are read
    # for non-finite entries on the host before their unused rows are zeroed
    # (a finite pair skips the zeroing); below it the zeroing costs less
    finite_check_min: int = 1 << 16

    def softmax_before_product(self, x: Array, axis: int = -1) -> Array:
        """A softmax whose output is multiplied by the values next: where the
        framework's own softmax leaves a NaN row's other entries finite (the
        NaN stays in its entry), this may too, since the product spreads it
        over the output row. ``softmax`` unless a backend saves work here."""
        backend: Any = self
        return backend.softmax(x, axis)

    def nan_rows(self, weights: Array, axis: int = -1) -> Array:
        """Weights from ``softmax_before_product`` as ``softmax`` gives them
        (a row with a NaN entry is all NaN)."""
        return weights

    def below_lengths(self, x: Array, keep: Any, lens: Array, value: float, axis: int) -> Array:
        """``where(keep, x, value)`` (``value`` replaces NaN too) where ``keep``
        is the key lengths' rule along ``axis`` of ``x`` (batch, [heads,] Q|K,
        K|d): -1, key ``j`` of a query's row below its length; -2, key row
        ``j`` below the largest length of the batch element. ``lens`` (batch,)
        or (batch, Q). ``keep``: the array, or a function that makes it. A
        framework with an operator for lengths (``masks_by_lengths``) uses it
        instead of the broadcast ``keep``, which it then need not make."""
        backend: Any = self
        return backend.where(keep() if callable(keep) else keep, x, value)

    # == Arrays: host reads and messages ================================================
    def near_miss(self, x: Any) -> str | None:
        """How to make an array of ``x`` when it is this framework's object of
        another kind (MXNet's ``mx.nd`` arrays), else None."""
        return None

    def host_sum(self, x: Array) -> float:
        """The sum of every entry of a concrete ``x``, read on the host."""
        backend: Any = self
        return float(backend.to_numpy(backend.sum(x.reshape((-1,)), 0)))

    def reshape(self, x: Array, shape: Any) -> Array:
        """``x`` in ``shape`` (a tuple whose entries are ints, one -1, or
        ``shape``'s dynamic sizes)."""
        return x.reshape(shape)

    def shape(self, x: Array) -> tuple[Any, ...]:
        """``x``'s shape: ints, or where the framework does not know a
        dimension while it traces (TensorFlow's ``None``) its size as a
        scalar of the framework, known when the program runs."""
        return tuple(x.shape)
