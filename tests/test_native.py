"""Modules are native objects of their framework: torch ``nn.Module``, Gluon
``Block``, JAX pytree, plain NumPy object. Initialization, train/eval,
get_params/set_params, Nadaraya-Watson training, heatmaps and
``attention_weights`` on every backend. Expected numbers come from
tests/oracle.py or from float64 NumPy written here."""

import copy
import io
import math

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle
from attention_multi.backends.capabilities import opt
from conftest import load_backend

P_DROP = 0.3
MHA_NAMES = ["W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight"]
MHA_BIAS_NAMES = [
    "W_q.weight",
    "W_q.bias",
    "W_k.weight",
    "W_k.bias",
    "W_v.weight",
    "W_v.bias",
    "W_o.weight",
    "W_o.bias",
]


def put(B, x, dtype="float32"):
    return B.asarray(np.asarray(x), dtype)


def f64(B, x):
    return B.to_numpy(x).astype(np.float64)


def drop_key(B, seed=0):
    """Dropout keyword for a training-mode call: JAX needs a PRNG key."""
    key = opt(B).dropout_key(seed)
    return {} if key is None else {"key": key}


def qkv(seed=0, batch=2, nq=3, nk=5, dq=4, dk=5, dv=6):
    r = np.random.default_rng(seed)
    return (
        r.normal(size=(batch, nq, dq)).astype(np.float32),
        r.normal(size=(batch, nk, dk)).astype(np.float32),
        r.normal(size=(batch, nk, dv)).astype(np.float32),
    )


def mha(B, bias=True, dropout=0.0, dtype="float32"):
    # key_size 5, query_size 4, value_size 6, num_hiddens 8, num_heads 2
    return am.MultiHeadAttention(5, 4, 6, 8, 2, dropout, bias=bias, backend=B, dtype=dtype)


def additive(B, dropout=0.0):
    # key_size 5, query_size 4, num_hiddens 7
    return am.AdditiveAttention(5, 4, 7, dropout, backend=B)


def squared_output(B, module, q, k, v, lens):
    out = module(put(B, q), put(B, k), put(B, v), lens)
    return B.sum(B.sum(B.sum(out * out, axis=2), axis=1), axis=0)


# ---------------------------------------------------------------------------
# 1. torch: a module IS a torch.nn.Module


def test_torch_modules_are_nn_modules_with_d2l_state_dict_keys():
    load_backend("torch")
    import torch

    m = mha("torch")
    assert isinstance(m, torch.nn.Module) and isinstance(m, am.MultiHeadAttention)
    assert list(m.state_dict()) == MHA_BIAS_NAMES
    shapes = {n: tuple(t.shape) for n, t in m.state_dict().items()}
    assert shapes == {
        "W_q.weight": (8, 4),
        "W_q.bias": (8,),
        "W_k.weight": (8, 5),
        "W_k.bias": (8,),
        "W_v.weight": (8, 6),
        "W_v.bias": (8,),
        "W_o.weight": (8, 8),
        "W_o.bias": (8,),
    }
    params = list(m.parameters())
    assert len(params) == 8 and all(isinstance(p, torch.nn.Parameter) for p in params)
    assert all(p.requires_grad for p in params)
    assert {id(p) for p in params} == {id(p) for _, p in m.named_parameters()}
    assert isinstance(m.attention, torch.nn.Module)
    assert [n for n, _ in m.named_children()] == ["attention", "W_q", "W_k", "W_v", "W_o"]

    assert list(mha("torch", bias=False).state_dict()) == MHA_NAMES
    a = additive("torch")
    assert [(n, tuple(t.shape)) for n, t in a.state_dict().items()] == [
        ("W_k.weight", (7, 5)),
        ("W_q.weight", (7, 4)),
        ("w_v.weight", (1, 7)),
    ]
    nw = am.NWKernelRegression(backend="torch")
    assert [(n, tuple(t.shape)) for n, t in nw.state_dict().items()] == [("w", (1,))]
    assert isinstance(nw.w, torch.nn.Parameter)
    # No parameters: as in d2l, P is not in the state dict.
    assert list(am.DotProductAttention(0.1, backend="torch").state_dict()) == []
    assert list(am.PositionalEncoding(8, 0.1, backend="torch").state_dict()) == []


def test_torch_to_cpu_float64_and_double():
    load_backend("torch")
    import torch

    q, k, v = qkv(1)
    lens = np.array([2, 4])
    m = mha("torch")
    assert m.to("cpu") is m and m.to(torch.device("cpu")) is m
    assert m.to(torch.float64) is m
    assert all(p.dtype == torch.float64 for p in m.parameters())
    out = m(*(torch.tensor(a, dtype=torch.float64) for a in (q, k, v)), torch.tensor(lens))
    assert out.dtype == torch.float64
    want, _ = oracle.multi_head_attention(am.get_params(m), q, k, v, lens, 2)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-10, atol=1e-12)

    a = additive("torch").double()
    assert all(p.dtype == torch.float64 for p in a.parameters())
    out = a(*(torch.tensor(x, dtype=torch.float64) for x in (q, k, v)))
    want, _ = oracle.additive_attention(am.get_params(a), q, k, v, None)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-10, atol=1e-12)
    assert a.float() is a and all(p.dtype == torch.float32 for p in a.parameters())

    # The table was made in float32, so .double() keeps float32 rounding.
    pe = am.PositionalEncoding(6, 0.0, max_len=20, backend="torch").double()
    assert pe.P.dtype == torch.float64
    X = np.random.default_rng(2).normal(size=(2, 9, 6))
    np.testing.assert_allclose(
        pe(torch.tensor(X)).numpy(), oracle.positional_encoding(X), rtol=0, atol=1e-7
    )


