"""The tensorflow backend (issue 61): its translation of the core, against the
float64 NumPy oracle (``attention_multi.reference``), and its modules as Keras
layers. Its own file, not the per-backend grids (``conftest.GRID_BACKENDS``):
each path and mask form once, float32 and float64, forward and backward
(``tf.GradientTape``), ``tf.function`` (XLA, unknown sizes), Keras' ``fit``,
saving and loading, and d2l's TensorFlow edition (``tests/d2l_tensorflow.py``).
"""

import importlib.util
import os

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference
from attention_multi.backends import capabilities as caps
from conftest import import_or_skip

if importlib.util.find_spec("tensorflow") is None:
    import_or_skip("tensorflow")  # (skips the file, or fails where it is required)

pytestmark = pytest.mark.second_stack  # (TensorFlow is on the modern stack)

# TensorFlow is imported by the first test that runs here, not at collection:
# every xdist worker collects this file, and importing TF takes 5-20 s
tf = keras = B = None


@pytest.fixture(autouse=True, scope="module")
def _tensorflow():
    global tf, keras, B
    import keras as _keras
    import tensorflow as _tf

    tf, keras, B = _tf, _keras, am.get_backend("tensorflow")


rng = np.random.default_rng(61)
TOL = {"float32": 2e-5, "float64": 1e-12}


def t(x, dtype=None):
    return tf.constant(np.asarray(x) if dtype is None else np.asarray(x, dtype))


def qkv(b=2, h=2, nq=5, nk=7, d=8, dv=6, kv_heads=None):
    q = rng.normal(size=(b, h, nq, d))
    k = rng.normal(size=(b, kv_heads or h, nk, d))
    v = rng.normal(size=(b, kv_heads or h, nk, dv))
    return q, k, v


# -- the backend ----------------------------------------------------------------------------


def test_the_backend_by_name_alias_and_environment(monkeypatch):
    assert am.get_backend("tf") is B and B.name == "tensorflow"
    assert caps.supports(B, caps.Autodiff) and not caps.supports(B, caps.Fused)
    from attention_multi.backends.required import REQUIRED

    assert all(hasattr(B, n) for n in REQUIRED)
    monkeypatch.setenv("ATTENTION_MULTI_BACKEND", "tensorflow")
    m = am.DotProductAttention(0.0)
    assert isinstance(m, keras.layers.Layer) and m.backend is B
    x = t(rng.normal(size=(2, 3, 4)), "float32")
    out = am.dot_product_attention(x, x, x)  # (TF in, TF out)
    assert isinstance(out, tf.Tensor) and out.dtype == tf.float32


def test_the_protocol_and_the_module_contract():
    """tests/test_backends.py's checks of every backend, on this one (not in its grid)."""
    import tests.test_backends as per_backend

    per_backend.test_the_required_protocol_is_small_and_capabilities_are_declared(B)
    per_backend.test_module_base_provides_the_native_module_contract(B)
    per_backend.test_native_class_is_cached_and_native(B)
    assert caps.supports(B, caps.Tracing) and caps.supports(B, caps.Arrays)


FORMS = {
    "none": {},
    "lens": {"valid_lens": np.array([3, 7])},
    "lens2d": {"valid_lens": rng.integers(0, 8, size=(2, 5))},
    "mask": {"mask": rng.random((2, 1, 5, 7)) > 0.3},
    "bias": {"bias": rng.normal(size=(1, 2, 5, 7))},
    "causal": {"causal": True},
    "window": {"window": (2, 1)},
    "causal+lens": {"causal": True, "valid_lens": np.array([4, 6])},
    "segments": {"segment_ids": np.array([[0, 0, 1, 1, 1, 2, -1], [0, 1, 1, 1, 2, 2, 2]])},
    "mask_mod": {"mask_mod": lambda b, h, q, k: (q + k) % 3 != 0},
    "score_mod": {"score_mod": lambda s, b, h, q, k: s - 0.1 * abs(q - k)},
}
# (TF's ops do not promote: a TF user's score_mod casts the int32 indices)
TF_MODS = {"score_mod": lambda s, b, h, q, k: s - 0.1 * tf.cast(abs(q - k), s.dtype)}


