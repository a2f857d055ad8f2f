"""Parameters as ``{d2l name: NumPy array}``, in PyTorch's (out, in) layout, or
in Keras' (in, out) one, as d2l's TensorFlow edition has them.

d2l's PyTorch and MXNet editions and this library name a projection's weight
``W_q.weight``, (out, in); d2l's TensorFlow edition has Keras ``Dense`` layers
under the same attribute names, whose weight is ``W_q.kernel``, (in, out).
``get_params(module, layout="keras")`` gives the second naming,
``set_params`` takes either, and ``keras_params``/``set_keras_params`` read
and write a Keras layer's weights by attribute name (without importing
TensorFlow or Keras), so that a d2l TensorFlow layer loads into a module of
any backend::

    am.set_params(ours, am.keras_params(d2l_layer))
    am.set_keras_params(d2l_layer, am.get_params(ours))  # and back
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

import attention_multi.backends as backends
from attention_multi.backends.types import Array

from .modules.base import Linear, Module

_M = TypeVar("_M", bound=Any)  # an attention_multi module of any backend
_L = TypeVar("_L", bound=Any)  # a Keras layer (duck-typed)

LAYOUTS = ("torch", "keras")
_TORCH = "PyTorch's (out, in) layout"
_KERAS = "Keras' (in, out) layout"


def get_params(module: Any, layout: str = "torch") -> dict[str, np.ndarray]:
    """``{name: numpy array}`` of a module of any backend.

    ``layout="torch"`` (the default): a ``Linear``'s weight is ``X.weight``,
    (out, in), as in PyTorch and MXNet (``W_q.weight``...).
    ``layout="keras"``: it is ``X.kernel``, (in, out), as a Keras ``Dense``
    has it (d2l's TensorFlow edition). Biases (``X.bias``) and any other
    parameter (``NWKernelRegression``'s ``w``) are the same in both.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'torch' or 'keras', got {layout!r}")
    module._check_sized("get_params")
    xp = module.backend
    params = {name: xp.to_numpy(value) for name, value in module.named_arrays().items()}
    if layout == "torch":
        return params
    kernels = _kernel_names(module, params)
    return {
        kernels.get(name, name): np.ascontiguousarray(value.T) if name in kernels else value
        for name, value in params.items()
    }


def set_params(module: _M, params: Mapping[str, Any]) -> _M:
    """Load ``{name: array}`` into ``module``; strict about names and shapes.

    Each ``Linear``'s weight may be given as ``X.weight``, (out, in), or as
    ``X.kernel``, (in, out), Keras' layout (``get_params(layout="keras")``,
    ``keras_params``), entry by entry. Values are cast to the dtype of the
    module's parameters. Raises ValueError listing missing or unknown
    names, naming an ``X.weight`` given with its ``X.kernel``, or naming a
    mismatched shape; nothing is loaded then.
    """
    module._check_sized("set_params")
    xp = module.backend
    current = module.named_arrays()
    shapes = {name: tuple(value.shape) for name, value in current.items()}
    aliases = {kernel: weight for weight, kernel in _kernel_names(module, current).items()}
    arrays = _matched(type(module).__name__, "module", shapes, params, aliases, _KERAS)
    loaded = {
        name: xp.asarray(value, xp.dtype_name(current[name]), xp.device_of(current[name]))
        for name, value in arrays.items()
    }
    for name, value in loaded.items():
        module._assign_param(name, value)
    return module


def keras_params(layer: Any) -> dict[str, np.ndarray]:
    """``{name: numpy array}`` of a Keras layer's dense weights, by attribute
    name, in Keras' layout: ``X.kernel`` (in, out) and ``X.bias`` for each
    public attribute ``X`` of ``layer`` that has a ``kernel`` (a ``Dense``),
    and ``kernel``/``bias`` for the layer's own. One level deep: pass a
    nested layer itself (``keras_params(block.attention)``).

    For d2l's TensorFlow layers: ``AdditiveAttention`` gives ``W_k.kernel``,
    ``W_q.kernel``, ``w_v.kernel``; ``MultiHeadAttention`` ``W_q``, ``W_k``,
    ``W_v``, ``W_o`` (with ``.bias`` where ``bias=True``);
    ``DotProductAttention`` none. ``set_params(ours, keras_params(theirs))``
    loads them into this library's module on any backend.

    Duck-typed (TensorFlow and Keras are not imported): a weight is read with
    ``.numpy()`` or ``np.asarray``. Keras creates a ``Dense``'s weights at its
    first call: a sublayer not built yet raises ValueError naming it.
    """
    return {name: _read(var) for name, var in _keras_variables(layer, "keras_params").items()}


def set_keras_params(layer: _L, params: Mapping[str, Any]) -> _L:
    """Load ``{name: array}`` into a Keras layer's dense weights (those
    ``keras_params(layer)`` names), the reverse of ``keras_params``:
    ``set_keras_params(d2l_layer, get_params(ours))``.

    Each kernel may be given as ``X.kernel``, (in, out), or as ``X.weight``,
    (out, in), PyTorch's layout (``get_params``' default). Values are cast to
    each variable's dtype and assigned (``.assign``). Strict as
    ``set_params``: ValueError on missing or unknown names, on both
    ``X.weight`` and ``X.kernel``, on a mismatched shape; nothing is
    assigned then.
    """
    variables = _keras_variables(layer, "set_keras_params")
    current = {name: _read(var) for name, var in variables.items()}
    shapes = {name: tuple(value.shape) for name, value in current.items()}
    aliases = {
        _sibling(name, "weight"): name
        for name, value in current.items()
        if _leaf(name) == "kernel" and value.ndim == 2
    }
    arrays = _matched(type(layer).__name__, "layer", shapes, params, aliases, _TORCH)
    for name, value in arrays.items():
        variables[name].assign(value.astype(current[name].dtype))
    return layer


# -- names ----------------------------------------------------------------------------------


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def _sibling(name: str, leaf: str) -> str:
    """``"W_q.weight"`` -> ``"W_q.<leaf>"``; ``"weight"`` -> ``leaf``."""
    owner, dot, _ = name.rpartition(".")
    return f"{owner}{dot}{leaf}"


def _kernel_names(module: Any, names: Mapping[str, Any]) -> dict[str, str]:
    """``{"W_q.weight": "W_q.kernel"}`` for each of ``names`` that is a
    ``Linear``'s weight (``module`` itself, or a child at that path)."""
    out = {}
    for name in names:
        *path, leaf = name.split(".")
        if leaf != "weight":
            continue
        owner = module
        for part in path:
            owner = getattr(owner, part, None)
        if isinstance(owner, Linear):
            out[name] = _sibling(name, "kernel")
    return out


def _matched(
    owner: str,
    what: str,
    shapes: Mapping[str, tuple[int, ...]],
    params: Mapping[str, Any],
    aliases: Mapping[str, str],
    alias_layout: str,
) -> dict[str, np.ndarray]:
    """``params`` as NumPy arrays under the names of ``shapes``, checked.

    ``aliases``: ``{other name: name}`` of the 2-D weights that may be given
    transposed under another name (``alias_layout``), which are transposed
    back. ValueError on both names of one weight, on missing or unknown
    names, on a wrong shape."""
    given: dict[str, tuple[str, Any]] = {}  # name -> (the name given, value)
    for name, value in params.items():
        target = aliases.get(name, name)
        if target in given:
            raise ValueError(
                f"both {given[target][0]!r} and {name!r} are given to {owner}: they are "
                f"one parameter ({_TORCH} and {_KERAS}); give one of them"
            )
        given[target] = (name, value)
    missing = sorted(set(shapes) - set(given))
    unknown = sorted(name for target, (name, _) in given.items() if target not in shapes)
    if missing or unknown:
        hint = next(
            (
                f"; a weight may be given transposed, in {alias_layout}: {other!r} for {name!r}"
                for other, name in aliases.items()
                if name in missing
            ),
            "",
        )
        raise ValueError(
            f"parameter names do not match {owner}: missing {missing}, unknown {unknown}; "
            f"the {what} expects {sorted(shapes)}{hint}"
        )
    arrays = {}
    for target, (name, value) in given.items():
        value = _to_numpy(value)
        want = shapes[target]
        if name != target:  # (the other layout: the transpose)
            if value.shape != want[::-1]:
                raise ValueError(
                    f"parameter {name!r} has shape {value.shape}, the {what} expects "
                    f"{want[::-1]} ({alias_layout}: the transpose of {target!r}, {want})"
                )
            value = value.T
        elif value.shape != want:
            raise ValueError(
                f"parameter {name!r} has shape {value.shape}, the {what} expects {want}"
            )
        arrays[target] = value
    return arrays


# -- Keras layers, duck-typed ---------------------------------------------------------------


def _has_kernel(obj: Any) -> bool:
    """A Dense-like layer: a ``kernel`` property on its class (Keras 3's,
    which raises until the layer is built) or attribute."""
    return isinstance(getattr(type(obj), "kernel", None), property) or hasattr(obj, "kernel")


def _keras_variables(layer: Any, caller: str) -> dict[str, Any]:
    """``{"W_q.kernel": variable, "W_q.bias": variable, ...}`` of ``layer``."""
    if isinstance(layer, Module):
        raise TypeError(
            f"{caller} takes a Keras layer; this is attention_multi's "
            f"{type(layer).__name__} (its Linears are not Dense layers): use "
            f"am.get_params(module, layout='keras') or am.set_params"
        )
    found: dict[str, Any] = {}
    owners = [("", layer)] if _has_kernel(layer) else []
    owners += [
        (f"{attr}.", value)
        for attr, value in getattr(layer, "__dict__", {}).items()
        if not attr.startswith("_") and value is not layer and _has_kernel(value)
    ]
    for prefix, owner in owners:
        try:
            kernel = owner.kernel
        except AttributeError:
            where = f"{type(layer).__name__}.{prefix[:-1]}" if prefix else type(layer).__name__
            raise ValueError(
                f"{where} ({type(owner).__name__}) is not built yet, so it has no kernel: "
                f"call {type(layer).__name__} once on an example input first (Keras "
                f"creates a layer's weights at its first call)"
            ) from None
        found[prefix + "kernel"] = kernel
        bias = getattr(owner, "bias", None)
        if bias is not None:
            found[prefix + "bias"] = bias
    return found


def _read(var: Any) -> np.ndarray:
    """A Keras (or TF) variable's value as a NumPy array."""
    return np.asarray(var.numpy() if hasattr(var, "numpy") else var)


def _to_numpy(value: Array) -> np.ndarray:
    if isinstance(value, (np.ndarray, np.generic, list, tuple, int, float)):
        return np.asarray(value)
    try:
        backend = backends.backend_of_array(value)
    except TypeError:
        if hasattr(value, "numpy") or hasattr(value, "__array__"):  # (a Keras variable)
            return _read(value)
        raise
    return backend.to_numpy(value)
