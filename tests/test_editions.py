"""Both d2l editions (issue 12): the seeds' ``MultiHeadAttention(key_size,
query_size, value_size, num_hiddens, num_heads, dropout, bias=False)`` and
``AdditiveAttention(key_size, query_size, num_hiddens, dropout)`` beside d2l
1.0's ``MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False)`` and
``AdditiveAttention(num_hiddens, dropout)``, whose input sizes come from the
first call (``Linear(None, out)``, lazily sized, native on each framework).

Expected numbers come from the float64 oracle (attention_multi/reference.py)."""

import io
import re

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle
from attention_multi.testing import assert_close
from conftest import load_backend


def put(B, x, dtype="float32"):
    return B.asarray(np.asarray(x), dtype)


def inputs(B, seed=0, batch=2, nq=3, nk=4, dq=5, dk=6, dv=7):
    r = np.random.default_rng(seed)
    q, k, v = (
        r.normal(size=s).astype(np.float32)
        for s in ((batch, nq, dq), (batch, nk, dk), (batch, nk, dv))
    )
    lens = np.array([4, 2][:batch])
    return (q, k, v, lens), (put(B, q), put(B, k), put(B, v), put(B, lens, "int32"))


def same_params(a, b):
    pa, pb = am.get_params(a), am.get_params(b)
    assert list(pa) == list(pb)
    assert {n: x.shape for n, x in pa.items()} == {n: x.shape for n, x in pb.items()}


# -- the two forms ---------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_multi_head_attention_editions_agree(backend, bias):
    (q, k, v, lens), (Q, K, V, L) = inputs(backend)
    seeds = am.MultiHeadAttention(6, 5, 7, 8, 2, 0.1, bias, backend=backend).eval()
    d2l10 = am.MultiHeadAttention(8, 2, 0.1, bias, backend=backend).eval()
    assert not d2l10.sized and seeds.sized
    assert (d2l10.key_size, d2l10.query_size, d2l10.value_size) == (None, None, None)
    d2l10(Q, K, V, L)  # sizes from the first call
    assert d2l10.sized and (d2l10.key_size, d2l10.query_size, d2l10.value_size) == (6, 5, 7)
    same_params(seeds, d2l10)
    params = am.get_params(seeds)
    am.set_params(d2l10, params)
    a, b = seeds(Q, K, V, L), d2l10(Q, K, V, L)
    assert backend.to_numpy(a).tobytes() == backend.to_numpy(b).tobytes()
    want, _ = oracle.multi_head_attention(params, q, k, v, lens, 2)
    assert_close(b, want, rtol=1e-5, atol=1e-5)
    # keywords give the sizes up front: nothing lazy, the seeds' module again
    kw = am.MultiHeadAttention(
        8, 2, 0.1, bias, key_size=6, query_size=5, value_size=7, backend=backend
    ).eval()
    assert kw.sized
    same_params(seeds, kw)
    am.set_params(kw, params)
    assert backend.to_numpy(kw(Q, K, V, L)).tobytes() == backend.to_numpy(a).tobytes()


def test_additive_attention_editions_agree(backend):
    (q, k, v, lens), (Q, K, V, L) = inputs(backend)
    seeds = am.AdditiveAttention(6, 5, 8, 0.1, backend=backend).eval()
    d2l10 = am.AdditiveAttention(8, 0.1, backend=backend).eval()
    assert not d2l10.sized
    d2l10(Q, K, V, L)
    assert (d2l10.key_size, d2l10.query_size) == (6, 5)
    same_params(seeds, d2l10)
    params = am.get_params(seeds)
    am.set_params(d2l10, params)
    a, b = seeds(Q, K, V, L), d2l10(Q, K, V, L)
    assert backend.to_numpy(a).tobytes() == backend.to_numpy(b).tobytes()
    want, _ = oracle.additive_attention(params, q, k, v, lens)
    assert_close(b, want, rtol=1e-5, atol=1e-5)
    kw = am.AdditiveAttention(num_hiddens=8, dropout=0.1, key_size=6, query_size=5, backend=backend)
    assert kw.sized
    same_params(seeds, kw)