def _tf_forms(forms, dtype):
    out = {}
    for name, value in forms.items():
        if name in ("valid_lens", "mask", "segment_ids"):
            out[name] = t(value)
        elif name == "bias":
            out[name] = t(value, dtype)
        elif name in TF_MODS:
            out[name] = TF_MODS[name]
        else:
            out[name] = value
    return out


def _oracle(q, k, v, forms):
    return reference.attention(q, k, v, **forms)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("form", list(FORMS))
def test_every_mask_form_against_the_oracle(form, dtype):
    q, k, v = qkv()
    forms = FORMS[form]
    want, _ = _oracle(q, k, v, forms)
    got = am.dot_product_attention(*(t(x, dtype) for x in (q, k, v)), **_tf_forms(forms, dtype))
    assert got.dtype.name == dtype
    np.testing.assert_allclose(got.numpy(), want, atol=TOL[dtype], rtol=TOL[dtype])


PATH_FORMS = {
    "lens2d": {"valid_lens": rng.integers(0, 12, size=(2, 9))},
    "causal+lens": {"causal": True, "valid_lens": np.array([4, 11])},
    "mask": {"mask": rng.random((2, 9, 11)) > 0.3},
}


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("path", ["full", "chunked", "tiled"])
@pytest.mark.parametrize("form", list(PATH_FORMS))
def test_every_path_against_the_oracle(path, form, compiled):
    """Each path by name (blocks of 4), its weights too; compiled: inside a tf.function."""
    q, k, v = (x[:, 0] for x in qkv(nq=9, nk=11))
    forms = PATH_FORMS[form]
    as4 = {n: (a[:, None] if n == "mask" else a) for n, a in forms.items()}
    want, weights = _oracle(q[:, None], k[:, None], v[:, None], as4)
    m = am.DotProductAttention(0.0, path=path, chunk_size=4, backend="tensorflow")
    tf_forms = _tf_forms(forms, "float64")

    def call(*x):
        return m(*x, **tf_forms)

    call = tf.function(call) if compiled else call
    got = call(*(t(x, "float64") for x in (q, k, v)))
    np.testing.assert_allclose(got.numpy(), want[:, 0], atol=1e-12)
    if not compiled:
        assert m.last_path == path
        np.testing.assert_allclose(m.attention_weights.numpy(), weights[:, 0], atol=1e-12)


def test_grouped_heads_and_sinks():
    q, k, v = qkv(h=4, kv_heads=2)
    sinks = rng.normal(size=(4,))
    want, _ = reference.attention(q, k, v, causal=True, sinks=sinks)
    got = am.dot_product_attention(
        *(t(x, "float64") for x in (q, k, v)), causal=True, sinks=t(sinks, "float64")
    )
    np.testing.assert_allclose(got.numpy(), want, atol=1e-12)


@pytest.mark.parametrize("form", ["lens", "lens2d", "bias", "causal", "segments"])
def test_gradients_against_the_oracle(form):
    q, k, v = qkv()
    forms = FORMS[form]
    g = rng.normal(size=(2, 2, 5, 6))
    want = reference.attention_gradients(q, k, v, g, **forms)
    xs = [t(x, "float64") for x in (q, k, v)]
    tf_forms = _tf_forms(forms, "float64")
    with tf.GradientTape() as tape:
        tape.watch(xs)
        if "bias" in tf_forms:
            tape.watch(tf_forms["bias"])
        out = am.dot_product_attention(*xs, **tf_forms)
        loss = tf.reduce_sum(out * t(g))
    wrt = xs + ([tf_forms["bias"]] if "bias" in tf_forms else [])
    got = tape.gradient(loss, wrt)
    for name, a, b in zip(("queries", "keys", "values"), got, want):
        np.testing.assert_allclose(a.numpy(), b, atol=1e-10, err_msg=name)
    if "bias" in tf_forms:
        np.testing.assert_allclose(got[3].numpy(), want[3].sum(0, keepdims=True), atol=1e-10)


