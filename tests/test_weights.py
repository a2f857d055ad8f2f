"""``attention_weights``: those of the call that produced them, whatever the
caller writes into its arrays afterwards; a module whose weights are read
computes them in the same pass on its next call."""

import contextlib

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle

TOL = dict(rtol=1e-5, atol=1e-6)
RNG = np.random.default_rng(3)
# (large enough that a forced "fused" without a kernel falls back to the tiles)
Q, K, V = (
    RNG.standard_normal(s).astype(np.float32) for s in ((2, 64, 4), (2, 256, 4), (2, 256, 5))
)
LENS = np.array([2, 200])
MASK = RNG.random((2, 64, 256)) > 0.4
MASK[:, :, 0] = True


def _torch():
    import torch

    return torch


ARRAYS = {
    "numpy": lambda x: x.copy(),
    "torch": lambda x: _torch().tensor(x),
}


@pytest.mark.parametrize("name", ["numpy", "torch-inference"])
@pytest.mark.parametrize("path", ["fused", "tiled", "chunked"])
def test_weights_are_those_of_the_call(name, path):
    """Writes into the queries, keys, lengths or mask after the call leave
    the reported weights as they were (they come from copies: NumPy, and
    torch tensors made under ``inference_mode``, which count no writes)."""
    name, _, inference = name.partition("-")
    pytest.importorskip(name)
    with _torch().inference_mode() if inference else contextlib.nullcontext():
        _check_weights_survive_writes(name, path)


def _check_weights_survive_writes(name, path):
    a = ARRAYS[name]
    for form in ("lens", "mask"):
        m = am.DotProductAttention(0.0, backend=name, path=path).eval()
        q, k, v, lens, mask = a(Q), a(K), a(V), a(LENS), a(MASK)
        if form == "lens":
            m(q, k, v, lens)
            expected = oracle.dot_product_attention(Q, K, V, LENS)[1]
        else:
            m(q, k, v, mask=mask)
            w = oracle.attention(Q[:, None], K[:, None], V[:, None], mask=MASK[:, None])[1]
            expected = w[:, 0]
        assert m.last_path != "full"  # (weights computed on reading)
        q[:] = 0
        k[:] = 0
        lens[:] = 1
        mask[:] = True
        got = m.attention_weights
        np.testing.assert_allclose(np.asarray(got), expected, **TOL)


@pytest.mark.parametrize("path", ["fused", "tiled", "chunked"])
def test_torch_keeps_its_inputs_and_refuses_a_read_after_a_write(path):
    """torch keeps the tensors themselves (no copy: a parallel region on a
    busy CPU) with their version counters; a read after an in-place write
    raises, as autograd does for what it saved, and one before it is right."""
    torch = pytest.importorskip("torch")
    m = am.DotProductAttention(0.0, backend="torch", path=path).eval()
    q, k, v, lens = (torch.tensor(x) for x in (Q, K, V, LENS))
    expected = oracle.dot_product_attention(Q, K, V, LENS)[1]
    m(q, k, v, lens)
    np.testing.assert_allclose(m.attention_weights.numpy(), expected, **TOL)
    m(q, k, v, lens)
    assert m.last_path != "full"
    with torch.inference_mode():  # (writes under inference_mode count too)
        k.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified in place since"):
        m.attention_weights  # noqa: B018
    lens[:] = 1  # (the lengths are copied: small)
    m(q, k, v, torch.tensor(LENS))
    m.attention_weights  # noqa: B018


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_read_weights_are_computed_in_the_same_pass(name):
    """Past the small calls (``Costs.small_scores``), "auto" takes another
    path; once the weights of a call are read, the next call takes the full
    path (which keeps them), and a call whose weights nobody read lets the
    one after it go back."""
    pytest.importorskip(name)
    a = ARRAYS[name]
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((32, 128, 16)).astype(np.float32) for _ in range(3))
    lens = rng.integers(32, 129, 32)
    m = am.DotProductAttention(0.0, backend=name).eval()
    m(a(q), a(k), a(v), a(lens))
    other = m.last_path
    assert other != "full"
    expected = oracle.dot_product_attention(q, k, v, lens)[1]
    np.testing.assert_allclose(np.asarray(m.attention_weights), expected, **TOL)
    m(a(q), a(k), a(v), a(lens))
    assert m.last_path == "full"
    np.testing.assert_allclose(np.asarray(m.attention_weights), expected, **TOL)
    m(a(q), a(k), a(v), a(lens))
    assert m.last_path == "full"  # (read again above)
    m(a(q), a(k), a(v), a(lens))  # not read after the last call
    assert m.last_path == other


def test_jax_weights_of_a_jitted_call():
    """Under ``jax.jit`` the weights are read inside the trace and returned
    (the oracle's); the module passed in keeps its eager call's weights; one
    the trace closed over says why it has none, instead of leaking a tracer."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q = jnp.asarray(Q)
    m = am.DotProductAttention(0.0, backend="jax").eval()
    m(q, q, q, jnp.asarray([2, 64]))
    eager = np.asarray(m.attention_weights)
    lens = np.array([5, 7])
    _, got = jax.jit(lambda mod, x, n: (mod(x, x, x, n), mod.attention_weights))(m, q, lens)
    _, want = oracle.attention(Q[:, None], Q[:, None], Q[:, None], valid_lens=lens)
    np.testing.assert_allclose(np.asarray(got), want[:, 0], **TOL)
    np.testing.assert_array_equal(np.asarray(m.attention_weights), eager)
    jax.jit(lambda x, n: m(x, x, x, n))(q, lens)
    with pytest.raises(RuntimeError, match="under a trace .* that has ended"):
        _ = m.attention_weights
