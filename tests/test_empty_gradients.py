"""A call in which no query may see any key (all lengths 0, a window or a
causal offset that leaves nothing) returns zeros that stay in the autodiff
graph: ``backward`` works and every gradient (inputs, projections) is a
finite zero, on every path and backend with autodiff, at sizes that take
the tiled and chunked paths."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi.backends.capabilities import Autodiff, supports

PATHS = ("auto", "fused", "tiled", "chunked", "full")
T, D = 256, 8
FORMS = {
    "lens0": lambda B: dict(valid_lens=B.asarray(np.zeros(2, np.int32))),
    "lens0_2d": lambda B: dict(valid_lens=B.asarray(np.zeros((2, T), np.int32))),
}


def _inputs(B):
    rng = np.random.default_rng(0)
    return [B.asarray(rng.normal(size=(2, T, D)), "float32") for _ in range(3)]


def _grads_all_zero(B, grads):
    for g in grads:
        assert g is not None
        g = B.to_numpy(g)
        assert np.isfinite(g).all() and (g == 0).all()


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("path", PATHS)
def test_dot_product_attention_that_sees_nothing_has_zero_gradients(backend, path, form):
    if not supports(backend, Autodiff):
        pytest.skip(f"the {backend.name} backend has no autodiff")
    m = am.DotProductAttention(0.0, backend=backend, path=path)
    options = FORMS[form](backend)
    lens = options.pop("valid_lens", None)

    assert (backend.to_numpy(m(*_inputs(backend), lens, **options)) == 0).all()

    def loss(module, q, k, v):
        out = module(q, k, v, lens, **options)
        return backend.sum((out * out + out).reshape((-1,)), 0)

    _, _, grads = backend.gradients(loss, m, *_inputs(backend))
    _grads_all_zero(backend, grads)


@pytest.mark.parametrize("path", PATHS)
def test_multi_head_attention_that_sees_nothing_has_zero_gradients(backend, path):
    if not supports(backend, Autodiff):
        pytest.skip(f"the {backend.name} backend has no autodiff")
    m = am.MultiHeadAttention(D, D, D, 16, 2, 0.0, backend=backend, path=path)
    lens = backend.asarray(np.zeros(2, np.int32))

    def loss(module, q, k, v):
        out = module(q, k, v, lens)
        return backend.sum((out * out).reshape((-1,)), 0)

    _, params, grads = backend.gradients(loss, m, *_inputs(backend))
    _grads_all_zero(backend, grads)
    names = [n for n in params if n.split(".")[0] in ("W_q", "W_k", "W_v")]
    assert names
    _grads_all_zero(backend, [params[n] for n in names])
