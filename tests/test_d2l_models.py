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
    mnp, autograd = mx.np, mx.autograd
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


# ---------------------------------------------------------------------------
# B. The book's Transformer with our attention in all six places (PyTorch)

VOCAB, HIDDENS, FFN, HEADS, BLOCKS, STEPS = 11, 8, 16, 2, 2, 4


def _seq2seq_batch():
    """A tiny padded seq2seq batch (pad 0, bos 1), d2l's teacher forcing."""
    rng = np.random.default_rng(3)
    src_lens, tgt_lens = np.array([6, 4, 5, 2]), np.array([5, 6, 3, 4])
    src = rng.integers(2, VOCAB, size=(4, 6))
    tgt = rng.integers(2, VOCAB, size=(4, 6))
    src[np.arange(6) >= src_lens[:, None]] = 0
    tgt[np.arange(6) >= tgt_lens[:, None]] = 0
    dec_in = np.concatenate([np.ones((4, 1), np.int64), tgt[:, :-1]], axis=1)
    return src, dec_in, tgt, src_lens


def _swap_torch(net):
    """d2l 1.0's MultiHeadAttention(num_hiddens, num_heads, dropout) -> ours."""
    for blk in net.encoder.blks:
        blk.attention = am.MultiHeadAttention(HIDDENS, HEADS, 0.0, backend="torch")
    for blk in net.decoder.blks:
        blk.attention1 = am.MultiHeadAttention(HIDDENS, HEADS, 0.0, backend="torch")
        blk.attention2 = am.MultiHeadAttention(HIDDENS, HEADS, 0.0, backend="torch")
    return net