def test_keyword_spellings_of_both_forms(backend):
    for m in (
        am.MultiHeadAttention(num_hiddens=8, num_heads=2, dropout=0.0, backend=backend),
        am.MultiHeadAttention(8, num_heads=2, dropout=0.0, bias=True, backend=backend),
        am.MultiHeadAttention(4, 4, 4, 8, 2, dropout=0.0, backend=backend),
        am.MultiHeadAttention(
            key_size=4,
            query_size=4,
            value_size=4,
            num_hiddens=8,
            num_heads=2,
            dropout=0.0,
            backend=backend,
        ),
        am.MultiHeadAttention(4, 4, 4, 8, 2, 0.0, bias=True, backend=backend),
    ):
        assert (m.num_hiddens, m.num_heads) == (8, 2)
    assert am.MultiHeadAttention(8, 2, 0.0, True, backend=backend).W_o.has_bias
    assert am.AdditiveAttention(8, dropout=0.0, backend=backend).num_hiddens == 8
    assert am.AdditiveAttention(4, 4, 8, dropout=0.0, backend=backend).key_size == 4


@pytest.mark.core
@pytest.mark.parametrize(
    "cls, args, kwargs, pattern",
    [
        (
            "MultiHeadAttention",
            (4, 4, 4, 8, 2, 0.0, False, 1),
            {},
            r"takes 6 or 7 positional arguments \(key_size, query_size, value_size, "
            r"num_hiddens, num_heads, dropout, bias=False: the seeds' form\) or at most 4 "
            r"\(num_hiddens, num_heads, dropout, bias=False: d2l 1.0's form, input sizes "
            r"from the first call or as keywords key_size=, query_size=, value_size=\), "
            r"got 8: 4, 4, 4, 8, 2, 0.0, False, 1",
        ),
        (
            "MultiHeadAttention",
            (4, 4, 4, 8, 2),
            {},
            r"missing required argument 'dropout' \(the seeds' form: key_size, query_size, "
            r"value_size, num_hiddens, num_heads, dropout, bias=False; d2l 1.0's: "
            r"num_hiddens, num_heads, dropout, bias=False\)",
        ),
        (
            "MultiHeadAttention",
            (4, 4, 4, 8),
            {"num_heads": 2, "dropout": 0.0},
            r"got multiple values for argument 'num_heads': 4 positional arguments are "
            r"d2l 1.0's form \(num_hiddens, num_heads, dropout, bias=False\)",
        ),
        (
            "MultiHeadAttention",
            (4, 4, 4, 8, 2, 0.0),
            {"key_size": 4},
            r"multiple values for argument 'key_size': 6 positional arguments are the "
            r"seeds' form",
        ),
        ("MultiHeadAttention", (8, 2), {}, r"missing required argument 'dropout'"),
        (
            "MultiHeadAttention",
            (),
            {"key_size": 4},
            r"missing required arguments 'num_hiddens', 'num_heads', 'dropout'",
        ),
        (
            "AdditiveAttention",
            (4, 4, 8, 0.1, 0.2),
            {},
            r"takes 4 positional arguments \(key_size, query_size, num_hiddens, dropout: the "
            r"seeds' form\) or at most 2 \(num_hiddens, dropout: d2l 1.0's form, input "
            r"sizes from the first call or as keywords key_size=, query_size=\), got 5",
        ),
        ("AdditiveAttention", (4, 4, 8), {}, r"missing required argument 'dropout'"),
        (
            "AdditiveAttention",
            (4, 4),
            {"num_hiddens": 8, "dropout": 0.1},
            r"multiple values for argument 'num_hiddens': 2 positional arguments are d2l "
            r"1.0's form \(num_hiddens, dropout\), where num_hiddens is positional number 1",
        ),
        ("AdditiveAttention", (8,), {}, r"missing required argument 'dropout'"),
        (
            "AdditiveAttention",
            (8, 0.1),
            {"num_hiddens": 8},
            r"multiple values for argument 'num_hiddens'",
        ),
    ],
)
def test_ambiguous_or_invalid_combinations(backend, cls, args, kwargs, pattern):
    with pytest.raises(TypeError, match=pattern):
        getattr(am, cls)(*args, backend=backend, **kwargs)


