"""Porting MXNet (d2l Gluon) models: ``am.port.load_into`` and ``attention-multi port``.

The committed fixtures were written by MXNet (tests/fixtures/mxnet/README.md),
so everything but the tests at the end runs without MXNet: weights saved by
MXNet's ``save_parameters`` must reproduce MXNet's own outputs and attention
weights on every backend. The tests at the end run only where mxnet imports.
"""

import contextlib
import importlib.util
import warnings
from pathlib import Path

import numpy as np
import pytest

import attention_multi as am
from attention_multi.port import load_into, load_mxnet_params, save_mxnet_params
from tests.cli_runner import run_in_process

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "mxnet"

MHA = dict(key_size=5, query_size=5, value_size=5, num_hiddens=8, num_heads=2, dropout=0.5)
ADDITIVE = dict(key_size=2, query_size=20, num_hiddens=8, dropout=0.1)
# fixture -> (module class, constructor arguments, dtype, max abs error allowed)
CASES = {
    "mha_nobias": (am.MultiHeadAttention, dict(MHA, bias=False), "float32", 2e-5),
    "mha_bias": (am.MultiHeadAttention, dict(MHA, bias=True), "float32", 2e-5),
    "mha_bias_float64": (am.MultiHeadAttention, dict(MHA, bias=True), "float64", 1e-12),
    "additive": (am.AdditiveAttention, ADDITIVE, "float32", 2e-5),
}
MHA_SPEC = "key_size=5,query_size=5,value_size=5,num_hiddens=8,num_heads=2,dropout=0"