def _train_torch(torch, net, batch, dtype):
    """d2l's loop: Adam, the masked cross-entropy of d2l's Seq2Seq.loss."""
    src, dec_in, tgt, src_lens = (torch.as_tensor(a) for a in batch)
    net.to(dtype).train()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    losses = []
    for _ in range(STEPS):
        logits = net(src, dec_in, src_lens)
        per_token = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), tgt.reshape(-1), reduction="none"
        )
        mask = (tgt.reshape(-1) != 0).to(dtype)
        loss = (per_token * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


def _greedy_torch(torch, net, src, src_lens, steps=5):
    """d2l's predict_step: one token at a time, self-attention without valid_lens."""
    net.eval()
    with torch.no_grad():
        state = net.decoder.init_state(net.encoder(src, src_lens), src_lens)
        outputs, logits, weights = [torch.ones((src.shape[0], 1), dtype=torch.int64)], [], []
        for _ in range(steps):
            Y, state = net.decoder(outputs[-1], state)
            outputs.append(Y.argmax(2))
            logits.append(Y.double().numpy())
            weights.append(
                [
                    blk.attention1.attention.attention_weights.double().numpy()
                    for blk in net.decoder.blks
                ]
            )
    return torch.cat(outputs[1:], 1).numpy(), np.concatenate(logits, 1), weights


def test_torch_transformer_with_our_attention_trains_like_d2ls():
    """Encoder self-attention, decoder self- and cross-attention swapped for
    ours: a few Adam steps give d2l's own losses and weights within float32
    rounding of a float64 run of d2l's own model (both float32 runs are
    compared with it, not with each other); greedy decoding, where d2l's
    decoder calls self-attention with valid_lens=None, gives d2l's tokens,
    logits and attention weights."""
    torch = pytest.importorskip("torch")
    from tests import d2l_torch

    batch = _seq2seq_batch()
    src, dec_in, _, src_lens = (torch.as_tensor(a) for a in batch)
    torch.manual_seed(0)
    d2l = d2l_torch.EncoderDecoder(
        d2l_torch.TransformerEncoder(VOCAB, HIDDENS, FFN, HEADS, BLOCKS, 0.0),
        d2l_torch.TransformerDecoder(VOCAB, HIDDENS, FFN, HEADS, BLOCKS, 0.0),
    )
    with torch.no_grad():  # (d2l keeps its weights: deepcopy refuses a graph)
        d2l(src, dec_in, src_lens)  # sizes the lazy layers
        ours = _swap_torch(copy.deepcopy(d2l))
        ours(src, dec_in, src_lens)
    ours.load_state_dict(d2l.state_dict())  # strict: the same names
    assert sum(isinstance(m, am.MultiHeadAttention) for m in ours.modules()) == 6
    d2l64 = copy.deepcopy(d2l)

    want = _train_torch(torch, d2l64, batch, torch.float64)
    got_d2l = _train_torch(torch, d2l, batch, torch.float32)
    got = _train_torch(torch, ours, batch, torch.float32)
    assert want[-1] < 0.9 * want[0]  # it learns
    np.testing.assert_allclose(got_d2l, want, rtol=1e-6)  # measured: 1e-7
    np.testing.assert_allclose(got, want, rtol=1e-6)
    final = {k: v.double().numpy() for k, v in d2l64.state_dict().items()}
    for name, value in ours.state_dict().items():
        np.testing.assert_allclose(value.double().numpy(), final[name], atol=1e-5, err_msg=name)

    # greedy decoding at our trained weights, against d2l's own in float64
    d2l64.load_state_dict(ours.state_dict())
    tokens, logits, weights = _greedy_torch(torch, ours, src, src_lens)
    tokens64, logits64, weights64 = _greedy_torch(torch, d2l64, src, src_lens)
    np.testing.assert_array_equal(tokens, tokens64)
    np.testing.assert_allclose(logits, logits64, rtol=1e-5, atol=1e-5)
    for step, (w, w64) in enumerate(zip(weights, weights64)):
        for blk, (a, b) in enumerate(zip(w, w64)):
            assert a.shape == (4 * HEADS, 1, step + 1)
            np.testing.assert_allclose(a, b, atol=1e-6, err_msg=f"step {step}, block {blk}")


# ---------------------------------------------------------------------------
# B. The same on MXNet: d2l's encoder, Gluon's record()/backward()/Trainer


def _mx_encoder(mx, make_models, dtype, swap=False, dropout=0.0):
    """d2l's MXNet TransformerEncoder, sized by one call; ``swap``: ours in
    every block (Gluon refuses a child of another type: delete it first)."""
    enc = make_models.TransformerEncoder(VOCAB, HIDDENS, FFN, HEADS, BLOCKS, dropout)
    enc.initialize(mx.init.Xavier())
    src, _, _, src_lens = _seq2seq_batch()
    enc(mx.np.array(src), mx.np.array(src_lens))
    if swap:
        for blk in enc.blks:
            del blk.attention
            blk.attention = am.MultiHeadAttention(HIDDENS, HEADS, dropout, backend="mxnet")
        enc(mx.np.array(src), mx.np.array(src_lens))  # sizes ours
    if dtype != "float32":
        enc.cast(dtype)
    return enc


def _train_mx(mx, enc, dtype):
    """Gluon's loop: record(), backward(), Trainer('adam'); a masked squared
    error of the encoder's outputs against a fixed target."""
    autograd, mnp = mx.autograd, mx.np
    src, _, _, src_lens = _seq2seq_batch()
    target = np.random.default_rng(4).normal(size=(4, 6, HIDDENS))
    mask = (np.arange(6) < src_lens[:, None]).astype(dtype)
    X, lens = mnp.array(src, dtype=dtype), mnp.array(src_lens)
    target, mask = mnp.array(target, dtype=dtype), mnp.array(mask, dtype=dtype)
    trainer = mx.gluon.Trainer(enc.collect_params(), "adam", {"learning_rate": 0.01})
    losses = []
    for _ in range(STEPS):
        with autograd.record():
            out = enc(X, lens)
            loss = (((out - target) ** 2).sum(axis=-1) * mask).sum() / mask.sum()
        loss.backward()
        trainer.step(1)
        losses.append(float(loss))
    return np.array(losses)


def test_mxnet_encoder_with_our_attention_trains_like_d2ls(mx, seeds):
    """d2l's MXNet encoder, our MultiHeadAttention in every block: Gluon's
    training loop gives d2l's own losses and weights within float32 rounding
    of a float64 run of d2l's own encoder."""
    _, make_models = seeds
    mx.random.seed(0)
    d2l = _mx_encoder(mx, make_models, "float32")
    start = {k: v.data().asnumpy() for k, v in d2l._collect_params_with_prefix().items()}
    nets = {
        "d2l64": _mx_encoder(mx, make_models, "float64"),
        "d2l": d2l,
        "ours": _mx_encoder(mx, make_models, "float32", swap=True),
    }
    assert all(isinstance(b.attention, am.MultiHeadAttention) for b in nets["ours"].blks)
    for net in nets.values():
        params = net._collect_params_with_prefix()
        assert sorted(params) == sorted(start)
        for name, p in params.items():
            p.set_data(mx.np.array(start[name], dtype=p.dtype))
    losses = {
        n: _train_mx(mx, net, "float64" if n == "d2l64" else "float32") for n, net in nets.items()
    }
    want = losses["d2l64"]
    assert want[-1] < 0.9 * want[0]  # it learns
    np.testing.assert_allclose(losses["d2l"], want, rtol=1e-6)
    np.testing.assert_allclose(losses["ours"], want, rtol=1e-6)
    final = {k: v.data().asnumpy() for k, v in nets["d2l64"]._collect_params_with_prefix().items()}
    for name, p in nets["ours"]._collect_params_with_prefix().items():
        np.testing.assert_allclose(p.data().asnumpy(), final[name], atol=1e-5, err_msg=name)


def test_mxnet_lazy_attention_first_called_inside_record(mx):
    """d2l's Gluon loop may size a lazy block inside record() (Gluon's own
    deferred initialization allows it): the parameters are created, and the
    gradients are those of the float64 oracle's loss."""
    x = np.random.default_rng(5).normal(size=(2, 3, 4)).astype(np.float32)
    X = mx.np.array(x)
    mha = am.MultiHeadAttention(8, 2, 0.5, backend="mxnet")
    with mx.autograd.record():
        out = mha(X, X, X, mx.np.array([3, 1]))
    out.backward()
    assert mha.sized and mha.W_q.weight.shape == (8, 4)
    assert np.abs(mha.W_o.weight.grad().asnumpy()).sum() > 0
    mha.eval()
    want, _ = oracle.multi_head_attention(am.get_params(mha), x, x, x, np.array([3, 1]), 2)
    np.testing.assert_allclose(
        mha(X, X, X, mx.np.array([3, 1])).asnumpy(), want, rtol=1e-5, atol=1e-6
    )


def test_mxnet_encoder_with_dropout_predicts_as_d2ls_outside_record(mx, seeds):
    """Dropout 0.5 everywhere: d2l.mxnet predicts with enc(X) outside
    record(), never eval(); the encoder with ours then gives d2l's own output,
    call after call, and inside record() draws masks."""
    _, make_models = seeds
    d2l = _mx_encoder(mx, make_models, "float32", dropout=0.5)
    ours = _mx_encoder(mx, make_models, "float32", swap=True, dropout=0.5)
    for name, p in ours._collect_params_with_prefix().items():
        p.set_data(d2l._collect_params_with_prefix()[name].data())
    src, _, _, src_lens = _seq2seq_batch()
    X, lens = mx.np.array(src), mx.np.array(src_lens)
    want = d2l(X, lens).asnumpy()
    for _ in range(3):
        np.testing.assert_allclose(ours(X, lens).asnumpy(), want, rtol=1e-5, atol=1e-6)
    with mx.autograd.record():
        drawn = [ours(X, lens).asnumpy() for _ in range(2)]
        assert ours.blks[0].attention.training
    assert not np.allclose(drawn[0], want) and not np.allclose(drawn[0], drawn[1])
