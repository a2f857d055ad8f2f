"""JAX backend: modules are pytrees whose leaves are exactly their parameters."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .base import Backend, PlainModule, np_dtype


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


@functools.partial(jax.jit, static_argnums=4)
def _fused_attention(queries, keys, values, lens, scale):
    dtype = queries.dtype
    if dtype in (jnp.float16, jnp.bfloat16):   # (no half dot on the CPU)
        queries, keys, values = (x.astype(jnp.float32) for x in (queries, keys, values))
    three_d = queries.ndim == 3
    if three_d:   # (N, n, d) -> (N, n, 1, d): a reshape, no copy
        q, k, v = (x[:, :, None, :] for x in (queries, keys, values))
    else:
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (queries, keys, values))
    options = {}
    if lens is not None:
        positions = jnp.arange(k.shape[1], dtype=jnp.int32)
        longest = lens if lens.ndim == 1 else jnp.max(lens, axis=1)
        used = positions[None, :, None, None] < longest[:, None, None, None]
        v = jnp.where(used, v, jnp.zeros((), v.dtype))
        if lens.ndim == 1:
            options["key_value_seq_lengths"] = lens
        else:
            options["mask"] = (positions < lens[:, :, None])[:, None]
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, **options)
    if lens is not None:   # no valid key: zeros, not the mean of the values
        has_keys = (lens > 0)[:, None, None, None] if lens.ndim == 1 else \
            (lens > 0)[:, :, None, None]
        out = jnp.where(has_keys, out, jnp.zeros((), out.dtype))
    out = out.astype(dtype)
    return out[:, :, 0, :] if three_d else jnp.swapaxes(out, 1, 2)


class JaxBackend(Backend):
    name = "jax"
    autodiff = True
    module_base = JaxModule

    def _register_class(self, cls):
        jax.tree_util.register_pytree_node(cls, cls._tree_flatten, cls._tree_unflatten)

    def is_array(self, x):
        return isinstance(x, jax.Array)

    def is_concrete(self, x):
        return not isinstance(x, jax.core.Tracer)

    def asarray(self, x, dtype=None, device=None):
        if dtype == "float64" and not jax.config.jax_enable_x64:
            raise TypeError("float64 on the jax backend needs "
                            "jax.config.update('jax_enable_x64', True) first")
        x = jnp.asarray(x, dtype=None if dtype is None else np_dtype(dtype))
        return x if device is None else jax.device_put(x, device)

    def to_numpy(self, x):
        return np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)

    def arange(self, n, device=None):
        return jnp.arange(n, dtype=jnp.int32)

    def dtype_name(self, x):
        return jnp.dtype(x.dtype).name

    def astype(self, x, dtype):
        return x.astype(np_dtype(dtype))

    def matmul(self, a, b, transpose_b=False):
        return jnp.matmul(a, jnp.swapaxes(b, -1, -2) if transpose_b else b)

    def linear(self, x, weight, bias=None):
        out = x @ weight.T
        return out if bias is None else out + bias

    def softmax(self, x, axis=-1):
        return jax.nn.softmax(x, axis=axis)

    def where(self, condition, x, y):
        return jnp.where(condition, x, y)

    def exp(self, x):
        return jnp.exp(x)

    def tanh(self, x):
        return jnp.tanh(x)

    def max(self, x, axis, keepdims=False):
        return jnp.max(x, axis=axis, keepdims=keepdims)

    def sum(self, x, axis, keepdims=False):
        return jnp.sum(x, axis=axis, keepdims=keepdims)

    def repeat(self, x, repeats, axis):
        return jnp.repeat(x, repeats, axis=axis)

    def transpose(self, x, axes):
        return jnp.transpose(x, axes)

    def concatenate(self, xs, axis):
        return jnp.concatenate(list(xs), axis=axis)

    def fused_attention(self, queries, keys, values, lens, scale, memory_budget=None):
        """``jax.nn.dot_product_attention`` in its (batch, n, heads, d) layout,
        lengths as ``key_value_seq_lengths`` (per-query lengths as a mask),
        as one jitted function (eager calls run one compiled program).
        Its XLA implementation materializes the scores, so it declines (None)
        when they would not fit in ``memory_budget``. It also declines when
        values and queries differ in feature size (JAX requires them equal)
        and for float64 (it computes the scores in float32)."""
        *lead, num_q, _ = queries.shape
        num_k = keys.shape[-2]
        if not hasattr(jax.nn, "dot_product_attention") or \
                values.shape[-1] != queries.shape[-1] or queries.dtype == jnp.float64 or (
                    memory_budget is not None and
                    int(np.prod(lead)) * num_q * num_k * 4 > memory_budget):
            return None
        return _fused_attention(queries, keys, values, lens, float(scale))
    def enable_float64(self):
        jax.config.update("jax_enable_x64", True)

    def dropout_key(self, seed):
        return jax.random.PRNGKey(seed)

    def fold_key(self, key, index):
        return key if key is None or index is None else jax.random.fold_in(key, index)

    def device(self, kind, index=0):
        if kind == "cuda":
            try:
                gpus = jax.devices("gpu")
            except RuntimeError:
                gpus = []
            if index >= len(gpus):
                raise ValueError(f"device cuda:{index} is not available to the jax "
                                 f"backend ({len(gpus)} GPU devices found)")
            return gpus[index]
        return super().device(kind, index)

    def _cpu_device(self):
        return jax.devices("cpu")[0]

    def device_of(self, x):
        return next(iter(x.devices())) if self.is_concrete(x) else None

    def to_device(self, x, device):
        return x if device is None else jax.device_put(x, device)

    def uniform(self, shape, low, high, dtype="float32", device=None):
        # Drawn by NumPy's global generator (np.random.seed applies): no JAX
        # key to thread through construction, and no compile per shape.
        x = np.random.uniform(low, high, size=shape).astype(np_dtype(dtype))
        return self.asarray(x, device=device)

    def dropout(self, x, p, key=None):
        if key is None:
            raise ValueError(
                "dropout in training mode on the jax backend needs an explicit "
                "PRNG key: call module(..., key=jax.random.PRNGKey(0)), or "
                "module.eval() to turn dropout off")
        keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
        return jnp.where(keep, x / (1.0 - p), jnp.zeros((), x.dtype))

    def value_and_grad(self, module, loss_fn):
        loss, grads = jax.value_and_grad(loss_fn)(module)
        return float(loss), grads.named_arrays()
