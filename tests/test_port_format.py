"""Tests for the pure-NumPy MXNet .params reader/writer (attention_multi.port).

Most tests use the committed MXNet-made fixtures and need no mxnet; the ones at
the end run only where mxnet is importable.
"""

import contextlib
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

from attention_multi.port import load_mxnet_params, save_mxnet_params

# (issue 63) the files' format, on NumPy 1 and NumPy 2
pytestmark = pytest.mark.second_stack

FIXTURES = Path(__file__).parent / "fixtures" / "mxnet"
NP_MODE = ["mha_nobias", "mha_bias", "mha_bias_float64", "mha_bias_float16", "additive"]
V2_MAGIC, V3_MAGIC = b"\xc9\xfa\x93\xf9", b"\xca\xfa\x93\xf9"
FLOATS = ["float16", "float32", "float64"]
MHA_NAMES = [f"W_{x}.{p}" for x in "qkvo" for p in ("weight", "bias")]


def expected_params(name):
    with np.load(FIXTURES / f"{name}.npz") as z:
        return {k[len("param:") :]: z[k] for k in z.files if k.startswith("param:")}


def assert_same(got, want):
    """Same names in the same order, same dtypes and shapes, bit-equal values."""
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert got[k].shape == want[k].shape, k
        assert got[k].tobytes() == want[k].tobytes(), k


def sample_params(dtype, with_scalar=True):
    rng = np.random.default_rng(0)
    params = {
        "W_q.weight": rng.normal(size=(8, 5)),
        "W_q.bias": rng.normal(size=8),
        "blk.0.x": rng.normal(size=(2, 3, 4)),
        "one": np.array([-1.5]),
        "empty": np.zeros((0, 3)),
    }
    if with_scalar:
        params["scalar"] = np.array(2.25)
    return {k: v.astype(dtype) for k, v in params.items()}


# ---- committed MXNet fixtures ----


@pytest.mark.parametrize("name", NP_MODE + ["legacy_v2"])
def test_fixture_matches_mxnet_collect_params(name):
    assert_same(load_mxnet_params(FIXTURES / f"{name}.params"), expected_params(name))


def test_fixture_names_shapes_dtypes():
    mha = load_mxnet_params(FIXTURES / "mha_bias.params")
    assert list(mha) == MHA_NAMES
    assert mha["W_q.weight"].shape == (8, 5) and mha["W_o.weight"].shape == (8, 8)
    assert mha["W_o.bias"].shape == (8,) and mha["W_q.weight"].dtype == np.float32
    assert list(load_mxnet_params(FIXTURES / "mha_nobias.params")) == MHA_NAMES[::2]
    for dtype in ("float16", "float64"):
        cast = load_mxnet_params(FIXTURES / f"mha_bias_{dtype}.params")
        assert list(cast) == MHA_NAMES
        for k in MHA_NAMES:
            assert cast[k].dtype == dtype
            assert np.array_equal(cast[k], mha[k].astype(dtype))  # MXNet's cast == NumPy's
    add = load_mxnet_params(FIXTURES / "additive.params")
    assert {k: v.shape for k, v in add.items()} == {
        "W_k.weight": (8, 2),
        "W_q.weight": (8, 20),
        "w_v.weight": (1, 8),
    }


def test_legacy_fixture_is_v2_and_arg_prefix_is_stripped():
    raw = (FIXTURES / "legacy_v2.params").read_bytes()
    assert raw[24:28] == V2_MAGIC and b"arg:W_q.weight" in raw
    got = load_mxnet_params(FIXTURES / "legacy_v2.params")
    assert list(got) == ["W_k.weight", "W_q.weight", "w_v.weight", "int_counts", "half"]
    assert got["int_counts"].dtype == np.int32
    assert np.array_equal(got["int_counts"], np.arange(6).reshape(2, 3))
    assert got["half"].dtype == np.float16
    assert got["half"].tolist() == [0.5, -2.0, 65504.0]


