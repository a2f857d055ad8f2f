"""Choosing the backend and the device.

Precedence: ``use_backend`` (thread-local, nestable) > ``set_backend`` >
``ATTENTION_MULTI_BACKEND`` > ``"numpy"``. Devices: ``ATTENTION_MULTI_DEVICE``
(``cpu``, ``cuda``, ``cuda:N`` or ``gpu``), default ``cpu``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import attention_multi.backends as backends
from attention_multi.backends import Backend, devices
from attention_multi.backends.types import DeviceKind

BACKEND_ENV = "ATTENTION_MULTI_BACKEND"
DEVICE_ENV = "ATTENTION_MULTI_DEVICE"

_state: dict[str, Backend | None] = {"backend": None}  # set_backend's choice, process-wide
_local = threading.local()  # .stack: use_backend's choices, per thread


def get_backend(backend: str | Backend | Any = None) -> Backend:
    """A Backend (an object with ``.name``): with no argument the current
    default (``use_backend`` > ``set_backend`` > ATTENTION_MULTI_BACKEND >
    ``"numpy"``); else the backend of a name (``"torch"``), a Backend, or an
    array (``am.get_backend(tensor)``). The one public way to fetch a backend."""
    if backend is not None:
        return _given(backend)
    chosen = chosen_backend()
    return backends.load("numpy") if chosen is None else chosen


def chosen_backend() -> Backend | None:
    """The default backend where one was chosen (``use_backend``,
    ``set_backend``, ATTENTION_MULTI_BACKEND), else None."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    chosen = _state["backend"]
    if chosen is not None:
        return chosen
    name = os.environ.get(BACKEND_ENV, "").strip()
    if not name:
        return None
    try:
        return backends.load(name)
    except ValueError as exc:
        raise ValueError(f"{BACKEND_ENV}={name!r}: {exc}") from None


def _given(backend: str | Backend | Any) -> Backend:
    """The backend of a name, a Backend or an array."""
    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, str):
        return backends.load(backend)
    return backends.backend_of_array(backend)


def set_backend(name: str | Backend) -> Backend:
    """Make ``name`` the default backend for the whole process."""
    backend = _state["backend"] = _given(name)
    return backend


@contextlib.contextmanager
def use_backend(name: str | Backend) -> Iterator[Backend]:
    """Use ``name`` as the default backend inside a ``with`` block (this thread)."""
    backend = _given(name)
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(backend)
    try:
        yield backend
    finally:
        stack.pop()


def parse_device(name: str | None = None) -> tuple[DeviceKind, int]:
    """``"gpu"`` -> ``("cuda", 0)``; ``None`` reads ATTENTION_MULTI_DEVICE."""
    if name is None:
        with _named_env_device() as name:
            return backends.parse_device(name)
    return backends.parse_device(name)


def native_device(backend: Backend, name: Any = None) -> Any:
    """The framework's device object for a device name (ValueError if absent);
    ``None`` reads ATTENTION_MULTI_DEVICE. A native device object passes through."""
    if name is None:
        with _named_env_device() as name:
            return devices.native_device(backend, name)
    return devices.native_device(backend, name)


@contextlib.contextmanager
def _named_env_device() -> Iterator[str]:
    """ATTENTION_MULTI_DEVICE (default cpu); a ValueError inside names the variable."""
    name = os.environ.get(DEVICE_ENV, "").strip() or "cpu"
    try:
        yield name
    except ValueError as exc:
        if DEVICE_ENV not in os.environ:
            raise
        raise ValueError(f"{DEVICE_ENV}={os.environ[DEVICE_ENV]!r}: {exc}") from None