def fixture(name):
    with np.load(FIXTURES / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


def forward(module, data, dtype=None):
    """Run ``module`` (in eval mode) on a fixture's inputs; NumPy output and weights."""
    B = module.backend
    dtype = dtype or B.dtype_name(next(iter(module.named_arrays().values())))
    q, k, v = (am.asarray(data[n], dtype=dtype, backend=B) for n in ("queries", "keys", "values"))
    out = module.eval()(q, k, v, am.asarray(data["valid_lens"], backend=B))
    return B.to_numpy(out), B.to_numpy(module.attention_weights)


def assert_close(got, want, atol):
    assert got.shape == want.shape
    err = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    assert err <= atol, f"max abs error {err:.3g} > {atol:g}"


def test_port_is_reachable_as_am_port():
    assert am.port.load_mxnet_params is load_mxnet_params
    assert am.port.load_into is load_into
    assert "port" in am.__all__


# ---- committed MXNet fixtures, every backend ----


@pytest.mark.parametrize("name", list(CASES))
def test_fixture_reproduces_mxnet(name, backend):
    cls, kwargs, dtype, atol = CASES[name]
    module = load_into(cls(**kwargs, backend=backend, dtype=dtype), FIXTURES / f"{name}.params")
    data = fixture(name)
    for pname, value in am.get_params(module).items():  # loaded exactly, dtype kept
        assert value.dtype == dtype
        assert value.tobytes() == data["param:" + pname].tobytes(), pname
    out, weights = forward(module, data)
    assert out.dtype == dtype
    assert_close(out, data["output"], atol)
    assert_close(weights, data["attention_weights"], atol)


def test_float16_fixture(backend):
    """MXNet cannot run its float16 copy on CPU; ours runs it, near the float32 output."""
    module = am.MultiHeadAttention(**MHA, bias=True, backend=backend, dtype="float16")
    load_into(module, FIXTURES / "mha_bias_float16.params")
    want = fixture("mha_bias_float16")
    for pname, value in am.get_params(module).items():
        assert value.dtype == np.float16
        assert value.tobytes() == want["param:" + pname].tobytes(), pname
    data = fixture("mha_bias")
    out, weights = forward(module, data)
    assert out.dtype == np.float16
    assert_close(out, data["output"], 1e-2)
    assert_close(weights, data["attention_weights"], 1e-2)


def test_load_into_casts_to_the_module_dtype():
    module = load_into(
        am.MultiHeadAttention(**MHA, bias=True, dtype="float64"), FIXTURES / "mha_bias.params"
    )
    data = fixture("mha_bias")
    assert am.get_params(module)["W_q.weight"].dtype == np.float64
    out, _ = forward(module, data)
    assert_close(out, data["output"], 2e-5)


# ---- load_into errors ----


def test_load_into_name_mismatch_lists_file_and_module_names():
    path = FIXTURES / "mha_bias.params"
    module = am.MultiHeadAttention(**MHA, bias=False)
    before = am.get_params(module)
    with pytest.raises(ValueError) as info:
        load_into(module, path)
    msg = str(info.value)
    assert str(path) in msg and "does not match MultiHeadAttention" in msg
    assert "only in the file: W_q.bias, W_k.bias, W_v.bias, W_o.bias" in msg
    assert "bias=True" in msg
    assert (
        "the file holds: W_q.weight (8, 5), W_q.bias (8,), W_k.weight (8, 5), "
        "W_k.bias (8,), W_v.weight (8, 5), W_v.bias (8,), W_o.weight (8, 8), "
        "W_o.bias (8,)"
    ) in msg
    assert (
        "MultiHeadAttention expects: W_q.weight (8, 5), W_k.weight (8, 5), "
        "W_v.weight (8, 5), W_o.weight (8, 8)"
    ) in msg
    after = am.get_params(module)  # nothing was loaded
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_load_into_other_module_and_shapes():
    with pytest.raises(ValueError) as info:
        load_into(am.MultiHeadAttention(**MHA), FIXTURES / "additive.params")
    msg = str(info.value)
    assert "only in the file: W_k.weight, W_q.weight, w_v.weight" not in msg  # W_k/W_q are shared
    assert "only in the file: w_v.weight" in msg
    assert "missing from the file: W_v.weight, W_o.weight" in msg
    assert "W_q.weight: shape (8, 20) in the file, (8, 5) in MultiHeadAttention" in msg
    with pytest.raises(
        ValueError,
        match=r"W_o.weight: shape \(8, 8\) in the file, "
        r"\(16, 16\) in MultiHeadAttention",
    ):
        load_into(am.MultiHeadAttention(5, 5, 5, 16, 2, 0), FIXTURES / "mha_nobias.params")


def test_load_into_bad_file_names_it(tmp_path):
    path = tmp_path / "short.params"
    path.write_bytes((FIXTURES / "mha_bias.params").read_bytes()[:300])
    with pytest.raises(ValueError, match=r"short\.params: truncated at byte 300"):
        load_into(am.MultiHeadAttention(**MHA, bias=True), path)


# ---- the CLI, end to end ----


def run_cli(*args, cwd=None):
    """``attention-multi port ARGS`` in this process (tests/cli_runner.py;
    test_cli_files.py runs the entry point itself in subprocesses)."""
    return run_in_process("port", *args, cwd=cwd or REPO)


def assert_clean_failure(result, code):
    assert result.returncode == code, result.stderr
    assert result.stderr.startswith("attention-multi port: error: ")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name", ["mha_bias", "mha_nobias", "mha_bias_float64"])
def test_cli_to_torch_loads_into_torch_module(name, tmp_path):
    torch = pytest.importorskip("torch")
    cls, kwargs, dtype, atol = CASES[name]
    out = tmp_path / "mha.pt"
    spec = f"{MHA_SPEC},bias={kwargs['bias']}"
    result = run_cli(
        FIXTURES / f"{name}.params",
        "--to",
        "torch",
        "--out",
        out,
        "--module",
        "MultiHeadAttention",
        "--args",
        spec,
    )
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}: {4 * (1 + kwargs['bias'])} arrays ({dtype})" in result.stdout
    state = torch.load(out)
    assert {str(t.dtype) for t in state.values()} == {f"torch.{dtype}"}  # the file's dtype
    module = am.MultiHeadAttention(**kwargs, backend="torch", dtype=dtype)
    module.load_state_dict(state)
    data = fixture(name)
    got, weights = forward(module, data)
    assert_close(got, data["output"], atol)
    assert_close(weights, data["attention_weights"], atol)


def test_cli_additive_to_torch(tmp_path):
    torch = pytest.importorskip("torch")
    out = tmp_path / "additive.pt"
    result = run_cli(
        FIXTURES / "additive.params",
        "--to",
        "torch",
        "--out",
        out,
        "--module",
        "AdditiveAttention",
        "--args",
        "key_size=2,query_size=20,num_hiddens=8",  # dropout has no shape: not needed
    )
    assert result.returncode == 0, result.stderr
    module = am.AdditiveAttention(**ADDITIVE, backend="torch")
    module.load_state_dict(torch.load(out))
    data = fixture("additive")
    got, weights = forward(module, data)
    assert_close(got, data["output"], 2e-5)
    assert_close(weights, data["attention_weights"], 2e-5)


