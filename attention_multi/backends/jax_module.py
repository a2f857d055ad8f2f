"""Native module base for JAX: a pytree whose leaves are exactly the parameters.

The module classes are also registered for ``jax.export`` serialization, under
``"<module>.<class>"`` of the public class (e.g.
``attention_multi.modules.attention.MultiHeadAttention``), so a function
taking a module as an argument can be exported, serialized and called back.
"""

import base64
import io
import json
import operator

import jax
import jax.numpy as jnp
import numpy as np

from .plain_module import PlainModule


class _ByIdentity:
    """Wraps an unhashable static value (a constant table) for pytree aux data;
    equal to another wrapping the same object, or (arrays, such as one read
    back from a ``jax.export`` serialization) an equal array."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        if not isinstance(other, _ByIdentity):
            return False
        if other.value is self.value:
            return True
        a, b = self.value, other.value
        return (
            hasattr(a, "shape")
            and hasattr(b, "shape")
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(np.array_equal(np.asarray(a), np.asarray(b)))
        )

    def __hash__(self):
        value = self.value
        if hasattr(value, "shape"):
            return hash((tuple(value.shape), str(value.dtype)))
        return id(value)


class _NameList(tuple):
    """A list of names in aux data: hashable and compared by value, so modules
    built alike have equal treedefs; unflattened back into a list."""

    __slots__ = ()


def _getter(names):
    """A function of a module's ``__dict__`` that returns the tuple of its
    values at ``names`` (``jax.jit`` flattens a module at every call: a
    comprehension there cost a tenth of a microsecond)."""
    if not names:
        return lambda attributes: ()
    if len(names) == 1:
        (name,) = names
        return lambda attributes: (attributes[name],)
    return operator.itemgetter(*names)


class JaxModule(PlainModule):
    """Native base: a pytree. Transient state (attention weights) is dropped.

    The static part of the tree (every attribute but the parameters and
    children) is kept between flattenings: ``jax.jit`` flattens the module on
    every call, and at d2l's sizes building it cost as much as the call.
    Setting an attribute, or adding a parameter or buffer, forgets it."""

    def __setattr__(self, name, value):
        self.__dict__.pop("_tree_static", None)
        super().__setattr__(name, value)

    def _add_param(self, name, value):
        self.__dict__.pop("_tree_static", None)
        super()._add_param(name, value)

    def _add_lazy_param(self, name, shape):
        self.__dict__.pop("_tree_static", None)
        super()._add_lazy_param(name, shape)

    def _add_buffer(self, name, value):
        self.__dict__.pop("_tree_static", None)
        super()._add_buffer(name, value)

    def __getstate__(self):
        parent = getattr(super(), "__getstate__", None)  # (absent before 3.11)
        state = dict(parent() if parent is not None else self.__dict__)
        state.pop("_tree_static", None)
        return state

    def _tree_flatten(self):
        attributes = self.__dict__
        kept = attributes.get("_tree_static")
        if kept is None:  # (a getter of the leaves, aux data)
            names = (*self._param_names, *self._child_names)
            kept = attributes["_tree_static"] = (
                _getter(names),
                (len(self._param_names), self._tree_static()),
            )
        leaves, aux = kept
        return leaves(attributes), aux

    def _tree_static(self):
        skip = set(self._param_names) | set(self._child_names) | {"_tree_static"}
        static = []
        for k, v in sorted(vars(self).items()):
            if k in skip or k.startswith("_attention") or k == "_device":
                # (the device is used only while building; treedefs of
                # modules on different devices are equal)
                continue
            if isinstance(v, list):
                v = _NameList(v)
            try:
                hash(v)
            except TypeError:
                v = _ByIdentity(v)
            static.append((k, v))
        return tuple(static)

    @classmethod
    def _tree_unflatten(cls, aux, leaves):
        n_params, static = aux
        self = object.__new__(cls)
        for k, v in static:
            if isinstance(v, _ByIdentity):
                v = v.value
            elif isinstance(v, _NameList):
                v = list(v)
            object.__setattr__(self, k, v)
        for name, value in zip(self._param_names + self._child_names, leaves):
            object.__setattr__(self, name, value)
        return self


def _encode(value):
    """A static attribute as JSON-able data."""
    if isinstance(value, _NameList):
        return {"names": list(value)}
    if isinstance(value, _ByIdentity):
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(value.value), allow_pickle=False)
        return {"array": base64.b64encode(buffer.getvalue()).decode("ascii")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    raise TypeError(
        f"cannot serialize a module attribute of type {type(value).__name__} "
        f"for jax.export: {value!r}"
    )


def _decode(data):
    if "names" in data:
        return _NameList(data["names"])
    if "array" in data:
        array = np.load(io.BytesIO(base64.b64decode(data["array"])), allow_pickle=False)
        return _ByIdentity(jnp.asarray(array))
    if "tuple" in data:
        return tuple(_decode(v) for v in data["tuple"])
    return data.get("value")


def _serialize_aux(aux):
    n_params, static = aux
    return json.dumps([n_params, [[k, _encode(v)] for k, v in static]]).encode()


def _deserialize_aux(data):
    n_params, static = json.loads(data)
    return n_params, tuple((k, _decode(v)) for k, v in static)


def serialized_name(cls):
    """The stable name of a module class in ``jax.export`` serializations."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register(cls):
    """Make ``cls`` (a subclass of JaxModule) a pytree node, serializable by
    ``jax.export`` where this JAX has ``register_pytree_node_serialization``
    (0.4.32 and later)."""
    jax.tree_util.register_pytree_node(cls, cls._tree_flatten, cls._tree_unflatten)
    try:
        from jax import export  # (a submodule: not imported by ``import jax`` on 0.6)
    except ImportError:  # pragma: no cover (jax < 0.4.30)
        export = None
    register_serialization = getattr(export, "register_pytree_node_serialization", None)
    if register_serialization is not None:
        register_serialization(
            cls,
            serialized_name=serialized_name(cls),
            serialize_auxdata=_serialize_aux,
            deserialize_auxdata=_deserialize_aux,
        )
