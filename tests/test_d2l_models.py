"""Inside d2l's own models and conventions.

MXNet: our blocks' dropout follows Gluon's convention (``nn.Dropout``: on
inside ``autograd.record()``, off outside it), with ``train()``/``eval()`` as
pins; checked against Gluon's ``nn.Dropout`` and the seeds' MXNet code
(tests/fixtures/mxnet/). PyTorch and MXNet: the book's chapter-11 Transformer
with our attention swapped in trains to the loss of d2l's own, both compared
with a float64 run of d2l's own model.
"""

import contextlib
import copy
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle
from conftest import load_backend

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "mxnet"


def _load_fixture_module(name):
    spec = importlib.util.spec_from_file_location(name, FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    with contextlib.redirect_stdout(None):
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mx():
    """mxnet, after the backend (which restores numpy.bool and sets NumPy mode)."""
    load_backend("mxnet")
    import mxnet

    return mxnet


@pytest.fixture(scope="module")
def seeds(mx):
    """d2l's MXNet code: make_fixtures.py (attention) and make_model_fixtures.py
    (PositionalEncoding, the Transformer)."""
    return _load_fixture_module("make_fixtures"), _load_fixture_module("make_model_fixtures")


# ---------------------------------------------------------------------------
# A. Gluon's dropout convention on MXNet

# The states of the table: (what is done to our block, the autograd scope it is
# called in). Gluon's nn.Dropout has no train()/eval(); a pinned block acts as
# nn.Dropout does under autograd.train_mode() (train()) or predict_mode() (eval()).
SCOPES = ("outside", "record", "record(train_mode=False)", "train_mode()", "predict_mode()")
PINS = {None: None, "train()": "train_mode()", "eval()": "predict_mode()"}


def _scope(autograd, name):
    return {
        "outside": contextlib.nullcontext(),
        "record": autograd.record(),
        "record(train_mode=False)": autograd.record(train_mode=False),
        "train_mode()": autograd.train_mode(),
        "predict_mode()": autograd.predict_mode(),
    }[name]


def _drops(out, exact):
    """Whether a dropout mask was drawn: p = 0.5 over >= 400 elements."""
    return not np.array_equal(out, exact)


def _our_blocks(mx):
    """Every module of ours with a dropout, with an input and its exact output."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 20, 16)).astype(np.float32)
    X = mx.np.array(x)
    lens = mx.np.array([20, 13])
    dot = am.DotProductAttention(0.5, backend="mxnet")
    mha = am.MultiHeadAttention(16, 16, 16, 16, 2, 0.5, backend="mxnet")
    add = am.AdditiveAttention(16, 16, 8, 0.5, backend="mxnet")
    pe = am.PositionalEncoding(16, 0.5, backend="mxnet")
    params_mha, params_add = am.get_params(mha), am.get_params(add)
    return {
        "DotProductAttention": (
            dot,
            (X, X, X, lens),
            oracle.dot_product_attention(x, x, x, np.array([20, 13]))[0],
        ),
        "MultiHeadAttention": (
            mha,
            (X, X, X, lens),
            oracle.multi_head_attention(params_mha, x, x, x, np.array([20, 13]), 2)[0],
        ),
        "AdditiveAttention": (
            add,
            (X, X, X, lens),
            oracle.additive_attention(params_add, x, x, x, np.array([20, 13]))[0],
        ),
        "PositionalEncoding": (pe, (X,), oracle.positional_encoding(x)),
    }


@pytest.mark.parametrize("pin", list(PINS))
def test_mxnet_dropout_is_on_exactly_where_gluon_dropout_is(mx, pin):
    """Every scope x {no pin, train(), eval()}: our blocks drop exactly when
    Gluon's nn.Dropout does (pins: under train_mode()/predict_mode()), and
    give the float64 oracle's output when they do not."""
    autograd = mx.autograd
    gluon_dropout = mx.gluon.nn.Dropout(0.5)
    ones = mx.np.ones((20, 20))
    blocks = _our_blocks(mx)
    for block, _, _ in blocks.values():
        if pin is not None:
            assert (block.train() if pin == "train()" else block.eval()) is block
    for scope in SCOPES:
        with _scope(autograd, PINS[pin] or scope):
            gluon_drops = _drops(gluon_dropout(ones).asnumpy(), np.ones((20, 20)))
        for name, (block, args, exact) in blocks.items():
            with _scope(autograd, scope):
                training = block.training
                out = block(*args).asnumpy()
            where = f"{name}, {pin or 'no pin'}, {scope}"
            assert training == gluon_drops, where
            if gluon_drops:
                assert not np.allclose(out, exact, rtol=1e-4, atol=1e-4), where
            else:
                np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-5, err_msg=where)
    # the pin reaches every child; train(None) follows autograd again
    mha = blocks["MultiHeadAttention"][0]
    assert mha.attention.training == mha.W_q.training == mha.training
    mha.train(None)
    assert not mha.attention.training
    with autograd.record():
        assert mha.attention.training and mha.training


