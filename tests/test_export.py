"""Tracing as a first-class mode: torch.export, torch.compile(fullgraph=True),
torch.jit.trace and ONNX export on torch; jax.jit, jax.vmap and jax.export
(serialized and read back) on JAX. Each traced program is compared with the
eager module on lengths it was not traced with."""

import importlib.util
import warnings

import numpy as np
import pytest

import attention_multi as am
from attention_multi.testing import assert_close

TOL = dict(rtol=1e-5, atol=1e-6)
X = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
LENS = {
    1: (np.array([3, 5]), np.array([1, 4])),
    2: (np.array([[0, 2, 5, 3, 1], [4, 4, 4, 4, 4]]), np.array([[5, 0, 1, 2, 3], [1, 2, 3, 4, 9]])),
}
MASK = np.random.default_rng(1).random((2, 5, 5)) > 0.3
BIAS = np.random.default_rng(2).standard_normal((2, 5, 5)).astype(np.float32)
FORMS = {
    "lens": {},
    "causal": {"causal": True},
    "window": {"window": (1, 2)},
    "mask": {"mask": MASK},
    "bias": {"bias": BIAS},
}


def make(name, backend):
    """A module in eval mode, with its forward's (queries, keys, values) size 8."""
    if name == "dot":
        return am.DotProductAttention(0.0, backend=backend).eval()
    if name == "mha":
        return am.MultiHeadAttention(8, 8, 8, 8, 2, 0.0, backend=backend).eval()
    return am.AdditiveAttention(8, 8, 6, 0.0, backend=backend).eval()


# ---- torch ------------------------------------------------------------------------

torch = pytest.importorskip("torch") if importlib.util.find_spec("torch") else None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _torch_forms(form):
    """The keyword arguments of a mask form, arrays as tensors (graph inputs)."""
    return {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in FORMS[form].items()}


class _Call(torch.nn.Module if torch else object):
    """``module(x, x, x, lens, **forms)`` with the forms' arrays as inputs."""

    def __init__(self, module, form):
        super().__init__()
        self.module, self.form = module, form
        self.statics = {k: v for k, v in FORMS[form].items() if not isinstance(v, np.ndarray)}

    def forward(self, x, lens, *arrays):
        names = [k for k, v in FORMS[self.form].items() if isinstance(v, np.ndarray)]
        return self.module(x, x, x, lens, **self.statics, **dict(zip(names, arrays)))


def _arrays(form):
    return tuple(torch.tensor(v) for v in FORMS[form].values() if isinstance(v, np.ndarray))


CASES = [(name, dim, form) for name in ("dot", "mha") for dim in (1, 2) for form in FORMS] + [
    ("additive", dim, "lens") for dim in (1, 2)
]


@needs_torch
@pytest.mark.parametrize("name,dim,form", CASES)
def test_torch_export_equals_eager_on_new_lengths(name, dim, form):
    torch.manual_seed(0)
    call = _Call(make(name, "torch"), form)
    x = torch.tensor(X)
    traced_lens, new_lens = (torch.tensor(a) for a in LENS[dim])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(call, (x, traced_lens) + _arrays(form))
    x2 = torch.tensor(X[::-1].copy())
    got = program.module()(x2, new_lens, *_arrays(form))
    assert_close(got, call(x2, new_lens, *_arrays(form)), **TOL)
    # no host round trip in the program: nothing specialized on the lengths
    assert "_local_scalar_dense" not in program.graph_module.code


@needs_torch
def test_torch_export_other_modules():
    x = torch.tensor(X)
    pe = am.PositionalEncoding(8, 0.0, max_len=10, backend="torch").eval()
    program = torch.export.export(pe, (x,))
    assert_close(program.module()(2 * x), pe(2 * x), **TOL)
    nw = am.NWKernelRegression(backend="torch")
    q, kv = torch.tensor(X[0, :, 0]), torch.tensor(X[1, :, :])
    program = torch.export.export(nw, (q, kv, kv))
    assert_close(program.module()(2 * q, kv, kv), nw(2 * q, kv, kv), **TOL)


