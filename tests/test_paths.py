"""The fused, chunked and full paths of attention agree with the float64 oracle.

Each path is forced explicitly (``path=``; a small ``chunk_size`` makes the
chunked path run several blocks of queries and of keys), on every backend, for every form of mask.
No timing here: speed is measured by ``attention-multi bench``.
"""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle
from attention_multi.backends.capabilities import Autodiff, Fused, opt, supports, value_and_grad
from attention_multi.core import DEFAULT_MEMORY_BUDGET, attend, make_mask

PATHS = ("fused", "tiled", "chunked", "full")
TOL = dict(rtol=1e-5, atol=1e-5)
BATCH, NQ, NK, D = 3, 5, 7, 4

# name -> valid_lens for (BATCH, NQ) queries over NK keys
MASKS = {
    "none": None,
    "1d": np.array([0, 4, 7]),  # with a 0
    "2d": np.array([[0, 3, 0, 7, 1], [5, 0, 2, 2, 0], [7, 6, 5, 4, 3]]),
    "zeros": np.array([0, 0, 0]),
    "full-length": np.array([NK, NK, NK]),
    "over-long": np.array([NK + 3, 100, 2**40]),
}


def _inputs(seed=0, batch=BATCH, nq=NQ, nk=NK, d=D, dv=D):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((batch, nq, d)),
        rng.standard_normal((batch, nk, d)),
        rng.standard_normal((batch, nk, dv)),
    )


def _module(cls, backend, path, *args, dtype="float32", **kw):
    m = cls(
        *args,
        backend=backend,
        dtype=dtype,
        path=path,
        chunk_size=3 if path == "chunked" else None,
        **kw,
    )
    m.eval()
    return m


def _expected_path(backend, path, dv=D, d=D, mask=None):
    """A forced "fused" falls back to "auto"'s choice where the backend has no
    kernel for the case: at these sizes the cheapest plan is the full path
    (a tile would cost a kernel call), or the tiles when no query sees a key
    (they call no kernel then)."""
    if path == "fused" and (not supports(backend, Fused) or (backend.name == "jax" and dv != d)):
        return "tiled" if mask == "zeros" and not opt(backend).compiles_per_shape else "full"
    return path  # (jax.nn.dot_product_attention needs dv == d)


def _attend(backend, q, k, v, lens, **options):
    """attend() on (batch, heads, n, d) arrays with lengths broadcast over heads."""
    mask = make_mask(backend, q.shape[0], q.shape[1], q.shape[2], k.shape[2], valid_lens=lens)
    return attend(backend, q, k, v, mask, **options)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mask", MASKS)
def test_dot_product_paths_match_oracle(backend, path, mask):
    q, k, v = _inputs()
    lens = MASKS[mask]
    ref, ref_w = oracle.dot_product_attention(q, k, v, lens)
    m = _module(am.DotProductAttention, backend, path, 0.0)
    out = m(
        *(backend.asarray(x, "float32") for x in (q, k, v)),
        None if lens is None else backend.asarray(lens),
    )
    assert m.last_path == _expected_path(backend, path, mask=mask)
    assert tuple(out.shape) == (BATCH, NQ, D)
    np.testing.assert_allclose(backend.to_numpy(out), ref, **TOL)
    # read after the call: computed from what the call kept
    np.testing.assert_allclose(backend.to_numpy(m.attention_weights), ref_w, **TOL)


@pytest.mark.parametrize("path", PATHS)
def test_value_size_differs_from_query_size(backend, path):
    q, k, v = _inputs(1, dv=6)
    lens = MASKS["2d"]
    ref, _ = oracle.dot_product_attention(q, k, v, lens)
    m = _module(am.DotProductAttention, backend, path, 0.0)
    out = m(*(backend.asarray(x, "float32") for x in (q, k, v)), backend.asarray(lens))
    assert m.last_path == _expected_path(backend, path, dv=6)
    np.testing.assert_allclose(backend.to_numpy(out), ref, **TOL)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mask", ["none", "2d", "over-long"])
