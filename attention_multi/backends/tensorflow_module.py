"""Native module base for TensorFlow: a Keras 3 ``Layer``.

A module is a ``keras.layers.Layer`` (``autocast=False``: float64 inputs stay
float64): its parameters are Keras variables, its children tracked layers,
so ``keras.Model``, ``fit``, ``.keras`` saving and the functional API take it
as any layer. ``training`` is what Keras passes (``call(..., training=)``, or
the outer call's), until ``train()`` or ``eval()`` pins it; an explicit
``training=`` argument wins over both. A lazily sized module is sized when
Keras builds it (``build`` runs it once, eagerly, on zeros of the traced
shapes), so ``load_model`` finds its weights.
"""

from __future__ import annotations

import inspect
import threading

import keras
import tensorflow as tf

from .devices import native_device

# the package of the Keras registrations ("attention_multi>MultiHeadAttention")
PACKAGE = "attention_multi"
_CALLS = threading.local()  # .training: the mode of the module call in progress


class KerasModule(keras.layers.Layer):
    """Native base: a Keras ``Layer``; our ``path`` option shadows Keras'
    read-only ``Layer.path`` (a name Keras reads only for quantization)."""

    path = None  # (a plain class attribute: the instance's own value wins)
    # (Keras' masks pass through, as its own MultiHeadAttention's: the
    # queries' mask is the output's; ``mask=`` is ours, a mask form)
    supports_masking = True

    def _native_init(self):
        keras.layers.Layer.__init__(self, autocast=False)
        d = self.__dict__
        d["_param_names"], d["_child_names"], d["_lazy_names"] = [], [], []
        d["_training_mode"] = None  # None: what Keras passes
        d["_call_training"] = None

    def __setattr__(self, name, value):
        if isinstance(value, KerasModule) and name not in self.__dict__.get("_child_names", ()):
            self.__dict__["_child_names"].append(name)
        super().__setattr__(name, value)

    # -- training --------------------------------------------------------------------
    @property
    def training(self):
        """This call's ``training=``, else the mode ``train()``/``eval()``
        pinned, else the enclosing call's (a child that the parent's forward
        runs directly), else False (inference, as a Keras layer)."""
        d = self.__dict__
        mode = d.get("_call_training")
        if mode is None:
            mode = d.get("_training_mode")
        if mode is None:
            mode = getattr(_CALLS, "training", None)
        return bool(mode)

    @training.setter
    def training(self, mode):
        self.__dict__["_training_mode"] = mode

    def train(self, mode=True):
        self.__dict__["_training_mode"] = mode
        for c in self._child_names:
            getattr(self, c).train(mode)
        return self

    def eval(self):
        return self.train(False)

    @tf.autograph.experimental.do_not_convert
    def call(self, *args, training=None, **kwargs):
        """``forward``; ``training``: Keras' (an explicit one, or the outer call's)."""
        d = self.__dict__
        if training is None:
            training = d.get("_training_mode")
        if training is None:
            training = getattr(_CALLS, "training", None)
        before, outer = d.get("_call_training"), getattr(_CALLS, "training", None)
        d["_call_training"] = _CALLS.training = training
        try:
            return self.forward(*args, **kwargs)
        finally:
            d["_call_training"], _CALLS.training = before, outer

    # -- build and config -------------------------------------------------------------
    def build(self, *shapes, **named):
        """Size lazily sized parameters from the shapes Keras traced: one call
        on zeros of them (unknown dimensions as 1), eagerly."""
        if not self._unsized():
            return
        names = list(self._call_names)
        given = dict(zip(names, shapes))
        given.update({k[: -len("_shape")]: v for k, v in named.items()})
        arrays = []
        with tf.init_scope():
            for name in names:
                shape = given.get(name)
                if shape is None or name == "valid_lens":
                    break
                arrays.append(tf.zeros([1 if n is None else n for n in shape], self._dtype))
            if arrays:
                mode = self.__dict__.get("_training_mode")
                self.__dict__["_training_mode"] = False
                try:
                    self.forward(*arrays)
                finally:
                    self.__dict__["_training_mode"] = mode

    def get_config(self):
        """The constructor's arguments (and the layer's name): ``.keras`` saving."""
        args, kwargs = self.__dict__["_arguments"]
        for value in (*args, *kwargs.values()):
            if not isinstance(value, (str, int, float, bool, type(None))):
                raise TypeError(
                    f"{type(self).__name__} was built with an argument Keras cannot "
                    f"save, {value!r}: give sizes, rates and names (device='cpu', "
                    f"backend='tensorflow') to save it as .keras"
                )
        return {"name": self.name, "args": list(args), "kwargs": dict(kwargs)}

    @classmethod
    def from_config(cls, config):
        layer = cls(*config.get("args", ()), **config.get("kwargs", {}))
        if config.get("name") is not None:
            layer.name = config["name"]
        return layer

    # -- parameters ------------------------------------------------------------------------
    def _add_param(self, name, value):
        var = self.add_weight(
            shape=tuple(value.shape),
            dtype=value.dtype.name,
            initializer=lambda shape, dtype=None: value,
            name=name,
            trainable=True,
            autocast=False,
        )
        self.__dict__["_param_names"].append(name)
        object.__setattr__(self, name, var)

    def _add_lazy_param(self, name, shape):
        self.__dict__["_lazy_names"].append(name)

    def _fill_lazy_param(self, name, value):
        self._lazy_names.remove(name)
        tracker = getattr(self, "_tracker", None)
        if tracker is not None and tracker.locked:
            tracker.unlock()
            try:
                self._add_param(name, value)
            finally:
                tracker.lock()
        else:
            self._add_param(name, value)
        if not self._lazy_names:
            self.built = True

    def _unsized(self, prefix=""):
        out = [prefix + n for n in self._lazy_names]
        for c in self._child_names:
            out += getattr(self, c)._unsized(f"{prefix}{c}.")
        return out

    def _add_buffer(self, name, value):
        object.__setattr__(self, name, value)

    def _param(self, name):
        return getattr(self, name).value

    def named_arrays(self, prefix=""):
        out = {prefix + n: getattr(self, n) for n in self._param_names}
        for c in self._child_names:
            out.update(getattr(self, c).named_arrays(f"{prefix}{c}."))
        return out

    def _assign_param(self, dotted_name, value):
        var = self.named_arrays()[dotted_name]
        var.assign(tf.cast(value, var.dtype))

    def to_device(self, device):
        dev = native_device(self._backend, device)
        for var in self.named_arrays().values():
            with tf.device(dev):
                var.assign(tf.identity(var.value))
        return self