@pytest.mark.parametrize("name", ["mha_bias", "mha_bias_float64", "mha_bias_float16", "legacy_v2"])
def test_cli_to_numpy_keeps_names_dtypes_and_bits(name, tmp_path):
    out = tmp_path / "p.npz"
    result = run_cli(FIXTURES / f"{name}.params", "--to", "numpy", "--out", out)  # no spec
    assert result.returncode == 0, result.stderr
    want = load_mxnet_params(FIXTURES / f"{name}.params")
    with np.load(out, allow_pickle=False) as z:
        assert list(z.files) == list(want)
        for k in want:
            assert z[k].dtype == want[k].dtype and z[k].tobytes() == want[k].tobytes(), k


def test_cli_npz_runs_on_numpy_backend(tmp_path):
    result = run_cli(
        FIXTURES / "mha_bias.params",
        "--to",
        "numpy",
        "--out",
        tmp_path / "p.npz",
        "--module",
        "MultiHeadAttention",
        "--args",
        MHA_SPEC + ",bias=true",
    )
    assert result.returncode == 0, result.stderr
    module = am.MultiHeadAttention(**MHA, bias=True, backend="numpy")
    with np.load(tmp_path / "p.npz") as z:
        am.set_params(module, dict(z))
    data = fixture("mha_bias")
    assert_close(forward(module, data)[0], data["output"], 2e-5)


def test_cli_dtype_option_and_default_out(tmp_path):
    src = tmp_path / "half.params"
    src.write_bytes((FIXTURES / "mha_bias_float16.params").read_bytes())
    result = run_cli(src, "--to", "numpy", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    with np.load(tmp_path / "half.npz") as z:  # default OUT: IN with suffix .npz
        got = dict(z)
    want = load_mxnet_params(src)
    assert {v.dtype for v in got.values()} == {np.dtype("float32")}
    assert all(np.array_equal(got[k], want[k].astype("float32")) for k in want)
    result = run_cli(
        FIXTURES / "legacy_v2.params",
        "--to",
        "numpy",
        "--out",
        tmp_path / "l.npz",
        "--dtype",
        "float64",
    )
    with np.load(tmp_path / "l.npz") as z:
        assert z["int_counts"].dtype == np.int32  # only floating-point arrays are cast
        assert z["half"].dtype == np.float64


def test_cli_spec_mismatch_names_both_sides(tmp_path):
    out = tmp_path / "x.pt"
    spec = MHA_SPEC.replace("num_hiddens=8", "num_hiddens=16") + ",bias=True"
    result = run_cli(
        FIXTURES / "mha_bias.params",
        "--to",
        "torch",
        "--out",
        out,
        "--module",
        "MultiHeadAttention",
        "--args",
        spec,
    )
    assert_clean_failure(result, 1)
    err = result.stderr
    assert "mha_bias.params does not match MultiHeadAttention" in err
    assert "W_q.weight: shape (8, 5) in the file, (16, 5) in MultiHeadAttention" in err
    assert "the file holds: W_q.weight (8, 5), W_q.bias (8,)" in err
    assert "MultiHeadAttention expects: W_q.weight (16, 5), W_q.bias (16,)" in err
    assert not out.exists()


def test_cli_spec_missing_bias(tmp_path):
    result = run_cli(
        FIXTURES / "mha_bias.params",
        "--to",
        "numpy",
        "--out",
        tmp_path / "x.npz",
        "--module",
        "MultiHeadAttention",
        "--args",
        MHA_SPEC,
    )
    assert_clean_failure(result, 1)
    assert "only in the file: W_q.bias, W_k.bias, W_v.bias, W_o.bias" in result.stderr
    assert "bias=True" in result.stderr


@pytest.mark.parametrize(
    "cut,message",
    [
        (10, "truncated at byte 0 while reading the file header (needed 16 bytes, 10 left)"),
        (300, "truncated at byte 300 while reading the shape of array 2 (needed 16 bytes, 0 left)"),
        (
            1000,
            "truncated at byte 856 while reading the data of array 6 (needed 256 bytes, 144 left)",
        ),
    ],
)
def test_cli_truncated_file_exits_2_with_offset(cut, message, tmp_path):
    bad = tmp_path / "cut.params"
    bad.write_bytes((FIXTURES / "mha_bias.params").read_bytes()[:cut])
    result = run_cli(bad, "--to", "torch", "--out", tmp_path / "x.pt")
    assert_clean_failure(result, 2)
    assert f"cut.params: {message}" in result.stderr
    assert not (tmp_path / "x.pt").exists()


def test_cli_corrupt_and_missing_files_exit_2(tmp_path):
    bad = tmp_path / "junk.params"
    bad.write_bytes(b"this is not an MXNet file at all")
    result = run_cli(bad, "--to", "numpy", "--out", tmp_path / "x.npz")
    assert_clean_failure(result, 2)
    assert "not an MXNet NDArray file" in result.stderr and "(at byte 0)" in result.stderr
    result = run_cli(
        FIXTURES / "sparse_csr_v2.params", "--to", "numpy", "--out", tmp_path / "x.npz"
    )
    assert_clean_failure(result, 2)
    assert "storage type" in result.stderr and "at byte" in result.stderr
    result = run_cli(tmp_path / "missing.params", "--to", "numpy")
    assert_clean_failure(result, 2)
    assert "missing.params: No such file or directory" in result.stderr


@pytest.mark.parametrize(
    "module,args,message",
    [
        ("Transformer", "", "unknown module 'Transformer'; choose one of AdditiveAttention"),
        (
            "MultiHeadAttention",
            "key_size=5",
            "missing required arguments 'num_hiddens', 'num_heads'",
        ),
        ("MultiHeadAttention", "key_size", "--args: expected KEY=VALUE, got 'key_size'"),
        ("MultiHeadAttention", MHA_SPEC + ",num_heads=3", "num_heads"),
        ("MultiHeadAttention", MHA_SPEC + ",backend=torch", "backend and device"),
        (None, "key_size=5", "--args needs --module"),
    ],
)
def test_cli_bad_module_spec_exits_2(module, args, message, tmp_path):
    extra = (["--module", module] if module else []) + (["--args", args] if args else [])
    result = run_cli(
        FIXTURES / "mha_bias.params", "--to", "numpy", "--out", tmp_path / "x.npz", *extra
    )
    assert_clean_failure(result, 2)
    assert message in result.stderr


def test_cli_values_are_parsed():
    from attention_multi.cli.port import _parse_args

    assert _parse_args("a=5, b=0.5,c=True,d=false,e=None,f=float64,g=-2,h=1e-3") == dict(
        a=5, b=0.5, c=True, d=False, e=None, f="float64", g=-2, h=1e-3
    )
    assert _parse_args("") == {}


# ---- against real MXNet (skipped where it is not installed) ----


def mxnet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if not hasattr(np, "bool"):  # mxnet 1.9 needs numpy.bool, gone in numpy 1.24-1.26
            np.bool = bool
    return pytest.importorskip("mxnet", reason="mxnet not installed")


@pytest.fixture
def d2l_mx():
    """The d2l MXNet blocks of make_fixtures.py, with np semantics on meanwhile."""
    mx = mxnet()
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mx.util.np_shape(True))
        stack.enter_context(mx.util.np_array(True))
        mx.random.seed(1)
        yield module


