"""Module base for frameworks without a module system (NumPy, and JAX's pytrees).

Parameters, buffers and child modules are plain attributes whose names are
tracked so that they can be listed, loaded and (for JAX) flattened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .devices import native_device
from .types import Array

if TYPE_CHECKING:
    from typing_extensions import Self


class PlainModule:
    _backend: Any  # set on the native subclasses by the core (modules.base.native_class)
    _param_names: list[str]
    _buffer_names: list[str]
    _child_names: list[str]
    _lazy_names: list[str]
    training: bool
    forward: Callable[..., Any]  # the public class's

    def _native_init(self) -> None:
        object.__setattr__(self, "_param_names", [])
        object.__setattr__(self, "_buffer_names", [])
        object.__setattr__(self, "_child_names", [])
        object.__setattr__(self, "_lazy_names", [])
        self.training = True

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, PlainModule) and name not in self._child_names:
            self._child_names.append(name)
        object.__setattr__(self, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def _add_param(self, name: str, value: Array) -> None:
        self._param_names.append(name)
        object.__setattr__(self, name, value)

    def _add_lazy_param(self, name: str, shape: tuple) -> None:
        # nothing to allocate: the parameter appears at the first call (under
        # JAX the pytree's leaves change then)
        self._lazy_names.append(name)

    def _fill_lazy_param(self, name: str, value: Array) -> None:
        self._lazy_names.remove(name)
        self._add_param(name, value)

    def _unsized(self, prefix: str = "") -> list[str]:
        out = [prefix + n for n in self._lazy_names]
        for c in self._child_names:
            out += getattr(self, c)._unsized(f"{prefix}{c}.")
        return out

    def _add_buffer(self, name: str, value: Array) -> None:
        self._buffer_names.append(name)
        object.__setattr__(self, name, value)

    def _param(self, name: str) -> Array:
        return getattr(self, name)

    def named_arrays(self, prefix: str = "") -> dict[str, Array]:
        """``{dotted name: parameter}`` over this module and its children."""
        out = {prefix + n: getattr(self, n) for n in self._param_names}
        for c in self._child_names:
            out.update(getattr(self, c).named_arrays(f"{prefix}{c}."))
        return out

    def _assign_param(self, dotted_name: str, value: Array) -> None:
        *path, name = dotted_name.split(".")
        owner = self
        for part in path:
            owner = getattr(owner, part)
        object.__setattr__(owner, name, value)

    def train(self, mode: bool = True) -> Self:
        self.training = mode
        for c in self._child_names:
            getattr(self, c).train(mode)
        return self

    def eval(self) -> Self:
        return self.train(False)

    def to_device(self, device: Any) -> Self:
        """Move parameters and buffers to ``device`` (a name such as 'cuda:0')."""
        dev = native_device(self._backend, device)
        for n in self._param_names + self._buffer_names:
            object.__setattr__(self, n, self._backend.to_device(getattr(self, n), dev))
        for c in self._child_names:
            getattr(self, c).to_device(device)
        return self
