"""This library as the attention of flax nnx's modules.

```python
from attention_multi.integrations import flax as amf

layer = nnx.MultiHeadAttention(
    num_heads=8, in_features=64, attention_fn=amf.dot_product_attention, rngs=nnx.Rngs(0)
)
```

``dot_product_attention`` has the signature of flax's own
(``flax.nnx.dot_product_attention``, flax 0.12.8) and its layouts: ``query``
(batch..., Q, heads, d), ``key`` and ``value`` (batch..., K, kv_heads, d),
any number of batch dimensions (none too), grouped-query heads; ``mask``
boolean or float (0/1, as ``nnx.make_attention_mask`` and ``combine_masks``
make it: nonzero may attend) and ``bias``, each broadcastable to (batch...,
heads, Q, K); ``is_causal`` (aligned top left, as flax's); it works under
``jax.jit``, ``jax.grad``, ``nnx.jit`` and ``decode=True`` (the cache's mask
is the one the module hands over).

- **Dropout.** ``dropout_rate`` is applied when ``deterministic`` is False,
  with ``dropout_rng`` as the key (required then). Each weight gets its own
  draw: ``broadcast_dropout=True`` (flax's one mask shared by the batch and
  head dimensions) is accepted and not followed; the expected output is the
  same.
- **Weights.** ``module`` (``sow_weights=True``): the weights (batch...,
  heads, Q, K), before dropout, are sown into ``nnx.Intermediate`` as
  ``attention_weights``, as flax does.
- **Precision.** ``precision`` is accepted and not used: the products run
  at XLA's default precision for the dtype (on a CPU, full float32); flax's
  ``jax.nn.dot_product_attention`` path ignores it likewise.
- ``dtype`` and ``promote_dtype`` promote the inputs as flax does; the
  output has the promoted dtype.

**The one difference.** A query that may see no key (a padded position)
gives zeros here; flax averages the values there.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

import attention_multi as am

__all__ = ["dot_product_attention"]


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    broadcast_dropout: bool = True,
    dropout_rng: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Any = dtypes.promote_dtype,
    is_causal: bool = False,
) -> Any:
    """flax's ``attention_fn``: ``query`` (batch..., Q, heads, d), ``key`` and
    ``value`` (batch..., K, kv_heads, d|dv) -> (batch..., Q, heads, dv).
    See the module's docstring for each argument."""
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    if not query.ndim == key.ndim == value.ndim or query.ndim < 3:
        raise ValueError(
            f"query, key and value must have the same rank, at least 3 ((batch..., length, "
            f"heads, depth)), got {query.shape}, {key.shape} and {value.shape}"
        )
    if key.shape[-3] != value.shape[-3]:
        raise ValueError(f"k, v lengths must match, but got {key.shape[-3]} and {value.shape[-3]}.")
    batch = query.shape[:-3]
    num_q, heads, depth = query.shape[-3:]
    num_k = key.shape[-3]
    n = math.prod(batch)

    def heads_first(x: Any) -> Any:  # (batch..., T, H, d) -> (n, H, T, d)
        return jnp.swapaxes(x.reshape((n,) + x.shape[-3:]), 1, 2)

    q, k, v = heads_first(query), heads_first(key), heads_first(value)
    forms: dict[str, Any] = {}
    if mask is not None:
        forms["mask"] = _flat(jnp.asarray(mask).astype(bool), batch, n)
    if bias is not None:
        forms["bias"] = _flat(jnp.asarray(bias).astype(query.dtype), batch, n)
    if is_causal:  # (top left, as flax's: query i sees keys j <= i)
        if num_q == num_k:
            forms["causal"] = True
        elif num_k > num_q:  # (no query sees the keys past the last one)
            k, v = k[:, :, :num_q], v[:, :, :num_q]
            forms = {name: x[..., :num_q] for name, x in forms.items()}
            forms["causal"] = True
        else:
            forms["mask_mod"] = _top_left
    options: dict[str, Any] = {}
    if not deterministic and dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError("dropout_rate > 0 and deterministic=False need a dropout_rng")
        options = {"dropout": float(dropout_rate), "key": dropout_rng}
    out: Any = am.dot_product_attention(q, k, v, **options, **forms)
    if module is not None:  # sow_weights: the weights are those of the identity as values
        eye = jnp.broadcast_to(jnp.eye(k.shape[2], dtype=q.dtype), k.shape[:2] + (k.shape[2],) * 2)
        weights: Any = am.dot_product_attention(q, k, eye, **forms)
        if k.shape[2] != num_k:
            weights = jnp.pad(weights, ((0, 0), (0, 0), (0, 0), (0, num_k - k.shape[2])))
        module.sow(
            nnx.Intermediate, "attention_weights", weights.reshape(batch + weights.shape[1:])
        )
    return jnp.swapaxes(out, 1, 2).reshape(batch + (num_q, heads, value.shape[-1]))


def _flat(x: Any, batch: tuple[int, ...], n: int) -> Any:
    """A mask or bias broadcastable to (batch..., heads, Q, K) as (n or 1, heads or 1, Q, K)."""
    while x.ndim < len(batch) + 3:
        x = x[None]
    lead = x.shape[: x.ndim - 3]
    if all(d == 1 for d in lead):
        return x.reshape((1,) + x.shape[-3:])
    return jnp.broadcast_to(x, batch + x.shape[-3:]).reshape((n,) + x.shape[-3:])


def _top_left(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx <= q_idx
