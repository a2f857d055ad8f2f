"""Running the report's cases: which backends and devices can run, and the
cells, timings and training run of one backend on one device."""

import importlib.metadata
import platform
import statistics
import sys
import time

import numpy as np

import attention_multi as am
from attention_multi import backends
from attention_multi.backends.capabilities import opt

from .cases import CASES, DTYPES, compare

PLANT = 1e-2


class Runner:
    """Arrays and modules of one backend (resolved once), device and dtype."""

    def __init__(self, backend, device, dtype):
        self.am, self.B, self.device, self.dtype = am, backend, device, dtype

    def a(self, x):
        return am.asarray(x, self.dtype, backend=self.B, device=self.device)

    def lens(self, x):
        return am.asarray(x, "int32", backend=self.B, device=self.device)

    def mask(self, x):
        return am.asarray(x, "bool", backend=self.B, device=self.device)

    def numpy(self, x):
        return self.B.to_numpy(x)

    def module(self, cls, *args, params=None, **kwargs):
        net = cls(*args, backend=self.B, device=self.device, dtype=self.dtype, **kwargs)
        if params is not None:
            am.set_params(net, params)
        return net.eval()


def backend_state(name):
    """(Backend or None, note): 'not installed' with the pip extra, or why import fails."""
    if name not in backends.available_backends():
        return None, f"not installed ({backends.install_hint(name)})"
    try:
        return am.get_backend(name), ""
    except ImportError as exc:
        cause = exc.__cause__ or exc
        reason = str(cause).strip().splitlines()[0][:200] if str(cause).strip() else ""
        return None, f"installed but fails to import ({type(cause).__name__}: {reason})"


def device_state(B, device):
    """(native device or None, note)."""
    try:
        return backends.devices.native_device(B, device), ""
    except ValueError as exc:
        return None, f"{device} not available ({exc})"


def versions():
    out = [f"Python {sys.version.split()[0]} ({platform.platform()})"]
    for dist in ("numpy", "torch", "jax", "jaxlib", "mxnet", "matplotlib"):
        try:
            out.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{dist} not installed")
    return out


def run_cells(B, device, inputs, refs, plant):
    """{(mechanism, dtype): (error or None, passed, message)} for one backend/device."""
    opt(B).enable_float64()  # explicit float32 stays float32
    cells = {}
    for dtype in DTYPES:
        if dtype not in B.float_dtypes:
            continue
        r = Runner(B, device, dtype)
        for name, run, _ in CASES:
            try:
                got = [r.numpy(x) for x in run(r, inputs[dtype])]
                if plant:
                    got = [g + PLANT for g in got]
                err, ok = compare(got, refs[dtype][name], dtype)
                cells[name, dtype] = (err, ok, "")
            except Exception as exc:  # one broken mechanism must not stop the report
                cells[name, dtype] = (None, False, error_text(exc))
    return cells


def error_text(exc: BaseException) -> str:
    """``Type: message`` in one line; a message that is a traceback (MXNet's
    C++ errors: ``Traceback (most recent call last):``, its frames, then the
    error) gives its last line, the error itself."""
    name = type(exc).__name__
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return name
    if lines[0].startswith("Traceback") and len(lines) > 1:
        last = lines[-1]
        return last if last.startswith(f"{name}:") else f"{name}: {last}"
    return f"{name}: {' '.join(lines)}"


TIMING_SHAPE = (
    "MultiHeadAttention forward, float32: batch 8, 64 queries x 64 keys, "
    "128 hiddens, 8 heads, valid_lens (8,); median of 5 after a warm-up, "
    "copy to NumPy included"
)


def time_forward(B, device, repeats=5):
    """Median seconds of a float32 MultiHeadAttention forward (+ copy to NumPy)."""
    rng = np.random.default_rng(1)
    r = Runner(B, device, "float32")
    net = r.module(am.MultiHeadAttention, 128, 128, 128, 128, 8, 0.0)
    q, kv = r.a(rng.standard_normal((8, 64, 128))), r.a(rng.standard_normal((8, 64, 128)))
    lens = r.lens(rng.integers(1, 65, 8))
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        start = time.perf_counter()
        r.numpy(net(q, kv, kv, lens))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def train_nw(B, device, i, epochs=5, lr=0.5):
    """Seed 003's training; returns (w, losses, predictions on x_test)."""
    r = Runner(B, device, "float32")
    net = r.module(am.NWKernelRegression, params={"w": np.array([0.3])})
    losses = am.train_kernel_regression(
        net, r.a(i["x_train"]), r.a(i["y_train"]), epochs=epochs, lr=lr
    )
    x_test = i["x_test"]
    keys = np.tile(i["x_train"], (len(x_test), 1))
    values = np.tile(i["y_train"], (len(x_test), 1))
    y_fit = r.numpy(net(r.a(x_test), r.a(keys), r.a(values)))
    return float(am.get_params(net)["w"][0]), [float(x) for x in losses], y_fit
