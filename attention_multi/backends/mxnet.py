"""MXNet backend: ``mxnet.numpy`` arrays, ``npx.batch_dot``, Gluon blocks.

MXNet 1.9.1 quirks handled here:
- it uses ``numpy.bool``, which numpy 1.24-1.26 removed: this module restores
  the alias just before it imports MXNet (the one place the library touches
  NumPy's namespace, and only when the MXNet backend loads);
- importing this backend calls ``npx.set_np()``, which switches the whole
  process to MXNet's NumPy mode (Gluon blocks then take ``mxnet.numpy`` arrays,
  and legacy ``mx.nd`` code in the same process runs in NumPy mode too);
- its CPU ``batch_dot`` and ``fully_connected`` have no float16 kernels, and
  ``fully_connected`` corrupts memory on empty inputs (its backward);
- ``np.where`` with a scalar operand sends gradients to the wrong positions,
  and ``npx.softmax`` leaves a row finite when one entry is NaN.
"""

import functools
import math

import numpy as np

if "bool" not in vars(np):  # numpy 1.24-1.26 (numpy 2 has it again)
    np.bool = bool  # type: ignore[assignment,attr-defined,misc,unused-ignore]

import mxnet as mx  # noqa: E402
from mxnet import autograd, npx  # noqa: E402
from mxnet import np as mnp  # noqa: E402

from .mxnet_module import GluonModule
from .numpy_like import NumpyLike
from .protocol import MaskView

npx.set_np()

_FOLD_MIN_SCORES = 1 << 20  # fewer scores: a bias costs less than the copies


_SCALARS: dict = {}  # (repr, dtype, ctx) -> 0-d array, never handed out


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_SEQUENCE_MASK_MIN = 8192  # elements


@functools.cache
def _exact_in_float32(value):
    """Whether float ``value`` is exact as a float32 (SequenceMask's value)."""
    return abs(value) <= _FLOAT32_MAX and float(np.float32(value)) == value


def _scalar(value, like):
    """``value`` as a 0-d array like ``like``, made once: each new one is a
    copy that waits for MXNet's engine (where() only reads it)."""
    key = (repr(float(value)), like.dtype, str(like.ctx))
    out = _SCALARS.get(key)
    if out is None:
        out = mnp.array(value, dtype=like.dtype, ctx=like.ctx)
        if len(_SCALARS) < 64:
            _SCALARS[key] = out
    return out


def _cpu_half(x):
    """MXNet's CPU batch_dot and fully_connected have no float16 kernels."""
    return x.dtype == np.float16 and x.ctx.device_type == "cpu"


def _append_feature(x, column):
    """``x`` (..., n, f) with ``column`` (a scalar or (..., n, 1)) as feature f+1."""
    shape = tuple(x.shape[:-1]) + (x.shape[-1] + 1,)
    if autograd.is_recording():  # slice assignment is not differentiable
        if not isinstance(column, mnp.ndarray):
            column = mnp.full(shape[:-1] + (1,), column, dtype=x.dtype, ctx=x.ctx)
        return mnp.concatenate([x, column], axis=-1)
    out = mnp.empty(shape, dtype=x.dtype, ctx=x.ctx)
    head = (slice(None),) * (len(shape) - 1)
    out[head + (slice(0, x.shape[-1]),)] = x
    out[head + (slice(x.shape[-1], None),)] = column
    return out


