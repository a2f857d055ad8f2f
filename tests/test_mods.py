"""The grid of the programmable forms: ``mask_mod``, ``score_mod`` and
``segment_ids`` (alone, combined by AND with the other forms, with rows that
see no key), on every backend, dtype and path, against the float64 oracle
(``attention_multi.reference.attention``, a dense mask from the function,
then the formula); gradients through them on the backends with autodiff;
block masks and block skipping."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle
from attention_multi.backends.capabilities import Autodiff, supports
from attention_multi.core import attend, make_mask
from attention_multi.core.mask import EMPTY, FULL, PARTIAL, computed_fraction, host_table

BATCH, HEADS, D = 2, 4, 4
TOL = {"float16": 3e-3, "bfloat16": 2e-2, "float32": 3e-5, "float64": 1e-10}
GRAD_TOL = {"float32": 2e-4, "float64": 1e-8}
PATHS = ("full", "chunked", "tiled", "fused")
SEGMENTS = np.array(
    [[0, 0, 0, 1, 1, 2, 2, 2, 2, -1, -1], [0, 1, 1, 1, 1, 1, 3, 3, 4, 4, 4]], np.int32
)
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])


def _case(B, name):
    """(kv_heads, Q, K, form for the backend, form for the oracle)."""
    nk = SEGMENTS.shape[1]
    kv, nq = HEADS, nk
    seg = B.asarray(SEGMENTS, "int32")
    slopes = B.asarray(SLOPES, "float32")
    prefix = B.asarray(np.array([3, 0], np.int32), "int32")

    def doc(b, h, q, k, ids=seg):
        return ids[b, q] == ids[b, k]

    def doc_np(b, h, q, k):
        return SEGMENTS[b, q] == SEGMENTS[b, k]

    def prefix_lm(b, h, q, k, p=prefix):
        return (k <= q) | (k < p[b])

    def sink_window(b, h, q, k):
        return ((k <= q) & (q - k <= 2)) | (k < 2)

    def alibi(s, b, h, q, k, slopes=slopes):
        return s + slopes[h] * (k - q)

    def alibi_np(s, b, h, q, k):
        return s + SLOPES[h] * (k - q)

    def cap(s, b, h, q, k):
        return 2.0 * B.tanh(s / 2.0)

    def cap_np(s, b, h, q, k):
        return 2.0 * np.tanh(s / 2.0)

    def nothing_for_q4(b, h, q, k):
        return q != 4

    lens = np.array([7, 0])
    cases = {
        "segments": ({"segment_ids": seg}, {"segment_ids": SEGMENTS}),
        "segments_causal": ({"segment_ids": seg, "causal": True}, None),
        "segments_pair": (
            {"segment_ids": (seg[:, 4:], seg)},
            {"segment_ids": (SEGMENTS[:, 4:], SEGMENTS)},
        ),
        "segments_fewer_queries": ({"segment_ids": seg, "causal": True}, None),
        "mod_doc": ({"mask_mod": doc}, {"mask_mod": doc_np}),
        "prefix_lm": (
            {"mask_mod": prefix_lm},
            {"mask_mod": lambda b, h, q, k: (k <= q) | (k < np.array([3, 0])[b])},
        ),
        "sink_window": ({"mask_mod": sink_window}, None),
        "empty_row": ({"mask_mod": nothing_for_q4}, None),
        "alibi": ({"score_mod": alibi, "causal": True}, {"score_mod": alibi_np, "causal": True}),
        "softcap": (
            {"score_mod": cap, "valid_lens": B.asarray(lens)},
            {"score_mod": cap_np, "valid_lens": lens},
        ),
        "all": (
            {
                "segment_ids": seg,
                "mask_mod": sink_window,
                "score_mod": alibi,
                "valid_lens": B.asarray(np.array([9, 11])),
                "window": (4, 1),
            },
            {
                "segment_ids": SEGMENTS,
                "mask_mod": sink_window,
                "score_mod": alibi_np,
                "valid_lens": np.array([9, 11]),
                "window": (4, 1),
            },
        ),
    }
    form, ref = cases[name]
    if ref is None:
        ref = dict(form)
        if "segment_ids" in ref:
            ref["segment_ids"] = SEGMENTS
    if name == "segments_fewer_queries":
        nq = 6
    if name == "segments_pair":
        nq = nk - 4
    if name == "all":
        kv = 2
    return kv, nq, nk, form, ref


CASES = (
    "segments",
    "segments_causal",
    "segments_pair",
    "segments_fewer_queries",
    "mod_doc",
    "prefix_lm",
    "sink_window",
    "empty_row",
    "alibi",
    "softcap",
    "all",
)
HALF_CASES = ("segments_causal", "mod_doc", "alibi", "all")


def _inputs(B, kv, nq, nk, dtype, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((BATCH, HEADS, nq, D), (BATCH, kv, nk, D), (BATCH, kv, nk, D))
    return [B.asarray(rng.normal(size=s), dtype) for s in shapes]


def _run(B, q, k, v, form, path, chunk=3):
    m = make_mask(B, q.shape[0], q.shape[1], q.shape[2], k.shape[2], dtype=B.dtype_name(q), **form)
    out, _, _, taken = attend(B, q, k, v, m, path=path, chunk_size=chunk)
    return out, taken


@pytest.mark.grid
@pytest.mark.parametrize(
    "case, dtype",
    [(c, d) for c in CASES for d in ("float32", "float64")]
    + [(c, d) for c in HALF_CASES for d in ("float16", "bfloat16")],
)
def test_mods_every_path(backend, case, dtype, grid_paths):
    if dtype not in backend.float_dtypes:
        pytest.skip(f"the {backend.name} backend has no {dtype}")
    kv, nq, nk, form, ref = _case(backend, case)
    q, k, v = _inputs(backend, kv, nq, nk, dtype)
    want, _ = oracle.attention(*(backend.to_numpy(x) for x in (q, k, v)), **ref)
    rows = oracle.allowed_keys(
        BATCH,
        HEADS,
        nq,
        nk,
        **{n: x for n, x in ref.items() if n not in ("score_mod",)},
    ).any(-1)
    tol = TOL[dtype]
    for path in grid_paths(PATHS):
        for chunk in (3, None) if path in ("chunked", "tiled") else (None,):
            out, taken = _run(backend, q, k, v, form, path, chunk)
            if path != "fused":
                assert taken.family == path, (path, taken)  # (tiled: the blocks)
            assert backend.dtype_name(out) == dtype
            got = backend.to_numpy(out).astype(np.float64)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{path} {chunk}")
            if not rows.all():  # rows with no allowed key are exactly zero
                assert (got[~rows] == 0).all(), path


def test_mods_nan_in_unseen_keys_does_not_leak(backend):
    """NaN in keys/values of a padding segment (seen by nobody) stays out."""
    kv, nq, nk, form, ref = _case(backend, "segments_causal")
    q, k, v = (np.array(backend.to_numpy(x)) for x in _inputs(backend, kv, nq, nk, "float32"))
    k[0, :, -1] = np.nan  # key 10 of element 0 has segment -1
    v[0, :, -1] = np.nan
    want, _ = oracle.attention(q, np.nan_to_num(k), np.nan_to_num(v), **ref)
    for path in PATHS:
        out, _ = _run(backend, *(backend.asarray(x) for x in (q, k, v)), form, path)
        np.testing.assert_allclose(backend.to_numpy(out), want, rtol=3e-5, atol=3e-5)


def _numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        d = np.zeros_like(x)
        d[i] = eps
        g[i] = (f(x + d) - f(x - d)) / (2 * eps)
    return g


@pytest.mark.grid
@pytest.mark.parametrize("case", ["segments_causal", "prefix_lm", "all"])
def test_mods_gradients(backend, case, grid_paths):
    if not supports(backend, Autodiff):
        pytest.skip(f"the {backend.name} backend has no autodiff")
    dtype = "float64" if "float64" in backend.float_dtypes else "float32"
    kv, nq, nk, form, ref = _case(backend, case)
    q, k, v = _inputs(backend, kv, nq, nk, dtype)
    qn, kn, vn = (backend.to_numpy(x).astype(np.float64) for x in (q, k, v))
    grad_out = np.random.default_rng(1).normal(size=(BATCH, HEADS, nq, D))
    if "score_mod" in ref:  # (the analytic gradients know no score_mod)

        def loss(i):
            def f(x):
                args = [qn, kn, vn]
                args[i] = x
                return (oracle.attention(*args, **ref)[0] * grad_out).sum()

            return f

        want = [_numeric_grad(loss(i), x) for i, x in enumerate((qn, kn, vn))]
        tol = max(GRAD_TOL[dtype], 1e-6)
    else:
        want = oracle.attention_gradients(qn, kn, vn, grad_out, **ref)[:3]
        tol = GRAD_TOL[dtype]
    R = backend.asarray(grad_out, dtype)
    dummy = am.DotProductAttention(0.0, backend=backend, dtype=dtype)
    for path in grid_paths(("full", "chunked", "tiled")):

        def f(module, q, k, v, path=path):
            out, _ = _run(backend, q, k, v, form, path)
            return backend.sum((out * R).reshape((-1,)), 0)

        _, _, grads = backend.gradients(f, dummy, q, k, v)
        for name, g, w in zip(("queries", "keys", "values"), grads, want):
            g = backend.to_numpy(g).astype(np.float64)
            assert np.isfinite(g).all(), (path, name)
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"{path} d{name}")


def test_mods_through_the_api(backend):
    """The functional form (3-D and 4-D), both modules, and the KV cache."""
    kv, nq, nk, form, ref = _case(backend, "all")
    q, k, v = _inputs(backend, kv, nq, nk, "float32")
    want, _ = oracle.attention(*(backend.to_numpy(x) for x in (q, k, v)), **ref)
    form = dict(form)
    got = am.dot_product_attention(q, k, v, form.pop("valid_lens"), **form)
    np.testing.assert_allclose(backend.to_numpy(got), want, rtol=3e-5, atol=3e-5)

    kv, nq, nk, form, ref = _case(backend, "segments_causal")
    q, k, v = (x[:, 0] for x in _inputs(backend, 1, nq, nk, "float32"))
    want, _ = oracle.attention(*(backend.to_numpy(x)[:, None] for x in (q, k, v)), **ref)
    got = am.dot_product_attention(q, k, v, **form)
    np.testing.assert_allclose(backend.to_numpy(got), want[:, 0], rtol=3e-5, atol=3e-5)
    module = am.DotProductAttention(0.0, backend=backend).eval()
    np.testing.assert_allclose(
        backend.to_numpy(module(q, k, v, **form)), want[:, 0], rtol=3e-5, atol=3e-5
    )


def test_mods_with_the_cache(backend):
    """Decoding step by step with a KV cache: ``q_idx`` is the position in
    the cache, segment ids are the cache's; equal to one call over all."""
    rng = np.random.default_rng(2)
    T, hidden = 8, 8
    x = backend.asarray(rng.normal(size=(BATCH, T, hidden)), "float32")
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]], np.int32)
    segs = backend.asarray(seg, "int32")

    def sinks(b, h, q, k):
        return (q - k <= 2) | (k < 1)

    def alibi(s, b, h, q, k):
        return s + 0.1 * (k - q)

    mha = am.MultiHeadAttention(hidden, 2, 0.0, backend=backend, dtype="float32").eval()
    forms = dict(segment_ids=segs, mask_mod=sinks, score_mod=alibi)
    whole = mha(x, x, x, causal=True, **forms)
    cache = mha.init_cache(BATCH, T)
    outs = []
    for t0, t1 in ((0, 3), (3, 4), (4, 8)):
        out, cache = mha(x[:, t0:t1], x[:, t0:t1], x[:, t0:t1], cache=cache, **forms)
        outs.append(backend.to_numpy(out))
    np.testing.assert_allclose(
        np.concatenate(outs, 1), backend.to_numpy(whole), rtol=3e-5, atol=3e-5
    )


