"""Jitted JAX gradients through the block loops (``jax.jit(jax.grad(...))``,
the way JAX trains) against the float64 oracle's gradient formulas: the full
blocks of keys run as one ``lax.scan`` (``Blocks.sequential_scan``), lengths
known or traced. Peak memory is measured by the bench (``bench --memory``);
here, what the compiled gradient holds."""

import numpy as np
import pytest

from attention_multi import reference as oracle
from attention_multi.core import attend, make_mask

jax = pytest.importorskip("jax")
jnp = jax.numpy

BATCH, HEADS, NQ, NK, D = 2, 2, 90, 100, 8
LENS = np.array([37, 100])
FORMS = {
    "none": {},
    "lens": {"valid_lens": LENS},
    "causal": {"causal": True},
    "window": {"window": (20, 3)},
    "lens-causal": {"valid_lens": LENS, "causal": True},
}


def _check(form, traced, path, chunk_size):
    import attention_multi as am

    B = am.get_backend("jax")
    rng = np.random.default_rng(3)
    q = rng.standard_normal((BATCH, HEADS, NQ, D))
    k = rng.standard_normal((BATCH, HEADS, NK, D))
    v = rng.standard_normal((BATCH, HEADS, NK, D))
    g = rng.standard_normal((BATCH, HEADS, NQ, D))
    options = FORMS[form]
    lens = options.get("valid_lens")
    rest = {n: x for n, x in options.items() if n != "valid_lens"}

    def loss(q, k, v, lens_arg):
        if lens is not None:  # a constant inside the jitted function, or an argument
            lens_arg = lens_arg if traced else jnp.asarray(lens, jnp.int32)
        mask = make_mask(B, BATCH, HEADS, NQ, NK, valid_lens=lens_arg, **rest)
        out, _, _, _ = attend(B, q, k, v, mask, path=path, chunk_size=chunk_size)
        return (out * jnp.asarray(g, jnp.float32)).sum()

    arrays = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    lens_arg = None if lens is None else jnp.asarray(lens, jnp.int32)
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*arrays, lens_arg)
    want = oracle.attention_gradients(q, k, v, g, lens, **rest)[:3]
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(a), b, rtol=2e-4, atol=2e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.second_stack
@pytest.mark.parametrize("form", FORMS)
def test_jitted_gradient_chunked(form):
    """Chunked path, blocks of 16: five full blocks scanned, one short one."""
    _check(form, traced=False, path="chunked", chunk_size=16)


@pytest.mark.second_stack
@pytest.mark.parametrize("form", ["lens", "lens-causal"])
def test_jitted_gradient_traced_lengths(form):
    """Lengths as an argument of the jitted function: the traced tiled path
    scans its blocks of keys, skipping at run time those no query sees."""
    _check(form, traced=True, path="auto", chunk_size=16)


@pytest.mark.second_stack
def test_jitted_gradient_counts_what_its_backward_holds():
    """Under ``jax.jit(jax.grad(...))`` a materialized softmax holds about
    four score-sized arrays for the backward pass: "auto" counts them against
    ``memory_budget``. At T=4096 (512 MiB of scores, 8 heads) the compiled
    gradient of ``MultiHeadAttention`` needs at most twice the scores (it
    took 2060 MiB when the budget counted the forward only)."""
    import attention_multi as am

    T = 4096
    m = am.MultiHeadAttention(
        256, 8, 0.0, key_size=256, query_size=256, value_size=256, backend="jax"
    ).eval()
    x = jnp.zeros((1, T, 256), jnp.float32)
    grad = jax.jit(jax.grad(lambda m, x: (m(x, x, x) ** 2).mean()))
    held = grad.lower(m, x).compile().memory_analysis().temp_size_in_bytes
    scores = 8 * T * T * 4
    assert held <= 2 * scores, f"{held / 2**20:.0f} MiB held for {scores / 2**20:.0f} MiB of scores"
