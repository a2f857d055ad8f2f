"""TensorFlow backend: modules are Keras 3 layers (``tensorflow_module``).

The math is TensorFlow's own ops (``tf.experimental.numpy`` is ``xp``, but
each member is written with ``tf`` ops: its functions promote Python scalars
NumPy's way). TF's process-wide NumPy mode is never turned on (it changes
users' type promotion), so a ``tf.Tensor`` has no ``reshape``, ``astype``,
``T`` or ``copy``: the core asks the backend (``Arrays.reshape``,
``Arrays.shape``). Where Keras or a ``TensorSpec`` leaves a dimension
unknown (``None``), ``shape`` gives the dynamic one (``tf.shape``).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from . import tensorflow_module
from .numpy_like import NumpyLike, np_dtype

try:  # keep the library out of AutoGraph: a tf.function runs its Python as written
    from tensorflow.python.autograph.core import config as _autograph_config

    if not any(
        getattr(r, "name", None) == "attention_multi" for r in _autograph_config.CONVERSION_RULES
    ):
        _autograph_config.CONVERSION_RULES = (
            _autograph_config.DoNotConvert("attention_multi"),
            *_autograph_config.CONVERSION_RULES,
        )
except (ImportError, AttributeError):  # pragma: no cover (a TF without it: the call wrappers)
    pass

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _dtype(name):
    return tf.as_dtype(np_dtype(name)) if name != "bfloat16" else tf.bfloat16


def _like(x, value):
    """``value`` (a Python or NumPy scalar) as a tensor of ``x``'s dtype;
    arrays as they are (TF ops take no weak scalars of another kind)."""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return value
    return tf.constant(value, dtype=x.dtype)


class TensorflowBackend(NumpyLike):
    name = "tensorflow"
    xp = tf.experimental.numpy
    array_type = (tf.Tensor, tf.Variable)
    module_base = tensorflow_module.KerasModule
    float_dtypes = _FLOATS
    mixed_int_ops = False  # (int32 and int64 tensors do not meet in one op)
    traced_values_end = True  # (a tf.function's tensors are gone when its trace ends)
    classes_by_name = True  # (Keras' load_model finds our layers by their registered names)

    def __init__(self):
        super().__init__()
        self._generator = None  # keras.random.SeedGenerator, made eagerly on first need

    def register_class(self, cls):
        tensorflow_module.register(cls)

    # -- arrays --------------------------------------------------------------------
    def asarray(self, x, dtype=None, device=None):
        if isinstance(x, (tf.Tensor, tf.Variable)):
            x = x if dtype is None or x.dtype == _dtype(dtype) else tf.cast(x, _dtype(dtype))
        else:
            x = tf.convert_to_tensor(np.asarray(x, None if dtype is None else np_dtype(dtype)))
        return x if device is None else self.to_device(x, device)

    def to_numpy(self, x):
        if self.dtype_name(x) == "bfloat16":
            x = tf.cast(x, tf.float32)
        return np.asarray(x.numpy())

    def dtype_name(self, x):
        dtype = x.dtype  # (a Keras variable's is a name already)
        return dtype if isinstance(dtype, str) else dtype.name

    def astype(self, x, dtype):
        want = _dtype(dtype)
        return x if x.dtype == want else tf.cast(x, want)

    def reshape(self, x, shape):
        return tf.reshape(x, shape)

    def shape(self, x):
        """The static shape, with ``tf.shape``'s scalar where a dimension is unknown."""
        static = tuple(x.shape)
        if None not in static:
            return static
        dynamic = tf.shape(x)
        return tuple(dynamic[i] if n is None else n for i, n in enumerate(static))

    def arange(self, n, device=None):
        return tf.range(n, dtype=tf.int32)

    def zeros(self, shape, dtype, device=None):
        return tf.zeros(shape, _dtype(dtype))

    # -- math: TF's ops for NumPy's names --------------------------------------------
    def exp(self, x):
        return tf.exp(x)

    def log(self, x):
        return tf.math.log(x)

    def tanh(self, x):
        return tf.tanh(x)

    def sqrt(self, x):
        return tf.sqrt(x)

    def where(self, condition, x, y):
        if not isinstance(x, (tf.Tensor, tf.Variable)):
            x = _like(y, x) if isinstance(y, (tf.Tensor, tf.Variable)) else tf.constant(x)
        return tf.where(condition, x, _like(x, y))

    def max(self, x, axis=None, keepdims=False):
        return tf.reduce_max(x, axis, keepdims)

    def min(self, x, axis=None, keepdims=False):
        return tf.reduce_min(x, axis, keepdims)

    def sum(self, x, axis=None, keepdims=False):
        return tf.reduce_sum(x, axis, keepdims)

    def any(self, x, axis=None, keepdims=False):
        return tf.reduce_any(tf.cast(x, tf.bool), axis, keepdims)

    def repeat(self, x, repeats, axis=None):
        return tf.repeat(x, repeats, axis)

    def transpose(self, x, axes=None):
        return tf.transpose(x, axes)

    def concatenate(self, xs, axis=0):
        return tf.concat(list(xs), axis)

    def broadcast_to(self, x, shape):
        return tf.broadcast_to(x, shape)

    def minimum(self, a, b):
        return tf.minimum(a, _like(a, b)) if not isinstance(a, (int, float)) else tf.minimum(b, a)

    def maximum(self, a, b):
        return tf.maximum(a, _like(a, b)) if not isinstance(a, (int, float)) else tf.maximum(b, a)

    def take(self, x, indices, axis=None):
        if axis is None:
            x, axis = tf.reshape(x, (-1,)), 0
        return tf.gather(x, indices, axis=axis)

    def logical_and(self, a, b):
        return tf.logical_and(a, b)

    def split(self, x, size, axis):
        n = x.shape[axis]
        if isinstance(size, int):
            size = [size] * (n // size) + ([n % size] if n % size else [])
        return list(tf.split(x, size, axis))

    def softmax(self, x, axis=-1):
        return tf.nn.softmax(x, axis=axis)

    def matmul(self, a, b, transpose_b=False):
        if len(b.shape) == 2 and len(a.shape) > 2:
            # a (..., n, d) by a 2-D matrix as one 2-D product: TF 2.21's oneDNN
            # batched matmul gives wrong numbers for a (2, 1, 10, 8) by a
            # broadcast (8, 1) (tests/test_tensorflow.py)
            lead, d = self.shape(a)[:-1], a.shape[-1]
            out = tf.matmul(tf.reshape(a, (-1, d)), b, transpose_b=transpose_b)
            return tf.reshape(out, (*lead, b.shape[0] if transpose_b else b.shape[1]))
        return tf.matmul(a, b, transpose_b=transpose_b)

    def linear(self, x, weight, bias=None):
        out = self.matmul(x, weight, transpose_b=True)
        return out if bias is None else out + bias

    # -- devices ------------------------------------------------------------------
    def device(self, kind, index=0):
        """A ``tf.DeviceSpec`` (what ``tf.device`` takes; not a string, which
        would read as a device name of ours)."""
        if kind == "cpu":
            return tf.DeviceSpec(device_type="CPU", device_index=0)
        gpus = tf.config.list_logical_devices("GPU")
        if index >= len(gpus):
            raise ValueError(
                f"device cuda:{index} is not available to the tensorflow backend "
                f"({len(gpus)} GPU devices found)"
            )
        return tf.DeviceSpec(device_type="GPU", device_index=index)

    def device_of(self, x):
        """Where an eager tensor lives; None while traced (TF places the graph's ops)."""
        name = getattr(x, "device", "") if tf.executing_eagerly() else ""
        if not name:
            return None
        spec = tf.DeviceSpec.from_string(name)
        return tf.DeviceSpec(device_type=spec.device_type, device_index=spec.device_index)

    def to_device(self, x, device):
        if device is None or self.device_of(x) == device:
            return x
        with tf.device(device):
            return tf.identity(x)

    def on_accelerator(self, device):
        return device is not None and device.device_type == "GPU"

    # -- randomness ------------------------------------------------------------------
    def seed(self, n):
        np.random.seed(n)  # (the parameters' initialization: NumpyArrays.uniform)
        self._seeds().state.assign(tf.constant([n, 0], self._seeds().state.dtype))

    def _seeds(self):
        if self._generator is None:
            import keras

            with tf.init_scope():  # (a variable: made eagerly, even inside a tf.function)
                self._generator = keras.random.SeedGenerator(np.random.randint(1 << 30))
        return self._generator

    def dropout(self, x, p, key=None):
        if key is not None:
            raise ValueError(
                "key= is only used by the jax backend; the tensorflow backend draws "
                "dropout masks from a keras.random.SeedGenerator"
            )
        import keras

        if p >= 1:
            return tf.zeros_like(x)
        keep = keras.random.uniform(tf.shape(x), seed=self._seeds()) >= p
        return tf.where(keep, x * tf.constant(1.0 / (1.0 - p), x.dtype), tf.zeros((), x.dtype))

    # -- tracing ------------------------------------------------------------------------
    def is_concrete(self, x):
        return not tf.is_symbolic_tensor(x) and tf.executing_eagerly()

    def is_tracing(self):
        return not tf.executing_eagerly()

    def register_tree(self, cls, flatten, unflatten):
        """``tf.nest``'s protocol on ``cls`` (a KV cache passes through ``tf.function``)."""
        if "__tf_flatten__" not in vars(cls):
            cls.__tf_flatten__ = lambda obj: tuple(reversed(flatten(obj)))
            cls.__tf_unflatten__ = classmethod(lambda _, aux, children: unflatten(aux, children))

    def snapshot(self, x):
        return x  # (tensors are immutable)

    def read_slice(self, x, start, size, axis):
        begin = [0] * len(x.shape)
        begin[axis] = start
        sizes = [-1] * len(x.shape)
        sizes[axis] = size
        return tf.slice(x, tf.stack(begin) if not isinstance(start, int) else begin, sizes)

    def write_slice(self, buffer, update, start, axis):
        n, m = buffer.shape[axis], update.shape[axis]
        update = tf.cast(update, buffer.dtype)
        if isinstance(start, int):
            before = self.read_slice(buffer, 0, start, axis)
            after = self.read_slice(buffer, start + m, n - start - m, axis)
            return tf.concat([before, update, after], axis)
        # a traced start: each position of the buffer takes the update's row
        # at its offset from start where it falls inside, its own elsewhere
        index = tf.range(n) - tf.cast(start, tf.int32)
        inside = (index >= 0) & (index < m)
        taken = tf.gather(update, tf.clip_by_value(index, 0, m - 1), axis=axis)
        shape = [1] * len(buffer.shape)
        shape[axis] = n
        return tf.where(tf.reshape(inside, shape), taken, buffer)

    def host_sum(self, x):
        return float(tf.reduce_sum(x).numpy())

    # -- autodiff -----------------------------------------------------------------------
    def gradients(self, loss_fn, module, *inputs):
        params = module.named_arrays()
        with tf.GradientTape() as tape:
            tape.watch(list(inputs))
            loss = loss_fn(module, *inputs)
        found = tape.gradient(loss, [*params.values(), *inputs])
        found = [
            tf.zeros_like(x) if g is None else tf.convert_to_tensor(g)
            for x, g in zip([*params.values(), *inputs], found)
        ]
        return float(loss), dict(zip(params, found[: len(params)])), found[len(params) :]
