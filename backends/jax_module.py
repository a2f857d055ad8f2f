"""Native module base for JAX: a pytree whose leaves are exactly the parameters."""
import jax

from .plain_module import PlainModule


class _ByIdentity:
    """Wraps an unhashable static value (a constant table) for pytree aux data."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _ByIdentity) and other.value is self.value

    def __hash__(self):
        return id(self.value)


class _NameList(tuple):
    """A list of names in aux data: hashable and compared by value, so modules
    built alike have equal treedefs; unflattened back into a list."""
    __slots__ = ()


class JaxModule(PlainModule):
    """Native base: a pytree. Transient state (attention weights) is dropped."""

    def _tree_flatten(self):
        params = tuple(getattr(self, n) for n in self._param_names)
        children = tuple(getattr(self, n) for n in self._child_names)
        skip = set(self._param_names) | set(self._child_names)
        static = []
        for k, v in sorted(vars(self).items()):
            if k in skip or k.startswith("_attention"):
                continue
            if isinstance(v, list):
                v = _NameList(v)
            try:
                hash(v)
            except TypeError:
                v = _ByIdentity(v)
            static.append((k, v))
        return params + children, (len(params), tuple(static))

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


def register(cls):
    """Make ``cls`` (a subclass of JaxModule) a pytree node."""
    jax.tree_util.register_pytree_node(cls, cls._tree_flatten, cls._tree_unflatten)