def test_torch_sgd_step_changes_parameters_and_lowers_the_loss():
    load_backend("torch")
    import torch

    torch.manual_seed(0)
    q, k, v = (torch.tensor(a) for a in qkv(3))
    target = torch.tensor(np.random.default_rng(4).normal(size=(2, 3, 8)).astype(np.float32))
    m = mha("torch")
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.SGD(m.parameters(), lr=0.05)

    def loss_fn():
        return ((m(q, k, v, torch.tensor([3, 5])) - target) ** 2).sum()

    first = loss_fn()
    opt.zero_grad()
    first.backward()
    # A bias on the keys adds q.b to every score of a query's row, which
    # softmax ignores: its gradient is 0 up to rounding, so SGD may leave it.
    grads = {n: p.grad for n, p in m.named_parameters()}
    assert float(grads.pop("W_k.bias").abs().max()) < 1e-6
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())
    opt.step()
    for n, p in m.named_parameters():
        assert n == "W_k.bias" or not torch.equal(p.detach(), before[n]), n
        np.testing.assert_allclose(
            p.detach().numpy(), (before[n] - 0.05 * p.grad).numpy(), rtol=1e-6
        )
    assert loss_fn().item() < first.item()


def test_torch_state_dict_round_trip_deepcopy_and_save():
    load_backend("torch")
    import torch

    q, k, v = (torch.tensor(a) for a in qkv(5))
    lens = torch.tensor([2, 5])
    m = mha("torch")
    out = m(q, k, v, lens)  # holds attention weights from a call
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert list(loaded) == MHA_BIAS_NAMES

    other = mha("torch")
    assert not torch.equal(other.W_q.weight, m.W_q.weight)
    assert other.load_state_dict(loaded) is not None
    for n, p in other.named_parameters():
        assert torch.equal(p, m.get_parameter(n)), n
    torch.testing.assert_close(other(q, k, v, lens), out, rtol=0, atol=0)

    twin = copy.deepcopy(m)  # after a call, as when snapshotting a model
    assert type(twin) is type(m) and twin is not m
    assert twin.attention_weights is None  # the copy has made no call yet
    for (n, p), (_, p2) in zip(m.named_parameters(), twin.named_parameters()):
        assert torch.equal(p, p2) and p.data_ptr() != p2.data_ptr(), n
    torch.testing.assert_close(twin(q, k, v, lens), out, rtol=0, atol=0)
    with torch.no_grad():
        twin.W_q.weight.add_(1.0)
    assert not torch.equal(twin.W_q.weight, m.W_q.weight)
    assert tuple(m.attention_weights.shape) == (4, 3, 5)


# ---------------------------------------------------------------------------
# 2. MXNet: a module IS a gluon.Block


def test_mxnet_modules_are_blocks_with_params_and_gradients():
    B = load_backend("mxnet")
    from mxnet import autograd, gluon

    m = mha(B)
    assert isinstance(m, gluon.Block) and isinstance(m, am.MultiHeadAttention)
    params = m.collect_params()
    assert len(list(params.keys())) == 8
    assert sorted(p.shape for p in params.values()) == sorted(
        [(8, 4), (8, 5), (8, 6), (8, 8)] + [(8,)] * 4
    )
    assert len(list(additive(B).collect_params().keys())) == 3
    nw_params = am.NWKernelRegression(backend=B).collect_params()
    assert [p.shape for p in nw_params.values()] == [(1,)]

    q, k, v = qkv(6)
    with autograd.record():
        loss = squared_output(B, m, q, k, v, np.array([2, 4]))
    loss.backward()
    for name, p in params.items():
        assert np.abs(p.grad().asnumpy()).sum() > 0, name


def test_a_parent_gluon_blocks_initialize_redraws_ours_and_a_bare_one_keeps_them():
    load_backend("mxnet")
    import warnings

    from mxnet import gluon, init

    class Parent(gluon.Block):  # a d2l model holding one of our blocks
        def __init__(self):
            super().__init__()
            self.attention = am.MultiHeadAttention(4, 4, 4, 8, 2, 0.0, bias=True, backend="mxnet")

    net = Parent()
    drawn = am.get_params(net.attention)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net.initialize()  # d2l's bare call: ours are kept
        kept = am.get_params(net.attention)
        net.initialize(init.Xavier())  # an init: ours are re-drawn with it
    redrawn = am.get_params(net.attention)
    assert all((kept[n] == drawn[n]).all() for n in drawn)
    assert all((redrawn[n] != drawn[n]).any() for n in drawn if n.endswith("weight"))
    assert all((redrawn[n] == 0).all() for n in drawn if n.endswith("bias"))  # Xavier's biases
    assert not [w for w in caught if "already initialized" in str(w.message)]


def test_mxnet_save_and_load_parameters_use_d2l_names(tmp_path):
    B = load_backend("mxnet")
    from attention_multi.port import load_mxnet_params

    q, k, v = (put(B, a) for a in qkv(7))
    for make, names in (
        (mha, MHA_BIAS_NAMES),
        (additive, ["W_k.weight", "W_q.weight", "w_v.weight"]),
        (lambda B: am.NWKernelRegression(backend=B), ["w"]),
    ):
        m = make(B)
        path = tmp_path / "m.params"
        m.save_parameters(str(path))
        stored = load_mxnet_params(path)
        assert sorted(stored) == sorted(names)
        want = am.get_params(m)
        for n in names:
            np.testing.assert_array_equal(stored[n], want[n])
        fresh = make(B)
        assert not np.array_equal(am.get_params(fresh)[names[0]], want[names[0]])
        fresh.load_parameters(str(path))
        for n, value in am.get_params(fresh).items():
            np.testing.assert_array_equal(value, want[n])
        if make is not mha:
            continue
        np.testing.assert_array_equal(
            B.to_numpy(fresh(q, k, v, np.array([2, 3]))), B.to_numpy(m(q, k, v, np.array([2, 3])))
        )


def test_mxnet_where_with_a_scalar_sends_gradients_to_the_chosen_branch():
    B = load_backend("mxnet")
    from mxnet import autograd

    cond = B.arange(4).reshape((1, 4)) < put(B, [[2], [3]], "int32")
    for scalar_first in (False, True):
        x = put(B, np.ones((2, 4)))
        x.attach_grad()
        with autograd.record():
            picked = B.where(cond, 0.0, x) if scalar_first else B.where(cond, x, 0.0)
            loss = B.sum(B.sum(picked * put(B, np.arange(4.0)), axis=1), axis=0)
        loss.backward()
        chose_x = (
            ~np.array([[1, 1, 0, 0], [1, 1, 1, 0]], bool)
            if scalar_first
            else np.array([[1, 1, 0, 0], [1, 1, 1, 0]], bool)
        )
        np.testing.assert_array_equal(x.grad.asnumpy(), np.where(chose_x, np.arange(4.0), 0))


