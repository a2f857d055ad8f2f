"""MXNet backend: ``mxnet.numpy`` arrays, ``npx.batch_dot``, Gluon blocks.

MXNet 1.9.1 quirks handled here:
- it uses ``numpy.bool``, which numpy 1.24-1.26 removed: the alias is restored
  before ``import mxnet``;
- importing this backend calls ``npx.set_np()``, which switches the whole
  process to MXNet's NumPy mode (Gluon blocks then take ``mxnet.numpy`` arrays,
  and legacy ``mx.nd`` code in the same process runs in NumPy mode too).
"""
import numpy as np

if "bool" not in vars(np):  # numpy 1.24-1.26 removed the alias
    np.bool = bool

import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon, npx  # noqa: E402
from mxnet import np as mnp  # noqa: E402

from .base import Backend  # noqa: E402

npx.set_np()


class GluonModule(gluon.Block):
    """Native base: a Gluon ``Block``; ``save_parameters`` gives d2l names."""

    def _native_init(self):
        gluon.Block.__init__(self)
        self.training = True

    def __call__(self, *args, **kwargs):
        # Block.__call__ takes positional arguments only.
        return self.forward(*args, **kwargs) if kwargs else super().__call__(*args)

    def _add_param(self, name, value):
        param = self.params.get(name, shape=value.shape, dtype=value.dtype)
        param.initialize(ctx=value.ctx)
        param.set_data(value)
        setattr(self, name, param)

    def _add_buffer(self, name, value):
        setattr(self, name, value)

    def _param(self, name):
        return getattr(self, name).data()

    def named_arrays(self):
        return {n: p.data() for n, p in self._collect_params_with_prefix().items()}

    def _assign_param(self, dotted_name, value):
        self._collect_params_with_prefix()[dotted_name].set_data(value)

    def initialize(self, init=None, ctx=None, verbose=False, force_reinit=False):
        """Parameters are initialized at construction (like PyTorch); a bare
        ``initialize()`` as in d2l code keeps them, an ``init`` re-draws them."""
        if init is not None or force_reinit:
            return super().initialize(init or mx.init.Uniform(), ctx, verbose, True)
        if ctx is not None:
            self.collect_params().reset_ctx(ctx)

    def train(self, mode=True):
        self.training = mode
        for child in self._children.values():
            child.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def to_device(self, device):
        from attention_multi.config import native_device
        self.collect_params().reset_ctx(native_device(self._backend, device))
        return self


