"""Gradient parity: torch, JAX and MXNet gradients of one scalar loss, with
respect to parameters and inputs, agree with central differences of the
float64 oracle (and so with each other)."""

import functools

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle
from attention_multi.backends.capabilities import Autodiff, supports
from tests.gradients import gradients

SHAPES = {"queries": (2, 3, 4), "keys": (2, 5, 4), "values": (2, 5, 3)}
LENS = {"1d": np.array([2, 5]), "2d": np.array([[1, 3, 5], [0, 2, 4]])}


def setup(mechanism):
    rng = np.random.default_rng(11)
    inputs = [rng.normal(size=s) for s in SHAPES.values()]
    loss_weights = rng.normal(size=(2, 3, 3 if mechanism != "multi_head" else 6))
    if mechanism == "additive":
        params = {
            "W_q.weight": rng.normal(size=(6, 4)),
            "W_k.weight": rng.normal(size=(6, 4)),
            "w_v.weight": rng.normal(size=(1, 6)),
        }
    elif mechanism == "multi_head":
        params = {
            f"W_{c}.{kind}": rng.normal(scale=0.5, size=shape)
            for c, n_in in zip("qkvo", (4, 4, 3, 6))
            for kind, shape in (("weight", (6, n_in)), ("bias", (6,)))
        }
    else:
        params = {}
    return inputs, params, loss_weights


def oracle_loss(mechanism, inputs, params, loss_weights, lens):
    if mechanism == "dot_product":
        out, _ = oracle.dot_product_attention(*inputs, lens)
    elif mechanism == "additive":
        out, _ = oracle.additive_attention(params, *inputs, lens)
    else:
        out, _ = oracle.multi_head_attention(params, *inputs, lens, 2)
    return float((out * loss_weights).sum())


@functools.cache
def numeric_gradients(mechanism, mask):
    inputs, params, R = setup(mechanism)
    lens, eps = LENS[mask], 1e-6
    arrays = {f"input{i}": x for i, x in enumerate(inputs)} | params
    grads = {}
    for name, array in arrays.items():
        grad = np.zeros_like(array)
        for idx in np.ndindex(array.shape):
            saved = array[idx]
            array[idx] = saved + eps
            up = oracle_loss(mechanism, inputs, params, R, lens)
            array[idx] = saved - eps
            down = oracle_loss(mechanism, inputs, params, R, lens)
            array[idx] = saved
            grad[idx] = (up - down) / (2 * eps)
        grads[name] = grad
    return grads


def build(mechanism, backend, params):
    options = dict(backend=backend, dtype="float64")
    module = {
        "dot_product": lambda: am.DotProductAttention(0.0, **options),
        "additive": lambda: am.AdditiveAttention(4, 4, 6, 0.0, **options),
        "multi_head": lambda: am.MultiHeadAttention(4, 4, 3, 6, 2, 0.0, bias=True, **options),
    }[mechanism]()
    return am.set_params(module, params).eval()


@pytest.mark.parametrize("mask", list(LENS))
@pytest.mark.parametrize("mechanism", ["dot_product", "additive", "multi_head"])
def test_gradients_match_the_oracle(backend, mechanism, mask):
    if not supports(backend, Autodiff):
        with pytest.raises(ValueError, match="no autodiff"):
            gradients(backend, None, [], None, None)
        return
    inputs, params, R = setup(mechanism)
    module = build(mechanism, backend, params)
    got = gradients(
        backend,
        module,
        [backend.asarray(x, "float64") for x in inputs],
        R,
        backend.asarray(LENS[mask]),
    )
    want = numeric_gradients(mechanism, mask)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
