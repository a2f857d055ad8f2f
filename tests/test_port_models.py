"""Whole d2l models ported from MXNet into PyTorch: ``am.port.load_into``,
``to_state_dict`` and ``mapping`` on any ``torch.nn.Module``.

The fixtures were trained and saved by MXNet 1.9.1
(tests/fixtures/mxnet/make_model_fixtures.py); their PyTorch counterparts are
d2l's PyTorch code (tests/d2l_torch.py). Everything but the tests at the end
runs without MXNet. Each model loads with one ``load_into`` call and must
reproduce MXNet's saved outputs within 1e-5.
"""

import contextlib
import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attention_multi as am  # noqa: E402
from attention_multi.port import (  # noqa: E402
    load_into,
    load_mxnet_params,
    mapping,
    save_mxnet_params,
    to_state_dict,
)
from attention_multi.port.rules import rules_table, translate  # noqa: E402
from attention_multi.testing import assert_close  # noqa: E402
from tests import d2l_torch  # noqa: E402
from tests.test_port import run_cli  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "mxnet"
MODELS = list(d2l_torch.FACTORIES)
ATOL = 1e-5


def fixture(name):
    with np.load(FIXTURES / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


def inputs(name, data):
    """The model's forward arguments from its fixture (tokens as int64)."""

    def tokens(key):
        return torch.from_numpy(data[key]).long()

    if name in ("transformer", "seq2seq_gru"):
        return tokens("src"), tokens("tgt"), torch.from_numpy(data["src_valid_lens"])
    if name == "bn_lenet":
        return (torch.from_numpy(data["X"]),)
    return (tokens("tokens"),)


def run(net, name, data):
    with torch.no_grad():
        return net.eval()(*inputs(name, data))


def state(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def assert_unchanged(net, before):
    after = net.state_dict()
    assert list(after) == list(before)
    for k in before:
        assert torch.equal(after[k], before[k]), f"{k} changed"


def build(name, **kwargs):
    return d2l_torch.FACTORIES[name](**kwargs)


# ---- every model reproduces MXNet ----


@pytest.mark.parametrize(
    "name, kwargs",
    [(n, {}) for n in MODELS] + [("transformer", {"attention": "am"})],
    ids=MODELS + ["transformer-am_attention"],
)
def test_model_reproduces_mxnet(name, kwargs):
    net = build(name, **kwargs)
    assert load_into(net, FIXTURES / f"{name}.params") is net
    data = fixture(name)
    out = run(net, name, data)
    assert_close(out, data["output"], rtol=0, atol=ATOL, msg=name)
    if "enc_outputs" in data:  # the encoder alone, too
        with torch.no_grad():
            enc = net.encoder(*inputs(name, data)[::2])
        enc = enc[0].numpy() if isinstance(enc, tuple) else enc.numpy()
        assert_close(enc, data["enc_outputs"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", MODELS)
def test_every_entry_is_the_files(name):
    """Every parameter and running statistic holds the file's bits; only
    num_batches_tracked (no Gluon counterpart) keeps the module's value."""
    net = build(name)
    before = state(net)
    load_into(net, FIXTURES / f"{name}.params")
    file = load_mxnet_params(FIXTURES / f"{name}.params")
    pairs = mapping(FIXTURES / f"{name}.params", like=net).names()
    assert sorted(pairs.values()) == sorted(file)  # each Gluon name used once
    for key, value in net.state_dict().items():
        if key.endswith("num_batches_tracked"):
            assert torch.equal(value, before[key])
        else:
            assert value.numpy().tobytes() == file[pairs[key]].tobytes(), key


def test_batchnorm_running_statistics_are_trained():
    """The fixture's running statistics moved away from (0, 1), and eval mode uses them."""
    file = load_mxnet_params(FIXTURES / "bn_lenet.params")
    assert np.abs(file["net.9.running_mean"]).max() > 1e-2
    assert np.abs(file["net.9.running_var"] - 1).max() > 1e-2
    net = load_into(build("bn_lenet"), FIXTURES / "bn_lenet.params")
    data = fixture("bn_lenet")
    with torch.no_grad():
        train_mode = net.train()(*inputs("bn_lenet", data))
    assert np.abs(train_mode.numpy() - data["output"]).max() > 1e-3


@pytest.mark.parametrize(
    "name, gluon, blocks",
    [
        ("seq2seq_gru", "decoder.rnn._unfused.0.i2h_weight", 3),  # GRU: r, z, n
        ("rnn_lm", "lstm._unfused.0.r_cell.h2h_weight", 4),  # LSTM: i, f, g, o
    ],
)
def test_gate_order_matters(name, gluon, blocks, tmp_path):
    """Swapping two gates' rows changes the output: the parity above checks the order."""
    params = load_mxnet_params(FIXTURES / f"{name}.params")
    rows = np.split(params[gluon], blocks)
    params[gluon] = np.concatenate([rows[1], rows[0]] + rows[2:])
    net = load_into(build(name), params)
    data = fixture(name)
    assert np.abs(run(net, name, data).numpy() - data["output"]).max() > 1e-3


def test_older_mxnet_rnn_names_load(tmp_path):
    """MXNet before 1.9 saved recurrent layers as l0_i2h_weight / r0_h2h_bias."""
    params = load_mxnet_params(FIXTURES / "rnn_lm.params")
    old = {}
    for name, value in params.items():
        for cell, prefix in ((".l_cell.", "l"), (".r_cell.", "r"), (".", "l")):
            parts = name.split("._unfused.")
            if len(parts) == 2 and parts[1][1:].startswith(cell):
                name = f"{parts[0]}.{prefix}{parts[1][0]}_{parts[1][1 + len(cell) :]}"
                break
        old[name] = value
    assert "lstm.r1_h2h_bias" in old and "rnn.l0_i2h_weight" in old
    save_mxnet_params(old, tmp_path / "old.params")
    net = load_into(build("rnn_lm"), tmp_path / "old.params")
    data = fixture("rnn_lm")
    assert_close(run(net, "rnn_lm", data), data["output"], rtol=0, atol=ATOL)


def test_values_are_cast_to_the_modules_dtype():
    net = build("transformer").double()
    load_into(net, FIXTURES / "transformer.params")
    assert {v.dtype for v in net.state_dict().values()} == {torch.float64}
    data = fixture("transformer")
    src, tgt, lens = inputs("transformer", data)
    with torch.no_grad():
        out = net.eval()(src, tgt, lens.double())
    assert out.dtype == torch.float64
    assert_close(out, data["output"], rtol=0, atol=ATOL)


# ---- to_state_dict and the mapping ----


@pytest.mark.parametrize("name", ["transformer", "bn_lenet"])
def test_to_state_dict_loads_strictly(name):
    like = build(name)
    sd = to_state_dict(FIXTURES / f"{name}.params", like=like)
    assert list(sd) == list(like.state_dict())
    assert all(isinstance(v, np.ndarray) for v in sd.values())
    fresh = build(name)
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})  # strict
    data = fixture(name)
    assert_close(run(fresh, name, data), data["output"], rtol=0, atol=ATOL)
    if name == "bn_lenet":
        assert sd["net.1.num_batches_tracked"] == like.state_dict()["net.1.num_batches_tracked"]
        assert (
            sd["net.1.weight"].tobytes()
            == load_mxnet_params(FIXTURES / "bn_lenet.params")["net.1.gamma"].tobytes()
        )


def test_mapping_table_shows_each_pair_and_how():
    table = str(mapping(FIXTURES / "transformer.params", like=build("transformer")))
    lines = table.splitlines()
    assert lines[0].split() == [
        "Gluon",
        f"({FIXTURES / 'transformer.params'})",
        "shape",
        "->",
        "EncoderDecoder",
        "shape",
        "how",
    ]
    assert len(lines) == 1 + 64 and "problem" not in table

    def row(gluon):
        return next(line.split() for line in lines if line.startswith(gluon + " "))

    assert row("encoder.embedding.weight") == [
        "encoder.embedding.weight",
        "(11,",
        "8)",
        "->",
        "encoder.embedding.weight",
        "(11,",
        "8)",
    ]
    assert row("encoder.blks.1.addnorm2.ln.gamma") == [
        "encoder.blks.1.addnorm2.ln.gamma",
        "(8,)",
        "->",
        "encoder.blks.block1.addnorm2.ln.weight",
        "(8,)",
        "by",
        "order:",
        "encoder.blks.1",
        "->",
        "encoder.blks.block1;",
        "gamma",
        "->",
        "weight",
    ]
    assert row("decoder.blks.0.ffn.dense1.weight")[:6] == [
        "decoder.blks.0.ffn.dense1.weight",
        "(16,",
        "8)",
        "->",
        "decoder.blks.block0.ffn.dense1.weight",
        "(16,",
    ]
    bn = str(mapping(FIXTURES / "bn_lenet.params", like=build("bn_lenet")))
    assert "net.9.gamma" in bn and "-> net.10.weight" in bn and "by order: net.9 -> net.10" in bn
    assert "-> net.10.num_batches_tracked  ()" in bn and "kept: BatchNorm's batch counter" in bn


def test_rules():
    cases = {
        "rnn._unfused.0.i2h_weight": "rnn.weight_ih_l0",
        "a.rnn._unfused.12.h2h_bias": "a.rnn.bias_hh_l12",
        "lstm._unfused.1.l_cell.h2h_weight": "lstm.weight_hh_l1",
        "lstm._unfused.1.r_cell.i2h_bias": "lstm.bias_ih_l1_reverse",
        "rnn.l0_i2h_weight": "rnn.weight_ih_l0",
        "rnn.r2_h2h_bias": "rnn.bias_hh_l2_reverse",
        "_unfused.0.i2h_weight": "weight_ih_l0",
        "blks.0.addnorm1.ln.gamma": "blks.0.addnorm1.ln.weight",
        "bn.beta": "bn.bias",
        "gamma": "weight",
        # unchanged: names PyTorch shares, and look-alikes
        "bn.running_mean": "bn.running_mean",
        "W_q.weight": "W_q.weight",
        "x.gamma_scale": "x.gamma_scale",
        "x.my_gamma": "x.my_gamma",
        "cell0_i2h_weight": "cell0_i2h_weight",
    }
    assert {name: translate(name)[0] for name in cases} == cases
    table = rules_table()
    assert "_unfused.N.i2h_weight" in table and "weight_ih_lN" in table
    assert "gamma" in table and "num_batches_tracked: kept" in table


def test_a_torch_module_may_name_a_parameter_gamma():
    """A rename rule also lets the Gluon name match as it is."""

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = torch.nn.Parameter(torch.zeros(3))
            self.ln = torch.nn.LayerNorm(3)

    net = Scale()
    params = {"gamma": np.arange(3.0), "ln.gamma": np.ones(3), "ln.beta": np.full(3, 2.0)}
    load_into(net, params)
    assert net.gamma.tolist() == [0.0, 1.0, 2.0] and net.ln.bias.tolist() == [2.0] * 3


def test_our_modules_inside_a_torch_model_and_on_their_own():
    """Our attention modules pair like any layer, inside a torch model too."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                [am.MultiHeadAttention(5, 5, 5, 8, 2, 0.0, bias=True, backend="torch")]
            )

    params = {
        f"blocks.0.{k}": v for k, v in load_mxnet_params(FIXTURES / "mha_bias.params").items()
    }
    net = load_into(Model(), params)
    data = np.load(FIXTURES / "mha_bias.npz")
    q, k, v, lens = (torch.from_numpy(data[n]) for n in ("queries", "keys", "values", "valid_lens"))
    with torch.no_grad():
        assert_close(net.blocks[0].eval()(q, k, v, lens), data["output"], rtol=0, atol=2e-5)


# ---- errors: clear, and nothing loaded ----


def failed_load(net, source):
    """load_into's ValueError message; the module must be left as it was."""
    before = state(net)
    with pytest.raises(ValueError) as info:
        load_into(net, source)
    assert_unchanged(net, before)
    return str(info.value)


def transformer_params():
    return load_mxnet_params(FIXTURES / "transformer.params")


def test_error_file_for_another_architecture():
    msg = failed_load(build("transformer"), FIXTURES / "seq2seq_gru.params")
    path = FIXTURES / "seq2seq_gru.params"
    assert msg.startswith(f"{path} does not match EncoderDecoder:\n")
    assert "  only in the file: encoder.rnn.rnn._unfused.0.i2h_weight, " in msg
    assert "decoder.attention.W_k.weight" in msg.split("only in the file: ")[1].split("\n")[0]
    assert "  missing from the file: encoder.blks.block0.attention.W_q.weight, " in msg
    assert "encoder.embedding.weight: shape (10, 6) in the file, (11, 8) in EncoderDecoder" in msg
    assert "\nthe file holds: encoder.embedding.weight (10, 6), " in msg
    assert "\nEncoderDecoder expects: encoder.embedding.weight (11, 8), " in msg


def test_error_missing_layer():
    params = transformer_params()
    del params["decoder.dense.weight"], params["decoder.dense.bias"]
    msg = failed_load(build("transformer"), params)
    assert msg.splitlines()[:2] == [
        "the given dict does not match EncoderDecoder:",
        "  missing from the file: decoder.dense.weight, decoder.dense.bias",
    ]


def test_error_missing_block():
    """A file of 2 blocks for a model of 3: registration order cannot pair them."""
    msg = failed_load(build("transformer", num_blks=3), FIXTURES / "transformer.params")
    assert (
        "cannot pair by order under encoder.blks: the file has 2 (0, 1), EncoderDecoder "
        "has 3 (block0, block1, block2)"
    ) in msg
    assert "cannot pair by order under decoder.blks" in msg
    assert "only in the file: encoder.blks.0.attention.W_q.weight" in msg
    assert "missing from the file: encoder.blks.block0.attention.W_q.weight" in msg


def test_error_transposed_shape_names_both_sides():
    params = transformer_params()
    params["decoder.blks.1.ffn.dense1.weight"] = params["decoder.blks.1.ffn.dense1.weight"].T
    msg = failed_load(build("transformer"), params)
    assert msg.splitlines()[1] == (
        "  decoder.blks.1.ffn.dense1.weight: shape (8, 16) in the file, "
        "decoder.blks.block1.ffn.dense1.weight (16, 8) in EncoderDecoder"
    )
    assert len(msg.splitlines()) == 4  # header, the one problem, the two listings


@pytest.mark.parametrize(
    "name, extra, source",
    [
        ("transformer", "encoder.blks.0.addnorm1.ln.weight", "encoder.blks.0.addnorm1.ln.gamma"),
        ("seq2seq_gru", "decoder.rnn.l1_h2h_bias", "decoder.rnn._unfused.1.h2h_bias"),
    ],
)
def test_error_two_candidates_for_one_name(name, extra, source):
    params = load_mxnet_params(FIXTURES / f"{name}.params")
    params[extra] = params[source]
    msg = failed_load(build(name), params)
    target = translate(source)[0].replace("blks.0", "blks.block0")
    assert msg.splitlines()[1] == f"  ambiguous: {target} could come from {source} or {extra}"


def test_error_left_over_and_bias_hint():
    params = transformer_params()
    params["encoder.extra.weight"] = np.zeros((2, 2), "float32")
    msg = failed_load(build("transformer"), params)
    assert msg.splitlines()[1] == "  only in the file: encoder.extra.weight"
    net = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False))
    msg = failed_load(net, {"0.weight": np.zeros((2, 3)), "0.bias": np.zeros(2)})
    assert "only in the file: 0.bias" in msg and "bias=True" in msg