def mx_inputs(mx, shapes, valid_lens, dtype, seed):
    rng = np.random.default_rng(seed)
    arrays = {
        n: rng.normal(size=s).astype(dtype) for n, s in zip(("queries", "keys", "values"), shapes)
    }
    arrays["valid_lens"] = np.array(valid_lens, dtype="float32")
    return arrays, [
        mx.np.array(arrays[n], dtype=arrays[n].dtype)
        for n in ("queries", "keys", "values", "valid_lens")
    ]


@pytest.mark.parametrize("bias", [True, False])
def test_fresh_mxnet_mha_round_trip(d2l_mx, bias, backend, tmp_path):
    mx = mxnet()
    data, inputs = mx_inputs(mx, [(3, 4, 5), (3, 7, 5), (3, 7, 5)], [2, 7, 5], "float32", 2)
    block = d2l_mx.MultiHeadAttention(8, 2, 0.5, use_bias=bias)
    block.initialize(mx.init.Normal(0.5))
    block(*inputs)
    for p in block.collect_params(".*bias").values():
        p.set_data(mx.np.random.normal(0, 0.5, p.shape))
    want = block(*inputs).asnumpy()
    want_weights = block.attention_weights.asnumpy()
    block.save_parameters(str(tmp_path / "fresh.params"))
    module = load_into(
        am.MultiHeadAttention(**MHA, bias=bias, backend=backend), tmp_path / "fresh.params"
    )
    got, weights = forward(module, data)
    assert_close(got, want, 2e-5)
    assert_close(weights, want_weights, 2e-5)


