"""NumPy backend: CPU only, plain-object modules, no autodiff."""
import contextlib
import ctypes
import glob
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .base import Backend, PlainModule, np_dtype, softmax_numpy

_BLOCK_QUERIES = 512
_PARALLEL_MIN_SCORES = 1 << 16   # fewer scores than this: not worth the threads


class _OpenBLAS:
    """The OpenBLAS that NumPy's wheels bundle, to run BLAS single-threaded
    inside our own worker threads (what threadpoolctl does). Absent (other
    BLAS, unknown build): ``usable`` is False and nothing is changed."""

    def __init__(self):
        self.local = self.set_global = self.get_global = self.config = None
        here = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
        for path in sorted(glob.glob(os.path.join(here, "*openblas*.so*"))):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            self.local = getattr(lib, "openblas_set_num_threads_local", None)
            for prefix in ("scipy_openblas", "openblas"):
                for suffix in ("64_", ""):
                    get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                    put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                    if get and put and self.get_global is None:
                        self.get_global, self.set_global = get, put
                    config = getattr(lib, f"{prefix}_get_config{suffix}", None)
                    if config and self.config is None:
                        config.restype = ctypes.c_char_p
                        self.config = config().decode(errors="replace")
            break
        self.usable = bool(self.local or self.set_global)
        self._lock = threading.Lock()
        self._active = 0
        self._saved = None

    def worker_init(self):
        if self.local:
            self.local(1)          # this worker thread only

    @contextlib.contextmanager
    def single_threaded(self):
        """Without a thread-local setting: one BLAS thread per call while any
        of our parallel calls runs (process-wide, restored afterwards)."""
        if self.local or not self.set_global:
            yield
            return
        with self._lock:
            if self._active == 0:
                self._saved = self.get_global()
                self.set_global(1)
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self.set_global(self._saved)


def blas_config():
    """The configuration string of NumPy's bundled OpenBLAS (None if absent)."""
    return _OpenBLAS().config


_blas = None
_pool = None
_pool_lock = threading.Lock()


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _workers():
    """(pool, OpenBLAS control), made on first use and again when
    ``NumpyBackend.threads`` changes; pool None: run serially."""
    global _blas, _pool
    with _pool_lock:
        if _blas is None:
            _blas = _OpenBLAS()
        threads = NumpyBackend.threads or _cores()
        size = _pool._max_workers if _pool is not None else 1
        if threads != size:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = None
            if _blas.usable and threads > 1:
                _pool = ThreadPoolExecutor(threads, "attention-numpy",
                                           initializer=_blas.worker_init)
    return _pool, _blas


def _attend_block(q, kT, k_norm, v, row_lens, scale, work):
    """softmax(scale q kT) v for one block of queries over all its keys, with
    per-query lengths ``row_lens`` (None: all keys valid).

    Softmax is shift-invariant: when ``|score| <= scale |q_i| max_j |k_j|``
    (Cauchy-Schwarz) bounds every score well inside exp's range, the scores
    are exponentiated as they are, without the pass for the row maxima.
    """
    qs = np.multiply(q, scale, dtype=work)
    s = np.matmul(qs, kT)
    if row_lens is not None:
        masked = np.arange(s.shape[1]) >= row_lens[:, None]
        s[masked] = -np.inf
    info = np.finfo(work)
    limit = min(np.log(info.max) - np.log(s.shape[1]), -np.log(info.tiny)) - 2
    bound = np.sqrt(np.einsum("ij,ij->i", qs, qs).max()) * k_norm
    if not bound <= limit:      # (also when a norm overflowed or is NaN)
        m = s.max(axis=1, keepdims=True)
        m[~np.isfinite(m)] = 0.0          # rows with no valid key: all -inf
        s -= m
    np.exp(s, out=s)
    total = s.sum(axis=1, keepdims=True)
    out = np.matmul(s, v)
    total[total == 0] = 1.0               # rows with no valid key: output 0
    out /= total
    return out


class NumpyBackend(Backend):
    name = "numpy"
    module_base = PlainModule
    float_dtypes = ("float16", "float32", "float64")
    threads = None   # worker threads of fused_attention (None: one per core; 1: none)

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
        """Per (batch, head) slice: only the keys within its longest length,
        in blocks of queries, in place, float32 for half.

        Keys past each batch element's longest length are skipped rather than
        computed and masked. Slices run on a pool of ``threads`` worker
        threads (default: one per core), each with single-threaded BLAS (the
        bundled OpenBLAS is told so; with NumPy < 2, whose OpenBLAS has no
        per-thread setting, BLAS is single-threaded process-wide during the
        call). Query blocks shrink so that each worker's block of scores fits
        in its share of ``memory_budget``; declines (None) when not even one
        query's scores fit.
        """
        dtype = queries.dtype
        if dtype.name not in ("float16", "float32", "float64"):
            return None
        work = np.dtype(np.float32) if dtype == np.float16 else dtype
        *lead, num_q, _ = queries.shape
        num_k, dv = keys.shape[-2], values.shape[-1]
        batch, heads = lead[0], (lead[1] if len(lead) == 2 else 1)
        pool, blas = (None, None)
        if batch * heads > 1 and batch * heads * num_q * num_k >= _PARALLEL_MIN_SCORES:
            pool, blas = _workers()
        workers = pool._max_workers if pool is not None else 1
        block_q = max(1, min(num_q, _BLOCK_QUERIES))
        if memory_budget is not None:
            per_query = 2 * num_k * work.itemsize * workers
            block_q = min(block_q, memory_budget // per_query)
            if block_q < 1:
                return None
        shape4 = (batch, heads)
        q, k, v = (x.reshape(shape4 + x.shape[-2:]) for x in (queries, keys, values))
        out = np.empty(shape4 + (num_q, dv), dtype)
        lens = None if lens is None else np.minimum(np.asarray(lens), num_k)
        scale = work.type(scale)
        tasks = []
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
            tasks.extend((n, b, h, row_lens) for h in range(heads))

        def attend_slice(task):
            n, b, h, row_lens = task
            kb = k[b, h, :n].astype(work, copy=False)
            vb = v[b, h, :n].astype(work, copy=False)
            k_norm = np.sqrt(np.einsum("ij,ij->i", kb, kb).max())
            for q0 in range(0, num_q, block_q):
                rows = None if row_lens is None else row_lens[q0:q0 + block_q]
                out[b, h, q0:q0 + block_q] = _attend_block(
                    q[b, h, q0:q0 + block_q], kb.T, k_norm, vb, rows, scale, work)

        if pool is None or len(tasks) < 2:
            for task in tasks:
                attend_slice(task)
        else:
            tasks.sort(key=lambda t: -t[0])        # longest first: balanced
            with blas.single_threaded():
                list(pool.map(attend_slice, tasks))
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