def test_mxnet_initialize_keeps_weights_unless_an_init_is_given():
    B = load_backend("mxnet")
    import mxnet as mx

    m = am.MultiHeadAttention(64, 64, 64, 256, 4, 0.0, bias=True, backend=B)
    before = am.get_params(m)
    m.initialize()  # as d2l code does after construction
    for n, value in am.get_params(m).items():
        np.testing.assert_array_equal(value, before[n])
    m.initialize(init=mx.init.Constant(0.5), force_reinit=True)
    params = am.get_params(m)  # an init draws the weights; biases are zeros, as in Gluon's Dense
    assert all((params[n] == 0.5).all() for n in params if n.endswith("weight"))
    assert all((params[n] == 0).all() for n in params if n.endswith("bias"))
    m.initialize(mx.init.Normal(0.01))  # an init re-draws
    weight = am.get_params(m)["W_o.weight"]
    assert abs(weight.std() - 0.01) < 0.001 and not (weight == 0.5).any()
    m.initialize(force_reinit=True)  # no init, forced: Gluon's default init
    weight2 = am.get_params(m)["W_o.weight"]
    assert not np.array_equal(weight2, weight) and np.unique(weight2).size > 1000


# ---------------------------------------------------------------------------
# 3. JAX: a module is a registered pytree of its parameters


def test_jax_leaves_are_exactly_the_parameters():
    B = load_backend("jax")
    import jax

    m = mha(B)
    leaves = jax.tree_util.tree_leaves(m)
    named = m.named_arrays()
    assert list(named) == MHA_BIAS_NAMES
    assert len(leaves) == 8 and all(a is b for a, b in zip(leaves, named.values()))
    m(*(put(B, a) for a in qkv(8)), np.array([1, 3]))  # keeps attention weights
    assert m.attention_weights is not None
    after = jax.tree_util.tree_leaves(m)
    assert len(after) == 8 and all(a is b for a, b in zip(after, leaves))

    leaves, treedef = jax.tree_util.tree_flatten(m)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(rebuilt) is type(m) and list(rebuilt.named_arrays()) == MHA_BIAS_NAMES
    assert [tuple(x.shape) for x in jax.tree_util.tree_leaves(additive(B))] == [
        (7, 5),
        (7, 4),
        (1, 7),
    ]
    assert [
        tuple(x.shape) for x in jax.tree_util.tree_leaves(am.NWKernelRegression(backend=B))
    ] == [(1,)]
    assert jax.tree_util.tree_leaves(am.PositionalEncoding(8, 0.1, backend=B)) == []
    assert jax.tree_util.tree_leaves(am.DotProductAttention(0.1, backend=B)) == []


def test_jax_modules_built_alike_have_one_tree_structure():
    B = load_backend("jax")
    import jax

    m1, m2 = mha(B), mha(B)
    assert jax.tree_util.tree_structure(m1) == jax.tree_util.tree_structure(m2)
    diff = jax.tree_util.tree_map(lambda a, b: a - b, m1, m2)
    np.testing.assert_allclose(
        f64(B, diff.W_k.weight), f64(B, m1.W_k.weight) - f64(B, m2.W_k.weight), rtol=1e-6
    )
    assert jax.tree_util.tree_structure(mha(B, bias=False)) != jax.tree_util.tree_structure(m1)
    assert jax.tree_util.tree_structure(m1.eval()) != jax.tree_util.tree_structure(m2)


def test_jax_jit_matches_eager_and_does_not_retrace():
    B = load_backend("jax")
    import jax

    q, k, v = (put(B, a) for a in qkv(9))
    lens = np.array([2, 5])
    traces = []

    def call(m, q, k, v):
        traces.append(1)  # runs only while tracing
        return m(q, k, v, lens)

    jitted = jax.jit(call)
    m = mha(B)
    eager = m(q, k, v, lens)
    want, _ = oracle.multi_head_attention(am.get_params(m), *qkv(9), lens, 2)
    np.testing.assert_allclose(f64(B, eager), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f64(B, jitted(m, q, k, v)), f64(B, eager), rtol=1e-6, atol=1e-6)
    jitted(m, q, k, v)
    assert len(traces) == 1
    # New weights are new leaf values, not baked-in constants: same trace.
    am.set_params(m, {n: x * 2 for n, x in am.get_params(m).items()})
    np.testing.assert_allclose(
        f64(B, jitted(m, q, k, v)), f64(B, m(q, k, v, lens)), rtol=1e-6, atol=1e-6
    )
    other = mha(B)
    np.testing.assert_allclose(
        f64(B, jitted(other, q, k, v)), f64(B, other(q, k, v, lens)), rtol=1e-6, atol=1e-6
    )
    assert len(traces) == 1


def test_jax_dropout_needs_a_key_and_is_deterministic_per_key():
    B = load_backend("jax")
    import jax

    q, k, v = (put(B, a) for a in qkv(10))
    m = mha(B, dropout=0.5)
    with pytest.raises(ValueError, match="PRNG key"):
        m(q, k, v)
    one = f64(B, m(q, k, v, key=jax.random.PRNGKey(1)))
    np.testing.assert_array_equal(f64(B, m(q, k, v, key=jax.random.PRNGKey(1))), one)
    assert not np.allclose(f64(B, m(q, k, v, key=jax.random.PRNGKey(2))), one)
    jitted = jax.jit(lambda m, key: m(q, k, v, key=key))
    np.testing.assert_allclose(f64(B, jitted(m, jax.random.PRNGKey(1))), one, rtol=1e-6, atol=1e-6)
    m.eval()
    want, _ = oracle.multi_head_attention(am.get_params(m), *qkv(10), None, 2)
    np.testing.assert_allclose(f64(B, m(q, k, v)), want, rtol=1e-5, atol=1e-6)


# Gradients of sum(out^2) match torch's for the same weights (JAX: jax.grad
# returns a module-shaped pytree; MXNet: autograd.record + backward).


