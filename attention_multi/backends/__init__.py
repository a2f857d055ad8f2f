"""Backends: one small class per framework, behind one protocol (``protocol.Backend``).

``load("torch")`` loads a backend by name; ``backend_of_array(array)`` finds
the backend of an array, looking only at frameworks that are already imported.
The library fetches backends through these two; its users call
``attention_multi.get_backend``, the one public way.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Callable

from . import capabilities, devices
from .capabilities import Autodiff, opt, supports
from .devices import native_device, parse_device
from .protocol import Backend
from .table import (
    ALIASES,
    BACKEND_NAMES,
    BACKENDS,
    ROOTS,
    BackendSpec,
    framework_of,
    install_hint,
    listing,
)

# backend name -> (module of this package, class, framework module, pip extra)
_SPECS = {s.name: (s.module, s.class_name, s.framework, s.extra) for s in BACKENDS}
_loaded: dict[str, Backend] = {}
_LOAD_HOOKS: list[Callable[[Backend], None]] = []


def _importer(module: str) -> Callable[[], Any]:
    """A function whose body is the statement ``import <package>.<module>``:
    an import statement, which torch.compile's dynamo runs while it traces (it
    refuses importlib's functions), so that a backend may load inside the
    first call of a process, compiled. (No finder on ``sys.meta_path``:
    importing the library changes nothing outside it.)"""
    importer = _IMPORTERS.get(module)
    if importer is None:
        scope: dict[str, Any] = {}
        code = f"def load():\n    import {__name__}.{module} as m\n    return m\n"
        exec(code, {}, scope)
        importer = _IMPORTERS[module] = scope["load"]
    return importer


_IMPORTERS: dict[str, Callable[[], Any]] = {}
for _spec in BACKENDS:  # (made now: a trace cannot make them)
    _importer(_spec.module)


__all__ = [
    "ALIASES",
    "Autodiff",
    "capabilities",
    "devices",
    "opt",
    "native_device",
    "supports",
    "BACKENDS",
    "BACKEND_NAMES",
    "Backend",
    "BackendSpec",
    "ROOTS",
    "available_backends",
    "backend_of_array",
    "canonical_name",
    "framework_of",
    "install_hint",
    "listing",
    "near_miss",
    "load",
    "on_load",
    "parse_device",
]


def canonical_name(name: str) -> str:
    """``"pytorch"`` -> ``"torch"``; ValueError naming the valid choices."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a name or a Backend, got {type(name).__name__}")
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in _SPECS:
        raise ValueError(
            f"unknown backend {name!r}; valid choices: {', '.join(BACKEND_NAMES)} "
            f"(aliases: {', '.join(ALIASES)})"
        )
    return key


def available_backends() -> list[str]:
    """Names of the backends whose framework is installed (nothing is imported)."""
    return [n for n in BACKEND_NAMES if importlib.util.find_spec(_SPECS[n][2]) is not None]


def load(name: str) -> Backend:
    """The backend named ``name`` (or an alias), imported on first use;
    ImportError naming the pip extra when its framework is missing."""
    return _load(canonical_name(name))


def _load(name: str) -> Backend:
    backend = _loaded.get(name)
    if backend is None:
        module_name, class_name, framework, extra = _SPECS[name]
        try:
            module = _importer(module_name)()
        except Exception as exc:  # missing, or installed but broken (e.g. mxnet on numpy 2)
            if importlib.util.find_spec(framework) is None:
                why = f"is not installed ({exc}); install it with: "
                why += install_hint(extra or name)
            else:  # not a missing install: say what broke it
                why = f"is installed but failed to import ({type(exc).__name__}: {exc}); "
                why += "fix that error (a warning made an error by -W, or a version "
                why += f"conflict: {install_hint(extra or name)} has the pins)"
            raise ImportError(f"the {name!r} backend needs {framework}, which {why}") from exc
        backend = _loaded[name] = getattr(module, class_name)()
        for hook in _LOAD_HOOKS:
            hook(backend)
    return backend


def on_load(hook: Callable[[Backend], None]) -> None:
    """Call ``hook(backend)`` for every backend loaded from now on and every
    one loaded already (the layer above registers its classes so, without
    the backends importing it)."""
    _LOAD_HOOKS.append(hook)
    for backend in list(_loaded.values()):
        hook(backend)


def backend_of_array(x: Any) -> Backend:
    """The backend an array belongs to (TypeError if none)."""
    for backend in _loaded.values():  # (no import: the first call may be traced)
        if backend.is_array(x):
            return backend
    for name in BACKEND_NAMES:
        if _SPECS[name][2] in sys.modules:  # never import a framework to look
            backend = _load(name)
            if backend.is_array(x):
                return backend
    raise TypeError(
        f"cannot tell which backend an object of type "
        f"{type(x).__module__}.{type(x).__qualname__} belongs to; expected "
        f"a {listing(BACKEND_NAMES)} array{near_miss(x)}"
    )


def near_miss(x: Any) -> str:
    """How to make an array of ``x`` (after "; ") where a loaded backend knows, else ""."""
    for backend in _loaded.values():
        hint = opt(backend).near_miss(x)
        if hint:
            return f"; {hint}"
    return ""
