"""JAX backend: modules are pytrees whose leaves are exactly their parameters."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import jax_module
from .numpy_like import NumpyLike, np_dtype
from .protocol import MaskView

try:  # no public spelling of "is anything being traced"
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:  # pragma: no cover - a JAX without it: inputs' tracers still tell

    def _trace_state_clean():
        return True


@functools.partial(jax.jit, static_argnames=("scale", "is_causal"))
def _dot_product_attention(q, k, v, lens, mask, bias, scale, is_causal):
    """``jax.nn.dot_product_attention`` on (batch, heads, n, d) arrays, in
    float32 for half precision (no half dot on the CPU)."""
    dtype = q.dtype
    if dtype in (jnp.float16, jnp.bfloat16):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # its (batch, n, heads, d)
    with jax.default_matmul_precision("highest"):  # (float32 products, not TF32 on a GPU)
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias=bias,
            mask=mask,
            scale=scale,
            is_causal=is_causal,
            key_value_seq_lengths=lens,
        )
    return jnp.swapaxes(out, 1, 2).astype(dtype)


_HIGHEST = jax.lax.Precision.HIGHEST
_DIFFERENTIATING = frozenset(("JVPTracer", "LinearizeTracer"))  # jax 0.6; 0.7 and later
_TREES: set[type] = set()  # classes registered by register_tree (once per process)
# NumPy dtypes a JAX array holds as they are (float64 and int64 only under x64)
_HELD = frozenset(np.dtype(t) for t in ("bool", "int8", "uint8", "int32", "float16", "float32"))


class JaxBackend(NumpyLike):
    name = "jax"
    xp = jnp
    array_type = jax.Array
    module_base = jax_module.JaxModule
    fused_keeps_nan = True  # (jax.nn.dot_product_attention masks by select)
    runtime_cond = True
    compiles_per_shape = True
    sequential_scan = True
    traced_values_end = True  # (tracers: a module keeps none past jax.jit)
    host_masks = True  # (eager, each operation compiles at a new shape)
    host_mask_min_size = 0

    def register_class(self, cls):
        jax_module.register(cls)

    # Products at the inputs' precision: a GPU's default for float32 is TF32
    # (10 mantissa bits), 2e-4 from the float64 oracle in a multi-head layer.
    def matmul(self, a, b, transpose_b=False):
        return jnp.matmul(a, jnp.swapaxes(b, -1, -2) if transpose_b else b, precision=_HIGHEST)

    def linear(self, x, weight, bias=None):
        out = jnp.matmul(x, weight.T, precision=_HIGHEST)
        return out if bias is None else out + bias

    def is_concrete(self, x):
        return not isinstance(x, jax.core.Tracer)

    def is_tracing(self):
        return not _trace_state_clean()

    def snapshot(self, x):
        return x  # (JAX arrays are immutable)

    def asarray(self, x, dtype=None, device=None):
        if dtype == "float64" and not jax.config.jax_enable_x64:
            raise TypeError(
                "float64 on the jax backend needs jax.config.update('jax_enable_x64', True) first"
            )
        want = None if dtype is None else np_dtype(dtype)
        if isinstance(x, np.ndarray) and x.dtype in _HELD and (want is None or want == x.dtype):
            if _trace_state_clean():  # (a copy to the device: no program to compile per shape)
                return jax.device_put(x, device, may_alias=False)
        x = jnp.asarray(x, dtype=want)
        return x if device is None else jax.device_put(x, device)

    def arange(self, n, device=None):
        if _trace_state_clean():  # (made on the host: no iota to compile per length)
            return jax.device_put(np.arange(n, dtype=np.int32), device, may_alias=False)
        return super().arange(n, device)

    def to_numpy(self, x):
        return np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)

    def host_sum(self, x):
        """On the CPU NumPy's sum of the array (no program compiled per shape)."""
        if x.dtype in (jnp.float32, jnp.float64) and not self.on_accelerator(self.device_of(x)):
            return float(np.sum(np.asarray(x)))
        return super().host_sum(x)

    def enable_float64(self):
        jax.config.update("jax_enable_x64", True)

    def is_differentiated(self, x):
        # (inside jax.grad, jax.vjp, value_and_grad, also under jit: JVP or
        # linearize tracers; a plain jit trace may still be differentiated later)
        return any(c.__name__ in _DIFFERENTIATING for c in type(x).__mro__)

    def softmax(self, x, axis=-1):
        return jax.nn.softmax(x, axis=axis)

    def fused_attention(
        self, queries, keys, values, mask: MaskView, scale, memory_budget=None, dropout=0.0
    ):
        """``jax.nn.dot_product_attention``, jitted: per-batch lengths as
        ``key_value_seq_lengths``, top-left causal as ``is_causal``, anything
        else as a boolean ``mask`` (a window too: jax 0.6.2 ignores
        ``local_window_size`` unless another mask is given) and ``bias``.
        Its XLA implementation materializes the scores, so it declines when
        they would not fit in ``memory_budget`` (four times over under
        autodiff, which holds them for the backward pass); also when values and queries
        differ in feature size (JAX requires them equal), for float64 (it
        computes the scores in float32) and with dropout (it has none)."""
        batch, heads, num_q, d = queries.shape
        if (
            dropout
            or values.shape[-1] != d
            or queries.dtype == jnp.float64
            or (
                memory_budget is not None
                # (under autodiff its backward holds about four score-sized arrays)
                and batch
                * heads
                * num_q
                * keys.shape[2]
                * 4
                * (4 if self.is_differentiated(queries) else 1)
                > memory_budget
            )
        ):
            return None
        lens = boolean = bias = None
        is_causal = mask.top_left_causal
        if mask.per_batch_lens is not None:
            lens = mask.per_batch_lens
        elif not is_causal and not mask.unmasked:
            boolean, bias = mask.boolean(self, None), mask.bias
        return _dot_product_attention(
            queries, keys, values, lens, boolean, bias, scale=float(scale), is_causal=is_causal
        )

    def dropout_key(self, seed):
        return jax.random.PRNGKey(seed)

    def write_slice(self, buffer, update, start, axis):
        starts = tuple(
            jnp.asarray(start, jnp.int32) if i == axis else jnp.int32(0)
            for i in range(len(buffer.shape))
        )
        return jax.lax.dynamic_update_slice(buffer, update.astype(buffer.dtype), starts)

    def read_slice(self, x, start, size, axis):
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis)

    def compiled(self, fn):
        return jax.jit(fn)

    def register_tree(self, cls, flatten, unflatten):
        if cls not in _TREES:
            jax.tree_util.register_pytree_node(cls, flatten, unflatten)
            _TREES.add(cls)

    def checkpoint(self, fn, *args):
        return jax.checkpoint(fn)(*args)

    def scan(self, fn, carry, xs):
        return jax.lax.scan(lambda c, x: (fn(c, list(x)), None), carry, list(xs))[0]

    def cond(self, pred, true_fn, false_fn, operand):
        return jax.lax.cond(pred, true_fn, false_fn, operand)

    def vmap(self, fn):
        return jax.vmap(fn)

    def fold_key(self, key, index):
        return key if key is None or index is None else jax.random.fold_in(key, index)

    def ring_exchange(self, group):
        """``jax.lax.ppermute`` over the mesh axis named ``group``, inside
        ``shard_map`` (differentiable); the rank is ``lax.axis_index``."""
        if not isinstance(group, str):
            raise ValueError(
                f"ring attention on jax runs inside shard_map: pass "
                f"axis_name= (the mesh axis the sequence is split "
                f"over), got {group!r}"
            )
        size = jax.lax.psum(1, group)
        perm = [(i, (i + 1) % size) for i in range(size)]
        return (jax.lax.axis_index(group), size, lambda x: jax.lax.ppermute(x, group, perm))

    def device(self, kind, index=0):
        if kind == "cpu":
            return jax.devices("cpu")[0]
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            gpus = []
        if index >= len(gpus):
            raise ValueError(
                f"device cuda:{index} is not available to the jax "
                f"backend ({len(gpus)} GPU devices found)"
            )
        return gpus[index]

    def device_of(self, x):
        """The device of a committed array; None for an uncommitted one (JAX
        places it), so that what is made beside it stays uncommitted too and
        can meet arrays sharded over a mesh (``jax.device_put`` commits)."""
        if not self.is_concrete(x) or not getattr(x, "committed", True):
            return None
        return next(iter(x.devices()))

    def to_device(self, x, device):
        return x if device is None else jax.device_put(x, device)

    def on_accelerator(self, device):
        """A committed array's device, else where JAX places arrays (and
        what ``jit`` compiles for): its default backend."""
        return (jax.default_backend() if device is None else device.platform) != "cpu"

    def dropout(self, x, p, key=None):
        if key is None:
            raise ValueError(
                "dropout in training mode on the jax backend needs an explicit "
                "PRNG key: call module(..., key=jax.random.PRNGKey(0)), or "
                "module.eval() to turn dropout off"
            )
        keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
        scale = 1.0 / (1.0 - p) if p < 1 else 0.0  # p = 1: every element dropped
        return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))

    def gradients(self, loss_fn, module, *inputs):
        argnums = tuple(range(len(inputs) + 1))
        loss, (g_module, *g_inputs) = jax.value_and_grad(loss_fn, argnums)(module, *inputs)
        return float(loss), g_module.named_arrays(), list(g_inputs)