def test_d2l_helpers_and_regression():
    x = rng.normal(size=(2, 3, 4))
    np.testing.assert_allclose(
        am.masked_softmax(t(x), t([2, 3])).numpy(), reference.masked_softmax(x, [2, 3]), atol=1e-12
    )
    np.testing.assert_allclose(
        am.sequence_mask(t(x[:, 0]), t([1, 3])).numpy(),
        reference.sequence_mask(x[:, 0], [1, 3]),
    )
    heads = am.transpose_qkv(t(rng.normal(size=(2, 3, 8))), 2)
    assert tuple(heads.shape) == (4, 3, 4)
    assert tuple(am.transpose_output(heads, 2).shape) == (2, 3, 8)
    xt, yt, xq = rng.random(6), rng.random(6), rng.random(4)
    np.testing.assert_allclose(
        am.nadaraya_watson(t(xt), t(yt), t(xq)).numpy(),
        reference.nadaraya_watson(xt, yt, xq)[0],
        atol=1e-12,
    )


def test_matmul_by_a_broadcast_matrix_is_a_two_d_product():
    """TF 2.21's oneDNN batched matmul of a (2, 1, 10, 8) by a broadcast (8, 1)
    gives wrong numbers: ``matmul`` and ``linear`` make it one 2-D product."""
    a, w = rng.normal(size=(2, 1, 10, 8)), rng.normal(size=(8, 1))
    np.testing.assert_allclose(B.matmul(t(a), t(w)).numpy(), a @ w, atol=1e-12)
    np.testing.assert_allclose(B.linear(t(a), t(w.T)).numpy(), a @ w, atol=1e-12)
    x32 = t(a, "float32")
    np.testing.assert_allclose(B.linear(x32, t(w.T, "float32")).numpy(), a @ w, atol=1e-5)


# -- tf.function --------------------------------------------------------------------------


def test_xla_compiled_without_a_retrace_per_length():
    q, k, v = qkv()
    traces = []

    @tf.function(jit_compile=True)
    def f(q, k, v, lens):
        traces.append(1)
        return am.dot_product_attention(q, k, v, lens, causal=True)

    xs = [t(x, "float32") for x in (q, k, v)]
    for lens in ([3, 7], [1, 2], [7, 0]):
        want, _ = reference.attention(q, k, v, np.array(lens), causal=True)
        np.testing.assert_allclose(f(*xs, t(lens, "int32")).numpy(), want, atol=2e-5)
    assert len(traces) == 1


@pytest.mark.parametrize("lens_2d", [False, True])
def test_unknown_sizes_in_a_tensor_spec(lens_2d):
    """A TensorSpec with None dimensions (as Keras traces): batch and lengths unknown."""
    x = rng.normal(size=(3, 5, 8))
    lens = rng.integers(0, 6, size=(3, 5) if lens_2d else (3,))
    spec = tf.TensorSpec([None, None, 8], tf.float64)
    lens_spec = tf.TensorSpec([None, None] if lens_2d else [None], tf.int32)
    m = am.MultiHeadAttention(8, 2, 0.0, backend="tensorflow", dtype="float64")
    m(t(x), t(x), t(x))  # (sized eagerly)

    @tf.function(input_signature=[spec, lens_spec])
    def f(x, lens):
        return am.dot_product_attention(x, x, x, lens), m(x, x, x, lens)

    got, got_m = f(t(x), t(lens, "int32"))
    want, _ = reference.dot_product_attention(x, x, x, lens)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-12)
    np.testing.assert_allclose(got_m.numpy(), m(t(x), t(x), t(x), t(lens)).numpy(), atol=1e-12)


# -- Keras -----------------------------------------------------------------------------------