def test_values_are_checked_in_both_forms(backend):
    with pytest.raises(ValueError, match=r"num_hiddens must be a positive int, got 0"):
        am.MultiHeadAttention(0, 2, 0.1, backend=backend)
    with pytest.raises(ValueError, match=r"dropout must be .*got 2.0"):
        am.AdditiveAttention(8, 2.0, backend=backend)
    with pytest.raises(
        TypeError,
        match=r"key_size must be None or a positive int, "
        r"got 'a'",
    ):
        am.MultiHeadAttention(8, 2, 0.1, key_size="a", backend=backend)
    with pytest.raises(ValueError, match=r"num_hiddens=8 is not divisible by num_heads=3"):
        am.MultiHeadAttention(8, 3, 0.1, backend=backend)


# -- lazily sized layers ----------------------------------------------------------


def test_lazy_linear_sizes_at_first_call(backend):
    backend.seed(0)  # (240 unseeded float32 draws now and then hold two equal ones)
    lin = am.Linear(None, 6, backend=backend)
    assert lin.in_features is None and not lin.sized
    # Gluon allocates a bias whose shape is known at once (as its Dense does)
    unsized = "weight" if backend.name == "mxnet" else "weight, bias"
    with pytest.raises(
        ValueError,
        match=rf"sizes are not known yet: {unsized} "
        rf"\(lazily sized layers\); get_params needs "
        rf"them. Call the module once",
    ):
        am.get_params(lin)
    x = np.random.default_rng(1).normal(size=(2, 3, 40)).astype(np.float32)
    y = lin(put(backend, x))
    assert lin.in_features == 40 and lin.sized
    params = am.get_params(lin)
    assert list(params) == ["weight", "bias"]
    assert params["weight"].shape == (6, 40) and params["bias"].shape == (6,)
    bound = 1 / np.sqrt(40)  # as Linear(40, 6): U(-1/sqrt(in), 1/sqrt(in))
    for p in params.values():
        assert np.abs(p).max() <= bound and np.unique(p).size == p.size
    # U(-b, b) has std b/sqrt(3); 240 draws stay far above b/4 (6 may not)
    assert params["weight"].std() > bound / 4
    assert_close(y, oracle.linear(x, params["weight"], params["bias"]), rtol=1e-5, atol=1e-5)
    with pytest.raises(
        ValueError,
        match=r"x has feature size 5 \(shape \(2, 3, 5\)\) "
        r"but in_features=40",
    ):
        lin(put(backend, x[..., :5]))  # sized now: 40 only


def test_lazy_modules_refuse_get_set_and_port_until_sized(backend):
    m = am.MultiHeadAttention(8, 2, 0.0, backend=backend)
    pattern = (
        r"MultiHeadAttention has parameters whose sizes are not known yet: "
        r"W_q.weight, W_k.weight, W_v.weight .*key_size=, query_size=, "
        r"value_size="
    )
    with pytest.raises(ValueError, match=pattern):
        am.get_params(m)
    with pytest.raises(ValueError, match=pattern):
        am.set_params(m, {})
    with pytest.raises(ValueError, match=pattern):
        am.port.load_into(m, {})
    _, (Q, K, V, L) = inputs(backend)
    m(Q, K, V, L)
    params = am.get_params(m)
    assert list(params) == ["W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight"]
    seeds = am.MultiHeadAttention(6, 5, 7, 8, 2, 0.0, backend=backend)
    am.port.load_into(m, am.get_params(seeds))  # porting after sizing
    for name, value in am.get_params(m).items():
        np.testing.assert_array_equal(value, am.get_params(seeds)[name])


def test_copies_of_a_lazy_module_size_on_their_own(backend):
    import copy
    import pickle

    _, (Q, K, V, L) = inputs(backend)
    m = am.MultiHeadAttention(8, 2, 0.0, backend=backend).eval()
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert not c.sized
        c(Q, K, V, L)
        assert c.sized and c.key_size == 6
    assert not m.sized