def test_error_uninitialized_lazy_layers():
    net = d2l_torch.EncoderDecoder(
        d2l_torch.TransformerEncoder(11, 8, 16, 2, 2, 0.1),
        d2l_torch.TransformerDecoder(11, 8, 16, 2, 2, 0.1),
    )
    for call in (
        lambda: load_into(net, FIXTURES / "transformer.params"),
        lambda: to_state_dict(FIXTURES / "transformer.params", like=net),
        lambda: mapping(FIXTURES / "transformer.params", like=net),
    ):
        with pytest.raises(ValueError) as info:
            call()
        msg = str(info.value)
        assert msg.startswith(
            "EncoderDecoder has uninitialized parameters: "
            "encoder.blks.block0.attention.W_q.weight, "
        )
        assert "decoder.dense.bias" in msg and "encoder.embedding.weight" not in msg
        assert "call the module once on an example input" in msg
    for name, value in net.named_parameters():  # still lazy, nothing touched
        assert torch.nn.parameter.is_lazy(value) == (
            ".W_" in name or "ffn" in name or name.startswith("decoder.dense")
        )


def test_error_not_a_module_or_not_a_source():
    with pytest.raises(
        TypeError,
        match="expected an attention_multi module or a torch.nn.Module, got builtins.dict",
    ):
        load_into({}, FIXTURES / "transformer.params")
    with pytest.raises(TypeError, match="expected a .params path or a {name: array} dict"):
        load_into(build("textcnn"), 42)