def test_mxnet_outside_record_equals_the_seeds_and_inside_draws_masks(mx, seeds):
    """d2l's MXNet DotProductAttention, MultiHeadAttention and
    PositionalEncoding with dropout 0.5, as d2l predicts (net(X), no record(),
    no eval()): deterministic and equal to ours. Inside record() both draw
    masks, and gradients flow through ours."""
    make_fixtures, make_models = seeds
    npx, mnp, autograd = mx.npx, mx.np, mx.autograd
    # seed 001/004's example
    keys = mnp.ones((2, 10, 2))
    values = mnp.tile(mnp.arange(40, dtype="float32").reshape(1, 10, 4), (2, 1, 1))
    queries = mnp.array(np.random.default_rng(1).normal(size=(2, 1, 2)).astype(np.float32))
    lens = mnp.array([2, 6])
    seed_dot = make_fixtures.DotProductAttention(0.5)
    seed_dot.initialize()
    dot = am.DotProductAttention(0.5, backend="mxnet")
    # d2l's multi-head attention, its weights loaded into ours
    x = mnp.array(np.random.default_rng(2).normal(size=(2, 4, 8)).astype(np.float32))
    seed_mha = make_fixtures.MultiHeadAttention(8, 2, 0.5)
    seed_mha.initialize(mx.init.Xavier())
    seed_mha(x, x, x, mnp.array([3, 2]))
    mha = am.MultiHeadAttention(8, 8, 8, 8, 2, 0.5, backend="mxnet")
    am.set_params(mha, {k: v.data() for k, v in seed_mha._collect_params_with_prefix().items()})
    seed_pe = make_models.PositionalEncoding(8, 0.5)
    seed_pe.initialize()
    pe = am.PositionalEncoding(8, 0.5, backend="mxnet")
    pairs = [
        (seed_dot, dot, (queries, keys, values, lens)),
        (seed_mha, mha, (x, x, x, mnp.array([3, 2]))),
        (seed_pe, pe, (x,)),
    ]
    for seed_block, ours, args in pairs:
        want = seed_block(*args).asnumpy()
        for _ in range(3):
            np.testing.assert_array_equal(seed_block(*args).asnumpy(), want)
            np.testing.assert_allclose(ours(*args).asnumpy(), want, rtol=1e-6, atol=1e-6)
        with autograd.record():
            seed_draws = [seed_block(*args).asnumpy() for _ in range(3)]
            draws = [ours(*args).asnumpy() for _ in range(3)]
        assert all(not np.allclose(d, want) for d in seed_draws + draws), type(ours).__name__
        assert not np.array_equal(draws[0], draws[1])
    with autograd.record():
        loss = (mha(x, x, x, mnp.array([3, 2])) ** 2).sum()
    loss.backward()
    np.testing.assert_allclose(
        dot(queries, keys, values, lens).asnumpy(), [[[2, 3, 4, 5]], [[10, 11, 12, 13]]]
    )
    assert np.abs(mha.W_q.weight.grad().asnumpy()).sum() > 0