def test_a_lazy_call_under_a_trace_is_refused():
    """Under jax.jit/grad the leaves of the pytree would change inside the
    trace; the module says to call it once eagerly or pass the sizes."""
    backend = load_backend("jax")
    import jax

    _, (Q, K, V, L) = inputs(backend)
    m = am.MultiHeadAttention(8, 2, 0.0, backend=backend).eval()
    assert len(jax.tree_util.tree_leaves(m)) == 1  # W_o.weight only
    message = (
        r"input size is not known yet and it is called under a trace \(jax: "
        r"jit, grad, vmap or compile\).*call the module once eagerly.*key_size="
    )
    with pytest.raises(TypeError, match=message):
        jax.jit(lambda mod, *a: mod(*a))(m, Q, K, V, L)
    with pytest.raises(TypeError, match=message):  # concrete inputs, traced module
        jax.grad(lambda mod: mod(Q, K, V, L).sum())(m)
    assert not m.sized
    eager = m(Q, K, V, L)
    assert len(jax.tree_util.tree_leaves(m)) == 4
    jitted = jax.jit(lambda mod, *a: mod(*a))(m, Q, K, V, L)
    assert_close(jitted, eager, rtol=1e-6, atol=1e-6)
    grads = jax.grad(lambda mod: mod(Q, K, V, L).sum())(m)
    assert set(grads.named_arrays()) == {"W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight"}


def test_torch_lazy_native():
    """As nn.LazyLinear: UninitializedParameter in state_dict before the first
    call, real parameters (optimizers, state_dict round trip) after it."""
    backend = load_backend("torch")
    import torch

    m = am.MultiHeadAttention(8, 2, 0.0, backend=backend)
    state = m.state_dict()
    assert [n for n, p in state.items() if torch.nn.parameter.is_lazy(p)] == [
        "W_q.weight",
        "W_k.weight",
        "W_v.weight",
    ]
    _, (Q, K, V, L) = inputs(backend)
    m(Q, K, V, L)
    assert not any(torch.nn.parameter.is_lazy(p) for p in m.parameters())
    assert m.W_q.weight.shape == (8, 5) and m.W_q.weight.requires_grad
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = m.W_q.weight.detach().clone()
    m(Q, K, V, L).square().sum().backward()
    opt.step()
    assert not torch.equal(before, m.W_q.weight.detach())
    other = am.MultiHeadAttention(6, 5, 7, 8, 2, 0.0, backend=backend)
    other.load_state_dict(m.state_dict())
    assert torch.equal(other(Q, K, V, L), m(Q, K, V, L))
    # load_state_dict sizes an unsized module, as for nn.LazyLinear
    lazy = am.MultiHeadAttention(8, 2, 0.0, backend=backend)
    lazy.load_state_dict(m.state_dict())
    assert lazy.sized and (lazy.key_size, lazy.query_size, lazy.value_size) == (6, 5, 7)
    assert torch.equal(lazy(Q, K, V, L), m(Q, K, V, L))
    # and an unsized state_dict loads into an unsized module (nothing to copy yet)
    unsized = am.MultiHeadAttention(8, 2, 0.0, backend=backend)
    unsized.load_state_dict(am.MultiHeadAttention(8, 2, 0.0, backend=backend).state_dict())
    assert not unsized.sized
    # torch.jit.trace refuses uninitialized parameters itself; a first call
    # under torch.compile is refused here
    with pytest.raises(RuntimeError, match="uninitialized parameters"):
        torch.jit.trace(unsized, (Q, K, V))
    with pytest.raises(
        TypeError,
        match=r"called under a trace \(torch: .*call the "
        r"module once eagerly",
    ):
        torch.compile(unsized, backend="eager")(Q, K, V)
    assert not unsized.sized


