"""Parameters as ``{d2l name: NumPy array}``, in PyTorch's (out, in) layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

import attention_multi.backends as backends
from attention_multi.backends.types import Array

_M = TypeVar("_M", bound=Any)  # an attention_multi module of any backend


def get_params(module: Any) -> dict[str, np.ndarray]:
    """``{name: numpy array}`` of a module of any backend (``W_q.weight``...)."""
    module._check_sized("get_params")
    xp = module.backend
    return {name: xp.to_numpy(value) for name, value in module.named_arrays().items()}


def set_params(module: _M, params: Mapping[str, Any]) -> _M:
    """Load ``{name: array}`` into ``module``; strict about names and shapes.

    Values are cast to the dtype of the module's parameters. Raises
    ValueError listing missing or unknown names, or the mismatched shapes.
    """
    module._check_sized("set_params")
    xp = module.backend
    current = module.named_arrays()
    missing = sorted(set(current) - set(params))
    unknown = sorted(set(params) - set(current))
    if missing or unknown:
        raise ValueError(
            f"parameter names do not match {type(module).__name__}: "
            f"missing {missing}, unknown {unknown}; the module expects "
            f"{sorted(current)}"
        )
    arrays = {}
    for name, value in params.items():
        value = _to_numpy(value)
        want = tuple(current[name].shape)
        if value.shape != want:
            raise ValueError(
                f"parameter {name!r} has shape {value.shape}, the module expects {want}"
            )
        arrays[name] = xp.asarray(value, xp.dtype_name(current[name]), xp.device_of(current[name]))
    for name, value in arrays.items():
        module._assign_param(name, value)
    return module


def _to_numpy(value: Array) -> np.ndarray:
    if isinstance(value, (np.ndarray, np.generic, list, tuple, int, float)):
        return np.asarray(value)
    return backends.backend_of_array(value).to_numpy(value)