def _model(dropout=0.0, lazy=True, dtype="float32"):
    T, D = 6, 8
    inp = keras.Input((T, D), dtype=dtype)
    lens = keras.Input((), dtype="int32")
    sizes = {} if lazy else {"key_size": D, "query_size": D, "value_size": D}
    mha = am.MultiHeadAttention(D, 2, dropout, backend="tensorflow", dtype=dtype, **sizes)
    out = keras.layers.Dense(D, dtype=dtype)(mha(inp, inp, inp, lens))
    return keras.Model([inp, lens], out), mha


def _data(n=10, dtype="float32"):
    x = rng.normal(size=(n, 6, 8)).astype(dtype)
    return x, rng.integers(1, 7, size=n).astype("int32"), rng.normal(size=(n, 6, 8)).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_keras_model_trains_with_a_partial_last_batch(dtype):
    """fit traces with batch None (10 examples, batches of 4: the last has 2);
    the loss falls; float64 stays float64 (``autocast=False``)."""
    model, mha = _model(0.1, dtype=dtype)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    x, lens, y = _data(dtype=dtype)
    history = model.fit([x, lens], y, batch_size=4, epochs=4, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    assert all(v.dtype == dtype for v in mha.trainable_variables)
    assert len(mha.trainable_variables) == 4  # W_q, W_k, W_v, W_o (no bias)
    eager = model([t(x), t(lens)])
    assert eager.dtype == dtype
    # (Keras' predict: inference, no dropout; the same as a call without training=)
    np.testing.assert_allclose(model.predict([x, lens], verbose=0), eager.numpy(), atol=1e-5)


def test_the_model_saves_and_loads_as_keras(tmp_path):
    model, _ = _model(0.1)
    model.compile("adam", "mse")
    x, lens, y = _data()
    model.fit([x, lens], y, batch_size=4, epochs=1, verbose=0)
    want = model.predict([x, lens], verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.predict([x, lens], verbose=0), want)
    mha = [la for la in loaded.layers if isinstance(la, am.MultiHeadAttention)][0]
    assert mha.backend is B and mha.num_heads == 2 and mha.attention.dropout == 0.1
    # in a fresh process: the classes are registered when the backend loads
    script = (
        "import sys, numpy as np, keras, attention_multi as am; am.get_backend('tensorflow')\n"
        f"m = keras.models.load_model({path!r})\n"
        f"x = np.load({str(tmp_path / 'x.npz')!r})\n"
        "np.save(sys.argv[1], m.predict([x['x'], x['lens']], verbose=0))\n"
    )
    np.savez(tmp_path / "x.npz", x=x, lens=lens)
    import subprocess
    import sys

    out = tmp_path / "out.npy"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", script, str(out)], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    np.testing.assert_array_equal(np.load(out), want)


def test_the_model_exports_a_saved_model(tmp_path):
    model, _ = _model(lazy=False)
    x, lens, _ = _data()
    want = model([t(x), t(lens)]).numpy()
    model.export(str(tmp_path / "saved"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "saved"))
    np.testing.assert_allclose(loaded.serve([t(x), t(lens)]).numpy(), want, atol=1e-6)
    # another batch size and lengths (the signature's batch is None)
    got = loaded.serve([t(x[:3]), t([6, 1, 0], "int32")]).numpy()
    np.testing.assert_allclose(got, model([t(x[:3]), t([6, 1, 0], "int32")]).numpy(), atol=1e-6)


def test_training_as_keras_passes_it_and_train_eval_pin_it():
    m = am.DotProductAttention(0.5, backend="tensorflow")
    x = t(rng.normal(size=(2, 4, 8)), "float32")
    plain = m(x, x, x).numpy()  # (no training=: inference, as a Keras layer)
    dropped = m(x, x, x, training=True).numpy()
    assert not np.allclose(plain, dropped)
    np.testing.assert_array_equal(m(x, x, x, training=False).numpy(), plain)
    m.train()  # pinned on
    assert not np.allclose(m(x, x, x).numpy(), plain)
    np.testing.assert_array_equal(m(x, x, x, training=False).numpy(), plain)  # explicit wins
    m.eval()
    np.testing.assert_array_equal(m(x, x, x).numpy(), plain)
    assert not np.allclose(m(x, x, x, training=True).numpy(), plain)
    # a parent's training= reaches its children (Keras' call context)
    mha = am.MultiHeadAttention(8, 2, 0.5, backend="tensorflow")
    assert not np.allclose(mha(x, x, x, training=True).numpy(), mha(x, x, x).numpy())


def test_dropout_is_seeded_and_traced_once():
    x = t(np.ones((2, 4, 8)), "float32")
    B.seed(3)
    a = B.dropout(x, 0.5).numpy()
    B.seed(3)
    np.testing.assert_array_equal(B.dropout(x, 0.5).numpy(), a)
    assert set(np.unique(a)) <= {0.0, 2.0} and 0 < (a == 0).mean() < 1
    assert not B.dropout(x, 1.0).numpy().any()
    m = am.DotProductAttention(0.3, backend="tensorflow")
    traces = []

    @tf.function(jit_compile=True)
    def step(q, lens):
        traces.append(1)
        return m(q, q, q, lens, training=True)

    q = t(rng.normal(size=(2, 4, 8)), "float32")
    first = step(q, t([2, 4], "int32")).numpy()
    second = step(q, t([3, 1], "int32")).numpy()
    assert len(traces) == 1 and not np.allclose(first, second)


def test_gradients_of_a_module_and_the_protocol():
    m = am.MultiHeadAttention(8, 2, 0.0, backend="tensorflow", dtype="float64")
    x = t(rng.normal(size=(2, 4, 8)))
    m(x, x, x)
    params = {n: np.asarray(v) for n, v in am.get_params(m).items()}

    def loss(module, q):
        return tf.reduce_sum(module(q, q, q, t([2, 4])) ** 2)

    value, grads, (gx,) = caps.gradients(B, loss, m, x)
    out, _ = reference.multi_head_attention(params, x.numpy(), x.numpy(), x.numpy(), [2, 4], 2)
    assert value == pytest.approx((out**2).sum(), rel=1e-12)
    assert set(grads) == set(params) and gx.shape == x.shape
    eps, name, sums = 1e-6, "W_q.weight", {}  # one entry by central differences
    for sign in (1, -1):
        bumped = dict(params, **{name: params[name].copy()})
        bumped[name][0, 0] += sign * eps
        o, _ = reference.multi_head_attention(bumped, x.numpy(), x.numpy(), x.numpy(), [2, 4], 2)
        sums[sign] = (o**2).sum()
    want = (sums[1] - sums[-1]) / 2 / eps
    np.testing.assert_allclose(grads[name].numpy()[0, 0], want, rtol=1e-6)


def test_bad_input_names_the_argument():
    m = am.MultiHeadAttention(8, 2, 0.0, backend="tensorflow")
    x = t(rng.normal(size=(2, 4, 8)), "float32")
    with pytest.raises(ValueError, match="valid_lens"):
        m(x, x, x, t([1, 2, 3]))
    with pytest.raises(TypeError, match="dtypes differ"):
        m(x, x, t(rng.normal(size=(2, 4, 8))))
    with pytest.raises(ValueError, match="queries"):
        am.dot_product_attention(t(rng.normal(size=(2, 4))), x, x)


# -- d2l's TensorFlow edition (vendored: attention_multi/cli/bench/d2l_tensorflow.py) ---------


def _d2l():
    from attention_multi.cli.bench import d2l_tensorflow

    return d2l_tensorflow


# (no length 0: d2l's row is then uniform, ours zeros, as documented)
LENS = {"1d": np.array([2, 6]), "2d": np.array([[1, 2, 3, 4, 5], [6, 5, 4, 2, 1]])}


@pytest.mark.parametrize("lens", list(LENS))
def test_d2l_dot_product_and_additive_attention(lens):
    d2l = _d2l()
    q, k, v = (t(rng.normal(size=s), "float32") for s in ((2, 5, 4), (2, 6, 4), (2, 6, 3)))
    valid = t(LENS[lens], "int32")
    theirs = d2l.DotProductAttention(0.5)
    ours = am.set_params(am.DotProductAttention(0.5, backend="tensorflow"), am.keras_params(theirs))
    np.testing.assert_allclose(
        ours(q, k, v, valid).numpy(), theirs(q, k, v, valid).numpy(), atol=1e-5
    )
    np.testing.assert_allclose(
        ours.attention_weights.numpy(), theirs.attention_weights.numpy(), atol=1e-5
    )
    qa = t(rng.normal(size=(2, 5, 3)), "float32")
    theirs = d2l.AdditiveAttention(4, 3, 8, 0.1)
    ours = am.AdditiveAttention(4, 3, 8, 0.1, backend="tensorflow")
    theirs(qa, k, v, valid)
    assert list(am.keras_params(theirs)) == ["W_k.kernel", "W_q.kernel", "w_v.kernel"]
    am.set_params(ours, am.keras_params(theirs))
    np.testing.assert_allclose(
        ours(qa, k, v, valid).numpy(), theirs(qa, k, v, valid).numpy(), atol=1e-5
    )
    np.testing.assert_allclose(
        ours.attention_weights.numpy(), theirs.attention_weights.numpy(), atol=1e-5
    )


D2L_UNBUILT = "ignore:.*(unbuilt state|does not have a `build\\(\\)`):UserWarning"  # (d2l's MHA)


@pytest.mark.filterwarnings(D2L_UNBUILT)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lens", list(LENS))
def test_d2l_multi_head_attention(lens, bias):
    d2l = _d2l()
    x = t(rng.normal(size=(2, 5, 6)), "float32")
    y = t(rng.normal(size=(2, 7, 6)), "float32")
    valid = t(LENS[lens] if lens == "1d" else rng.integers(1, 8, size=(2, 5)), "int32")
    theirs = d2l.MultiHeadAttention(6, 6, 6, 8, 2, 0.0, bias)
    ours = am.MultiHeadAttention(6, 6, 6, 8, 2, 0.0, bias, backend="tensorflow")
    want = theirs(x, y, y, valid)
    am.set_params(ours, am.keras_params(theirs))
    np.testing.assert_allclose(ours(x, y, y, valid).numpy(), want.numpy(), atol=1e-5)
    np.testing.assert_allclose(
        ours.attention.attention_weights.numpy(),
        theirs.attention.attention_weights.numpy(),
        atol=1e-5,
    )


@pytest.mark.filterwarnings(D2L_UNBUILT)
def test_d2l_transformer_encoder_with_ours_in_every_block():
    """d2l's TransformerEncoder, its blocks' attention d2l's or ours, same weights:
    the same encodings and the same attention weights (read as d2l reads them)."""
    d2l = _d2l()
    args = (20, 8, 8, 8, 8, [2], 16, 2, 2, 0.0)  # (norm_shape [2]: Keras 3's axis 2)
    theirs, ours = d2l.TransformerEncoder(*args), d2l.TransformerEncoder(*args, attention="am")
    tokens = t(rng.integers(0, 20, size=(2, 7)), "int32")
    valid = t([3, 7], "int32")
    want = theirs(tokens, valid)
    ours(tokens, valid)
    ours.embedding.set_weights(theirs.embedding.get_weights())
    for mine, their in zip(ours.blks, theirs.blks):
        am.set_params(mine.attention, am.keras_params(their.attention))
        for part in ("addnorm1", "addnorm2", "ffn"):
            getattr(mine, part).set_weights(getattr(their, part).get_weights())
    got = ours(tokens, valid, training=False)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)
    for a, b in zip(ours.attention_weights, theirs.attention_weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)