def test_mxnet_lazy_native(tmp_path):
    """Gluon's deferred initialization: the parameter's shape has an unknown
    axis until the first call; then autograd and save/load work."""
    backend = load_backend("mxnet")
    import mxnet as mx
    from mxnet import autograd

    m = am.MultiHeadAttention(8, 2, 0.0, backend=backend)
    assert m._collect_params_with_prefix()["W_q.weight"].shape == (8, -1)
    with pytest.raises(mx.gluon.parameter.DeferredInitializationError):
        m._collect_params_with_prefix()["W_q.weight"].data()
    with pytest.raises(ValueError, match="not known yet: W_q.weight"):
        m.load_parameters("unused.params")
    _, (Q, K, V, L) = inputs(backend)
    m(Q, K, V, L)
    p = m._collect_params_with_prefix()["W_q.weight"]
    assert p.shape == (8, 5)
    with autograd.record():
        loss = (m(Q, K, V, L) ** 2).sum()
    loss.backward()
    assert float(np.abs(p.grad().asnumpy()).sum()) > 0
    path = str(tmp_path / "mha.params")
    m.save_parameters(path)
    other = am.MultiHeadAttention(6, 5, 7, 8, 2, 0.0, backend=backend)
    other.load_parameters(path)
    assert_close(other(Q, K, V, L), m(Q, K, V, L), rtol=0, atol=0)


# -- a d2l-1.0-style Transformer encoder block --------------------------------------


def layer_norm(B, X, eps=1e-5):
    """nn.LayerNorm at its initialization (weight 1, bias 0), over the last axis."""
    d = X.shape[-1]
    mean = B.sum(X, -1, keepdims=True) / d
    centered = X - mean
    var = B.sum(centered * centered, -1, keepdims=True) / d
    return centered / B.sqrt(var + eps)


def relu(B, X):
    return B.where(X > 0, X, B.zeros((), B.dtype_name(X), B.device_of(X)))


class TransformerEncoderBlock:
    """d2l 1.0's TransformerEncoderBlock, backend-generic:
    ``Y = AddNorm(X, MHA(X, X, X, valid_lens))``, ``AddNorm(Y, FFN(Y))`` with
    ``FFN = dense2(relu(dense1(.)))`` built as d2l builds it, from
    ``MultiHeadAttention(num_hiddens, num_heads, dropout)`` and lazily sized
    ``Linear(None, ...)`` layers (d2l's ``nn.LazyLinear``). Dropout in AddNorm
    is off (eval mode)."""

    def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout, backend):
        self.attention = am.MultiHeadAttention(num_hiddens, num_heads, dropout, backend=backend)
        self.dense1 = am.Linear(None, ffn_num_hiddens, backend=backend)
        self.dense2 = am.Linear(None, num_hiddens, backend=backend)
        self.B = backend

    def modules(self):
        return (self.attention, self.dense1, self.dense2)

    def eval(self):
        for m in self.modules():
            m.eval()
        return self

    def __call__(self, X, valid_lens, modules=None):
        attention, dense1, dense2 = modules or self.modules()
        B = self.B
        Y = layer_norm(B, X + attention(X, X, X, valid_lens))
        return layer_norm(B, Y + dense2(relu(B, dense1(Y))))


def oracle_block(params, X, valid_lens, num_heads):
    def ln(Z):
        mean = Z.mean(-1, keepdims=True)
        return (Z - mean) / np.sqrt(Z.var(-1, keepdims=True) + 1e-5)

    attention = {n[len("attention.") :]: v for n, v in params.items() if n.startswith("attention.")}
    X = X.astype(np.float64)
    Y = ln(X + oracle.multi_head_attention(attention, X, X, X, valid_lens, num_heads)[0])
    hidden = np.maximum(oracle.linear(Y, params["dense1.weight"], params["dense1.bias"]), 0)
    return ln(Y + oracle.linear(hidden, params["dense2.weight"], params["dense2.bias"]))


def block_params(block):
    return {
        f"{prefix}.{n}": v
        for prefix, m in zip(("attention", "dense1", "dense2"), block.modules())
        for n, v in am.get_params(m).items()
    }


