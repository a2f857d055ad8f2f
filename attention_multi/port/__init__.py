"""Port MXNet Gluon models: read ``.params`` files with NumPy alone and load
them into this library's modules (every backend) or into any
``torch.nn.Module`` built with the same architecture.

- ``load_into(module, path)``: fill the module; strict, all or nothing.
- ``to_state_dict(path, like=module)``: ``{module name: numpy array}``.
- ``mapping(path, like=module)``: how the names pair; ``print`` it for a table.
- ``load_mxnet_params`` / ``save_mxnet_params``: the file format (``params_file``).

Gluon names map onto PyTorch names through ``rules.RULES`` (LayerNorm and
BatchNorm ``gamma``/``beta``, the GRU/LSTM/RNN layers); containers whose names
differ (``blks.0`` and ``blks.block0``) pair in registration order
(``matching``). Nothing here imports a framework: a torch module is
recognised only when torch is already imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping as MappingType
from typing import Any, TypeVar, Union

import numpy as np

from .matching import Mapping, match
from .params_file import load_mxnet_params, save_mxnet_params
from .rules import RULES, rules_table

Source = Union[str, "os.PathLike[str]", MappingType[str, Any]]
"""A ``.params`` path, or ``{Gluon name: array}``."""
_M = TypeVar("_M", bound=Any)  # this library's module (any backend) or a torch.nn.Module

__all__ = [
    "Mapping",
    "RULES",
    "check_params",
    "load_into",
    "load_mxnet_params",
    "mapping",
    "rules_table",
    "save_mxnet_params",
    "to_state_dict",
]


class _Target:
    """The entries of a module that a file fills: for this library's modules
    their parameters (any backend), for a torch module its ``state_dict``."""

    def __init__(self, module: Any) -> None:
        from ..modules import Module

        self.module, self.label = module, type(module).__name__
        torch = sys.modules.get("torch")
        if isinstance(module, Module):
            module._check_sized("loading parameters")
            self.torch: Any = None
            self.arrays: dict[str, Any] = module.named_arrays()
        elif torch is not None and isinstance(module, torch.nn.Module):
            self.torch = torch
            self.arrays = {
                n: v
                for n, v in module.state_dict(keep_vars=True).items()
                if isinstance(v, torch.Tensor)
            }
            lazy = [n for n, v in self.arrays.items() if torch.nn.parameter.is_lazy(v)]
            if lazy:
                raise ValueError(
                    f"{self.label} has uninitialized parameters: {', '.join(lazy)}. They "
                    "belong to lazily sized layers (such as nn.LazyLinear) that have not "
                    "been called yet; call the module once on an example input, so that "
                    "their shapes are known, then load"
                )
        else:
            raise TypeError(
                f"expected an attention_multi module or a torch.nn.Module, got "
                f"{type(module).__module__}.{type(module).__qualname__}"
            )
        self.shapes = {n: tuple(v.shape) for n, v in self.arrays.items()}

    def to_numpy(self, name: str) -> np.ndarray:
        value = self.arrays[name]
        if self.torch is not None:
            return value.detach().cpu().numpy()
        return self.module.backend.to_numpy(value)

    def _storage(self, name: str) -> Any:
        """What two names that share one parameter (tied weights) share."""
        v = self.arrays[name]
        if self.torch is not None and v.numel():
            return (v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.dtype)
        return id(v)

    def check_tied(self, params: MappingType[str, np.ndarray], label: str) -> None:
        """Raise ValueError where names that share one parameter would get
        different values (the last would silently win)."""
        groups: dict[Any, list[str]] = {}
        for name in params:
            groups.setdefault(self._storage(name), []).append(name)
        for names in groups.values():
            first = params[names[0]]
            for other in names[1:]:
                value = params[other]
                same = first.shape == value.shape and np.array_equal(
                    first, value, equal_nan=first.dtype.kind in "fc" and value.dtype.kind in "fc"
                )
                if not same:
                    raise ValueError(
                        f"{self.label}.{names[0]} and {self.label}.{other} are one (tied) "
                        f"parameter, but {label} gives them different values; untie them "
                        "or give both the same values"
                    )

    def assign(self, params: MappingType[str, np.ndarray]) -> None:
        """Load ``{name: numpy array}`` (every name, shapes checked), cast to
        each entry's dtype. Everything is converted before anything is written."""
        if self.torch is None:
            from ..params import set_params

            set_params(self.module, params)
            return
        torch = self.torch
        ready = {
            n: torch.as_tensor(
                np.ascontiguousarray(v), dtype=self.arrays[n].dtype, device=self.arrays[n].device
            )
            for n, v in params.items()
        }
        with torch.no_grad():
            for name, value in ready.items():
                self.arrays[name].copy_(value)