def test_error_malformed_file_names_it(tmp_path):
    bad = tmp_path / "cut.params"
    bad.write_bytes((FIXTURES / "textcnn.params").read_bytes()[:200])
    net = build("textcnn")
    msg = failed_load(net, bad)
    assert msg.startswith(f"{bad}: truncated at byte")


# ---- against real MXNet (skipped where it is not installed) ----


@pytest.fixture
def mx_models():
    """tests/fixtures/mxnet/make_model_fixtures.py, imported (needs mxnet)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if not hasattr(np, "bool"):  # mxnet 1.9 needs numpy.bool, gone in numpy 1.24-1.26
            np.bool = bool
    pytest.importorskip("mxnet", reason="mxnet not installed")
    spec = importlib.util.spec_from_file_location(
        "make_model_fixtures", FIXTURES / "make_model_fixtures.py"
    )
    module = importlib.util.module_from_spec(spec)
    with contextlib.redirect_stdout(None):
        spec.loader.exec_module(module)
    return module


def test_fixture_script_writes_the_committed_files(mx_models, tmp_path):
    """The script reproduces the committed files: the same names, shapes,
    dtypes and inputs, and the trained weights and outputs up to float32
    rounding (MXNet's kernels round differently on another CPU)."""
    with contextlib.redirect_stdout(None):
        mx_models.main(folder=str(tmp_path))
    for name in MODELS:
        got = load_mxnet_params(str(tmp_path / (name + ".params")))
        want = load_mxnet_params(str(FIXTURES / (name + ".params")))
        assert list(got) == list(want), name
        for n in want:
            assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, n
            np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-5, err_msg=n)
        with (
            np.load(tmp_path / (name + ".npz")) as got,
            np.load(FIXTURES / (name + ".npz")) as want,
        ):
            assert sorted(got.files) == sorted(want.files), name
            for n in want.files:
                tol = 0 if np.issubdtype(want[n].dtype, np.integer) else 1e-5
                np.testing.assert_allclose(
                    got[n], want[n], rtol=tol, atol=tol, err_msg=f"{name}.npz {n}"
                )