def test_d2l10_transformer_encoder_block(backend):
    r = np.random.default_rng(3)
    X = r.normal(size=(2, 5, 8)).astype(np.float32)
    lens = np.array([3, 5])
    block = TransformerEncoderBlock(8, 12, 2, 0.5, backend).eval()
    out = block(put(backend, X), put(backend, lens, "int32"))
    assert tuple(out.shape) == (2, 5, 8)
    params = block_params(block)
    assert {n: v.shape for n, v in params.items()} == {
        "attention.W_q.weight": (8, 8),
        "attention.W_k.weight": (8, 8),
        "attention.W_v.weight": (8, 8),
        "attention.W_o.weight": (8, 8),
        "dense1.weight": (12, 8),
        "dense1.bias": (12,),
        "dense2.weight": (8, 12),
        "dense2.bias": (8,),
    }
    want = oracle_block(params, X, lens, 2)
    assert_close(out, want, rtol=1e-5, atol=2e-5)
    if backend.name == "jax":  # sized now: the block compiles
        import jax

        jitted = jax.jit(lambda mods, x, v: block(x, v, mods))(
            block.modules(), put(backend, X), put(backend, lens, "int32")
        )
        assert_close(jitted, want, rtol=1e-5, atol=2e-5)


def test_d2l10_transformer_encoder_block_trains_in_torch():
    """The same block as a torch nn.Module, written as d2l 1.0 writes it
    (nn.LayerNorm, nn.Dropout), around our modules: optimizers see every
    parameter after the first call, as with nn.LazyLinear."""
    load_backend("torch")
    import torch
    from torch import nn

    class AddNorm(nn.Module):
        def __init__(self, norm_shape, dropout):
            super().__init__()
            self.dropout = nn.Dropout(dropout)
            self.ln = nn.LayerNorm(norm_shape)

        def forward(self, X, Y):
            return self.ln(self.dropout(Y) + X)

    class PositionWiseFFN(nn.Module):
        def __init__(self, ffn_num_hiddens, ffn_num_outputs):
            super().__init__()
            self.dense1 = am.Linear(None, ffn_num_hiddens, backend="torch")
            self.relu = nn.ReLU()
            self.dense2 = am.Linear(None, ffn_num_outputs, backend="torch")

        def forward(self, X):
            return self.dense2(self.relu(self.dense1(X)))

    class Block(nn.Module):
        def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias=False):
            super().__init__()
            self.attention = am.MultiHeadAttention(
                num_hiddens, num_heads, dropout, use_bias, backend="torch"
            )
            self.addnorm1 = AddNorm(num_hiddens, dropout)
            self.ffn = PositionWiseFFN(ffn_num_hiddens, num_hiddens)
            self.addnorm2 = AddNorm(num_hiddens, dropout)

        def forward(self, X, valid_lens):
            Y = self.addnorm1(X, self.attention(X, X, X, valid_lens))
            return self.addnorm2(Y, self.ffn(Y))

    torch.manual_seed(0)
    r = np.random.default_rng(3)
    X = torch.tensor(r.normal(size=(2, 5, 8)).astype(np.float32))
    lens = torch.tensor([3, 5])
    block = Block(8, 12, 2, 0.5).eval()
    out = block(X, lens)
    state = {n: v.detach().numpy().copy() for n, v in block.state_dict().items()}
    params = {n.replace("ffn.", ""): v for n, v in state.items() if "addnorm" not in n}
    assert_close(out, oracle_block(params, X.numpy(), lens.numpy(), 2), rtol=1e-5, atol=2e-5)
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    block.train()
    target = torch.tensor(r.normal(size=(2, 5, 8)).astype(np.float32))
    (block(X, lens) * target).sum().backward()
    opt.step()
    for name, value in block.state_dict().items():
        if name.startswith("attention.W_") or name.startswith("ffn."):
            assert not np.array_equal(value.numpy(), state[name]), name
    buf = io.BytesIO()
    torch.save(block.state_dict(), buf)
    assert re.search(rb"attention\.W_q\.weight", buf.getvalue())