def test_fresh_mxnet_additive_round_trip_via_cli(d2l_mx, tmp_path):
    torch = pytest.importorskip("torch")
    mx = mxnet()
    data, inputs = mx_inputs(mx, [(2, 3, 20), (2, 10, 2), (2, 10, 4)], [2, 6], "float32", 3)
    block = d2l_mx.AdditiveAttention(num_hiddens=8, dropout=0.1)
    block.initialize()
    want = block(*inputs).asnumpy()
    want_weights = block.attention_weights.asnumpy()
    block.save_parameters(str(tmp_path / "add.params"))
    result = run_cli(
        tmp_path / "add.params",
        "--to",
        "torch",
        "--out",
        tmp_path / "add.pt",
        "--module",
        "AdditiveAttention",
        "--args",
        "key_size=2,query_size=20,num_hiddens=8,dropout=0.1",
    )
    assert result.returncode == 0, result.stderr
    module = am.AdditiveAttention(**ADDITIVE, backend="torch")
    module.load_state_dict(torch.load(tmp_path / "add.pt"))
    got, weights = forward(module, data)
    assert_close(got, want, 2e-5)
    assert_close(weights, want_weights, 2e-5)


@pytest.mark.parametrize("dtype,atol", [("float32", 2e-5), ("float64", 1e-12)])
@pytest.mark.parametrize("bias", [True, False])
def test_torch_weights_load_into_mxnet_d2l_block(d2l_mx, dtype, atol, bias, tmp_path):
    """The way back: save_mxnet_params(get_params(torch module)) -> d2l load_parameters."""
    torch = pytest.importorskip("torch")
    mx = mxnet()
    torch.manual_seed(0)
    module = am.MultiHeadAttention(**MHA, bias=bias, backend="torch", dtype=dtype).eval()
    save_mxnet_params(am.get_params(module), tmp_path / "from_torch.params")
    data, inputs = mx_inputs(mx, [(2, 4, 5), (2, 6, 5), (2, 6, 5)], [3, 6], dtype, 4)
    block = d2l_mx.MultiHeadAttention(8, 2, 0.5, use_bias=bias)
    block.cast(dtype)
    block.load_parameters(str(tmp_path / "from_torch.params"))
    want = block(*inputs).asnumpy()
    assert want.dtype == dtype
    got, weights = forward(module, data)
    assert_close(got, want, atol)
    assert_close(weights, block.attention_weights.asnumpy(), atol)


def test_torch_additive_weights_load_into_mxnet(d2l_mx, tmp_path):
    torch = pytest.importorskip("torch")
    mx = mxnet()
    torch.manual_seed(1)
    module = am.AdditiveAttention(**ADDITIVE, backend="torch").eval()
    save_mxnet_params(am.get_params(module), tmp_path / "add.params")
    data, inputs = mx_inputs(mx, [(2, 3, 20), (2, 10, 2), (2, 10, 4)], [2, 6], "float32", 5)
    block = d2l_mx.AdditiveAttention(num_hiddens=8, dropout=0.1)
    block.load_parameters(str(tmp_path / "add.params"))
    want = block(*inputs).asnumpy()
    got, weights = forward(module, data)
    assert_close(got, want, 2e-5)
    assert_close(weights, block.attention_weights.asnumpy(), 2e-5)


def tied_torch_mha(share_module):
    torch = pytest.importorskip("torch")

    class MHA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name in ("W_q", "W_k", "W_v", "W_o"):
                setattr(self, name, torch.nn.Linear(5 if name != "W_o" else 8, 8))
            if share_module:
                self.W_k = self.W_q
            else:
                self.W_k.weight = self.W_q.weight

    return MHA()


@pytest.mark.parametrize("share_module", [False, True], ids=["weight", "module"])
def test_load_into_refuses_tied_parameters_given_different_values(share_module):
    m = tied_torch_mha(share_module)
    before = {n: v.clone() for n, v in m.state_dict().items()}
    path = FIXTURES / "mha_bias.params"
    with pytest.raises(ValueError, match=r"MHA\.W_q\.weight and MHA\.W_k\.weight are one \(tied\)"):
        load_into(m, path)
    assert all(v.equal(before[n]) for n, v in m.state_dict().items())  # nothing loaded
    params = load_mxnet_params(path)
    params["W_k.weight"] = params["W_q.weight"]
    if share_module:
        params["W_k.bias"] = params["W_q.bias"]
    load_into(m, params)  # the same values for both names: fine
    assert np.array_equal(m.W_k.weight.detach().numpy(), params["W_q.weight"])
    assert np.array_equal(m.W_v.weight.detach().numpy(), params["W_v.weight"])
