"""attention_multi.integrations.flax as the attention_fn of flax nnx's
MultiHeadAttention, against flax's own dot_product_attention: masks (boolean
and float), several batch dimensions, bias, causal, GQA, dropout, sown
weights, under jax.jit, jax.grad, nnx.jit and decode=True."""

import inspect

import pytest

from conftest import import_or_skip

flax = import_or_skip("flax")
jax = import_or_skip("jax")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from attention_multi.integrations.flax import dot_product_attention as ours  # noqa: E402

TOL = 2e-5


def layers(**options):
    def make(fn):
        return nnx.MultiHeadAttention(
            num_heads=4, in_features=16, qkv_features=32, rngs=nnx.Rngs(0), attention_fn=fn,
            **{"decode": False, **options},
        )  # fmt: skip

    return make(nnx.dot_product_attention), make(ours)


def inputs(shape=(2, 3, 7, 16), seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)  # (under x64 too)


def padding(batch=(2, 3), length=7):
    lens = jnp.arange(1, 1 + int(jnp.prod(jnp.array(batch)))).reshape(batch) % length + 1
    return jnp.arange(length) < lens[..., None]


def close(a, b, keep=None):
    diff = a - b if keep is None else jnp.where(keep, a - b, 0)
    return float(jnp.abs(diff).max()) <= TOL


def test_signature_is_flax_s():
    assert list(inspect.signature(ours).parameters) == list(
        inspect.signature(nnx.dot_product_attention).parameters
    )
    for name, p in inspect.signature(nnx.dot_product_attention).parameters.items():
        assert inspect.signature(ours).parameters[name].default == p.default, name


@pytest.mark.parametrize("dtype", ["bool", "float32"])
def test_padding_masks_under_jit_and_grad(dtype):
    theirs, mine = layers()
    x, pad = inputs(), padding()
    mask = nnx.make_attention_mask(pad, pad, dtype=jnp.dtype(dtype))
    keep = pad[..., None]  # (a padded query sees no key: zeros here, flax's mean there)
    assert close(theirs(x, mask=mask), mine(x, mask=mask), keep)

    def loss(model, x):
        return jnp.sum(jnp.where(keep, model(x, mask=mask), 0) ** 2)

    for transform in (nnx.jit(nnx.grad(loss)), nnx.grad(loss)):
        want, got = transform(theirs, x), transform(mine, x)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            assert close(a, b)


def test_functional_jax_jit_grad_bias_causal():
    g = jax.random.split(jax.random.key(2), 4)
    q = jax.random.normal(g[0], (2, 9, 4, 8))
    k, v = (jax.random.normal(x, (2, 9, 2, 8)) for x in g[1:3])  # GQA: 2 kv heads
    bias = 0.3 * jax.random.normal(g[3], (1, 4, 9, 9))
    causal = nnx.make_causal_mask(jnp.ones((2, 9)))

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, bias=bias, mask=causal) ** 2)

    for wrt in range(1, 4):
        grad = jax.jit(jax.grad(loss, argnums=wrt), static_argnums=0)
        for a, b in zip(
            jax.tree.leaves(grad(nnx.dot_product_attention, q, k, v)),
            jax.tree.leaves(grad(ours, q, k, v)),
        ):
            assert close(a, b)


@pytest.mark.parametrize("num_q, num_k", [(7, 7), (3, 7), (7, 3)])
def test_is_causal_top_left(num_q, num_k):
    x = inputs((2, 7, 1, 8))
    q, k = x[:, :num_q], x[:, :num_k]
    want = nnx.dot_product_attention(q, k, k, is_causal=True)
    assert close(want, ours(q, k, k, is_causal=True))


def test_no_batch_dimensions_and_many():
    x = inputs((7, 2, 8))
    assert close(nnx.dot_product_attention(x, x, x), ours(x, x, x))
    y = inputs((2, 2, 3, 5, 2, 8))
    assert close(nnx.dot_product_attention(y, y, y), ours(y, y, y))


def test_decode_with_cache():
    theirs, mine = layers(decode=True)
    x = inputs((2, 6, 16))
    outs = []
    for model in (theirs, mine):
        model.init_cache(x.shape)
        step = nnx.jit(lambda m, xt: m(xt))
        outs.append(jnp.concatenate([step(model, x[:, t : t + 1]) for t in range(6)], axis=1))
    assert close(*outs)


def test_sown_weights():
    theirs, mine = layers()
    x, pad = inputs(), padding()
    mask = nnx.make_attention_mask(pad, pad)
    _, sown_theirs = nnx.capture(theirs, nnx.Intermediate)(x, mask=mask, sow_weights=True)
    _, sown_mine = nnx.capture(mine, nnx.Intermediate)(x, mask=mask, sow_weights=True)
    (want,) = jax.tree.leaves(sown_theirs)
    (got,) = jax.tree.leaves(sown_mine)
    assert want.shape == got.shape == (2, 3, 4, 7, 7)
    assert close(want, got, pad[..., None, :, None])


def test_dropout_arguments():
    theirs, mine = layers(dropout_rate=0.5)
    x = inputs()
    assert close(theirs(x, deterministic=True), mine(x, deterministic=True))
    first = mine(x, deterministic=False, rngs=nnx.Rngs(dropout=3))
    again = mine(x, deterministic=False, rngs=nnx.Rngs(dropout=3))
    assert close(first, again)
    assert float(jnp.abs(first - mine(x, deterministic=True)).max()) > 1e-3
    with pytest.raises(ValueError, match="dropout_rng"):
        ours(x[..., None, :], x[..., None, :], x[..., None, :], dropout_rate=0.5)