class MXNetBackend(NumpyLike):
    name = "mxnet"
    masks_by_adding = True  # (broadcast where: ~12 ns an element, an addition ~3)
    masks_by_lengths = True  # (SequenceMask: about a fifth of where's time)
    xp = mnp
    array_type = mnp.ndarray

    def near_miss(self, x):
        if isinstance(x, mx.nd.NDArray):
            return "the mxnet backend takes mxnet.numpy arrays: convert with x.as_np_ndarray()"
        return None

    module_base = GluonModule
    float_dtypes = ("float16", "float32", "float64")
    dense_index_grids = True  # MXNet 1.9.1: | and & on broadcast booleans fail
    mixed_int_ops = False  # MXNet 1.9.1: int32 <= int64 fails ("Type inconsistent")
    kernel_call_cost = 32768  # (each operator call goes through MXNet's engine)

    def asarray(self, x, dtype=None, device=None):
        if isinstance(x, mnp.ndarray):
            x = x if dtype is None else x.astype(dtype)
            return x if device is None else x.as_in_ctx(device)
        x = np.asarray(x)
        return mnp.array(x, dtype=dtype or x.dtype, ctx=device)

    def may_differentiate(self, x):
        return autograd.is_recording()

    is_differentiated = may_differentiate

    def to_numpy(self, x):
        if x.size == 0:  # asnumpy() fails on an empty array never written
            return np.zeros(x.shape, np.dtype(x.dtype))
        return x.asnumpy()

    def astype(self, x, dtype):
        return x.astype(dtype, copy=False)

    def arange(self, n, device=None):
        return mnp.arange(n, dtype="int32", ctx=device)

    def zeros(self, shape, dtype, device=None):
        return mnp.zeros(shape, dtype=dtype, ctx=device)

    def matmul(self, a, b, transpose_b=False):
        if _cpu_half(a):
            return self.matmul(a.astype("float32"), b.astype("float32"), transpose_b).astype(
                a.dtype
            )
        return npx.batch_dot(a, b, transpose_b=transpose_b)

    def linear(self, x, weight, bias=None):
        # (each .shape or .size is a C call here: small calls pay for each)
        if 0 in x.shape:  # fully_connected corrupts memory on empty inputs
            out = mnp.zeros(tuple(x.shape[:-1]) + (weight.shape[0],), dtype=x.dtype, ctx=x.ctx)
            out = out + mnp.sum(x.reshape((0,)))  # (0: keeps autograd's graph)
            return out if bias is None else out + bias
        if _cpu_half(x):
            weight = weight.astype("float32")
            bias = bias if bias is None else bias.astype("float32")
            return self.linear(x.astype("float32"), weight, bias).astype(x.dtype)
        return npx.fully_connected(
            x, weight, bias, num_hidden=weight.shape[0], no_bias=bias is None, flatten=False
        )

    def softmax(self, x, axis=-1):
        # npx.softmax leaves a row's other entries finite when one is NaN (or
        # +inf); make the whole row NaN, as the other frameworks do: the row's
        # max is NaN or inf there (0 * it is NaN), finite elsewhere (3 operators,
        # not 4: small calls pay for each).
        return npx.softmax(x, axis=axis) + 0 * mnp.max(x, axis=axis, keepdims=True)

    def softmax_before_product(self, x, axis=-1):
        return npx.softmax(x, axis=axis)  # (a NaN row keeps its NaN entry: nan_rows)

    def nan_rows(self, weights, axis=-1):
        return weights + 0 * mnp.max(weights, axis=axis, keepdims=True)

    def below_lengths(self, x, keep, lens, value, axis):
        # (SequenceMask's value is a float32: only values exact there; a few
        # operators more than one where: for small arrays where is cheaper)
        shape = x.shape  # (one C call)
        if not _exact_in_float32(value) or math.prod(shape) < _SEQUENCE_MASK_MIN:
            return self.where(keep() if callable(keep) else keep, x, value)
        batch, last = shape[0], shape[-1]
        per = math.prod(shape[1:-2])  # heads, or 1 (a Python int: np.prod costs 5 µs)
        if axis == -2:  # rows of keys or values: below the batch element's longest
            lens = mnp.max(lens, axis=1) if lens.ndim == 2 else lens
            rows = mnp.repeat(lens, per) if per > 1 else lens
            x = x.reshape(batch * per, shape[-2], last)
        else:  # scores: each query's row below its own length
            queries = shape[-2]
            if lens.ndim == 1:
                rows = mnp.repeat(lens, per * queries)
            else:
                lens = lens.reshape(batch, 1, queries)
                if per > 1:
                    lens = mnp.broadcast_to(lens, (batch, per, queries))
                rows = lens.reshape(-1)
            x = x.reshape(-1, last)
        out = npx.sequence_mask(x, rows, use_sequence_length=True, value=value, axis=1)
        return out.reshape(shape)

    def logical_and(self, a, b):
        # MXNet 1.9.1 has no logical_and, and & on booleans fails on some shapes
        return (a.astype("int8") * b.astype("int8")).astype("bool")

    def where(self, condition, x, y):
        # MXNet 1.9.1's where() with a scalar operand sends the other operand's
        # gradient to the wrong positions (apache/mxnet#17893); 0-d arrays do not.
        like = x if isinstance(x, mnp.ndarray) else y
        x, y = (v if isinstance(v, mnp.ndarray) else _scalar(v, like) for v in (x, y))
        return mnp.where(condition, x, y)

    def fused_attention(
        self, queries, keys, values, mask: MaskView, scale, memory_budget=None, dropout=0.0
    ):
        """``npx.batch_dot`` and plain ``npx.softmax``, the mask added to the
        scores as the core's additive mask. Per-batch lengths on large inputs
        are folded into the first product as an extra feature instead
        (``[scale q, 1] . [k, additive]``), which skips the pass over the
        scores. (On the CPU, MXNet 1.9.1's softmax with ``length=`` or
        ``temperature=`` and broadcast ``where`` are several times slower.)
        Materializes the scores, so it declines when they would not fit in
        ``memory_budget``; declines with dropout (the core's paths have it)."""
        batch, heads, num_q, _ = queries.shape
        num_k = keys.shape[2]
        if dropout or (
            memory_budget is not None
            # (under autograd.record() its intermediates are held: about four score-sized)
            and batch * heads * num_q * num_k * 4 * (4 if autograd.is_recording() else 1)
            > memory_budget
        ):
            return None
        dtype = queries.dtype
        if dtype == np.float16:  # no float16 dot on the CPU; accumulate in float32
            queries, keys, values = (x.astype("float32") for x in (queries, keys, values))
        if keys.shape[1] != heads:
            keys, values = (mnp.repeat(x, heads // keys.shape[1], axis=1) for x in (keys, values))
        queries = queries * scale
        work = np.dtype(queries.dtype).name
        additive = mask.additive(self, work, keys.ctx)
        if (
            additive is not None
            and mask.per_batch_lens is not None
            and batch * heads * num_q * num_k >= _FOLD_MIN_SCORES
        ):
            column = mnp.broadcast_to(
                mnp.transpose(additive, (0, 1, 3, 2)), tuple(keys.shape[:-1]) + (1,)
            )
            out = self._softmax_product(
                _append_feature(queries, 1.0), _append_feature(keys, column), values
            )
        else:
            out = self._softmax_product(queries, keys, values, additive)
        return out.astype(dtype, copy=False)

    @staticmethod
    def _softmax_product(queries, keys, values, bias=None):
        scores = npx.batch_dot(queries, keys, transpose_b=True)
        if bias is not None:
            scores = scores + bias
        return npx.batch_dot(npx.softmax(scores, axis=-1), values)

    def write_slice(self, buffer, update, start, axis):
        """Out of place by concatenation (slice assignment is in place, which
        ``autograd.record()`` refuses); empty pieces are left out (MXNet 1.9.1
        mishandles some zero-size arrays)."""
        start = int(start)
        stop = start + update.shape[axis]
        index = [slice(None)] * len(buffer.shape)
        parts = []
        for lo, hi, piece in ((0, start, None), (start, stop, update), (stop, None, None)):
            size = (buffer.shape[axis] if hi is None else hi) - lo
            if size > 0:
                index[axis] = slice(lo, hi)
                parts.append(buffer[tuple(index)] if piece is None else piece)
        return parts[0] if len(parts) == 1 else mnp.concatenate(parts, axis=axis)

    def device(self, kind, index=0):
        if kind == "cpu":
            return mx.cpu()
        count = mx.context.num_gpus()
        if index >= count:
            raise ValueError(
                f"device cuda:{index} is not available to the mxnet backend ({count} GPUs found)"
            )
        return mx.gpu(index)

    def device_of(self, x):
        return x.ctx

    def to_device(self, x, device):
        return x if device is None else x.as_in_ctx(device)

    def on_accelerator(self, device):
        return device is not None and device.device_type != "cpu"

    def uniform(self, shape, low, high, dtype="float32", device=None):
        return mnp.random.uniform(low, high, size=shape, ctx=device).astype(dtype)

    def seed(self, n):
        mx.random.seed(n)

    def _dropout(self, x, p):
        keep = mnp.random.uniform(0, 1, size=x.shape, ctx=x.ctx) >= p
        scale = 1.0 / (1 - p) if p < 1 else 0.0  # p = 1: every element dropped
        return mnp.where(keep, x * scale, mnp.zeros((), dtype=x.dtype, ctx=x.ctx))

    def gradients(self, loss_fn, module, *inputs):
        params = module._collect_params_with_prefix()
        for p in params.values():  # what the loss does not use gets zeros
            for g in p.list_grad():  # (Parameter.zero_grad fails in NumPy mode)
                if g.size:
                    g[:] = 0
        inputs = [x.copy() for x in inputs]
        for x in inputs:
            x.attach_grad()
            if x.size:
                x.grad[:] = 0
        with autograd.record():
            loss = loss_fn(module, *inputs)
        loss.backward()
        return (float(loss), {n: p.grad() for n, p in params.items()}, [x.grad for x in inputs])