def _read(source: Source) -> tuple[dict[str, np.ndarray], str]:
    """``({name: numpy array}, label)`` from a ``.params`` path or a dict."""
    if isinstance(source, (str, os.PathLike)):
        return load_mxnet_params(source), os.fspath(source)
    if isinstance(source, MappingType):
        from ..params import _to_numpy

        return {str(n): _to_numpy(v) for n, v in source.items()}, "the given dict"
    raise TypeError(
        f"expected a .params path or a {{name: array}} dict, got {type(source).__name__}"
    )


def _mapping(source: Source, target: _Target) -> tuple[dict[str, np.ndarray], Mapping]:
    params, label = _read(source)
    shapes = {n: v.shape for n, v in params.items()}
    return params, match(shapes, target.shapes, source_label=label, target_label=target.label)


def mapping(source: Source, like: Any) -> Mapping:
    """How the Gluon names of ``source`` (a ``.params`` path or a
    ``{name: array}`` dict) pair with the names of the module ``like``.

    Returns a ``Mapping``: ``print`` it for a table (Gluon name, shape ->
    module name, shape, and how they paired: by name, by a rule, by
    registration order), with any problems listed at the end. It does not
    raise for problems; ``mapping(...).check()`` does.
    """
    return _mapping(source, _Target(like))[1]


def to_state_dict(source: Source, like: Any) -> dict[str, np.ndarray]:
    """``{module name: numpy array}`` for the module ``like``, in its order,
    from a ``.params`` path (or ``{name: array}`` dict) written by Gluon.

    For a torch module the keys are those of ``like.state_dict()``, so the
    result loads with ``like.load_state_dict`` (strict). Arrays keep the
    file's dtype; entries with no Gluon counterpart (BatchNorm's
    ``num_batches_tracked``) take ``like``'s current value. Raises
    ValueError, listing the names, unless every entry pairs (see ``mapping``).
    """
    target = _Target(like)
    params, m = _mapping(source, target)
    m.check()
    mapped = {row.torch: params[row.gluon] for row in m.rows}
    mapped.update((name, target.to_numpy(name)) for name, _ in m.kept)
    return {name: mapped[name] for name in target.shapes}


def load_into(module: _M, path: Source) -> _M:
    """Load a Gluon ``.params`` file (or ``{name: array}`` dict) into
    ``module``; returns ``module``.

    ``module`` is this library's module (any backend) or any
    ``torch.nn.Module`` with the Gluon model's architecture; names pair as
    ``mapping`` shows. Strict: anything missing, left over, ambiguous or of
    another shape raises ValueError naming it (and the file), and then
    nothing is loaded; so do tied parameters (one parameter under two names)
    that the file gives different values. Values are cast to the module's dtypes. Modules with
    lazily sized layers must have been called once. Call ``module.eval()``
    before comparing outputs (dropout; BatchNorm's running statistics).
    """
    target = _Target(module)
    params, m = _mapping(path, target)
    m.check()
    values = {row.torch: params[row.gluon] for row in m.rows}
    target.check_tied(values, m.source_label)
    target.assign(values)
    return module


def check_params(params: MappingType[str, Any], module: Any, source: str = "the file") -> None:
    """Raise ValueError unless ``params`` has exactly the names and shapes of
    ``module``'s entries (no renaming rules, no pairing by order).

    The message (headed by ``source``, e.g. the file's path) lists the
    differences, then everything the file holds and everything the module
    expects, each with its shape.
    """
    target = _Target(module)
    shapes = {n: np.shape(v) for n, v in params.items()}
    match(shapes, target.shapes, exact=True, source_label=source, target_label=target.label).check()
