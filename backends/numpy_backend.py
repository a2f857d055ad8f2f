"""NumPy backend: CPU only, plain-object modules, no autodiff."""
import numpy as np

from .base import Backend, PlainModule, np_dtype, softmax_numpy


_BLOCK_QUERIES = 512


def _attend_block(q, kT, v, row_lens, scale, work):
    """softmax(scale q kT) v for one block of queries over all its keys, with
    per-query lengths ``row_lens`` (None: all keys valid)."""
    s = np.matmul(np.multiply(q, scale, dtype=work), kT)
    if row_lens is not None:
        masked = np.arange(s.shape[1]) >= row_lens[:, None]
        s[masked] = -np.inf
    m = s.max(axis=1, keepdims=True)
    empty = None
    if row_lens is not None:
        empty = row_lens[:, None] == 0
        if empty.any():
            m[empty] = 0.0
        else:
            empty = None
    s -= m
    np.exp(s, out=s)
    total = s.sum(axis=1, keepdims=True)
    out = np.matmul(s, v)
    if empty is not None:
        total[empty] = 1.0      # its row of s is all zeros: output 0
    out /= total
    return out


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

    def concatenate(self, xs, axis):
        return np.concatenate(xs, axis=axis)

    def fused_attention(self, queries, keys, values, lens, scale, memory_budget=None):
        """One (query block, key prefix) at a time, in place, float32 for half.

        Keys past each batch element's longest length are skipped rather than
        computed and masked. Query blocks shrink so that a block of scores
        (and its temporaries) fits in ``memory_budget``; declines (None) when
        not even one query's scores fit.
        """
        dtype = queries.dtype
        if dtype.name not in ("float16", "float32", "float64"):
            return None
        work = np.dtype(np.float32) if dtype == np.float16 else dtype
        *lead, num_q, _ = queries.shape
        num_k, dv = keys.shape[-2], values.shape[-1]
        block_q = max(1, min(num_q, _BLOCK_QUERIES))
        if memory_budget is not None:
            block_q = min(block_q, memory_budget // max(1, 2 * num_k * work.itemsize))
            if block_q < 1:
                return None
        batch, heads = lead[0], (lead[1] if len(lead) == 2 else 1)
        shape4 = (batch, heads)
        q, k, v = (x.reshape(shape4 + x.shape[-2:]) for x in (queries, keys, values))
        out = np.empty(shape4 + (num_q, dv), dtype)
        lens = None if lens is None else np.minimum(np.asarray(lens), num_k)
        scale = work.type(scale)
        for b in range(batch):
            row_lens = None
            if lens is None:
                n = num_k
            elif lens.ndim == 1:
                n = int(lens[b])
            else:
                row_lens = lens[b]
                n = int(row_lens.max()) if num_q else 0
            if n == 0:
                out[b] = 0
                continue
            for h in range(heads):
                kb = k[b, h, :n].astype(work, copy=False).T
                vb = v[b, h, :n].astype(work, copy=False)
                for q0 in range(0, num_q, block_q):
                    rows = None if row_lens is None else row_lens[q0:q0 + block_q]
                    out[b, h, q0:q0 + block_q] = _attend_block(
                        q[b, h, q0:q0 + block_q], kb, vb, rows, scale, work)
        return out.reshape(tuple(lead) + (num_q, dv))

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
