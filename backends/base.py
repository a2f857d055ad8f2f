"""The backend protocol: the few array operations the mechanisms need.

Each framework implements it in one small subclass. Mechanism code calls these
methods (and plain operators ``+ - * / <`` and ``.reshape``, ``.shape``),
never the framework directly.
"""
import numpy as np

from .devices import parse_device

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES = ("float16", "bfloat16")


class Backend:
    name = ""                    # canonical name, e.g. "torch"
    module_base = None           # base class that makes a module native
    float_dtypes = FLOAT_DTYPES  # float dtypes this framework supports
    autodiff = False             # whether value_and_grad works

    def __init__(self):
        self._native_classes = {}

    def __repr__(self):
        return f"<attention_multi backend {self.name!r}>"

    # -- arrays --------------------------------------------------------
    def is_array(self, x):
        """True if ``x`` is an array (or tracer) of this framework."""
        raise NotImplementedError

    def asarray(self, x, dtype=None, device=None):
        """Array of this framework from array-like ``x``; dtype is a name."""
        raise NotImplementedError

    def to_numpy(self, x):
        """NumPy copy of ``x`` (bfloat16 becomes float32)."""
        raise NotImplementedError

    def is_concrete(self, x):
        """False while ``x`` is traced (values unknown), e.g. under jax.jit."""
        return True

    def arange(self, n, device=None):
        """int32 ``[0, n)``."""
        raise NotImplementedError

    def dtype_name(self, x):
        raise NotImplementedError

    def astype(self, x, dtype):
        raise NotImplementedError

    # -- math ------------------------------------------------------------
    def matmul(self, a, b, transpose_b=False):
        """Batched matrix product over the last two axes."""
        raise NotImplementedError

    def linear(self, x, weight, bias=None):
        """``x @ weight.T + bias`` with ``weight`` laid out (out, in)."""
        raise NotImplementedError

    def softmax(self, x, axis=-1):
        raise NotImplementedError

    def where(self, condition, x, y):
        raise NotImplementedError

    def exp(self, x):
        raise NotImplementedError

    def tanh(self, x):
        raise NotImplementedError

    def max(self, x, axis, keepdims=False):
        raise NotImplementedError

    def sum(self, x, axis, keepdims=False):
        raise NotImplementedError

    def repeat(self, x, repeats, axis):
        """Repeat each element ``repeats`` times along ``axis``."""
        raise NotImplementedError

    def transpose(self, x, axes):
        raise NotImplementedError

    def concatenate(self, xs, axis):
        """Join a sequence of arrays along an existing ``axis``."""
        raise NotImplementedError

    # -- optional capabilities ------------------------------------------------
    def fused_attention(self, queries, keys, values, lens, scale, memory_budget=None):
        """Scaled dot-product attention in the framework's own kernel, or None.

        ``queries`` (..., Q, d), ``keys`` (..., K, d), ``values`` (..., K, dv)
        share their leading axes: ``(N,)`` or ``(batch, heads)`` (possibly
        strided views). ``lens`` is None or int32 ``(batch,)`` / ``(batch, Q)``,
        broadcast over ``heads``; ``scale`` multiplies the scores. Returns
        ``softmax(scale * Q K^T, masked) V`` with the leading axes of
        ``queries``, where, as on the generic path: a length past the end
        masks nothing, a query with no valid key gets an all-zero output, NaN
        in key or value rows past every query's length does not leak, and half
        precision does not overflow.

        Return None when this framework (or this case: dtype, device, a kernel
        that would need more than ``memory_budget`` extra bytes) has no such
        kernel; the caller then falls back to the generic path. ``None``
        budget means no limit. The default has no kernel at all.
        """
        return None

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

    # -- devices ------------------------------------------------------------
    def device(self, kind, index=0):
        """Native device for ``("cpu"|"cuda", index)``; ValueError if absent."""
        if kind == "cpu":
            return self._cpu_device()
        raise ValueError(f"device {kind}:{index} is not available to the "
                         f"{self.name} backend")

    def native_device(self, device):
        """The framework's device for a name (``"cuda:0"``); a native device
        object passes through. ValueError if it is absent."""
        if device is not None and not isinstance(device, str):
            return device
        return self.device(*parse_device("cpu" if device is None else device))

    def _cpu_device(self):
        raise NotImplementedError

    def device_of(self, x):
        raise NotImplementedError

    def to_device(self, x, device):
        raise NotImplementedError

    # -- randomness and training --------------------------------------------
    def uniform(self, shape, low, high, dtype="float32", device=None):
        """Samples from U(low, high), drawn from the framework's own RNG."""
        raise NotImplementedError

    def dropout(self, x, p, key=None):
        """Zero each element with probability p, scale survivors by 1/(1-p)."""
        if key is not None:
            raise ValueError(
                f"key= is only used by the jax backend; the {self.name} backend "
                f"draws dropout masks from its own random generator")
        return self._dropout(x, p)

    def _dropout(self, x, p):
        raise NotImplementedError

    def value_and_grad(self, module, loss_fn):
        """``(float loss, {param name: gradient})`` of ``loss_fn(module)``."""
        raise NotImplementedError(
            f"the {self.name} backend has no automatic differentiation; "
            f"train with the torch, jax or mxnet backend")

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


def np_dtype(name):
    """NumPy dtype for a dtype name (bfloat16 needs ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def softmax_numpy(x, axis=-1):
    """Stable softmax in NumPy, in place on a fresh array."""
    out = x - x.max(axis=axis, keepdims=True)
    np.exp(out, out=out)
    out /= out.sum(axis=axis, keepdims=True)
    return out


class PlainModule:
    """Module base for frameworks without a module system (NumPy, JAX).

    Parameters, buffers and child modules are plain attributes whose names
    are tracked so that they can be listed, loaded and (for JAX) flattened.
    """

    def _native_init(self):
        object.__setattr__(self, "_param_names", [])
        object.__setattr__(self, "_buffer_names", [])
        object.__setattr__(self, "_child_names", [])
        self.training = True

    def __setattr__(self, name, value):
        if isinstance(value, PlainModule) and name not in self._child_names:
            self._child_names.append(name)
        object.__setattr__(self, name, value)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def _add_param(self, name, value):
        self._param_names.append(name)
        object.__setattr__(self, name, value)

    def _add_buffer(self, name, value):
        self._buffer_names.append(name)
        object.__setattr__(self, name, value)

    def _param(self, name):
        return getattr(self, name)

    def named_arrays(self, prefix=""):
        """``{dotted name: parameter}`` over this module and its children."""
        out = {prefix + n: getattr(self, n) for n in self._param_names}
        for c in self._child_names:
            out.update(getattr(self, c).named_arrays(f"{prefix}{c}."))
        return out

    def _assign_param(self, dotted_name, value):
        *path, name = dotted_name.split(".")
        owner = self
        for part in path:
            owner = getattr(owner, part)
        object.__setattr__(owner, name, value)

    def train(self, mode=True):
        self.training = mode
        for c in self._child_names:
            getattr(self, c).train(mode)
        return self

    def eval(self):
        return self.train(False)

    def to_device(self, device):
        """Move parameters and buffers to ``device`` (a name such as 'cuda:0')."""
        dev = self._backend.native_device(device)
        for n in self._param_names + self._buffer_names:
            object.__setattr__(self, n, self._backend.to_device(getattr(self, n), dev))
        for c in self._child_names:
            getattr(self, c).to_device(device)
        return self

