"""Choosing the backend and the device.

Precedence: ``use_backend`` (thread-local, nestable) > ``set_backend`` >
``ATTENTION_MULTI_BACKEND`` > ``"numpy"``. Devices: ``ATTENTION_MULTI_DEVICE``
(``cpu``, ``cuda``, ``cuda:N`` or ``gpu``), default ``cpu``.
"""
import contextlib
import os
import re
import threading

import backends

BACKEND_ENV = "ATTENTION_MULTI_BACKEND"
DEVICE_ENV = "ATTENTION_MULTI_DEVICE"

_state = {"backend": None}      # set_backend's choice, process-wide
_local = threading.local()      # .stack: use_backend's choices, per thread


def get_backend():
    """The current default backend (an object with ``.name``)."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    if _state["backend"] is not None:
        return _state["backend"]
    name = os.environ.get(BACKEND_ENV, "").strip()
    if not name:
        return backends.get_backend("numpy")
    try:
        return backends.get_backend(name)
    except ValueError as exc:
        raise ValueError(f"{BACKEND_ENV}={name!r}: {exc}") from None


def set_backend(name):
    """Make ``name`` the default backend for the whole process."""
    _state["backend"] = backends.get_backend(name)
    return _state["backend"]


@contextlib.contextmanager
def use_backend(name):
    """Use ``name`` as the default backend inside a ``with`` block (this thread)."""
    backend = backends.get_backend(name)
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(backend)
    try:
        yield backend
    finally:
        stack.pop()


def resolve_backend(backend=None):
    """A Backend from ``backend=`` (name, Backend or None for the default)."""
    return get_backend() if backend is None else backends.get_backend(backend)


_DEVICE_RE = re.compile(r"^(cpu|cuda|gpu)(?::(\d+))?$")


def parse_device(name=None):
    """``"gpu"`` -> ``("cuda", 0)``; ``None`` reads ATTENTION_MULTI_DEVICE."""
    if name is None:
        name = os.environ.get(DEVICE_ENV, "").strip() or "cpu"
    match = _DEVICE_RE.match(str(name).strip().lower())
    if not match or (match.group(1) == "cpu" and match.group(2) not in (None, "0")):
        raise ValueError(f"unknown device {name!r}; use cpu, cuda, cuda:N or gpu")
    kind = "cpu" if match.group(1) == "cpu" else "cuda"
    return kind, int(match.group(2) or 0)


def native_device(backend, name=None):
    """The framework's device object for a device name (ValueError if absent).

    A native device object (``torch.device``, ``mx.gpu(0)``...) passes through."""
    if name is not None and not isinstance(name, str):
        return name
    return backend.device(*parse_device(name))