def test_multi_head_paths_match_oracle(backend, path, mask):
    heads, hidden = 2, 8
    q, k, v = _inputs(2, d=6, dv=6)
    lens = MASKS[mask]
    m = _module(am.MultiHeadAttention, backend, path, 6, 6, 6, hidden, heads, 0.0, bias=True)
    ref, ref_w = oracle.multi_head_attention(am.get_params(m), q, k, v, lens, heads)
    out = m(
        *(backend.asarray(x, "float32") for x in (q, k, v)),
        None if lens is None else backend.asarray(lens),
    )
    assert m.last_path == _expected_path(backend, path)
    assert tuple(out.shape) == (BATCH, NQ, hidden)
    np.testing.assert_allclose(backend.to_numpy(out), ref, **TOL)
    w = m.attention_weights
    assert tuple(w.shape) == (BATCH * heads, NQ, NK)  # d2l's layout
    np.testing.assert_allclose(backend.to_numpy(w), ref_w, **TOL)


@pytest.mark.grid(rows={"path": ("fused", "full")})  # (JAX: the paths it takes itself)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mask", ["1d", "2d"])
def test_nan_in_masked_keys_and_values_does_not_leak(backend, path, mask):
    q, k, v = _inputs(3)
    lens = MASKS[mask]
    longest = lens if lens.ndim == 1 else lens.max(axis=1)
    k_nan, v_nan = k.copy(), v.copy()
    for b, n in enumerate(longest):
        k_nan[b, n:] = v_nan[b, n:] = np.nan  # rows that no query may attend
    ref, _ = oracle.dot_product_attention(q, k, v, lens)
    m = _module(am.DotProductAttention, backend, path, 0.0)
    args = [backend.asarray(x, "float32") for x in (q, k_nan, v_nan)]
    out = backend.to_numpy(m(*args, backend.asarray(lens)))
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, **TOL)
    if supports(backend, Autodiff):  # nor into the gradients

        def loss_fn(module, *xs):
            y = module(*xs, backend.asarray(lens))
            return backend.sum((y * y).reshape((-1,)), 0)

        _, _, grads = backend.gradients(loss_fn, m, *args)
        for g, n in zip(grads, ("queries", "keys", "values")):
            g = backend.to_numpy(g)
            assert np.isfinite(
                g[:, :NQ]
                if n == "queries"
                else np.concatenate([g[b, : longest[b]] for b in range(BATCH)])
            ).all(), n


@pytest.mark.parametrize("path", PATHS)
def test_float16_large_scores_do_not_overflow(backend, path):
    if "float16" not in backend.float_dtypes:
        pytest.skip(f"{backend.name} has no float16")
    q, k, v = _inputs(4)
    q, k = q * 30, k * 30  # scores ~ 1e3 .. 1e4: exp overflows half
    lens = MASKS["2d"]
    ref, _ = oracle.dot_product_attention(
        q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), lens
    )
    m = _module(am.DotProductAttention, backend, path, 0.0, dtype="float16")
    out = m(*(backend.asarray(x, "float16") for x in (q, k, v)), backend.asarray(lens))
    assert backend.dtype_name(out) == "float16"
    out = backend.to_numpy(out).astype(np.float64)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("path", PATHS)