def register(cls):
    """Keras' part of a new native class: ``call`` and ``build`` take
    ``forward``'s arguments (Keras reads their names: build shapes, saving),
    and the class is registered for ``load_model`` under its public name."""
    forward = inspect.signature(cls.forward)
    params = [p for p in forward.parameters.values() if p.name != "self"]
    positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    cls._call_names = tuple(p.name for p in positional)
    training = inspect.Parameter("training", inspect.Parameter.KEYWORD_ONLY, default=None)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    keyword = [p for p in params if p.kind is not p.POSITIONAL_OR_KEYWORD]
    var_kw = [p for p in keyword if p.kind is p.VAR_KEYWORD]
    keyword = [p for p in keyword if p.kind is not p.VAR_KEYWORD]

    def call(self, *args, training=None, **kwargs):
        return KerasModule.call(self, *args, training=training, **kwargs)

    call.__signature__ = inspect.Signature([self_param, *positional, *keyword, training, *var_kw])
    cls.call = tf.autograph.experimental.do_not_convert(call)

    # (a real signature: Keras reads build's through functools.wraps, which
    # copies a __signature__ that a bound method would then cut short)
    names = [f"{p.name}_shape" for p in positional]
    scope = {"base": KerasModule.build}
    code = f"def build(self, {', '.join(f'{n}=None' for n in names)}):\n"
    code += f"    return base(self, {', '.join(names)})\n"
    exec(code, scope)  # noqa: S102
    build = scope["build"]
    cls.build = build
    public = cls.__bases__[0]
    keras.saving.get_custom_objects()[f"{PACKAGE}>{public.__name__}"] = cls
    from keras.src.saving import object_registration

    object_registration.GLOBAL_CUSTOM_NAMES[cls] = f"{PACKAGE}>{public.__name__}"