@pytest.mark.parametrize("name", ["jax", "mxnet"])
@pytest.mark.parametrize("make", [mha, additive], ids=["mha", "additive"])
def test_gradients_match_torch(name, make):
    torch_backend = load_backend("torch")
    B = load_backend(name)
    q, k, v = qkv(11)
    lens = np.array([[1, 3, 5], [2, 2, 4]])
    src = make(torch_backend)
    squared_output(torch_backend, src, q, k, v, lens).backward()
    want = {n: p.grad.numpy() for n, p in src.named_parameters()}
    m = am.set_params(make(B), am.get_params(src))
    if name == "jax":
        import jax

        grads = jax.jit(jax.grad(lambda mod: squared_output(B, mod, q, k, v, lens)))(m)
        assert type(grads) is type(m)
        got = {n: B.to_numpy(g) for n, g in grads.named_arrays().items()}
    else:
        from mxnet import autograd

        with autograd.record():
            loss = squared_output(B, m, q, k, v, lens)
        loss.backward()
        got = {n: p.grad().asnumpy() for n, p in m._collect_params_with_prefix().items()}
    assert list(got) == list(want)
    for n in want:
        assert np.abs(want[n]).sum() > 0, n
        np.testing.assert_allclose(got[n], want[n], rtol=1e-4, atol=1e-5, err_msg=n)


# ---------------------------------------------------------------------------
# 4. NumPy: a plain object that cannot train


def test_numpy_modules_are_plain_objects_that_cannot_train():
    B = load_backend("numpy")
    from attention_multi.backends.plain_module import PlainModule

    m = mha(B)
    ours = ("attention_multi.modules", "attention_multi.core")
    bases = [c for c in type(m).__mro__ if not c.__module__.startswith(ours)]
    assert bases == [PlainModule, object]
    assert all(isinstance(x, np.ndarray) for x in am.get_params(m).values())
    nw = am.NWKernelRegression(backend=B)
    x = np.linspace(0, 4, 6).astype(np.float32)
    with pytest.raises(NotImplementedError) as info:
        am.train_kernel_regression(nw, x, np.sin(x), epochs=1, lr=0.5)
    message = str(info.value)
    assert "numpy" in message and all(n in message for n in ("torch", "jax", "mxnet"))


# ---------------------------------------------------------------------------
# 5. Ready after construction, initialized as nn.Linear


def test_parameters_are_initialized_like_nn_linear(backend):
    layer = am.Linear(1024, 256, backend=backend)
    w, b = (f64(backend, layer.named_arrays()[n]) for n in ("weight", "bias"))
    bound = 1 / math.sqrt(1024)
    assert w.shape == (256, 1024) and b.shape == (256,)
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound
    assert abs(w.std() / (bound / math.sqrt(3)) - 1) < 0.01
    assert abs(w.mean()) < 0.01 * bound
    assert np.unique(b).size > 200 and b.std() > 0.4 * bound

    m = mha(backend)
    fan_in = {"W_q": 4, "W_k": 5, "W_v": 6, "W_o": 8}
    scaled = []  # each value / its bound: U(-1, 1)
    for name, value in am.get_params(m).items():
        bound = 1 / math.sqrt(fan_in[name.split(".")[0]])
        assert np.abs(value).max() <= bound, name
        assert np.unique(value).size > value.size // 2, name
        scaled.extend(value.ravel() / bound)
    assert len(scaled) == 216 and max(scaled) > 0.8 and min(scaled) < -0.8
    a = additive(backend)
    for name, n_in in (("W_k.weight", 5), ("W_q.weight", 4), ("w_v.weight", 7)):
        value = am.get_params(a)[name]
        assert np.abs(value).max() <= 1 / math.sqrt(n_in), name
        assert np.unique(value).size > value.size // 2, name
    ws = [float(am.get_params(am.NWKernelRegression(backend=backend))["w"][0]) for _ in range(20)]
    assert all(0 <= w < 1 for w in ws) and len(set(ws)) > 1
    # Ready: a call works without initialize().
    out = m(*(put(backend, a) for a in qkv(12)))
    assert tuple(out.shape) == (2, 3, 8)


# ---------------------------------------------------------------------------
# 6. train() / eval() switch dropout


def test_dot_product_dropout_eval_is_exact_train_drops_p(backend):
    r = np.random.default_rng(13)
    batch, n = 5, 50  # 12500 weights
    q = r.normal(size=(batch, n, 8)).astype(np.float32)
    k = r.normal(size=(batch, n, 8)).astype(np.float32)
    eye = np.tile(np.eye(n, dtype=np.float32), (batch, 1, 1))
    _, want = oracle.dot_product_attention(q, k, eye, None)
    m = am.DotProductAttention(P_DROP, backend=backend)
    args = [put(backend, a) for a in (q, k, eye)]

    assert m.eval() is m and not m.training
    np.testing.assert_allclose(f64(backend, m(*args)), want, rtol=1e-5, atol=1e-7)
    assert m.train() is m and m.training
    out = f64(backend, m(*args, **drop_key(backend)))
    weights = f64(backend, m.attention_weights)
    np.testing.assert_allclose(weights, want, rtol=1e-5, atol=1e-7)
    assert (weights != 0).all()
    dropped = out == 0
    assert abs(dropped.mean() - P_DROP) < 0.03
    np.testing.assert_allclose(out[~dropped], weights[~dropped] / (1 - P_DROP), rtol=1e-6)


def test_multi_head_train_eval_reaches_the_inner_attention(backend):
    q, k, v = qkv(14)
    lens = np.array([3, 4])
    m = mha(backend, dropout=0.5)
    args = [put(backend, a) for a in (q, k, v)]
    m.eval()
    assert not m.training and not m.attention.training and not m.W_q.training
    want, _ = oracle.multi_head_attention(am.get_params(m), q, k, v, lens, 2)
    np.testing.assert_allclose(f64(backend, m(*args, lens)), want, rtol=1e-5, atol=1e-6)
    m.train()
    assert m.training and m.attention.training
    trained = f64(backend, m(*args, lens, **drop_key(backend)))
    assert np.abs(trained - want).max() > 1e-3
    m.attention.eval()  # only the inner dropout matters
    np.testing.assert_allclose(f64(backend, m(*args, lens)), want, rtol=1e-5, atol=1e-6)