def test_float64(backend, path):
    opt(backend).enable_float64()
    q, k, v = _inputs(5)
    lens = MASKS["2d"]
    ref, _ = oracle.dot_product_attention(q, k, v, lens)
    m = _module(am.DotProductAttention, backend, path, 0.0, dtype="float64")
    out = m(*(backend.asarray(x, "float64") for x in (q, k, v)), backend.asarray(lens))
    assert backend.dtype_name(out) == "float64"
    np.testing.assert_allclose(backend.to_numpy(out), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask", ["none", "1d", "1d-no-zero", "some-zero-2d"])
def test_chunked_many_blocks_matches_full(backend, mask):
    """Longer sequences, blocks not dividing the lengths; blocks within every
    length (not masked) and past every length (skipped)."""
    rng = np.random.default_rng(6)
    n, T, d = 2, 19, 8
    q, k, v = (rng.standard_normal((n, T, d)).astype(np.float32) for _ in range(3))
    lens = {
        "none": None,
        "1d": np.array([0, 14]),
        "1d-no-zero": np.array([11, 17]),
        "some-zero-2d": rng.integers(0, T + 3, (n, T)),
    }[mask]
    args = [backend.asarray(x) for x in (q, k, v)] + [
        None if lens is None else backend.asarray(lens)
    ]
    outs = []
    for path, chunk in (("full", None), ("chunked", 6)):
        m = am.DotProductAttention(0.0, backend=backend, path=path, chunk_size=chunk)
        outs.append(backend.to_numpy(m.eval()(*args)))
    np.testing.assert_allclose(outs[1], outs[0], **TOL)


def test_auto_path_choice(backend):
    """ "auto": the full path for small calls, the cheapest plan beyond them
    (a kernel's one call over the scores, or tiles that skip padding, each
    call counted), the chunked path when the scores do not fit the budget."""
    q, k, v = (backend.asarray(x, "float32") for x in _inputs(7))
    lens = backend.asarray(MASKS["2d"])
    m = am.DotProductAttention(0.0, backend=backend).eval()
    m(q, k, v, lens)
    assert m.last_path == "full"  # at most SMALL_SCORES scores
    # beyond small calls: every key seen, one kernel call where there is one
    big = _inputs(7, batch=3, nq=64, nk=1000)
    full = np.array([1000, 1000, 1000])
    want, _ = oracle.dot_product_attention(*big, full)
    qb, kb, vb = (backend.asarray(x, "float32") for x in big)
    got = m(qb, kb, vb, backend.asarray(full))
    assert m.last_path == ("fused" if supports(backend, Fused) else "tiled")
    np.testing.assert_allclose(backend.to_numpy(got), want, **TOL)
    # most keys padding: the tiles skip it (a framework that compiles each
    # shape takes its kernel)
    short = np.array([20, 1, 30])
    want, _ = oracle.dot_product_attention(*big, short)
    got = m(qb, kb, vb, backend.asarray(short))
    assert m.last_path == ("fused" if opt(backend).compiles_per_shape else "tiled")
    np.testing.assert_allclose(backend.to_numpy(got), want, **TOL)
    # neither the scores (3*5*7*4 bytes) nor a per-query mask (3*5*7) fit
    m.memory_budget = 16
    small = m(q, k, v, lens)
    assert m.last_path == "chunked"
    m.path = "full"
    np.testing.assert_allclose(backend.to_numpy(small), backend.to_numpy(m(q, k, v, lens)), **TOL)
    assert m.last_path == "full"
    # dropout active: the tiles (each through a kernel with its own dropout
    # where there is one), but not with a PRNG key: a jitted call must draw
    # what an eager one draws; the weights are those before dropout
    m = am.DotProductAttention(0.5, backend=backend).train()  # (MXNet: outside record())
    key = opt(backend).dropout_key(0)
    m(qb, kb, vb, backend.asarray(short), **({} if key is None else {"key": key}))
    assert m.last_path == ("full" if key is not None else "tiled")
    np.testing.assert_allclose(
        backend.to_numpy(m.attention_weights),
        oracle.dot_product_attention(*big, short)[1],
        **TOL,
    )
    assert am.DotProductAttention(0.5, backend=backend).eval().path == "auto"


def test_default_budget_and_option_checks():
    assert DEFAULT_MEMORY_BUDGET == 512 * 2**20
    with pytest.raises(ValueError, match="path must be one of"):
        am.DotProductAttention(0.0, backend="numpy", path="flash")
    with pytest.raises(ValueError, match="memory_budget"):
        am.DotProductAttention(0.0, backend="numpy", memory_budget=0)
    with pytest.raises(ValueError, match="chunk_size"):
        am.MultiHeadAttention(4, 4, 4, 4, 2, 0.0, backend="numpy", chunk_size=-1)
    m = am.MultiHeadAttention(4, 4, 4, 4, 2, 0.0, backend="numpy", path="chunked")
    assert (m.path, m.attention.path) == ("chunked", "chunked")
    m.memory_budget = 1024
    assert m.attention.memory_budget == 1024


@pytest.mark.grid(rows={"path": ("fused", "full")})  # (JAX: the paths it takes itself)
@pytest.mark.parametrize("path", PATHS)
def test_dropout_on_every_path(backend, path):
    """Dropout in training mode: per-block (or the kernel's own) masks, the
    right mean, zeros for rows with no key, and the pre-dropout weights."""
    key = opt(backend).dropout_key(0)
    backend.seed(0)
    q, k, v = _inputs(8, nk=16)
    lens = np.array([10, 16, 0])
    args = [backend.asarray(x, "float32") for x in (q, k, v)] + [backend.asarray(lens)]
    m = am.DotProductAttention(0.5, backend=backend, path=path, chunk_size=8).train()
    outs = []
    for i in range(40):
        kw = {} if key is None else {"key": opt(backend).fold_key(key, i)}
        outs.append(backend.to_numpy(m(*args, **kw)))
    # (no kernel with dropout, or keyed dropout, which no tile takes: "auto"'s
    # choice at this size, the full path)
    assert m.last_path == (
        "full"
        if (path == "fused" and not opt(backend).fused_dropout)
        or (path == "tiled" and key is not None)
        else path
    )
    assert all(np.isfinite(o).all() and (o[2] == 0).all() for o in outs)
    assert not np.allclose(outs[0], outs[1])
    ref, ref_w = oracle.dot_product_attention(q, k, v, lens)
    np.testing.assert_allclose(backend.to_numpy(m.attention_weights), ref_w, **TOL)
    # unbiased: the mean of 40 draws is near the exact output (rate 0.5, |v| ~ 1)
    assert np.abs(np.mean(outs, axis=0) - ref).max() < 0.5


@pytest.mark.parametrize("budget", [None, 2000, 1])
def test_additive_attention_blocks_of_queries(backend, budget):
    q, k, v = _inputs(9, d=3, dv=3)
    lens = MASKS["2d"]
    m = am.AdditiveAttention(3, 3, 6, 0.0, backend=backend, memory_budget=budget).eval()
    ref, ref_w = oracle.additive_attention(am.get_params(m), q, k, v, lens)
    out = m(*(backend.asarray(x, "float32") for x in (q, k, v)), backend.asarray(lens))
    np.testing.assert_allclose(backend.to_numpy(out), ref, **TOL)
    np.testing.assert_allclose(backend.to_numpy(m.attention_weights), ref_w, **TOL)


@pytest.mark.second_stack
@pytest.mark.parametrize("mask", ["1d", "2d"])
@pytest.mark.parametrize("path", PATHS)
def test_under_jax_jit(path, mask):
    """Traced lengths: the tiled path skips blocks at run time (lax.cond); NaN in
    key and value rows that no query may see does not leak; gradients agree."""
    jax = pytest.importorskip("jax")
    B = am.get_backend("jax")
    q, k, v = _inputs(10, nk=11)
    lens = (
        MASKS[mask]
        if mask == "1d"
        else np.array([[0, 3, 0, 11, 1], [5, 0, 2, 2, 0], [9, 6, 5, 4, 3]])
    )
    ref, _ = oracle.dot_product_attention(q, k, v, lens)
    longest = lens if lens.ndim == 1 else lens.max(axis=1)
    k_nan, v_nan = k.copy(), v.copy()
    for b, n in enumerate(longest):
        k_nan[b, n:] = v_nan[b, n:] = np.nan
    m = am.DotProductAttention(0.0, backend="jax", path=path, chunk_size=3).eval()
    args = [B.asarray(x, "float32") for x in (q, k_nan, v_nan)] + [B.asarray(lens, "int32")]
    out = jax.jit(lambda m, *a: m(*a))(m, *args)
    np.testing.assert_allclose(np.asarray(out), ref, **TOL)
    grad = jax.jit(jax.grad(lambda q: (m(q, *args[1:]) ** 2).sum()))(args[0])
    full = am.DotProductAttention(0.0, backend="jax", path="full").eval()
    want = jax.grad(lambda q: (full(q, *args[1:]) ** 2).sum())(args[0])
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_attend_function_4d_layout(backend):
    """attend() takes (batch, heads, n, d) and broadcasts lengths over heads."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    lens = np.array([[1, 0, 5, 2, 3], [4, 4, 4, 4, 4]])
    flat = [x.reshape(6, 5, 4) for x in (q, k, v)]
    ref, _ = oracle.dot_product_attention(*flat, np.repeat(lens, 3, axis=0))
    for path in PATHS:
        out, _, _, taken = _attend(
            backend,
            *(backend.asarray(x, "float32") for x in (q, k, v)),
            backend.asarray(lens, "int32"),
            path=path,
        )
        assert taken == _expected_path(backend, path) and tuple(out.shape) == (2, 3, 5, 4)
        np.testing.assert_allclose(backend.to_numpy(out).reshape(6, 5, 4), ref, **TOL)


def test_gradients_agree_across_paths(backend):
    """Training through each path (dropout 0, so fused is allowed in training
    mode) gives the gradients of the full path."""
    if not supports(backend, Autodiff):
        pytest.skip(f"the {backend.name} backend has no autodiff")
    q, k, v = (backend.asarray(x, "float32") for x in _inputs(12, d=6, dv=6))
    lens = backend.asarray(MASKS["2d"])
    params = None
    grads = {}
    # (JAX: jitted, where eager autodiff through the block loops would take
    # seconds; the tiled path under jit is checked in test_under_jax_jit)
    paths = ("full", "fused", "chunked") if opt(backend).compiles_per_shape else PATHS
    for path in paths:
        m = am.MultiHeadAttention(
            6, 6, 6, 8, 2, 0.0, bias=True, backend=backend, path=path, chunk_size=3
        )
        if params is None:
            params = am.get_params(m)
        am.set_params(m, params)

        def loss_fn(module):
            out = module(q, k, v, lens)
            return backend.sum((out * out).reshape((-1,)), 0)

        if opt(backend).compiles_per_shape:  # jitted: eager autodiff compiles op by op
            import jax

            g = jax.jit(jax.grad(loss_fn))(m).named_arrays()
        else:
            g = value_and_grad(backend, m, loss_fn)[1]
        grads[path] = {n: backend.to_numpy(x) for n, x in g.items()}
        if not opt(backend).compiles_per_shape:  # (jitted, the call ran on a traced copy)
            assert m.last_path == path
    for path in paths[1:]:
        for name, g in grads["full"].items():
            np.testing.assert_allclose(grads[path][name], g, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mask", ["none", "1d", "2d", "over-long"])
def test_size_dependent_kernel_variants(backend, mask):
    """Variants that are picked only for large inputs, at their sizes: the
    tiled path's parallel tiles (``PARALLEL_MIN_SCORES``), MXNet's lengths
    folded into the product (``_FOLD_MIN_SCORES``, 2**20 scores)."""
    n = 600  # 3 * 600 * 600 scores
    q, k, v = _inputs(13, nq=n, nk=n)
    lens = {
        "none": None,
        "1d": np.array([0, 400, n]),
        "2d": np.random.default_rng(13).integers(0, n + 1, (BATCH, n)),
        "over-long": np.array([n + 3, 1000, 2**40]),
    }[mask]
    ref, _ = oracle.dot_product_attention(q, k, v, lens)
    if lens is not None:  # as the modules' checks leave them: int32
        lens = np.minimum(lens, 2**31 - 1)
    for shape4 in (False, True):  # (N, 1, n, d) and (1, N, n, d) inputs
        args = [backend.asarray(x[None] if shape4 else x[:, None], "float32") for x in (q, k, v)]
        if shape4:  # one batch element, BATCH heads: lengths of element 0
            lens4 = None if lens is None else lens[:1]
            ref4, _ = oracle.dot_product_attention(
                q, k, v, None if lens is None else np.repeat(lens4, BATCH, axis=0)
            )
        for path in ("fused", "tiled"):
            out, _, _, taken = _attend(
                backend,
                *args,
                None if lens is None else backend.asarray(lens4 if shape4 else lens, "int32"),
                path=path,
            )
            # (no kernel: "auto"'s choice at this size, the tiles)
            assert taken == ("tiled" if not supports(backend, Fused) else path)
            np.testing.assert_allclose(
                backend.to_numpy(out).reshape(ref.shape), ref4 if shape4 else ref, **TOL
            )


@pytest.mark.parametrize("mask", ["1d", "2d"])
def test_tiles_skip_padding_per_batch_element(backend, mask):
    """The tiled path computes each batch element over the keys its rows may
    see: NaN in the keys past them never reaches an output."""
    rng = np.random.default_rng(14)
    batch, nq, nk = 9, 4, 40
    q, k, v = (rng.standard_normal((batch, n, D)) for n in (nq, nk, nk))
    lens = np.array([40, 12, 39, 0, 13, 25, 38, 12, 26])
    if mask == "2d":
        lens = np.stack([lens, np.maximum(lens - 3, 0), lens, lens // 2], axis=1)
    ref, _ = oracle.dot_product_attention(q, k, v, lens)
    seen = np.minimum(lens, nk).max(axis=-1) if lens.ndim == 2 else lens
    for b in range(batch):  # NaN where no query of the element looks
        k[b, seen[b] :], v[b, seen[b] :] = np.nan, np.nan
    m = _module(am.DotProductAttention, backend, "tiled", 0.0)
    out = m(*(backend.asarray(x, "float32") for x in (q, k, v)), backend.asarray(lens))
    assert m.last_path == "tiled"
    np.testing.assert_allclose(backend.to_numpy(out), ref, **TOL)


def test_the_tiles_bound_never_exceeds_their_plan():
    """``tiled.bound`` lets the chooser skip planning the tiles where another
    plan costs less: it must be at most the tiles' cost, whatever the mask."""
    from attention_multi.core.paths import tiled
    from attention_multi.core.paths.call import Call, Options

    xp = am.get_backend("numpy")
    rng = np.random.default_rng(7)
    for _ in range(300):
        batch, heads = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        nq, nk = int(rng.integers(1, 300)), int(rng.integers(1, 300))
        forms = {}
        if rng.random() < 0.6:
            shape = (batch,) if rng.random() < 0.5 else (batch, nq)
            forms["valid_lens"] = rng.integers(0, nk + 2, shape)
        if rng.random() < 0.4:
            forms["causal"] = True
        if rng.random() < 0.3:
            forms["window"] = (int(rng.integers(0, nk)), int(rng.integers(0, nk)))
        q = np.zeros((batch, heads, nq, 4), np.float32)
        k = np.zeros((batch, heads, nk, 4), np.float32)
        mask = make_mask(xp, batch, heads, nq, nk, **forms)
        budget = int(rng.choice([0, 1 << 12, 1 << 16])) or None
        chunk = int(rng.choice([0, 16, 64])) or None
        call = Call(xp, q, k, k, mask, 0.5, Options(budget=budget, chunk_size=chunk))
        plan = tiled.plan(call)
        if plan is not None:
            assert tiled.bound(call) <= plan.cost * (1 + 1e-12), forms


def test_tiles_weigh_the_mask_of_elements_that_see_different_keys():
    """Two elements that see 400 and 300 keys: one call over 400 keys saves a
    call, but the shorter one's tile is then masked (a pass over its scores):
    with that pass counted (``Costs.masked_score_cost``), they stay apart;
    elements that see the same keys share a call unmasked."""
    from attention_multi.core.paths.call import grouped

    starts, stops = np.array([0, 0]), np.array([400, 300])
    whole = np.array([True, True])
    merged = grouped(starts, stops, whole, 128, 16384, 16, False)
    assert [list(g[0]) for g in merged] == [[0, 1]]
    apart = grouped(starts, stops, whole, 128, 16384, 16, False, masked_cost=1.0)
    assert [(list(g[0]), g[2]) for g in apart] == [([0], 400), ([1], 300)]
    same = grouped(starts, np.array([300, 300]), whole, 128, 16384, 16, False, masked_cost=1.0)
    assert [(list(g[0]), g[3]) for g in same] == [([0, 1], True)]


@pytest.fixture
def blas_threads():
    """NumPy's bundled OpenBLAS at two threads at least (one would prove
    nothing), its count back after; yields its control (``get_global``
    reads the calling thread's count, its own where OpenBLAS keeps one)."""
    from attention_multi.backends import numpy_threads

    blas = numpy_threads.openblas()
    if not blas.set_global:
        pytest.skip(f"NumPy's BLAS is not an OpenBLAS we can set: {blas.config}")
    before = blas.get_global()
    blas.set_global(max(2, before))
    yield blas
    blas.set_global(before)


@pytest.mark.parametrize("form", ["lengths", "segments"])
def test_numpy_runs_many_small_products_in_one_blas_thread(blas_threads, form):
    """NumPy's tiles and block-sparse path make many small products, for
    which OpenBLAS's own threads cost more than they gain (idle or busy):
    they run in one BLAS thread (``Threads.in_fewer_threads``), a
    ``score_mod`` sees it, and the count comes back after; answers the oracle's."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((4, 256, 16)).astype(np.float32) for _ in range(3))
    if form == "lengths":
        kw = {"valid_lens": np.array([256, 40, 200, 90])}
    else:
        kw = {"segment_ids": np.repeat(np.arange(4), 64)[None].repeat(4, 0), "causal": True}
    threads, seen = blas_threads.get_global(), set()

    def same(s, b, h, i, j):
        seen.add(blas_threads.get_global())
        return s

    m = am.DotProductAttention(0.0, backend="numpy", path="tiled")
    out = m(q, k, v, score_mod=same, **kw)
    assert m.last_path == "blocked" and seen == {1}, seen
    assert blas_threads.get_global() == threads
    want, _ = oracle.attention(*(x[:, None] for x in (q, k, v)), **kw)
    np.testing.assert_allclose(out, want[:, 0], rtol=2e-5, atol=2e-5)


def test_every_path_has_its_own_name_and_one_result(backend):
    """One enumeration (``Path``): each planned path its own ``NAME``, which
    ``last_path`` reports; ``path="tiled"`` still asks for the tile family,
    ``"blocked"`` for the blocks alone. The functions and the modules route
    through ``select.compute`` and get one ``Result`` (output, weights, lse,
    path); ``attention`` gives it by name, ``dot_product_attention`` the output."""
    from attention_multi.core import paths

    names = [p.NAME for p in paths.REGISTRY]
    assert len(set(names)) == len(names) and set(names) | {am.Path.EMPTY} == set(am.Path)
    assert {p.family for p in am.Path} == {"full", "fused", "tiled", "chunked", "empty"}
    rng = np.random.default_rng(0)
    B, T = 2, 96
    q, k, v = (
        backend.asarray(np.asarray(rng.standard_normal((B, T, 8))), "float32") for _ in range(3)
    )
    ids = np.repeat(np.arange(3), 32)[None].repeat(B, 0)
    want, _ = oracle.attention(*(backend.to_numpy(x)[:, None] for x in (q, k, v)), segment_ids=ids)
    for path in ("tiled", "blocked"):
        m = _module(am.DotProductAttention, backend, path, 0.0)
        out = m(q, k, v, segment_ids=backend.asarray(np.asarray(ids), "int32"))
        assert m.last_path.family == "tiled" and (path == "tiled" or m.last_path == "blocked")
        np.testing.assert_allclose(backend.to_numpy(out), want[:, 0], rtol=2e-5, atol=2e-5)
    done = am.attention(q, k, v, segment_ids=backend.asarray(np.asarray(ids), "int32"), lse=True)
    assert isinstance(done, am.Result) and done.weights is None and done.path in am.Path
    assert tuple(done.lse.shape) == (B, T)
    np.testing.assert_allclose(backend.to_numpy(done.output), want[:, 0], rtol=2e-5, atol=2e-5)
    plain = am.dot_product_attention(q, k, v, segment_ids=backend.asarray(np.asarray(ids), "int32"))
    np.testing.assert_allclose(backend.to_numpy(plain), want[:, 0], rtol=2e-5, atol=2e-5)
    assert am.attention(q, k, v).lse is None  # (asked for by lse=True only)
