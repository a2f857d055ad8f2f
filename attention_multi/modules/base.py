"""The base of every module, and ``Linear``: one class, native on every backend.

``MultiHeadAttention(..., backend="torch")`` returns an instance of a subclass
of both ``MultiHeadAttention`` and the backend's ``module_base``
(``torch.nn.Module``, ``gluon.Block``, a JAX pytree, or a plain object).
The mechanism itself is written once, in the public class.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import backends
from ..backends.capabilities import opt
from ..config import get_backend, native_device
from ..core.checks import check_bool, check_positive_int
from ..types import Array, BackendLike, DeviceLike, FloatDType, ModuleOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from attention_multi.backends import Backend
    from attention_multi.backends.protocol import NativeModule as _Native
else:
    _Native = object  # at run time the backend's module_base supplies the members


def unexpected_keyword(cls: type[Any], name: str) -> TypeError:
    """The error for a keyword no form of ``cls``'s constructor takes: it names
    the keyword, the closest valid one, and all of them."""
    import difflib
    import inspect
    from typing import get_type_hints

    params = inspect.signature(cls).parameters.values()  # __init__'s, without self
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    valid = list(getattr(cls, "_SEEDS", ()))  # the seeds' form first, in its order
    for extra in (
        *(p.name for p in params if p.kind in kinds and p.name != "self"),
        *get_type_hints(ModuleOptions),
    ):
        if extra not in valid:
            valid.append(extra)
    close = difflib.get_close_matches(name, valid, n=1)
    return TypeError(
        f"{cls.__name__}() got an unexpected keyword argument {name!r}"
        + (f" (did you mean {close[0]}=?)" if close else "")
        + f"; its keywords: {', '.join(valid)}"
    )


class Module(_Native):
    """The base of every module. An instance is of a subclass native to its
    backend (``torch.nn.Module``, ``gluon.Block``, a JAX pytree or a plain
    object), which provides the members of
    ``attention_multi.backends.protocol.NativeModule``, on every backend:

    - ``eval()`` and ``train(mode=True)``: dropout off and on, returning the
      module (modules start in training mode, as in PyTorch; on MXNet a module
      follows ``autograd.record()`` until either is called, as Gluon's layers
      do, and ``train(None)`` returns it to that);
    - ``training``: the mode in force;
    - ``attention_weights`` (attention modules): the weights of the last call.
    """

    _backend: Any = None  # set on the native subclasses by native_class
    training: bool

    def __new__(cls, *args: Any, backend: BackendLike = None, **kwargs: Any) -> Any:
        if cls._backend is None:
            cls = native_class(get_backend(backend), cls)
        native_new = super().__new__
        if native_new is object.__new__:
            return object.__new__(cls)
        # (a base with its own __new__, Keras' Layer's; the arguments are kept
        # for a config to rebuild the module from: Keras' saving)
        kwargs["backend"] = cls._backend.name
        self = native_new(cls, *args, **kwargs)
        self.__dict__["_arguments"] = (args, kwargs)
        return self

    def _start(
        self,
        backend: BackendLike = None,
        device: DeviceLike = None,
        dtype: FloatDType = "float32",
        **unknown: Any,
    ) -> None:
        """Call first in ``__init__``: sets up the native base. (``backend``
        was already used by ``__new__`` to pick the native class.)"""
        if unknown:
            raise unexpected_keyword(type(self), next(iter(unknown)))
        self._native_init()
        self._device = native_device(self._backend, device)
        self._dtype = dtype
        if dtype not in self._backend.float_dtypes:
            raise TypeError(
                f"dtype={dtype!r} is not supported by the "
                f"{self._backend.name} backend; choose one of "
                f"{', '.join(self._backend.float_dtypes)}"
            )

    def _child_options(self) -> dict[str, Any]:
        return {"backend": self._backend, "device": self._device, "dtype": self._dtype}

    @property
    def backend(self) -> Backend:
        """The Backend this module runs on."""
        return self._backend

    def _new_param(self, name: str, shape: tuple[int, ...], low: float, high: float) -> None:
        self._add_param(name, self._backend.uniform(shape, low, high, self._dtype, self._device))

    @property
    def sized(self) -> bool:
        """False while a lazily sized layer has not yet seen its first call."""
        return not self._unsized()

    def _check_sized(self, what: str) -> None:
        """ValueError naming the parameters that are not sized yet."""
        unsized = self._unsized()
        if unsized:
            raise ValueError(
                f"{type(self).__name__} has parameters whose sizes are not known yet: "
                f"{', '.join(unsized)} (lazily sized layers); {what} needs them. Call "
                f"the module once on an example input, or give the input sizes to the "
                f"constructor (key_size=, query_size=, value_size=)"
            )

    def _dropout(self, x: Array, p: float, key: Any) -> Array:
        if not self.training or p == 0:
            return x
        return self._backend.dropout(x, p, key)

    # attention_weights is computed on first access from what the call kept;
    # a read tells the next call that its weights will be read too.
    @property
    def attention_weights(self) -> Array | None:
        """The attention weights of the last call, as d2l users read them."""
        kept = self.__dict__.get("_attention_kept")
        self.__dict__["_attention_read"] = True
        if isinstance(kept, _Traced):
            if not opt(self._backend).is_tracing():
                raise RuntimeError(
                    f"{type(self).__name__}.attention_weights: the last call ran under a "
                    f"trace (jax.jit, jax.grad, ...) that has ended, and its weights with "
                    f"it; read them inside the traced function and return them, or call "
                    f"the module outside the trace"
                )
            kept = kept.weights
        if callable(kept):
            kept = kept()
            self.__dict__["_attention_kept"] = kept
        return kept

    def _keep_attention(self, weights_or_thunk: Any) -> None:
        backend = opt(self._backend)
        if backend.traced_values_end and backend.is_tracing():
            weights_or_thunk = _Traced(weights_or_thunk)
        self.__dict__["_attention_kept"] = weights_or_thunk

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The native class is made at run time; pickle rebuilds it by name.
        public_class = type(self).__bases__[0]  # see native_class
        return (_rebuild, (public_class, self._backend.name), self.__getstate__())

    def __getstate__(self) -> dict[str, Any]:
        # copy.deepcopy and pickle leave the last call's weights behind: under
        # torch they are a non-leaf tensor, which deepcopy refuses.
        parent = getattr(super(), "__getstate__", None)  # absent before 3.11
        state = dict(parent() if parent is not None else self.__dict__)
        state.pop("_attention_kept", None)
        state.pop("_attention_read", None)
        state.pop("_attention_line", None)  # (a cache of the last small call's decisions)
        state.pop("_device", None)  # used only while building; JAX devices don't pickle
        return state


class _Traced(NamedTuple):
    """Weights (or their thunk) kept by a call under a trace that ends."""

    weights: Any


def _rebuild(public_class: type, backend_name: str) -> Any:
    """Unpickling: an empty instance of ``public_class``'s native class."""
    return object.__new__(native_class(get_backend(backend_name), public_class))


