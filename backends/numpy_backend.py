"""NumPy backend: CPU only, plain-object modules, no autodiff."""
import numpy as np

from .base import Backend, PlainModule, np_dtype, softmax_numpy


class NumpyBackend(Backend):
    name = "numpy"
    module_base = PlainModule
    float_dtypes = ("float16", "float32", "float64")

    def is_array(self, x):
        return isinstance(x, (np.ndarray, np.generic))

    def asarray(self, x, dtype=None, device=None):
        self._check_cpu(device)
        return np.asarray(x, dtype=None if dtype is None else np_dtype(dtype))

    def to_numpy(self, x):
        return np.asarray(x)

    def arange(self, n, device=None):
        return np.arange(n, dtype=np.int32)

    def dtype_name(self, x):
        return x.dtype.name

    def astype(self, x, dtype):
        return x.astype(np_dtype(dtype), copy=False)

    def matmul(self, a, b, transpose_b=False):
        return np.matmul(a, np.swapaxes(b, -1, -2) if transpose_b else b)

    def linear(self, x, weight, bias=None):
        out = x @ weight.T
        return out if bias is None else out + bias

    def softmax(self, x, axis=-1):
        return softmax_numpy(x, axis)

    def where(self, condition, x, y):
        return np.where(condition, x, y)

    def exp(self, x):
        return np.exp(x)

    def tanh(self, x):
        return np.tanh(x)

    def max(self, x, axis, keepdims=False):
        return x.max(axis=axis, keepdims=keepdims)

    def sum(self, x, axis, keepdims=False):
        return x.sum(axis=axis, keepdims=keepdims)

    def repeat(self, x, repeats, axis):
        return np.repeat(x, repeats, axis=axis)

    def transpose(self, x, axes):
        return np.transpose(x, axes)

    def _cpu_device(self):
        return "cpu"

    def device_of(self, x):
        return "cpu"

    def to_device(self, x, device):
        self._check_cpu(device)
        return x

    def _check_cpu(self, device):
        if device not in (None, "cpu"):
            raise ValueError(f"the numpy backend runs on the CPU only, not on {device!r}")

    def uniform(self, shape, low, high, dtype="float32", device=None):
        return np.random.uniform(low, high, size=shape).astype(np_dtype(dtype))

    def _dropout(self, x, p):
        keep = np.random.random_sample(x.shape) >= p
        return np.where(keep, x / np.asarray(1 - p, x.dtype), np.zeros((), x.dtype))