def test_freshly_trained_mxnet_models_port(mx_models, tmp_path):
    """Other seeds, straight from MXNet into PyTorch."""
    with contextlib.redirect_stdout(None):
        mx_models.main(folder=str(tmp_path), seed=100)
    for name in MODELS:
        net = load_into(build(name), tmp_path / f"{name}.params")
        data = np.load(tmp_path / f"{name}.npz")
        assert not np.array_equal(data["output"], fixture(name)["output"])
        assert_close(run(net, name, data), data["output"], rtol=0, atol=ATOL, msg=name)


# ---- the command line: attention-multi port --like ----


def cli(monkeypatch, capsys, *args):
    """``attention-multi port ...`` in this process: (status, stdout, stderr)."""
    from attention_multi.cli import main

    monkeypatch.chdir(FIXTURES.parents[2])  # --like imports from here
    monkeypatch.setattr(sys, "path", list(sys.path))
    status = main(["port", *map(str, args)])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_like_writes_a_state_dict_that_loads_strictly(tmp_path):
    out = tmp_path / "transformer.pt"
    result = run_cli(
        FIXTURES / "transformer.params",
        "--to",
        "torch",
        "--out",
        out,
        "--like",
        "tests.d2l_torch:transformer()",
        "--show-mapping",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[-4:] == ["->", "EncoderDecoder", "shape", "how"]
    assert any(
        line.startswith("encoder.blks.0.addnorm1.ln.gamma ")
        and "-> encoder.blks.block0.addnorm1.ln.weight " in line
        for line in lines
    )
    assert lines[-2:] == [
        "mapped 64 arrays onto EncoderDecoder",
        f"wrote {out}: 64 arrays (float32)",
    ]
    net = build("transformer")
    net.load_state_dict(torch.load(out))  # strict
    data = fixture("transformer")
    assert_close(run(net, "transformer", data), data["output"], rtol=0, atol=ATOL)


def test_cli_like_to_numpy_keeps_batchnorm_counters(monkeypatch, capsys, tmp_path):
    out = tmp_path / "bn.npz"
    status, stdout, err = cli(
        monkeypatch,
        capsys,
        FIXTURES / "bn_lenet.params",
        "--to",
        "numpy",
        "--out",
        out,
        "--like",
        "tests.d2l_torch:bn_lenet",
    )
    assert status == 0, err
    assert stdout.splitlines() == [
        "mapped 26 arrays onto BNLeNet; 4 kept as the model has them (no Gluon counterpart)",
        f"wrote {out}: 30 arrays (float32, int64)",
    ]
    with np.load(out) as z:
        assert list(z.files) == list(build("bn_lenet").state_dict())
        assert (
            z["net.10.running_var"].tobytes()
            == load_mxnet_params(FIXTURES / "bn_lenet.params")["net.9.running_var"].tobytes()
        )


def test_cli_like_mismatch_exits_1_and_writes_nothing(monkeypatch, capsys, tmp_path):
    out = tmp_path / "x.pt"
    status, stdout, err = cli(
        monkeypatch,
        capsys,
        FIXTURES / "transformer.params",
        "--to",
        "torch",
        "--out",
        out,
        "--like",
        "tests.d2l_torch:textcnn()",
        "--show-mapping",
    )
    assert status == 1 and not out.exists()
    assert err.startswith(
        f"attention-multi port: error: {FIXTURES / 'transformer.params'} does not match TextCNN:\n"
    )
    assert "problem(s):" in stdout  # the table, then its problems


@pytest.mark.parametrize(
    "args, message",
    [
        (["--like", "tests.d2l_torch"], "expected MODULE:FACTORY or MODULE:FACTORY(ARGS)"),
        (["--like", "tests.d2l_torch:nothing()"], "has no attribute 'nothing'"),
        (["--like", "no_such_module:build()"], "No module named 'no_such_module'"),
        (["--like", "tests.d2l_torch:transformer(attention=print)"], "must be literals"),
        (["--like", "tests.d2l_torch:transformer(attention='none')"], "KeyError: 'none'"),
        (
            ["--like", "tests.d2l_torch:BNLeNet()"],
            "BNLeNet has uninitialized parameters: net.0.weight, ",
        ),
        (
            ["--like", "tests.d2l_torch:FACTORIES"],
            "expected an attention_multi module or a torch.nn.Module, got builtins.dict",
        ),
        (["--show-mapping"], "--show-mapping needs --like"),
        (
            ["--like", "tests.d2l_torch:bn_lenet()", "--module", "MultiHeadAttention"],
            "--like and --module exclude each other",
        ),
    ],
)
def test_cli_bad_like_exits_2(args, message, monkeypatch, capsys, tmp_path):
    status, _, err = cli(
        monkeypatch,
        capsys,
        FIXTURES / "bn_lenet.params",
        "--to",
        "numpy",
        "--out",
        tmp_path / "x.npz",
        *args,
    )
    assert status == 2 and message in err, err
    assert err.startswith("attention-multi port: error: ") and not (tmp_path / "x.npz").exists()