class Linear(Module):
    """``y = x W^T + b``, with ``weight`` (out_features, in_features).

    ``Linear(None, out_features)`` is lazily sized (as ``nn.LazyLinear``):
    ``in_features`` comes from the first call, which creates the parameters,
    initialized as when the size is given. Until then the parameters are the
    framework's own "not yet sized" kind (torch ``UninitializedParameter``,
    a Gluon parameter with deferred initialization) or absent (NumPy, JAX),
    and ``get_params``/``set_params``/``port.load_into`` refuse the module.
    The first call must run eagerly: under a trace (``jax.jit``,
    ``jax.grad``, ``torch.compile``) it raises TypeError.
    """

    def __init__(
        self,
        in_features: int | None,
        out_features: int,
        bias: bool = True,
        **options: Unpack[ModuleOptions],
    ) -> None:
        in_features = check_positive_int("in_features", in_features, allow_none=True)
        out_features = check_positive_int("out_features", out_features)
        bias = check_bool("bias", bias)
        self._start(**options)
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        if in_features is None:
            self._add_lazy_param("weight", (out_features, None))
            if bias:
                self._add_lazy_param("bias", (out_features,))
        else:
            self._new_param("weight", (out_features, in_features), *self._bounds())
            if bias:
                self._new_param("bias", (out_features,), *self._bounds())

    def _bounds(self) -> tuple[float, float]:
        bound = 1.0 / math.sqrt(self.in_features)
        return -bound, bound

    def forward(self, x: Array) -> Array:
        """``x`` (..., in_features) -> (..., out_features)."""
        if self.in_features is None:
            self._size_from(x)
        elif x.shape[-1] != self.in_features:
            raise ValueError(
                f"x has feature size {x.shape[-1]} (shape {tuple(x.shape)}) "
                f"but in_features={self.in_features}"
            )
        bias = self._param("bias") if self.has_bias else None
        return self._backend.linear(x, self._param("weight"), bias)

    def _size_from(self, x: Array) -> None:
        """Create the parameters of a lazily sized layer for input ``x``."""
        xp = self._backend
        if opt(xp).is_tracing() or not opt(xp).is_concrete(x):
            raise TypeError(
                f"this {type(self).__name__}'s input size is not known yet and it is "
                f"called under a trace ({xp.name}: jit, grad, vmap or compile), where "
                f"its parameters cannot be created; call the module once eagerly on "
                f"an example input, or give the input sizes to the constructor "
                f"(key_size=, query_size=, value_size= for the attention modules)"
            )
        if x.shape[-1] < 1:
            raise ValueError(
                f"a lazily sized Linear takes its input size from the last "
                f"axis of its first input, which is empty (shape "
                f"{tuple(x.shape)})"
            )
        self._create(int(x.shape[-1]), self.__dict__.get("_device") or xp.device_of(x))

    def _create(self, in_features: int, device: Any) -> None:
        xp = self._backend
        self.in_features = in_features
        low, high = self._bounds()
        self._fill_lazy_param(
            "weight", xp.uniform((self.out_features, in_features), low, high, self._dtype, device)
        )
        if self.has_bias:
            self._fill_lazy_param(
                "bias", xp.uniform((self.out_features,), low, high, self._dtype, device)
            )

    def _size_lazy_params(self, name: str, shape: tuple[int, ...]) -> None:
        """Loading a parameter of ``shape`` into this unsized layer (torch's
        ``load_state_dict``, as for ``nn.LazyLinear``) sizes it first."""
        if name != "weight" or len(shape) != 2 or shape[0] != self.out_features or shape[1] < 1:
            raise ValueError(
                f"cannot size Linear(None, {self.out_features}) from a "
                f"{name!r} of shape {shape}; expected weight "
                f"({self.out_features}, in_features)"
            )
        self._create(shape[1], self.__dict__.get("_device"))