class MXNetBackend(Backend):
    name = "mxnet"
    module_base = GluonModule
    float_dtypes = ("float16", "float32", "float64")

    def is_array(self, x):
        return isinstance(x, mnp.ndarray)

    def asarray(self, x, dtype=None, device=None):
        if isinstance(x, mnp.ndarray):
            x = x if dtype is None else x.astype(dtype)
            return x if device is None else x.as_in_ctx(device)
        x = np.asarray(x)
        return mnp.array(x, dtype=dtype or x.dtype, ctx=device)

    def to_numpy(self, x):
        return x.asnumpy()

    def arange(self, n, device=None):
        return mnp.arange(n, dtype="int32", ctx=device)

    def dtype_name(self, x):
        return np.dtype(x.dtype).name

    def astype(self, x, dtype):
        return x.astype(dtype, copy=False)

    def matmul(self, a, b, transpose_b=False):
        return npx.batch_dot(a, b, transpose_b=transpose_b)

    def linear(self, x, weight, bias=None):
        return npx.fully_connected(x, weight, bias, num_hidden=weight.shape[0],
                                   no_bias=bias is None, flatten=False)

    def softmax(self, x, axis=-1):
        return npx.softmax(x, axis=axis)

    def where(self, condition, x, y):
        # MXNet 1.9.1 back-propagates wrong gradients through where() when a
        # branch is a Python scalar: pass a 0-d array instead
        like = x if isinstance(x, mnp.ndarray) else y
        if isinstance(like, mnp.ndarray):
            x, y = (v if isinstance(v, mnp.ndarray) else
                    mnp.full((), v, dtype=like.dtype, ctx=like.ctx) for v in (x, y))
        return mnp.where(condition, x, y)

    def exp(self, x):
        return mnp.exp(x)

    def tanh(self, x):
        return mnp.tanh(x)

    def max(self, x, axis, keepdims=False):
        return mnp.max(x, axis=axis, keepdims=keepdims)

    def sum(self, x, axis, keepdims=False):
        return mnp.sum(x, axis=axis, keepdims=keepdims)

    def repeat(self, x, repeats, axis):
        return mnp.repeat(x, repeats, axis=axis)

    def transpose(self, x, axes):
        return mnp.transpose(x, axes)

    def concatenate(self, xs, axis):
        return mnp.concatenate(list(xs), axis=axis)

    def fused_attention(self, queries, keys, values, lens, scale, memory_budget=None):
        """``npx.batch_dot`` and ``npx.softmax`` with its ``length`` input (the
        mask is applied inside the softmax: no masked copy of the scores) and
        ``temperature`` (no scaled copy). Materializes the scores, so it
        declines (None) when they would not fit in ``memory_budget``."""
        *lead, num_q, _ = queries.shape
        num_k = keys.shape[-2]
        if memory_budget is not None and \
                int(np.prod(lead)) * num_q * num_k * 4 > memory_budget:
            return None
        dtype = queries.dtype
        if dtype == np.float16:   # no float16 dot on the CPU; accumulate in float32
            queries, keys, values = (x.astype("float32") for x in (queries, keys, values))
        scores = npx.batch_dot(queries, keys, transpose_b=True)
        if lens is None:
            weights = npx.softmax(scores, axis=-1, temperature=1.0 / scale)
        else:
            heads = (1,) * (len(lead) - 1)
            # softmax's length must not exceed the axis: past it, MXNet 1.9.1
            # corrupts memory
            lens = mnp.minimum(lens, num_k)
            per_query = (lens.reshape((-1,) + heads + (1,)) if lens.ndim == 1 else
                         lens.reshape((lens.shape[0],) + heads + (num_q,)))
            weights = npx.softmax(scores, axis=-1, temperature=1.0 / scale,
                                  length=mnp.broadcast_to(per_query, scores.shape[:-1]),
                                  use_length=True)
            longest = lens if lens.ndim == 1 else mnp.max(lens, axis=1)
            used = mnp.arange(num_k, dtype="int32", ctx=keys.ctx).reshape((1, -1, 1)) < \
                longest.reshape((-1,) + heads + (1, 1))
            values = mnp.where(used, values, mnp.zeros((), dtype=values.dtype,
                                                         ctx=values.ctx))
        return npx.batch_dot(weights, values).astype(dtype, copy=False)

    def device(self, kind, index=0):
        if kind == "cuda":
            count = mx.context.num_gpus()
            if index >= count:
                raise ValueError(f"device cuda:{index} is not available to the mxnet "
                                 f"backend ({count} GPUs found)")
            return mx.gpu(index)
        return super().device(kind, index)

    def _cpu_device(self):
        return mx.cpu()

    def device_of(self, x):
        return x.ctx

    def to_device(self, x, device):
        return x.as_in_ctx(device)

    def uniform(self, shape, low, high, dtype="float32", device=None):
        return mnp.random.uniform(low, high, size=shape, ctx=device).astype(dtype)

    def _dropout(self, x, p):
        keep = mnp.random.uniform(0, 1, size=x.shape, ctx=x.ctx) >= p
        return mnp.where(keep, x / (1 - p), mnp.zeros((), dtype=x.dtype, ctx=x.ctx))

    def value_and_grad(self, module, loss_fn):
        params = module._collect_params_with_prefix()
        with autograd.record():
            loss = loss_fn(module)
        loss.backward()
        return float(loss), {n: p.grad() for n, p in params.items()}