@needs_torch
def test_torch_traced_lengths_act_as_clipped():
    """While traced, a negative length masks the whole row and one past the
    end masks nothing (the checks need the host), as under jax.jit."""
    call = _Call(make("dot", "torch"), "lens")
    x = torch.tensor(X)
    program = torch.export.export(call, (x, torch.tensor([3, 5])))
    got = program.module()(x, torch.tensor([-1, 99]))
    assert_close(got, call(x, torch.tensor([0, 5])), **TOL)
    assert float(got[0].abs().max()) == 0.0
    with pytest.raises(ValueError, match="valid_lens must be >= 0"):  # eager still checks
        call(x, torch.tensor([-1, 99]))


@needs_torch
def test_torch_export_still_checks_shapes():
    call = _Call(make("dot", "torch"), "lens")
    with pytest.raises(ValueError, match="valid_lens must have shape"):
        torch.export.export(call, (torch.tensor(X), torch.tensor([1, 2, 3])))


@needs_torch
@pytest.mark.parametrize(
    "name,dim,form",
    [
        ("mha", 1, "lens"),
        ("mha", 2, "causal"),
        ("dot", 2, "window"),
        ("dot", 1, "bias"),
        ("additive", 2, "lens"),
    ],
)
def test_torch_compile_fullgraph_forward_backward(name, dim, form):
    """One graph (``fullgraph=True``: a graph break is an error), forward and
    backward equal to eager, also on lengths it was not compiled with.
    ``aot_eager`` traces forward and backward as inductor does, without
    generating code (the inductor case is below)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    call = _Call(make(name, "torch"), form)
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    for lens in LENS[dim]:
        results = []
        for fn in (compiled, call):
            x = torch.tensor(X, requires_grad=True)
            out = fn(x, torch.tensor(lens), *_arrays(form))
            (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
            grads = [x.grad] + [p.grad for p in call.parameters()]
            results.append((out.detach(),) + tuple(g.clone() for g in grads))
            call.zero_grad()
        for got, expected in zip(*results):
            assert_close(got, expected, **TOL)


@pytest.mark.slow
@needs_torch
def test_torch_compile_inductor():
    torch._dynamo.reset()
    call = _Call(make("mha", "torch"), "lens")
    compiled = torch.compile(call, fullgraph=True)
    x = torch.tensor(X, requires_grad=True)
    out = compiled(x, torch.tensor(LENS[2][1]))
    out.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    expected = call(x, torch.tensor(LENS[2][1]))
    expected.sum().backward()
    assert_close(out, expected, **TOL)
    assert_close(grad, x.grad, **TOL)


@needs_torch
@pytest.mark.parametrize("name", ["dot", "mha", "additive"])
@pytest.mark.parametrize("dim", [1, 2])
def test_torch_jit_trace(name, dim):
    """Traced under ``no_grad`` and with gradients on (torch's default; its
    check traces again under ``no_grad`` and compares the graphs): the same
    answers for new lengths, and with gradients on the same gradients."""
    module = make(name, "torch")
    x = torch.tensor(X)
    new = torch.tensor(LENS[dim][1])
    for grad in (False, True):
        with torch.set_grad_enabled(grad), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(module, (x, x, x, torch.tensor(LENS[dim][0])))
        assert_close(traced(x, x, x, new), module(x, x, x, new), **TOL)
    grads = []
    for f in (traced, module) if list(module.parameters()) else ():
        module.zero_grad()
        f(x, x, x, new).square().sum().backward()
        grads.append([p.grad.clone() for p in module.parameters()])
    for a, b in zip(*grads):
        assert_close(a, b, **TOL)


def _onnx_required():
    """ONNX export is an extra (``attention-multi[onnx]``): the modern stack
    lists it in requirements/modern.txt, so there it must be installed; the
    legacy stack does not."""
    return np.lib.NumpyVersion(np.__version__) >= "2.0.0"


@pytest.mark.second_stack
@needs_torch
@pytest.mark.parametrize(
    "name,dim,form",
    [("mha", 1, "lens"), ("mha", 2, "causal"), ("dot", 1, "mask"), ("additive", 2, "lens")],
)
def test_onnx_export_runs_in_onnxruntime(name, dim, form, tmp_path):
    missing = [m for m in ("onnxscript", "onnxruntime") if importlib.util.find_spec(m) is None]
    if missing:
        if _onnx_required():
            pytest.fail(f"the modern stack requires {missing} (requirements/modern.txt)")
        pytest.skip(
            f"{', '.join(missing)} not installed: the onnx extra is not part "
            f"of this stack (requirements/legacy.txt)"
        )
    import onnxruntime

    call = _Call(make(name, "torch"), form)
    x = torch.tensor(X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            call, (x, torch.tensor(LENS[dim][0])) + _arrays(form), dynamo=True, verbose=False
        )
    path = tmp_path / "model.onnx"
    program.save(str(path))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    new = torch.tensor(LENS[dim][1])
    feeds = [x, new] + list(_arrays(form))
    names = [i.name for i in session.get_inputs()]
    assert len(names) == len(feeds)
    got = session.run(None, {n: f.numpy() for n, f in zip(names, feeds)})[0]
    assert_close(got, call(x, new, *_arrays(form)), **TOL)


# ---- JAX --------------------------------------------------------------------------

jax = pytest.importorskip("jax") if importlib.util.find_spec("jax") else None
needs_jax = pytest.mark.skipif(jax is None, reason="jax is not installed")


def _jax_modules():
    return {
        "dot": make("dot", "jax"),
        "mha": make("mha", "jax"),
        "additive": make("additive", "jax"),
    }


@pytest.mark.second_stack
@needs_jax
@pytest.mark.parametrize("dim", [1, 2])
def test_jax_jit_and_vmap_of_modules(dim):
    import jax.numpy as jnp

    x = jnp.asarray(X)
    for module in _jax_modules().values():

        def f(m, x, lens):
            return m(x, x, x, lens)

        for lens in LENS[dim][1:]:
            lens = jnp.asarray(lens)
            assert_close(jax.jit(f)(module, x, lens), f(module, x, lens), **TOL)
            # vmap over the batch: one element at a time, the module shared
            per_row = jax.vmap(lambda x, n, m=module: m(x[None], x[None], x[None], n[None])[0])
            assert_close(per_row(x, lens), f(module, x, lens), **TOL)


@pytest.mark.second_stack
@needs_jax
@pytest.mark.parametrize("name", ["dot", "mha", "additive", "pe", "nw"])
def test_jax_export_serialize_round_trip(name):
    """``jax.export`` of a function taking the module as an argument,
    serialized and read back, called with new lengths and new parameters."""
    if importlib.util.find_spec("flatbuffers") is None:
        pytest.fail("jax.export serialization needs flatbuffers (requirements/*.txt)")
    import jax.numpy as jnp
    from jax import export

    x = jnp.asarray(X)
    if name == "pe":
        module = am.PositionalEncoding(8, 0.0, max_len=10, backend="jax").eval()
        args, new_args = (x,), (2 * x,)

        def f(m, x):
            return m(x)
    elif name == "nw":
        module = am.NWKernelRegression(backend="jax")
        args = (x[0, :, 0], x[1], x[1])
        new_args = (2 * x[0, :, 0], x[1], x[1])

        def f(m, *a):
            return m(*a)
    else:
        module = _jax_modules()[name]
        args, new_args = (x, jnp.asarray(LENS[2][0])), (x, jnp.asarray(LENS[2][1]))

        def f(m, x, lens):
            return m(x, x, x, lens)

    exported = export.export(jax.jit(f))(module, *args)
    restored = export.deserialize(exported.serialize())
    assert_close(restored.call(module, *new_args), f(module, *new_args), **TOL)
    # other parameters of the same structure: the program takes them as inputs
    other = jax.tree_util.tree_map(lambda p: p * 0.5, module)
    assert_close(restored.call(other, *new_args), f(other, *new_args), **TOL)


@pytest.mark.second_stack
@needs_jax
def test_jax_export_serialized_names_are_stable():
    from attention_multi.backends import jax_module

    mha = make("mha", "jax")
    assert (
        jax_module.serialized_name(type(mha))
        == "attention_multi.modules.attention.MultiHeadAttention"
    )
    assert jax_module.serialized_name(type(mha.W_q)) == "attention_multi.modules.base.Linear"