@pytest.mark.parametrize("name", NP_MODE)
def test_writer_reproduces_mxnet_bytes_v3(name, tmp_path):
    path = FIXTURES / f"{name}.params"
    assert path.read_bytes()[24:28] == V3_MAGIC
    save_mxnet_params(load_mxnet_params(path), tmp_path / "out.params")
    assert (tmp_path / "out.params").read_bytes() == path.read_bytes()


def test_writer_reproduces_mxnet_bytes_v2(tmp_path):
    params = {"arg:" + k: v for k, v in load_mxnet_params(FIXTURES / "legacy_v2.params").items()}
    save_mxnet_params(params, tmp_path / "out.params", np_mode=False)
    assert (tmp_path / "out.params").read_bytes() == (FIXTURES / "legacy_v2.params").read_bytes()


def _softmax_masked(scores, valid_lens):
    """d2l masked_softmax: valid_lens (batch,) applies to every query row."""
    valid = np.repeat(valid_lens, scores.shape[1]).reshape(scores.shape[:2])
    mask = np.arange(scores.shape[-1]) < valid[..., None]
    e = np.exp(np.where(mask, scores, -1e6) - np.where(mask, scores, -1e6).max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize(
    "name,rtol", [("mha_nobias", 1e-5), ("mha_bias", 1e-5), ("mha_bias_float64", 1e-12)]
)
def test_mha_fixture_params_reproduce_mxnet_forward(name, rtol):
    """The loaded weights are (out, in) like torch; a NumPy forward matches MXNet's."""
    p = {k: v.astype(np.float64) for k, v in load_mxnet_params(FIXTURES / f"{name}.params").items()}
    with np.load(FIXTURES / f"{name}.npz") as z:
        q, k, v, lens = (
            z[n].astype(np.float64) for n in ("queries", "keys", "values", "valid_lens")
        )
        out, weights = z["output"], z["attention_weights"]

    def dense(x, layer):
        return x @ p[f"{layer}.weight"].T + p.get(f"{layer}.bias", 0.0)

    def split(x):  # d2l transpose_qkv with 2 heads
        heads = x.reshape(x.shape[0], x.shape[1], 2, -1).transpose(0, 2, 1, 3)
        return heads.reshape(-1, x.shape[1], 4)

    qh, kh, vh = split(dense(q, "W_q")), split(dense(k, "W_k")), split(dense(v, "W_v"))
    attn = _softmax_masked(qh @ kh.transpose(0, 2, 1) / 2.0, np.repeat(lens, 2))
    concat = (attn @ vh).reshape(-1, 2, 4, 4).transpose(0, 2, 1, 3).reshape(2, 4, 8)
    np.testing.assert_allclose(attn, weights, rtol=rtol, atol=rtol / 10)
    np.testing.assert_allclose(dense(concat, "W_o"), out, rtol=rtol, atol=rtol / 10)


def test_additive_fixture_params_reproduce_mxnet_forward():
    p = {
        k: v.astype(np.float64) for k, v in load_mxnet_params(FIXTURES / "additive.params").items()
    }
    with np.load(FIXTURES / "additive.npz") as z:
        q, k, v, lens = (
            z[n].astype(np.float64) for n in ("queries", "keys", "values", "valid_lens")
        )
        out, weights = z["output"], z["attention_weights"]
    features = np.tanh((q @ p["W_q.weight"].T)[:, :, None] + (k @ p["W_k.weight"].T)[:, None])
    attn = _softmax_masked((features @ p["w_v.weight"].T)[..., 0], lens)
    np.testing.assert_allclose(attn, weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(attn @ v, out, rtol=1e-5, atol=1e-6)


# ---- round trips ----


@pytest.mark.parametrize("np_mode", [True, False], ids=["v3", "v2"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_round_trip_floats(dtype, np_mode, tmp_path):
    params = sample_params(dtype, with_scalar=np_mode)
    save_mxnet_params(params, tmp_path / "p.params", np_mode=np_mode)
    assert (tmp_path / "p.params").read_bytes()[24:28] == (V3_MAGIC if np_mode else V2_MAGIC)
    assert_same(load_mxnet_params(tmp_path / "p.params"), params)


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int32", "int64", "bool"])
def test_round_trip_other_dtypes(dtype, tmp_path):
    params = {"a": (np.arange(-6, 6).reshape(3, 4) % 3).astype(dtype), "s": np.array(1, dtype)}
    save_mxnet_params(params, tmp_path / "p.params")
    assert_same(load_mxnet_params(tmp_path / "p.params"), params)


def test_round_trip_accepts_lists_and_noncontiguous(tmp_path):
    params = {
        "list": [[1.0, 2.0]],
        "strided": np.arange(12.0).reshape(3, 4)[:, ::2],
        "big_endian": np.arange(3, dtype=">f4"),
    }
    save_mxnet_params(params, tmp_path / "p.params")
    got = load_mxnet_params(tmp_path / "p.params")
    assert got["list"].tolist() == [[1.0, 2.0]] and got["list"].dtype == np.float64
    assert got["strided"].tolist() == [[0, 2], [4, 6], [8, 10]]
    assert got["big_endian"].tolist() == [0, 1, 2] and got["big_endian"].dtype == np.float32


def test_v1_records_are_read(tmp_path):
    """V1 (0xF993FAC8): like V2 but without the storage-type field."""
    data = np.array([[1.5, -2.0, 3.25]], np.float64)
    record = struct.pack("<Ii2qiii", 0xF993FAC8, 2, 1, 3, 1, 0, 1) + data.tobytes()
    path = tmp_path / "v1.params"
    path.write_bytes(
        struct.pack("<QQQ", 0x112, 0, 1) + record + struct.pack("<QQ", 1, 5) + b"arg:x"
    )
    assert_same(load_mxnet_params(path), {"x": data})


def test_writer_rejects_what_mxnet_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match="unsupported dtype complex64"):
        save_mxnet_params({"c": np.zeros(2, np.complex64)}, tmp_path / "p.params")
    with pytest.raises(ValueError, match="0-d arrays need np_mode=True"):
        save_mxnet_params({"s": np.array(1.0)}, tmp_path / "p.params", np_mode=False)


def test_list_saved_file_gets_index_names(tmp_path):
    path = tmp_path / "p.params"
    save_mxnet_params({"a": np.ones(2, np.float32)}, path)
    raw = path.read_bytes()
    path.write_bytes(raw[: -(8 + 8 + 1)] + struct.pack("<Q", 0))  # drop the names
    assert list(load_mxnet_params(path)) == ["0"]


# ---- malformed files ----


def small_file(tmp_path, np_mode=True):
    path = tmp_path / ("small_v3.params" if np_mode else "small_v2.params")
    save_mxnet_params(
        {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1.0, 2.0], np.float16)},
        path,
        np_mode=np_mode,
    )
    return path


def patched(path, offset, fmt, value):
    raw = bytearray(path.read_bytes())
    struct.pack_into(fmt, raw, offset, value)
    bad = path.with_name("bad_" + path.name)
    bad.write_bytes(bytes(raw))
    return bad


# Offsets in small_file: header 0-23, record 0: magic 24, stype 28, ndim 32,
# dims 36-51, ctx 52-59, dtype flag 60, data 64-87; record 1 magic at 88.
def raises_at(path, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        load_mxnet_params(path)
    assert path.name in str(info.value) and "byte" in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("np_mode", [True, False], ids=["v3", "v2"])
def test_every_truncation_raises(np_mode, tmp_path):
    raw = small_file(tmp_path, np_mode).read_bytes()
    cut = tmp_path / "cut.params"
    for n in range(len(raw)):
        cut.write_bytes(raw[:n])
        with pytest.raises(ValueError) as info:
            load_mxnet_params(cut)
        msg = str(info.value)
        assert msg.startswith(f"{cut}: ") and "byte" in msg, (n, msg)


def test_truncation_message_is_precise(tmp_path):
    raw = small_file(tmp_path).read_bytes()
    cut = tmp_path / "W_q.params"
    cut.write_bytes(raw[:45])
    with pytest.raises(ValueError) as info:
        load_mxnet_params(cut)
    assert str(info.value) == (
        f"{cut}: truncated at byte 36 while reading the shape of array 0 (needed 16 bytes, 9 left)"
    )
    cut.write_bytes(raw[:30])  # too short to hold even the smallest 2 records
    raises_at(cut, r"the array count is 2, but only 6 bytes are left \(at byte 16\)")
    cut.write_bytes(raw[:80])
    raises_at(
        cut,
        r"truncated at byte 64 while reading the data of array 0 "
        r"\(needed 24 bytes, 16 left\)",
    )


def test_fixture_truncated_in_the_middle(tmp_path):
    raw = (FIXTURES / "mha_bias.params").read_bytes()
    for n in (0, 8, 23, 24, 100, len(raw) // 2, len(raw) - 1):
        cut = tmp_path / "mha_bias_cut.params"
        cut.write_bytes(raw[:n])
        raises_at(cut, r"truncated at byte \d+|but only \d+ bytes are left")


def test_wrong_list_magic(tmp_path):
    msg = raises_at(patched(small_file(tmp_path), 0, "<Q", 0x113), "list magic is 0x113")
    assert "at byte 0" in msg
    text = tmp_path / "notes.params"
    text.write_bytes(b"this is not an MXNet file at all")
    raises_at(text, "not an MXNet NDArray file")


def test_wrong_array_magic(tmp_path):
    raises_at(
        patched(small_file(tmp_path), 24, "<I", 0xDEADBEEF),
        r"array 0 has unknown magic number 0xDEADBEEF \(at byte 24\)",
    )
    raises_at(
        patched(small_file(tmp_path), 88, "<I", 5),
        r"array 1 has unknown magic number 0x00000005 \(at byte 88\)",
    )


@pytest.mark.parametrize("flag", [8, 12, 99, -1])
def test_unsupported_dtype_flag(flag, tmp_path):
    raises_at(
        patched(small_file(tmp_path), 60, "<i", flag),
        rf"array 0 has unsupported dtype flag {flag} \(at byte 60\)",
    )


@pytest.mark.parametrize("stype", [1, 2, -1])
def test_unsupported_storage_type(stype, tmp_path):
    raises_at(
        patched(small_file(tmp_path), 28, "<i", stype),
        rf"array 0 has unsupported storage type {stype} .*\(at byte 28\)",
    )


def test_real_sparse_file_is_rejected():
    raises_at(FIXTURES / "sparse_csr_v2.params", r"array 0 has unsupported storage type 2")


def test_counts_exceeding_the_file(tmp_path):
    path = small_file(tmp_path)
    raises_at(
        patched(path, 16, "<Q", 2**63),
        r"the array count is 9223372036854775808, "
        r"but only \d+ bytes are left \(at byte 16\)",
    )
    raises_at(patched(path, 16, "<Q", 20), "the array count is 20")
    names_at = len(path.read_bytes()) - 8 - 2 * (8 + 1)  # count + 2 x (length, 1 char)
    raises_at(patched(path, names_at, "<Q", 2**40), "the name count is 1099511627776")
    raises_at(patched(path, names_at, "<Q", 1), "1 names for 2 arrays")
    raises_at(
        patched(path, names_at + 8, "<Q", 2**62), r"truncated at byte \d+ while reading name 0"
    )


def test_huge_shape_is_checked_before_reading(tmp_path):
    path = small_file(tmp_path)
    raises_at(patched(path, 36, "<q", 2**40), r"needed 13194139533312 bytes, \d+ left")
    raises_at(
        patched(path, 32, "<i", 2**31 - 1), r"array 0 has invalid ndim 2147483647 \(at byte 32\)"
    )
    raises_at(patched(path, 32, "<i", -5), "array 0 has invalid ndim -5")
    raises_at(patched(path, 36, "<q", -3), r"invalid shape \(-3, 3\)")


def test_unknown_shape_and_trailing_bytes(tmp_path):
    path = small_file(tmp_path)
    raises_at(patched(path, 36, "<q", -1), "array 0 has unknown shape")
    raises_at(
        patched(small_file(tmp_path, np_mode=False), 32, "<i", 0), "array 0 has unknown shape"
    )
    longer = tmp_path / "longer.params"
    longer.write_bytes(path.read_bytes() + b"\0\0\0")
    raises_at(longer, "3 unexpected trailing bytes")


def one_array_file(tmp_path, shape, dtype_flag=0, data=b""):
    """A V3 file holding one array of ``shape`` (any dims, even impossible ones)."""
    raw = struct.pack("<QQQIii", 0x112, 0, 1, 0xF993FACA, 0, len(shape))
    raw += struct.pack(f"<{len(shape)}q", *shape) + struct.pack("<iii", 1, 0, dtype_flag) + data
    raw += struct.pack("<QQ", 1, 1) + b"w"
    return _write(tmp_path / "shape.params", raw)


@pytest.mark.parametrize(
    "shape,message",
    [
        ((1,) * 33, "which NumPy cannot hold"),  # NumPy 1 holds 32 dims, NumPy 2 64
        ((0, 2**62, 2**62), "which NumPy cannot hold"),
        ((1,) * 65, "invalid ndim 65"),
    ],
)
def test_impossible_shapes_name_the_file_and_offset(tmp_path, shape, message):
    path = one_array_file(tmp_path, shape, data=b"\0\0\0\0" * (0 not in shape))
    if len(shape) == 33 and numpy_holds(shape):  # NumPy 2 reads it
        assert load_mxnet_params(path)["w"].shape == shape
        return
    msg = raises_at(path, message)
    assert msg.endswith("(at byte 32)"), msg


def numpy_holds(shape):
    try:
        np.empty(shape)
    except ValueError:
        return False
    return True


def test_names_with_a_nul_byte_are_refused(tmp_path):
    path = tmp_path / "names.params"
    save_mxnet_params({"ab": np.ones(1, np.float32), "ac": np.ones(1, np.float32)}, path)
    raw = path.read_bytes()
    (tmp_path / "nul.params").write_bytes(raw[:-2] + b"a\0")
    raises_at(tmp_path / "nul.params", r"name 1 \('a\\x00'\) contains a NUL byte")
    with pytest.raises(ValueError, match="NUL byte"):
        save_mxnet_params({"a\0x": np.ones(1), "a\0y": np.ones(1)}, tmp_path / "out.params")
    assert not (tmp_path / "out.params").exists()


def test_bad_names(tmp_path):
    path = tmp_path / "names.params"
    save_mxnet_params({"ab": np.ones(1, np.float32), "cd": np.ones(1, np.float32)}, path)
    raw = path.read_bytes()
    (tmp_path / "dup.params").write_bytes(raw[:-2] + b"ab")
    raises_at(tmp_path / "dup.params", "duplicate name 'ab'")
    (tmp_path / "utf.params").write_bytes(raw[:-2] + b"\xff\xfe")
    raises_at(tmp_path / "utf.params", "name 1 is not valid UTF-8")


def test_random_corruption_never_escapes_as_another_error(tmp_path):
    raw = small_file(tmp_path).read_bytes()
    rng = np.random.default_rng(0)
    for _ in range(2000):
        bad = bytearray(raw)
        for pos in rng.integers(0, len(raw), size=rng.integers(1, 4)):
            bad[pos] = rng.integers(0, 256)
        try:
            load_mxnet_params(_write(tmp_path / "bad.params", bytes(bad)))
        except ValueError as e:
            assert "bad.params" in str(e) and "byte" in str(e)


def _write(path, data):
    path.write_bytes(data)
    return path


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_mxnet_params(tmp_path / "nope.params")


# ---- against real MXNet (skipped where it is not installed) ----


def mxnet():
    with warnings.catch_warnings():  # numpy 1.2x warns on the hasattr probe itself
        warnings.simplefilter("ignore", FutureWarning)
        if not hasattr(np, "bool"):  # mxnet 1.9 needs numpy.bool, gone in numpy 1.24-1.26
            np.bool = bool
    return pytest.importorskip("mxnet", reason="mxnet not installed")


def mode(mx, np_mode):
    """np-shape/np-array semantics on or off, restored afterwards.

    MXNet refuses np-array semantics without np-shape semantics, so shape goes
    on first and array goes off first (the mxnet backend turns both on for
    the whole process when imported, e.g. by an earlier test)."""
    stack = contextlib.ExitStack()
    switches = [mx.util.np_shape(np_mode), mx.util.np_array(np_mode)]
    for switch in switches if np_mode else switches[::-1]:
        stack.enter_context(switch)
    return stack


def two_dense(mx, dtype, use_bias=True):
    from mxnet.gluon import nn

    class Block(mx.gluon.Block):
        def __init__(self):
            super().__init__()
            self.W_q = nn.Dense(8, use_bias=use_bias, flatten=False, dtype=dtype, in_units=5)
            self.W_o = nn.Dense(8, use_bias=use_bias, flatten=False, dtype=dtype, in_units=8)

    return Block()


def block_params(block):
    return {k: v.data().asnumpy() for k, v in block._collect_params_with_prefix().items()}


@pytest.mark.parametrize("np_mode", [True, False], ids=["v3", "v2"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_mxnet_loads_our_files(dtype, np_mode, tmp_path):
    mx = mxnet()
    params = sample_params(dtype, with_scalar=np_mode)
    del params["empty"]  # legacy mode reads a 0 in a shape as "unknown"
    save_mxnet_params(params, tmp_path / "p.params", np_mode=np_mode)
    with mode(mx, np_mode):
        load = mx.npx.load if np_mode else mx.nd.load
        got = {k: v.asnumpy() for k, v in load(str(tmp_path / "p.params")).items()}
    assert_same(got, params)


@pytest.mark.parametrize("np_mode", [True, False], ids=["v3", "v2"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_mxnet_load_parameters_accepts_our_files(dtype, np_mode, tmp_path):
    mx = mxnet()
    rng = np.random.default_rng(1)
    params = {
        k: rng.normal(size=s).astype(dtype)
        for k, s in [
            ("W_q.weight", (8, 5)),
            ("W_q.bias", (8,)),
            ("W_o.weight", (8, 8)),
            ("W_o.bias", (8,)),
        ]
    }
    save_mxnet_params(params, tmp_path / "p.params", np_mode=np_mode)
    with mode(mx, np_mode):
        block = two_dense(mx, dtype)
        block.load_parameters(str(tmp_path / "p.params"))
        assert_same(block_params(block), params)


@pytest.mark.parametrize("dtype", FLOATS)
def test_fresh_mxnet_save_parameters_reads_back(dtype, tmp_path):
    mx = mxnet()
    with mode(mx, True):
        mx.random.seed(0)
        block = two_dense(mx, "float32")
        block.initialize(mx.init.Normal(0.5))  # np-mode Normal only fills float32
        block.cast(dtype)
        block.W_q.bias.set_data(mx.np.arange(8).astype(dtype) / 4 - 1)
        block.W_o.bias.set_data(mx.np.arange(8).astype(dtype) / 8 + 1)
        block.save_parameters(str(tmp_path / "fresh.params"))
        want = block_params(block)
    raw = (tmp_path / "fresh.params").read_bytes()
    assert raw[24:28] == V3_MAGIC
    assert_same(load_mxnet_params(tmp_path / "fresh.params"), want)
    save_mxnet_params(want, tmp_path / "ours.params")
    assert (tmp_path / "ours.params").read_bytes() == raw


def test_fresh_mxnet_legacy_save_reads_back(tmp_path):
    mx = mxnet()
    want = sample_params("float32", with_scalar=False)
    del want["empty"]
    with mode(mx, False):
        mx.nd.save(
            str(tmp_path / "legacy.params"),
            {k: mx.nd.array(v, dtype=v.dtype) for k, v in want.items()},
        )
    assert (tmp_path / "legacy.params").read_bytes()[24:28] == V2_MAGIC
    assert_same(load_mxnet_params(tmp_path / "legacy.params"), want)
