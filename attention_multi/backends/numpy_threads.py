"""Worker threads for the NumPy backend's ``parallel_map``, each with
single-threaded BLAS (what threadpoolctl does, for the OpenBLAS that NumPy's
wheels bundle)."""

import contextlib
import ctypes
import glob
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np


class OpenBLAS:
    """The OpenBLAS that NumPy's wheels bundle. Absent (other BLAS, unknown
    build): ``usable`` is False and nothing is changed."""

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
            self.local(1)  # this worker thread only

    @contextlib.contextmanager
    def single_threaded(self):
        """One BLAS thread for the calling thread while inside: its own setting
        where OpenBLAS has one, else process-wide while any caller is inside
        (restored after the last)."""
        if self.local:
            before = self.local(1)
            try:
                yield
            finally:
                self.local(before)
            return
        if not self.set_global:
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
    return openblas().config


def cores():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_blas = None
_pool = None
_pool_lock = threading.Lock()


def openblas():
    """NumPy's bundled OpenBLAS, found once."""
    global _blas
    with _pool_lock:
        if _blas is None:
            _blas = OpenBLAS()
    return _blas


def workers(threads):
    """(pool, OpenBLAS control) for ``threads`` workers (None: one per core),
    made on first use and again when ``threads`` changes; pool None: serial."""
    global _pool
    blas = openblas()
    with _pool_lock:
        threads = threads or cores()
        size = _pool._max_workers if _pool is not None else 1
        if threads != size:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = None
            if blas.usable and threads > 1:
                _pool = ThreadPoolExecutor(threads, "attention-numpy", initializer=blas.worker_init)
    return _pool, blas


def parallel_map(fn, tasks, threads=None):
    """``[fn(t) for t in tasks]`` on the worker threads, BLAS single-threaded."""
    tasks = list(tasks)
    pool, blas = workers(threads) if len(tasks) > 1 else (None, None)
    if pool is None:
        return [fn(t) for t in tasks]
    with blas.single_threaded():
        return list(pool.map(fn, tasks))
