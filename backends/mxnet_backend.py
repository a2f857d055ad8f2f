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


def _cpu_half(x):
    """MXNet's CPU batch_dot and fully_connected have no float16 kernels."""
    return x.dtype == np.float16 and x.ctx.device_type == "cpu"


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
        param.initialize(init=mx.init.Zero(), ctx=value.ctx)  # Uniform fails on float64
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

    def load_parameters(self, filename, ctx=None, allow_missing=False,
                        ignore_extra=False, cast_dtype=False, dtype_source="current"):
        # Names without a dot (NWKernelRegression's "w") send MXNet 1.9.1 down its
        # legacy loader, which fails in NumPy mode; load them as the normal path does.
        try:
            loaded = npx.load(filename)
        except mx.base.MXNetError:   # e.g. saved without NumPy shape semantics
            loaded = None
        if not isinstance(loaded, dict) or any("." in name for name in loaded):
            return super().load_parameters(filename, ctx, allow_missing, ignore_extra,
                                           cast_dtype, dtype_source)
        params = self._collect_params_with_prefix()
        missing = sorted(set(params) - set(loaded)) if not allow_missing else []
        extra = sorted(set(loaded) - set(params)) if not ignore_extra else []
        if missing or extra:
            raise ValueError(f"{filename}: parameters missing {missing}, not in "
                             f"this block {extra}; it holds {sorted(params)}")
        for name in set(loaded) & set(params):
            params[name]._load_init(loaded[name], ctx, cast_dtype=cast_dtype,
                                    dtype_source=dtype_source)

    def train(self, mode=True):
        self.training = mode
        for child in self._children.values():
            child.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def to_device(self, device):
        self.collect_params().reset_ctx(self._backend.native_device(device))
        return self


_FOLD_MIN_SCORES = 1 << 20   # fewer scores: a bias costs less than the copies


def _append_feature(x, column):
    """``x`` (..., n, f) with ``column`` (a scalar or (..., n, 1)) as feature f+1."""
    shape = tuple(x.shape[:-1]) + (x.shape[-1] + 1,)
    if autograd.is_recording():   # slice assignment is not differentiable
        if not isinstance(column, mnp.ndarray):
            column = mnp.full(shape[:-1] + (1,), column, dtype=x.dtype, ctx=x.ctx)
        return mnp.concatenate([x, column], axis=-1)
    out = mnp.empty(shape, dtype=x.dtype, ctx=x.ctx)
    head = (slice(None),) * (len(shape) - 1)
    out[head + (slice(0, x.shape[-1]),)] = x
    out[head + (slice(x.shape[-1], None),)] = column
    return out


class MXNetBackend(Backend):
    name = "mxnet"
    autodiff = True
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
        if _cpu_half(a):
            return self.matmul(a.astype("float32"), b.astype("float32"),
                               transpose_b).astype(a.dtype)
        return npx.batch_dot(a, b, transpose_b=transpose_b)

    def linear(self, x, weight, bias=None):
        if _cpu_half(x):
            weight, bias = weight.astype("float32"), bias if bias is None else bias.astype("float32")
            return self.linear(x.astype("float32"), weight, bias).astype(x.dtype)
        return npx.fully_connected(x, weight, bias, num_hidden=weight.shape[0],
                                   no_bias=bias is None, flatten=False)

    def softmax(self, x, axis=-1):
        # npx.softmax leaves a row's other entries finite when one is NaN;
        # make the whole row NaN, as the other frameworks do.
        has_nan = mnp.sum(mnp.isnan(x), axis=axis, keepdims=True) > 0
        return self.where(has_nan, np.nan, npx.softmax(x, axis=axis))

    def where(self, condition, x, y):
        # MXNet 1.9.1's where() with a scalar operand sends the other operand's
        # gradient to the wrong positions (apache/mxnet#17893); 0-d arrays do not.
        like = x if isinstance(x, mnp.ndarray) else y
        x, y = (v if isinstance(v, mnp.ndarray) else mnp.array(v, dtype=like.dtype, ctx=like.ctx)
                for v in (x, y))
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
        """``npx.batch_dot`` and plain ``npx.softmax``, with no masking pass over
        the scores: per-batch lengths are folded into the first product as an
        extra feature (``[scale q, 1] . [k, 0 or -1e30]``), value rows past
        the lengths are zeroed by ``npx.sequence_mask``. Per-query lengths,
        and small inputs (where the extra copies cost more than they save),
        add a broadcast bias instead. (On the CPU, MXNet 1.9.1's softmax with
        ``length=`` or ``temperature=`` and broadcast ``where`` are several
        times slower than these.) Materializes the scores, so it declines
        (None) when they would not fit in ``memory_budget``."""
        *lead, num_q, d = queries.shape
        num_k = keys.shape[-2]
        if memory_budget is not None and \
                int(np.prod(lead)) * num_q * num_k * 4 > memory_budget:
            return None
        dtype = queries.dtype
        if dtype == np.float16:   # no float16 dot on the CPU; accumulate in float32
            queries, keys, values = (x.astype("float32") for x in (queries, keys, values))
        queries = queries * scale
        if lens is None:
            return self._softmax_product(queries, keys, values).astype(dtype, copy=False)
        heads = lead[1] if len(lead) == 2 else 1
        expand = (1,) * (len(lead) - 1)
        positions = mnp.arange(num_k, dtype="int32", ctx=keys.ctx)
        longest = lens if lens.ndim == 1 else mnp.max(lens, axis=1)
        # sequence_mask must not see lengths past the axis: MXNet 1.9.1
        # corrupts memory there
        longest = mnp.minimum(longest, num_k)
        seq_lens = longest if heads == 1 else mnp.repeat(longest, heads, axis=0)

        def zero_unused(x):   # rows past every length: NaN there must not leak
            flat = x.reshape((-1,) + tuple(x.shape[-2:]))   # (batch * heads, K, n)
            return npx.sequence_mask(flat, seq_lens.astype(x.dtype), True, value=0.0,
                                     axis=1).reshape(x.shape)
        keys, values = zero_unused(keys), zero_unused(values)
        if lens.ndim == 1 and int(np.prod(lead)) * num_q * num_k >= _FOLD_MIN_SCORES:
            offset = mnp.where(positions.reshape((-1, 1)) < lens.reshape((-1,) + expand + (1, 1)),
                               0.0, -1e30).astype(keys.dtype)
            offset = mnp.broadcast_to(offset, tuple(keys.shape[:-1]) + (1,))
            return self._softmax_product(_append_feature(queries, 1.0),
                                         _append_feature(keys, offset),
                                         values).astype(dtype, copy=False)
        rows = (lens.reshape((-1,) + expand + (1, 1)) if lens.ndim == 1 else
                lens.reshape((lens.shape[0],) + expand + (num_q, 1)))
        bias = mnp.where(positions < rows, 0.0, -1e30).astype(queries.dtype)
        out = self._softmax_product(queries, keys, values, bias)
        if lens.ndim == 2:   # no valid key: zeros, not the mean of the values
            out = out * (rows > 0).astype(out.dtype)   # (per batch: values are 0)
        return out.astype(dtype, copy=False)

    @staticmethod
    def _softmax_product(queries, keys, values, bias=None):
        scores = npx.batch_dot(queries, keys, transpose_b=True)
        if bias is not None:
            scores = scores + bias
        return npx.batch_dot(npx.softmax(scores, axis=-1), values)

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
