"""One implementation of the protocol for every framework with a NumPy-like
namespace (``numpy``, ``jax.numpy``, ``mxnet.numpy``, and ``torch``, which
takes NumPy's keywords): a subclass sets ``xp`` and overrides its quirks."""
import numpy as np

from .protocol import Backend

# Functions whose name and arguments are NumPy's in every ``xp``; a subclass
# that spells one differently defines a method of that name.
SAME_SPELLING = ("exp", "tanh", "sqrt", "where", "max", "sum", "any", "repeat",
                 "transpose", "concatenate", "broadcast_to", "minimum", "maximum", "take")


def np_dtype(name):
    """NumPy dtype for a dtype name (bfloat16 needs ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class NumpyLike(Backend):
    xp = None           # the framework's NumPy-like namespace
    array_type = ()     # what ``is_array`` accepts

    def __init__(self):
        super().__init__()
        for name in SAME_SPELLING:
            if not hasattr(type(self), name):
                setattr(self, name, getattr(self.xp, name))

    # -- arrays -----------------------------------------------------------------
    def is_array(self, x):
        return isinstance(x, self.array_type)

    def asarray(self, x, dtype=None, device=None):
        x = self.xp.asarray(x, dtype=None if dtype is None else np_dtype(dtype))
        return x if device is None else self.to_device(x, device)

    def to_numpy(self, x):
        return np.asarray(x)

    def dtype_name(self, x):
        return np.dtype(x.dtype).name

    def astype(self, x, dtype):
        return x.astype(np_dtype(dtype))

    def arange(self, n, device=None):
        """int32 ``[0, n)``."""
        return self.to_device(self.xp.arange(n, dtype=np.int32), device)

    def zeros(self, shape, dtype, device=None):
        return self.to_device(self.xp.zeros(shape, dtype=np_dtype(dtype)), device)

    # -- math -------------------------------------------------------------------
    def logical_and(self, a, b):
        """Elementwise AND of two boolean arrays (broadcasting)."""
        return a & b

    def matmul(self, a, b, transpose_b=False):
        """Batched matrix product over the last two axes."""
        return self.xp.matmul(a, self.xp.swapaxes(b, -1, -2) if transpose_b else b)

    def linear(self, x, weight, bias=None):
        """``x @ weight.T + bias`` with ``weight`` laid out (out, in)."""
        out = self.xp.matmul(x, weight.T)
        return out if bias is None else out + bias

    def exp_inplace(self, x):
        """``exp(x)``, reusing ``x``'s memory where the framework can (``x`` is
        a temporary the caller owns)."""
        return self.exp(x)

    def softmax(self, x, axis=-1):
        e = self.exp(x - self.max(x, axis, keepdims=True))
        return e / self.sum(e, axis, keepdims=True)

    # -- devices ------------------------------------------------------------------
    def device(self, kind, index=0):
        if kind == "cpu":
            return "cpu"
        raise ValueError(f"device {kind}:{index} is not available to the "
                         f"{self.name} backend")

    def device_of(self, x):
        return "cpu"

    def to_device(self, x, device):
        if device not in (None, "cpu"):
            raise ValueError(f"the {self.name} backend runs on the CPU only, "
                             f"not on {device!r}")
        return x

    # -- randomness -----------------------------------------------------------------
    def uniform(self, shape, low, high, dtype="float32", device=None):
        """Drawn by NumPy's global generator (``np.random.seed`` applies)."""
        return self.asarray(np.random.uniform(low, high, size=shape), dtype, device)

    def seed(self, n):
        np.random.seed(n)

    def dropout(self, x, p, key=None):
        if key is not None:
            raise ValueError(
                f"key= is only used by the jax backend; the {self.name} backend "
                f"draws dropout masks from its own random generator")
        return self._dropout(x, p)

    def _dropout(self, x, p):
        """Dropout with the framework's global random generator."""
        keep = self.asarray(np.random.random_sample(tuple(x.shape)) >= p,
                            device=self.device_of(x))
        scale = 1.0 / (1 - p) if p < 1 else 0.0       # p = 1: every element dropped
        return self.where(keep, x * scale,
                          self.zeros((), self.dtype_name(x), self.device_of(x)))