_NATIVE: dict[tuple[Any, type], type] = {}


def native_class(backend: Backend, public_class: type) -> type:
    """The subclass of ``public_class`` that is native to ``backend`` (its
    ``module_base``), made once."""
    cls = _NATIVE.get((backend, public_class))
    if cls is None:
        if backend.module_base is None:
            raise NotImplementedError(f"the {backend.name} backend sets no module_base")
        cls = type(
            public_class.__name__,
            (public_class, backend.module_base),
            {
                "_backend": backend,
                "__module__": public_class.__module__,
                "__qualname__": public_class.__qualname__,
            },
        )
        opt(backend).register_class(cls)
        _NATIVE[(backend, public_class)] = cls
    return cls


def _classes_by_name(backend: Backend) -> None:
    """The native class of every public module, made when a backend that
    asks (``Tracing.classes_by_name``: TensorFlow, whose Keras ``load_model``
    finds a layer's class by its registered name) loads."""
    if not opt(backend).classes_by_name:
        return
    found, todo = [], list(Module.__subclasses__())
    while todo:
        public = todo.pop()
        todo += public.__subclasses__()
        if public._backend is None and not public.__name__.startswith("_"):
            found.append(public)
    for public in found:
        native_class(backend, public)


backends.on_load(_classes_by_name)
