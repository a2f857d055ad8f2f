"""Device names: ``cpu``, ``cuda``, ``cuda:N`` and ``gpu`` (= ``cuda:0``)."""

from __future__ import annotations

import re
from typing import Any

from .types import DeviceKind

_DEVICE = re.compile(r"^(cpu|cuda|gpu)(?::(\d+))?$")


def parse_device(name: object) -> tuple[DeviceKind, int]:
    """``"gpu"`` -> ``("cuda", 0)``; ValueError for anything else than the names above."""
    match = _DEVICE.match(str(name).strip().lower())
    if not match or (match.group(1) == "cpu" and match.group(2) not in (None, "0")):
        raise ValueError(f"unknown device {name!r}; use cpu, cuda, cuda:N or gpu")
    kind: DeviceKind = "cpu" if match.group(1) == "cpu" else "cuda"
    return kind, int(match.group(2) or 0)


def native_device(backend: Any, device: Any) -> Any:
    """The framework's device for a name (``"cuda:0"``); a native device
    object passes through. ValueError if it is absent."""
    if device is not None and not isinstance(device, str):
        return device
    return backend.device(*parse_device("cpu" if device is None else device))
