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
``autodiff``/``gradients``/``checkpoint``, ``is_concrete``/``is_tracing``, ``runtime_cond``/``cond``,
``enable_float64``,
``dropout_key``/``fold_key``, ``parallel_map``/``concurrency``,
``write_slice`` (KV caches), ``register_tree`` (containers traced through),
``fused_attention`` (with ``fused_causal``), and
``module_base``: the class that makes a module native to the framework.
"""
from .devices import parse_device

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES = ("float16", "bfloat16")


class Backend:
    name = ""                    # canonical name, e.g. "torch"
    module_base = None           # base class that makes a module native
    float_dtypes = FLOAT_DTYPES  # float dtypes this framework supports
    autodiff = False             # whether ``gradients`` works
    runtime_cond = False         # whether ``cond`` decides at run time while traced
    compiles_per_shape = False   # whether each new array shape costs a compilation
    kernel_call_cost = 16384     # one more kernel call costs as much as this many scores
    has_fused_attention = False  # whether ``fused_attention`` is implemented
    fused_dropout = False        # whether it takes ``dropout`` (its own generator)
    fused_causal = False         # whether it skips the masked half of top-left causal

    def __init__(self):
        self._native_classes = {}

    def __repr__(self):
        return f"<attention_multi backend {self.name!r}>"

    # -- arrays (required) ----------------------------------------------------
    def is_array(self, x):
        """True if ``x`` is an array (or tracer) of this framework."""
        raise NotImplementedError

    def asarray(self, x, dtype=None, device=None):
        """Array of this framework from array-like ``x``; dtype is a name."""
        raise NotImplementedError

    def to_numpy(self, x):
        """NumPy copy of ``x`` (bfloat16 becomes float32)."""
        raise NotImplementedError

    def dtype_name(self, x):
        raise NotImplementedError

    def astype(self, x, dtype):
        raise NotImplementedError

    # -- devices (required) -----------------------------------------------------
    def device(self, kind, index=0):
        """Native device for ``("cpu"|"cuda", index)``; ValueError if absent."""
        raise NotImplementedError

    def device_of(self, x):
        raise NotImplementedError

    def to_device(self, x, device):
        raise NotImplementedError

    def native_device(self, device):
        """The framework's device for a name (``"cuda:0"``); a native device
        object passes through. ValueError if it is absent."""
        if device is not None and not isinstance(device, str):
            return device
        return self.device(*parse_device("cpu" if device is None else device))

    # -- randomness (required) --------------------------------------------------
    def uniform(self, shape, low, high, dtype="float32", device=None):
        """Samples from U(low, high), drawn from the framework's own RNG."""
        raise NotImplementedError

    def dropout(self, x, p, key=None):
        """Zero each element with probability p, scale survivors by 1/(1-p)."""
        raise NotImplementedError

    def seed(self, n):
        """Seed the global generators that ``uniform`` and ``dropout`` draw
        from (frameworks with explicit keys: only the initialization's)."""
        raise NotImplementedError

    # -- capabilities -------------------------------------------------------------
    def is_concrete(self, x):
        """False while ``x`` is traced (values unknown: ``jax.jit``,
        ``torch.compile``...); value checks and host-side decisions then wait."""
        return True

    def is_tracing(self):
        """True while the framework traces a function (``jax.jit``,
        ``jax.grad``, ``torch.compile``...), whatever the arrays at hand:
        lazily sized modules cannot create their parameters then."""
        return False

    def enable_float64(self):
        """Make float64 computable (JAX turns on x64; elsewhere nothing to do)."""

    def dropout_key(self, seed):
        """What a training-mode call passes as ``key=``: None, or a PRNG key
        for frameworks without a global random generator (JAX)."""
        return None

    def fold_key(self, key, index):
        """A key for the ``index``-th of several dropout draws within one call
        (frameworks with a global RNG ignore keys: ``key`` is returned)."""
        return key

    def gradients(self, loss_fn, module, *inputs):
        """``(float loss, {param name: gradient}, [gradient of each input])``
        of ``loss_fn(module, *inputs)``, by the framework's own autodiff."""
        raise NotImplementedError(
            f"the {self.name} backend has no automatic differentiation; "
            f"train with the torch, jax or mxnet backend")

    def value_and_grad(self, module, loss_fn):
        """``(float loss, {param name: gradient})`` of ``loss_fn(module)``."""
        loss, grads, _ = self.gradients(loss_fn, module)
        return loss, grads

    def parallel_map(self, fn, tasks):
        """``[fn(t) for t in tasks]``, in parallel where the framework does not
        parallelize each operation itself."""
        return [fn(t) for t in tasks]

    def concurrency(self):
        """How many tasks ``parallel_map`` runs at once."""
        return 1

    def cond(self, pred, true_fn, false_fn, operand):
        """``true_fn(operand)`` if ``pred`` else ``false_fn(operand)``; with
        ``runtime_cond``, also while traced (decided when the program runs)."""
        return true_fn(operand) if bool(pred) else false_fn(operand)

    def checkpoint(self, fn, *args):
        """``fn(*args)``; under the framework's autodiff, recomputed in the
        backward pass instead of keeping its intermediates (where it can)."""
        return fn(*args)

    def write_slice(self, buffer, update, start, axis):
        """A copy of ``buffer`` with ``update`` written at ``start`` along
        ``axis`` (the other axes whole): out of place, so autodiff sees it.
        ``start`` is an int, or a 0-d int array that may be traced where the
        framework compiles (JAX: then the write is clamped to the buffer)."""
        out = buffer.copy()
        index = [slice(None)] * len(buffer.shape)
        index[axis] = slice(start, start + update.shape[axis])
        out[tuple(index)] = update
        return out

    def register_tree(self, cls, flatten, unflatten):
        """Let the framework trace through instances of ``cls`` (JAX: a
        pytree node, so that ``jax.jit`` takes and returns them); elsewhere
        nothing. ``flatten(obj) -> (children, aux)``, ``unflatten(aux,
        children) -> obj``. Registering a class twice is harmless."""

    def fused_attention(self, queries, keys, values, mask, scale, memory_budget=None,
                        dropout=0.0):
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

    # -- modules ---------------------------------------------------------------
    def native_class(self, public_class):
        """The subclass of ``public_class`` that is native to this framework."""
        cls = self._native_classes.get(public_class)
        if cls is None:
            cls = type(public_class.__name__, (public_class, self.module_base), {
                "_backend": self,
                "__module__": public_class.__module__,
                "__qualname__": public_class.__qualname__,
            })
            self._register_class(cls)
            self._native_classes[public_class] = cls
        return cls

    def _register_class(self, cls):
        """Hook for frameworks that must know about new module classes."""