@pytest.mark.filterwarnings(D2L_UNBUILT)
@pytest.mark.parametrize("bias", [False, True])
def test_a_d2l_layers_weights_load_into_ours_on_numpy_and_torch(bias):
    """``am.keras_params`` of d2l's TF MultiHeadAttention into ours on other
    backends: d2l's outputs and weights; and back, ours into d2l's."""
    d2l = _d2l()
    x, y = rng.normal(size=(2, 5, 6)), rng.normal(size=(2, 7, 6))
    lens = np.array([3, 7])
    theirs = d2l.MultiHeadAttention(6, 6, 6, 8, 2, 0.0, bias)
    with pytest.raises(ValueError, match=r"MultiHeadAttention.W_q \(Dense\) is not built yet"):
        am.keras_params(theirs)
    tx, ty, tlens = t(x, "float32"), t(y, "float32"), t(lens, "int32")
    want = theirs(tx, ty, ty, tlens).numpy()
    want_weights = theirs.attention.attention_weights.numpy()
    params = am.keras_params(theirs)
    assert all(type(a) is np.ndarray for a in params.values())
    assert params["W_q.kernel"].shape == (6, 8) and ("W_q.bias" in params) == bias
    for name in ("numpy", "torch"):
        xp = am.get_backend(name)
        ours = am.MultiHeadAttention(6, 6, 6, 8, 2, 0.0, bias, backend=name).eval()
        am.set_params(ours, params)
        q, kv = xp.asarray(x, "float32"), xp.asarray(y, "float32")
        got = ours(q, kv, kv, xp.asarray(lens, "int32"))
        np.testing.assert_allclose(xp.to_numpy(got), want, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(
            xp.to_numpy(ours.attention_weights), want_weights, atol=1e-5, err_msg=name
        )
    # the way back: ours (torch) into d2l's layer
    assert am.set_keras_params(theirs, am.get_params(ours)) is theirs
    np.testing.assert_allclose(theirs(tx, ty, ty, tlens).numpy(), xp.to_numpy(got), atol=1e-5)


def test_the_keras_layout_on_tensorflow():
    """get_params(layout="keras") -> set_params: identical outputs; the kernels
    are the weights transposed; both namings of one weight, or a kernel of the
    wrong shape, are refused with their names."""
    x = t(rng.normal(size=(2, 5, 6)), "float32")
    lens = t([2, 5], "int32")
    src = am.MultiHeadAttention(6, 6, 6, 8, 2, 0.0, True, backend="tensorflow")
    dst = am.MultiHeadAttention(6, 6, 6, 8, 2, 0.0, True, backend="tensorflow")
    params, torch_layout = am.get_params(src, layout="keras"), am.get_params(src)
    for name, value in torch_layout.items():
        if name.endswith(".weight"):
            kernel = params[name.replace(".weight", ".kernel")]
            assert kernel.shape == value.shape[::-1] and name not in params
            np.testing.assert_array_equal(kernel, value.T)
        else:
            np.testing.assert_array_equal(params[name], value)
    am.set_params(dst, params)
    assert dst(x, x, x, lens).numpy().tobytes() == src(x, x, x, lens).numpy().tobytes()
    with pytest.raises(ValueError, match=r"both 'W_o.kernel' and 'W_o.weight' are given"):
        am.set_params(dst, {**params, "W_o.weight": torch_layout["W_o.weight"]})
    with pytest.raises(
        ValueError,
        match=r"'W_q.kernel' has shape \(8, 6\), the module expects \(6, 8\) "
        r"\(Keras' \(in, out\) layout: the transpose of 'W_q.weight', \(8, 6\)\)",
    ):
        am.set_params(dst, {**params, "W_q.kernel": torch_layout["W_q.weight"]})
    # a Keras Dense and our Linear, both ways
    dense = keras.layers.Dense(3)
    dense(t(np.ones((1, 6)), "float32"))
    lin = am.set_params(am.Linear(6, 3, backend="tensorflow"), am.keras_params(dense))
    np.testing.assert_allclose(lin(x).numpy(), dense(x).numpy(), atol=1e-6)
    am.set_keras_params(dense, am.get_params(am.Linear(6, 3, backend="tensorflow")))
    assert not np.allclose(lin(x).numpy(), dense(x).numpy())


@pytest.mark.filterwarnings(D2L_UNBUILT)
def test_the_guides_tensorflow_example_runs(capsys):
    """docs/guide/backends.md's TensorFlow blocks, in order, as one script
    (test_docs runs that page on the first stack, where TensorFlow is not installed)."""
    from tests.test_docs import DOCS, blocks

    found = blocks(DOCS / "guide" / "backends.md")
    code = "\n".join(code for need, _, code in found if need == "tensorflow")
    exec(compile(code, "backends.md", "exec"), {"__name__": "guide"})  # noqa: S102
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "['W_k.weight', 'W_o.weight', 'W_q.weight', 'W_v.weight']",
        "float32",
        "['W_k.kernel', 'W_o.kernel', 'W_q.kernel', 'W_v.kernel'] (6, 8)",
        "True (8, 6)",
        "True",
        "(6, 8)",
    ]