def test_segments_helper():
    from attention_multi.core.mask import segments_from_cu_seqlens, segments_from_lengths

    np.testing.assert_array_equal(
        segments_from_lengths([[2, 1], [3]], total=4), [[0, 0, 1, -1], [0, 0, 0, -1]]
    )
    np.testing.assert_array_equal(segments_from_cu_seqlens([0, 2, 5]), [[0, 0, 1, 1, 1]])
    with pytest.raises(ValueError, match="total=2"):
        segments_from_lengths([3], total=2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        segments_from_cu_seqlens([1, 2])


def test_mods_errors(backend):
    q = backend.asarray(np.zeros((2, 3, 4)), "float32")
    with pytest.raises(ValueError, match=r"segment_ids.*\(2, 3\)"):
        am.dot_product_attention(q, q, q, segment_ids=backend.asarray(np.zeros((2, 5), np.int32)))
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        am.dot_product_attention(q, q, q, mask_mod=3)
    with pytest.raises(TypeError, match="integers"):
        am.dot_product_attention(q, q, q, segment_ids=backend.asarray(np.zeros((2, 3)), "float32"))


def test_block_mask_states_and_skipping(backend):
    """``am.block_mask`` classifies blocks as the dense mask says; the paths
    that read it skip empty blocks and agree with the oracle; segment ids
    give the same blocks from integers alone."""
    T, lengths = 300, [[37, 120, 90, 53], [200, 64]]
    ids = am.segments_from_lengths(lengths, T)
    doc = backend.asarray(ids, "int32")

    def doc_causal(b, h, q, k):
        return (doc[b, q] == doc[b, k]) & (k <= q) & (doc[b, q] >= 0)

    def doc_causal_np(b, h, q, k):
        return (ids[b, q] == ids[b, k]) & (k <= q) & (ids[b, q] >= 0)

    bm = am.block_mask(doc_causal, BATCH, 1, T, T, block=64, backend=backend)
    dense = oracle.allowed_keys(BATCH, 1, T, T, mask_mod=doc_causal_np)
    n, computed = -(-T // 64), 0
    for b in range(BATCH):
        for i in range(n):
            for j in range(n):
                tile = dense[b, 0, i * 64 : (i + 1) * 64, j * 64 : (j + 1) * 64]
                want = 0 if not tile.any() else 2 if tile.all() else 1
                assert bm.states[b, 0, i, j] == want, (b, i, j)
                computed += want > 0
    # (a percentage of the scores, each computed block counted whole, as FlexAttention's)
    assert bm.sparsity() == pytest.approx(100 * (1 - computed * 64 * 64 / (BATCH * T * T)))
    q, k, v = _inputs(backend, HEADS, T, T, "float32")
    want, _ = oracle.attention(*(backend.to_numpy(x) for x in (q, k, v)), mask_mod=doc_causal_np)
    fractions = []
    for form in (
        {"mask_mod": bm},
        {"mask_mod": doc_causal},
        {"segment_ids": doc, "causal": True},
    ):
        m = make_mask(backend, BATCH, HEADS, T, T, dtype="float32", **form)
        fractions.append(computed_fraction(m, host_table(m, 64, 64), 64, 64))
        for path in ("tiled", "chunked"):
            out, _, _, taken = attend(backend, q, k, v, m, path=path, chunk_size=64)
            assert taken.family == path  # (tiled: the blocks)
            np.testing.assert_allclose(backend.to_numpy(out), want, rtol=3e-5, atol=3e-5)
    # the same blocks from the function, the block mask and the integers
    assert fractions[0] == fractions[1] == fractions[2] < 0.5, fractions


def test_block_states_of_answers_that_broadcast(backend):
    """Functions that ignore an axis (an answer of size 1 there, or a Python
    bool) get the dense mask's block states too: blocks past Q or K cut short,
    blocks of (5, 8), heads apart."""
    B, H, Q, K, bq, bk = 2, 3, 23, 19, 5, 8
    mods = {
        "queries only": lambda b, h, q, k: q % 7 < 4,
        "keys only": lambda b, h, q, k: k % 8 != 3,
        "heads and keys": lambda b, h, q, k: (h * 5 + k) % 9 < 6,
        "batch and queries": lambda b, h, q, k: (b * 11 + q) % 6 > 0,
        "a bool": lambda b, h, q, k: True,
    }
    for name, mod in mods.items():
        bm = am.block_mask(mod, B, H, Q, K, block=(bq, bk), backend=backend)
        dense = np.broadcast_to(oracle.allowed_keys(B, H, Q, K, mask_mod=mod), (B, H, Q, K))
        s = bm.states
        for b, h, i, j in np.ndindex(B, H, -(-Q // bq), -(-K // bk)):
            tile = dense[b, h, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            want = EMPTY if not tile.any() else FULL if tile.all() else PARTIAL
            got = s[min(b, s.shape[0] - 1), min(h, s.shape[1] - 1), i, j]
            assert got == want, (name, b, h, i, j)


@pytest.mark.parametrize("seed", range(6))
def test_interval_block_states_match_the_dense_mask(seed):
    """``mask.host_table`` classifies the blocks of interval masks (lengths
    per query, causal with an offset, windows; rows that see nothing; blocks
    past Q or K cut short) as the dense mask says."""
    from attention_multi import backends

    B = backends.load("numpy")
    rng = np.random.default_rng(seed)
    batch, nq, nk = 2, int(rng.integers(1, 90)), int(rng.integers(1, 90))
    bq, bk = int(rng.integers(1, 20)), int(rng.integers(1, 20))
    lens = rng.integers(0, nk + 1, size=(batch, nq))
    window = (int(rng.integers(0, 30)), int(rng.integers(0, 30))) if seed % 2 else None
    form = {"valid_lens": lens, "causal": seed % 3 == 0, "window": window}
    m = make_mask(B, batch, 1, nq, nk, **form)
    states = host_table(m, bq, bk)
    dense = np.broadcast_to(oracle.allowed_keys(batch, 1, nq, nk, **form), (batch, 1, nq, nk))
    for b in range(batch):
        for i in range(-(-nq // bq)):
            for j in range(-(-nk // bk)):
                tile = dense[b, 0, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
                want = FULL if tile.all() else PARTIAL if tile.any() else EMPTY
                got = states[b if states.shape[0] > 1 else 0, i, j]
                assert got == want, (b, i, j, got, want)


def test_traced_segments_compile_once(backend):
    """Under ``jax.jit`` with the segment ids as an argument, blocks are
    skipped at run time (``cond``): one compilation for 100 new layouts."""
    if backend.name != "jax":
        pytest.skip("jax.jit")
    import jax

    T, traces = 64, []
    module = am.DotProductAttention(0.0, path="tiled", chunk_size=16, backend=backend).eval()

    @jax.jit
    def f(q, k, v, seg):
        traces.append(1)
        return module(q, k, v, segment_ids=seg, causal=True)

    rng = np.random.default_rng(5)
    q, k, v = (x[:, 0] for x in _inputs(backend, 1, T, T, "float32"))
    for i in range(100):
        end = T - int(rng.integers(0, 8))  # (padding at the end)
        cuts = np.sort(rng.choice(np.arange(1, end), size=rng.integers(1, 6), replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [end]])).tolist()
        ids = am.segments_from_lengths([lengths, lengths[::-1]], T)
        out = f(q, k, v, jax.numpy.asarray(ids))
        if i % 25 == 0:
            want, _ = oracle.attention(
                *(backend.to_numpy(x)[:, None] for x in (q, k, v)), causal=True, segment_ids=ids
            )
            np.testing.assert_allclose(np.asarray(out), want[:, 0], rtol=3e-5, atol=3e-5)
    assert len(traces) == 1


def _layouts(rng, T, count):
    """``count`` random packed layouts of two rows of T (padding at the end)."""
    for _ in range(count):
        end = T - int(rng.integers(0, 8))
        cuts = np.sort(rng.choice(np.arange(1, end), size=rng.integers(1, 6), replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [end]])).tolist()
        yield am.segments_from_lengths([lengths, lengths[::-1]], T)


def test_traced_segments_torch_compile_once():
    """``torch.compile(fullgraph=True)`` with the segment ids as an argument:
    one compilation for 100 new layouts (no guard on their values, nor on a
    cache that fills while tracing), each answer the oracle's."""
    import torch
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    T, counter = 64, CompileCounter()
    module = am.DotProductAttention(0.0, path="tiled", chunk_size=16, backend="torch").eval()

    @torch.compile(backend=counter, fullgraph=True)
    def f(q, k, v, seg):
        return module(q, k, v, segment_ids=seg, causal=True)

    rng = np.random.default_rng(5)
    q, k, v = (torch.tensor(rng.normal(size=(2, T, 4)), dtype=torch.float32) for _ in range(3))
    for i, ids in enumerate(_layouts(rng, T, 100)):
        out = f(q, k, v, torch.as_tensor(ids))
        if i % 25 == 0:
            want, _ = oracle.attention(
                *(x.numpy()[:, None] for x in (q, k, v)), causal=True, segment_ids=ids
            )
            np.testing.assert_allclose(out.numpy(), want[:, 0], rtol=3e-5, atol=3e-5)
    assert counter.frame_count == 1


def _count(jaxpr, primitive):
    """How many ``primitive`` equations ``jaxpr`` holds, nested ones included."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == primitive
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _count(inner, primitive)
    return total


def test_traced_blocks_do_not_grow_with_the_batch():
    """Under ``jax.jit`` with traced segment ids each block is one ``cond``
    for the whole batch, skipped when empty for every element: the compiled
    program has as many conds at batch 8 as at batch 1 (it had one per block
    and element), and the answer is the oracle's."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    T, per_row = 512, [[200, 312], [512], [100, 150, 262], [300, 212]]  # (2 x 2 blocks)
    ids = np.asarray(am.segments_from_lengths(per_row * 2, T))
    rng = np.random.default_rng(3)

    def conds(batch):
        q, k, v = (jnp.asarray(rng.standard_normal((batch, 2, T, 8), np.float32)) for _ in range(3))

        def f(q, k, v, s):
            return am.dot_product_attention(q, k, v, segment_ids=s, causal=True)

        count = _count(jax.make_jaxpr(f)(q, k, v, jnp.asarray(ids[:batch])).jaxpr, "cond")
        got = np.asarray(jax.jit(f)(q, k, v, jnp.asarray(ids[:batch])))
        allowed = (ids[:batch, :, None] == ids[:batch, None, :]) & np.tril(np.ones((T, T), bool))
        want, _ = oracle.attention(
            *(np.asarray(x, np.float64) for x in (q, k, v)), mask=allowed[:, None]
        )
        np.testing.assert_allclose(got, want, rtol=TOL["float32"], atol=TOL["float32"])
        return count

    one, eight = conds(1), conds(8)
    assert one > 0
    assert eight == one