def test_positional_encoding_dropout(backend):
    X = np.random.default_rng(15).normal(size=(2, 200, 32)).astype(np.float32)
    want = oracle.positional_encoding(X)
    pe = am.PositionalEncoding(32, P_DROP, max_len=300, backend=backend)
    pe.eval()
    np.testing.assert_allclose(f64(backend, pe(put(backend, X))), want, rtol=1e-5, atol=1e-5)
    pe.train()
    out = f64(backend, pe(put(backend, X), **drop_key(backend)))
    dropped = out == 0
    assert abs(dropped.mean() - P_DROP) < 0.03
    np.testing.assert_allclose(out[~dropped], want[~dropped] / (1 - P_DROP), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# 7. get_params / set_params


def test_get_params_is_numpy_in_out_in_layout(backend):
    m = mha(backend)
    params = am.get_params(m)
    assert list(params) == MHA_BIAS_NAMES
    assert all(type(x) is np.ndarray and x.dtype == np.float32 for x in params.values())
    assert params["W_q.weight"].shape == (8, 4) and params["W_k.weight"].shape == (8, 5)
    assert params["W_v.weight"].shape == (8, 6) and params["W_o.weight"].shape == (8, 8)
    # (out, in): y = x W^T + b
    x = np.random.default_rng(16).normal(size=(2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(
        f64(backend, m.W_q(put(backend, x))),
        oracle.linear(x, params["W_q.weight"], params["W_q.bias"]),
        rtol=1e-5,
        atol=1e-6,
    )


def test_set_params_is_strict_and_atomic(backend):
    m = mha(backend)
    good = am.get_params(mha(backend))
    before = am.get_params(m)

    missing = {n: x for n, x in good.items() if n != "W_o.bias"}
    with pytest.raises(ValueError, match=r"missing \['W_o.bias'\], unknown \[\]"):
        am.set_params(m, missing)
    with pytest.raises(ValueError, match=r"missing \[\], unknown \['W_x.weight'\]"):
        am.set_params(m, {**good, "W_x.weight": np.zeros((8, 4))})
    wrong = {**good, "W_o.weight": np.zeros((8, 7))}
    with pytest.raises(ValueError, match=r"'W_o.weight' has shape \(8, 7\).*expects \(8, 8\)"):
        am.set_params(m, wrong)
    with pytest.raises(ValueError, match=r"'W_k.weight' has shape \(5, 8\).*expects \(8, 5\)"):
        am.set_params(m, {**good, "W_k.weight": good["W_k.weight"].T})
    for n, x in am.get_params(m).items():  # nothing was loaded by the failed calls
        np.testing.assert_array_equal(x, before[n])

    assert am.set_params(m, good) is m
    for n, x in am.get_params(m).items():
        np.testing.assert_array_equal(x, good[n])


def test_set_params_casts_to_the_module_dtype(backend):
    m = mha(backend)
    am.set_params(m, {n: x.astype(np.float64) + 1e-9 for n, x in am.get_params(m).items()})
    assert {backend.dtype_name(x) for x in m.named_arrays().values()} == {"float32"}
    m64 = am.Linear(4, 3, backend=backend, dtype="float64")
    values = {n: np.full(x.shape, 0.1, np.float32) for n, x in am.get_params(m64).items()}
    am.set_params(m64, values)
    assert list(values) == ["weight", "bias"]
    assert {backend.dtype_name(x) for x in m64.named_arrays().values()} == {"float64"}
    assert all((x == np.float64(np.float32(0.1))).all() for x in am.get_params(m64).values())
    nw = am.NWKernelRegression(backend=backend)
    am.set_params(nw, {"w": [0.25]})
    assert backend.dtype_name(nw.named_arrays()["w"]) == "float32"
    assert am.get_params(nw)["w"].tolist() == [0.25]


@pytest.mark.parametrize("make", [mha, additive], ids=["mha", "additive"])
def test_torch_params_give_identical_outputs(backend, make):
    torch_backend = load_backend("torch")
    q, k, v = qkv(17)
    lens = np.array([2, 4])
    src = make(torch_backend)
    want = f64(torch_backend, src(*(put(torch_backend, a) for a in (q, k, v)), lens))
    m = am.set_params(make(backend), am.get_params(src))
    got = f64(backend, m(*(put(backend, a) for a in (q, k, v)), lens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        f64(backend, m.attention_weights),
        f64(torch_backend, src.attention_weights),
        rtol=1e-5,
        atol=1e-7,
    )


def test_get_params_in_keras_layout(backend):
    """``layout="keras"``: each Linear's ``X.weight`` (out, in) is ``X.kernel``
    (in, out), as a Keras Dense has it; biases and NW's ``w`` are as they are."""
    m = mha(backend)
    torch_layout, keras_layout = am.get_params(m), am.get_params(m, layout="keras")
    assert list(keras_layout) == [n.replace(".weight", ".kernel") for n in MHA_BIAS_NAMES]
    assert keras_layout["W_q.kernel"].shape == (4, 8) and keras_layout["W_k.kernel"].shape == (5, 8)
    assert keras_layout["W_v.kernel"].shape == (6, 8) and keras_layout["W_q.bias"].shape == (8,)
    for name, value in torch_layout.items():
        kernel = keras_layout.get(name.replace(".weight", ".kernel"))
        want = value.T if name.endswith(".weight") else value
        assert type(kernel) is np.ndarray and kernel.dtype == np.float32
        np.testing.assert_array_equal(kernel, want)
    # x @ kernel + bias, as Keras' Dense computes
    x = np.random.default_rng(61).normal(size=(2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(
        f64(backend, m.W_q(put(backend, x))),
        x.astype(np.float64) @ keras_layout["W_q.kernel"] + keras_layout["W_q.bias"],
        rtol=1e-5,
        atol=1e-6,
    )
    assert list(am.get_params(additive(backend), layout="keras")) == [
        "W_k.kernel",
        "W_q.kernel",
        "w_v.kernel",
    ]
    lin = am.get_params(am.Linear(3, 2, backend=backend), layout="keras")
    assert {n: x.shape for n, x in lin.items()} == {"kernel": (3, 2), "bias": (2,)}
    nw = am.set_params(am.NWKernelRegression(backend=backend), {"w": [0.25]})
    assert am.get_params(nw, layout="keras")["w"].tolist() == [0.25]
    assert am.get_params(m, layout="torch").keys() == torch_layout.keys()
    with pytest.raises(ValueError, match=r"layout must be 'torch' or 'keras', got 'tf'"):
        am.get_params(m, layout="tf")


def test_set_params_takes_the_keras_layout_entry_by_entry(backend):
    q, k, v = qkv(61)
    lens = put(backend, np.array([2, 5]), "int32")
    src, m = mha(backend).eval(), mha(backend).eval()
    want = backend.to_numpy(src(put(backend, q), put(backend, k), put(backend, v), lens))
    params = am.get_params(src, layout="keras")
    assert am.set_params(m, params) is m  # the round trip: identical outputs
    got = backend.to_numpy(m(put(backend, q), put(backend, k), put(backend, v), lens))
    assert got.tobytes() == want.tobytes()
    for name, value in am.get_params(m).items():
        np.testing.assert_array_equal(value, am.get_params(src)[name])
    # the two namings mixed, one per weight
    mixed = {**params, "W_k.weight": params["W_k.kernel"].T}
    del mixed["W_k.kernel"]
    fresh = am.set_params(mha(backend), mixed)
    np.testing.assert_array_equal(am.get_params(fresh)["W_k.weight"], params["W_k.kernel"].T)

    before = am.get_params(m)
    with pytest.raises(
        ValueError,
        match=r"both 'W_k.kernel' and 'W_k.weight' are given to MultiHeadAttention: "
        r"they are one parameter",
    ):
        am.set_params(m, {**params, "W_k.weight": params["W_k.kernel"].T})
    with pytest.raises(
        ValueError,
        match=r"parameter 'W_k.kernel' has shape \(8, 5\), the module expects \(5, 8\) "
        r"\(Keras' \(in, out\) layout: the transpose of 'W_k.weight', \(8, 5\)\)",
    ):
        am.set_params(m, {**params, "W_k.kernel": params["W_k.kernel"].T})
    no_kernel = {n: x for n, x in params.items() if n != "W_o.kernel"}
    with pytest.raises(
        ValueError,
        match=r"missing \['W_o.weight'\], unknown \[\].*"
        r"given transposed, in Keras' \(in, out\) layout: 'W_o.kernel' for 'W_o.weight'",
    ):
        am.set_params(m, no_kernel)
    with pytest.raises(ValueError, match=r"missing \[\], unknown \['W_x.kernel'\]"):
        am.set_params(m, {**params, "W_x.kernel": params["W_q.kernel"]})
    with pytest.raises(ValueError, match=r"unknown \['w.kernel'\]"):  # (NW's w is no Linear)
        am.set_params(am.NWKernelRegression(backend=backend), {"w": [1.0], "w.kernel": [1.0]})
    for n, x in am.get_params(m).items():  # nothing was loaded by the failed calls
        np.testing.assert_array_equal(x, before[n])


class _Variable:
    """A Keras variable, as far as keras_params and set_keras_params use one."""

    def __init__(self, value):
        self.value = np.asarray(value, np.float32)

    def numpy(self):
        return self.value.copy()

    def assign(self, value):
        assert value.shape == self.value.shape and value.dtype == self.value.dtype
        self.value = value.copy()


class _Dense:
    """A Keras 3 ``Dense``: ``kernel`` (in, out) raises until the layer is built."""

    def __init__(self, units, use_bias=False):
        self.units, self.use_bias, self._kernel = units, use_bias, None

    def build(self, in_features, rng):
        self._kernel = _Variable(rng.normal(size=(in_features, self.units)))
        self.bias = _Variable(rng.normal(size=self.units)) if self.use_bias else None

    @property
    def kernel(self):
        if self._kernel is None:
            raise AttributeError("You must build the layer before accessing `kernel`.")
        return self._kernel


class _D2lMultiHeadAttention:
    """d2l's TensorFlow MultiHeadAttention's attributes (no TensorFlow)."""

    def __init__(self, num_hiddens, bias):
        self.num_heads, self.attention, self.name = 2, object(), "mha"
        self.W_q, self.W_k, self.W_v, self.W_o = (_Dense(num_hiddens, bias) for _ in range(4))
        self._tracker = _Dense(3)  # (private: not a weight of the layer)

    def build(self, query_size, key_size, value_size, seed=0):
        rng = np.random.default_rng(seed)
        for dense, size in zip((self.W_q, self.W_k, self.W_v, self.W_o),
                               (query_size, key_size, value_size, self.W_o.units)):  # fmt: skip
            dense.build(size, rng)


@pytest.mark.parametrize("bias", [False, True])
def test_keras_params_load_a_keras_layer_by_attribute_name(backend, bias):
    """``keras_params`` reads a Keras layer's Dense weights by attribute name,
    duck-typed (no TensorFlow here); ``set_params`` loads them, ``set_keras_params``
    writes ours back. Expected: float64 NumPy of d2l's layer (x @ kernel + bias)."""
    theirs = _D2lMultiHeadAttention(8, bias)
    with pytest.raises(ValueError, match=r"_D2lMultiHeadAttention.W_q \(_Dense\) is not built"):
        am.keras_params(theirs)
    theirs.build(4, 5, 6)
    params = am.keras_params(theirs)
    names = [f"{x}.{w}" for x in ("W_q", "W_k", "W_v", "W_o") for w in ("kernel", "bias")]
    assert list(params) == [n for n in names if bias or n.endswith("kernel")]
    assert params["W_q.kernel"].shape == (4, 8) and params["W_k.kernel"].shape == (5, 8)
    ours = am.set_params(mha(backend, bias), params).eval()
    q, k, v = qkv(62)
    lens = np.array([3, 5])
    # d2l's layer in float64 NumPy: the same heads, projections x @ kernel + b
    as_torch = {
        n.replace(".kernel", ".weight"): x.T if n.endswith("kernel") else x
        for n, x in params.items()
    }
    want, weights = oracle.multi_head_attention(as_torch, q, k, v, lens, 2)
    got = ours(put(backend, q), put(backend, k), put(backend, v), put(backend, lens, "int32"))
    np.testing.assert_allclose(f64(backend, got), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f64(backend, ours.attention_weights), weights, atol=1e-6)

    # the way back: ours into the Keras layer, in either layout
    other = mha(backend, bias)
    for layout in ("torch", "keras"):
        assert am.set_keras_params(theirs, am.get_params(other, layout=layout)) is theirs
        for name, value in am.get_params(other, layout="keras").items():
            attr, weight = name.split(".")
            np.testing.assert_array_equal(getattr(getattr(theirs, attr), weight).numpy(), value)
    back = am.keras_params(theirs)
    with pytest.raises(ValueError, match=r"both 'W_q.kernel' and 'W_q.weight' are given"):
        am.set_keras_params(theirs, {**back, "W_q.weight": back["W_q.kernel"].T})
    with pytest.raises(ValueError, match=r"missing \['W_v.kernel'\], unknown \['W_x.kernel'\]"):
        am.set_keras_params(
            theirs, {**{n: x for n, x in back.items() if n != "W_v.kernel"}, "W_x.kernel": 0}
        )
    with pytest.raises(
        ValueError,
        match=r"'W_q.weight' has shape \(4, 8\), the layer expects \(8, 4\) "
        r"\(PyTorch's \(out, in\) layout: the transpose of 'W_q.kernel', \(4, 8\)\)",
    ):
        am.set_keras_params(
            theirs, {**{n: x for n, x in back.items() if n != "W_q.kernel"},
                     "W_q.weight": back["W_q.kernel"]}
        )  # fmt: skip
    np.testing.assert_array_equal(am.keras_params(theirs)["W_q.kernel"], back["W_q.kernel"])
    # a Dense itself: kernel and bias, for a Linear
    dense = _Dense(3, use_bias=True)
    dense.build(2, np.random.default_rng(1))
    lin = am.set_params(am.Linear(2, 3, backend=backend), am.keras_params(dense))
    np.testing.assert_array_equal(am.get_params(lin)["weight"], dense.kernel.numpy().T)
    assert am.keras_params(object()) == {}  # (no Dense: DotProductAttention)
    with pytest.raises(TypeError, match=r"keras_params takes a Keras layer;.*get_params"):
        am.keras_params(ours)  # (ours, even on TensorFlow, are not Dense layers)
    with pytest.raises(TypeError, match=r"set_keras_params takes a Keras layer;.*set_params"):
        am.set_keras_params(ours, params)
    if bias:  # (a missing bias: no hint about kernels)
        no_bias = {n: x for n, x in params.items() if n != "W_q.bias"}
        with pytest.raises(ValueError, match=r"missing \['W_q.bias'\], unknown \[\]; [^;]*$"):
            am.set_params(ours, no_bias)


# ---------------------------------------------------------------------------
# 8. Nadaraya-Watson training (seed 003)

W0, EPOCHS, LR = 0.5, 5, 0.5


def nw_data():
    r = np.random.default_rng(3)
    x = np.sort(r.uniform(0, 5, 50)).astype(np.float32)
    y = (2 * np.sin(x) + x**0.8 + r.normal(0, 0.5, 50)).astype(np.float32)
    return x, y


def nw_loss_and_grad(w, x, y):
    """Summed squared error of the leave-one-out NW model and d/dw, float64."""
    n = len(x)
    others = ~np.eye(n, dtype=bool)
    keys = np.tile(x, (n, 1))[others].reshape(n, -1)
    values = np.tile(y, (n, 1))[others].reshape(n, -1)
    d = x[:, None] - keys
    s = -((d * w) ** 2) / 2
    a = np.exp(s - s.max(axis=1, keepdims=True))
    a /= a.sum(axis=1, keepdims=True)
    f = (a * values).sum(axis=1)
    err = f - y
    df_dw = (a * (values - f[:, None]) * (-d * d * w)).sum(axis=1)  # softmax rule
    return (err**2).sum(), (2 * err * df_dw).sum()


def nw_reference():
    x, y = (a.astype(np.float64) for a in nw_data())
    losses, w = [], W0
    for _ in range(EPOCHS):
        loss, grad = nw_loss_and_grad(w, x, y)
        losses.append(loss)
        w -= LR * grad
    return np.array(losses), w


def test_nw_reference_gradient_matches_finite_differences():
    x, y = (a.astype(np.float64) for a in nw_data())
    _, grad = nw_loss_and_grad(W0, x, y)
    h = 1e-6
    numeric = (nw_loss_and_grad(W0 + h, x, y)[0] - nw_loss_and_grad(W0 - h, x, y)[0]) / (2 * h)
    assert grad == pytest.approx(numeric, rel=1e-6)
    # The forward matches the oracle's NW formula.
    n = len(x)
    others = ~np.eye(n, dtype=bool)
    keys = np.tile(x, (n, 1))[others].reshape(n, -1)
    values = np.tile(y, (n, 1))[others].reshape(n, -1)
    pred = oracle.nw_kernel_regression(W0, x, keys, values)
    assert ((pred - y) ** 2).sum() == pytest.approx(nw_loss_and_grad(W0, x, y)[0], rel=1e-12)


def train(B):
    x, y = nw_data()
    net = am.set_params(am.NWKernelRegression(backend=B), {"w": [W0]})
    losses = am.train_kernel_regression(net, put(B, x), put(B, y), epochs=EPOCHS, lr=LR)
    return np.array([float(v) for v in losses]), float(am.get_params(net)["w"][0])


@pytest.mark.parametrize("name", ["torch", "jax", "mxnet"])
def test_nw_training_matches_float64_numpy(name):
    B = load_backend(name)
    want, w_want = nw_reference()
    losses, w = train(B)
    assert len(losses) == EPOCHS
    np.testing.assert_allclose(losses, want, rtol=1e-4)
    assert w == pytest.approx(w_want, rel=1e-4)
    assert losses[-1] < losses[0]
    assert want[-1] < 0.5 * want[0]


@pytest.mark.parametrize("name", ["jax", "mxnet"])
def test_nw_training_curve_matches_torch(name):
    torch_losses, torch_w = train(load_backend("torch"))
    losses, w = train(load_backend(name))
    np.testing.assert_allclose(losses, torch_losses, rtol=1e-4)
    assert w == pytest.approx(torch_w, rel=1e-4)


def test_nw_training_matches_d2l_torch_loop():
    """Seed 003 verbatim: nn.MSELoss(reduction='none'), l.sum().backward(), SGD."""
    load_backend("torch")
    import torch
    from torch import nn

    x, y = (torch.tensor(a) for a in nw_data())
    n = len(x)
    others = (1 - torch.eye(n)).type(torch.bool)
    keys = x.repeat((n, 1))[others].reshape((n, -1))
    values = y.repeat((n, 1))[others].reshape((n, -1))
    net = am.set_params(am.NWKernelRegression(backend="torch"), {"w": [W0]})
    loss = nn.MSELoss(reduction="none")
    trainer = torch.optim.SGD(net.parameters(), lr=LR)
    d2l_losses = []
    for _ in range(EPOCHS):
        trainer.zero_grad()
        batch_loss = loss(net(x, keys, values), y)
        batch_loss.sum().backward()
        trainer.step()
        d2l_losses.append(float(batch_loss.sum()))
    losses, w = train(load_backend("torch"))
    np.testing.assert_allclose(losses, d2l_losses, rtol=1e-6)
    assert w == pytest.approx(float(net.w), rel=1e-6)
    assert tuple(net.attention_weights.shape) == (n, n - 1)


# ---------------------------------------------------------------------------
# 9. show_heatmaps


def test_show_heatmaps_returns_a_figure(backend):
    mpl = pytest.importorskip("matplotlib")
    mpl.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    r = np.random.default_rng(18)
    data = r.random((2, 3, 4, 5)).astype(np.float32)
    fig = am.show_heatmaps(
        put(backend, data), "Keys", "Queries", titles=["a", "b", "c"], figsize=(6, 4)
    )
    try:
        assert isinstance(fig, Figure)
        assert len(fig.axes) == 2 * 3 + 1  # one per matrix + colorbar
        grid = fig.axes[:6]
        assert [ax.get_title() for ax in grid] == ["a", "b", "c"] * 2
        np.testing.assert_allclose(np.asarray(grid[5].images[0].get_array()), data[1, 2], rtol=1e-6)
        assert [ax.get_xlabel() for ax in grid] == ["", "", "", "Keys", "Keys", "Keys"]
        assert [ax.get_ylabel() for ax in grid] == ["Queries", "", "", "Queries", "", ""]
    finally:
        plt.close(fig)
    # attention weights straight from a module (torch: they require grad)
    m = mha(backend)
    m.eval()
    m(*(put(backend, a) for a in qkv(19)), np.array([2, 5]))
    fig = am.show_heatmaps(m.attention_weights.reshape((2, 2, 3, 5)), "Keys", "Queries")
    try:
        assert isinstance(fig, Figure) and len(fig.axes) == 5
        assert all(ax.get_title() == "" for ax in fig.axes[:4])
    finally:
        plt.close(fig)
    with pytest.raises(ValueError, match=r"\(4, 5, 6\)"):
        am.show_heatmaps(put(backend, np.zeros((4, 5, 6))), "k", "q")
    assert plt.get_fignums() == []


# ---------------------------------------------------------------------------
# 10. attention_weights after a call


def test_attention_weights_shapes_and_values(backend):
    q, k, v = qkv(20)
    lens = np.array([2, 4])
    per_query = np.array([[1, 2, 5], [0, 3, 4]])

    dot = am.DotProductAttention(0.0, backend=backend)
    assert dot.attention_weights is None
    qk = np.random.default_rng(21).normal(size=(2, 3, 5)).astype(np.float32)
    dot(put(backend, qk), put(backend, k), put(backend, v), lens)
    _, want = oracle.dot_product_attention(qk, k, v, lens)
    assert tuple(dot.attention_weights.shape) == (2, 3, 5)
    np.testing.assert_allclose(f64(backend, dot.attention_weights), want, rtol=1e-5, atol=1e-7)

    add = additive(backend)
    add(put(backend, q), put(backend, k), put(backend, v), per_query)
    _, want = oracle.additive_attention(am.get_params(add), q, k, v, per_query)
    assert tuple(add.attention_weights.shape) == (2, 3, 5)
    np.testing.assert_allclose(f64(backend, add.attention_weights), want, rtol=1e-5, atol=1e-7)
    assert (f64(backend, add.attention_weights)[1, 0] == 0).all()

    m = mha(backend)
    m(put(backend, q), put(backend, k), put(backend, v), lens)
    _, want = oracle.multi_head_attention(am.get_params(m), q, k, v, lens, 2)
    assert tuple(m.attention_weights.shape) == (4, 3, 5)
    np.testing.assert_allclose(f64(backend, m.attention_weights), want, rtol=1e-5, atol=1e-7)

    x, y = nw_data()
    n = 6
    queries, keys = x[:n], np.stack([x[i : i + 4] for i in range(n)])
    values = np.stack([y[i : i + 4] for i in range(n)])
    nw = am.set_params(am.NWKernelRegression(backend=backend), {"w": [1.5]})
    out = nw(put(backend, queries), put(backend, keys), put(backend, values))
    assert tuple(nw.attention_weights.shape) == (n, 4)
    scores = -(((queries[:, None].astype(np.float64) - keys) * 1.5) ** 2) / 2
    want = oracle.softmax_where(scores, True)
    np.testing.assert_allclose(f64(backend, nw.attention_weights), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        f64(backend, out),
        oracle.nw_kernel_regression(1.5, queries, keys, values),
        rtol=1e-5,
        atol=1e-6,
    )


def test_modules_pickle_and_deepcopy_on_every_backend(backend):
    import copy
    import pickle

    module = am.MultiHeadAttention(4, 4, 4, 8, 2, 0.0, bias=True, backend=backend).eval()
    x = backend.asarray(np.random.default_rng(0).normal(size=(2, 3, 4)), "float32")
    want = backend.to_numpy(module(x, x, x, np.array([1, 3])))
    for clone in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
        assert type(clone) is type(module) and not clone.training
        np.testing.assert_array_equal(backend.to_numpy(clone(x, x, x, np.array([1, 3]))), want)