@pytest.mark.parametrize("shape", [(0, 3, 0, 4), (2, 2, 0, 4)])
def test_an_empty_axis_gives_zeros_and_zero_gradients(shape):
    b, h, nk, d = shape
    q = t(rng.normal(size=(b, h, 3, d)))
    k = t(np.zeros((b, h, nk, d)))
    with tf.GradientTape() as tape:
        tape.watch(q)
        out = am.dot_product_attention(q, k, k, causal=True)
        loss = tf.reduce_sum(out)
    assert tuple(out.shape) == (b, h, 3, d) and not out.numpy().any()
    zero = tf.UnconnectedGradients.ZERO  # (no keys: the output does not depend on q)
    assert not tape.gradient(loss, q, unconnected_gradients=zero).numpy().any()


def test_positional_encoding_regression_and_the_kv_cache():
    x = rng.normal(size=(2, 5, 8))
    pe = am.PositionalEncoding(8, 0.0, backend="tensorflow", dtype="float64")
    np.testing.assert_allclose(pe(t(x)).numpy(), reference.positional_encoding(x), atol=1e-12)
    net = am.NWKernelRegression(backend="tensorflow")
    xt = np.sort(rng.random(20) * 5)
    yt = 2 * np.sin(xt) + xt**0.8
    losses = am.train_kernel_regression(net, t(xt, "float32"), t(yt, "float32"), epochs=3, lr=0.5)
    assert losses[-1] < losses[0]
    # decoding step by step with the cache, eagerly and in a tf.function (the cache
    # is a tf.nest structure), gives causal attention over the whole sequence
    mha = am.MultiHeadAttention(8, 2, 0.0, key_size=8, query_size=8, value_size=8,
                                backend="tensorflow")  # fmt: skip
    xs = t(rng.normal(size=(2, 6, 8)), "float32")
    want = mha(xs, xs, xs, causal=True).numpy()
    for step in (mha, tf.function(lambda x, cache: mha(x, x, x, cache=cache))):
        cache, outs = mha.init_cache(2, 6), []
        for i in range(6):
            x = xs[:, i : i + 1]
            out, cache = step(x, x, x, cache=cache) if step is mha else step(x, cache)
            outs.append(out)
        np.testing.assert_allclose(tf.concat(outs, 1).numpy(), want, atol=1e-6)


def test_the_conformance_grid_grades_ours_on_tensorflow(capsys):
    """``attention-multi conform --impl am-tensorflow --quick``: every case agrees
    (forward and ``tf.GradientTape`` gradients against the oracle)."""
    from attention_multi.cli import main

    assert main(["conform", "--impl", "am-tensorflow", "--quick"]) == 0
    assert "differs" not in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.parametrize("name", ["mha_bias", "mha_bias_float64", "additive"])
def test_an_mxnet_d2l_models_weights_load_into_ours_on_tensorflow(name):
    """tests/test_port.py's committed Gluon fixtures (a d2l MXNet model's .params and
    the outputs MXNet gave): ``am.port.load_into`` on this backend reproduces them."""
    import tests.test_port as port

    port.test_fixture_reproduces_mxnet(name, B)
