"""torch's FlexAttention API (``attention_multi.flex``) on every backend,
the log-sum-exp and attention sinks on every path, and gradients to what a
``score_mod`` captures: against the float64 oracle
(``attention_multi.reference.attention``), gradients against its central
differences; one test against torch's own compiled ``flex_attention``."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import flex
from attention_multi import reference as oracle
from attention_multi.backends.capabilities import Autodiff, opt, supports
from attention_multi.core import attend, make_mask
from attention_multi.core.paths.online import add_sinks

B_, H, KV, T, D = 2, 4, 2, 11, 4
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])
SINKS = np.array([0.3, -1.0, 2.0, 0.0])
PATHS = ("full", "chunked", "tiled", "fused")


def _inputs(B, dtype="float32", kv=KV, nq=T, nk=T, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((B_, H, nq, D), (B_, kv, nk, D), (B_, kv, nk, D))
    return [B.asarray(rng.normal(size=s), dtype) for s in shapes]


def _np(B, *xs):
    return [B.to_numpy(x).astype(np.float64) for x in xs]


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _near(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= 3


def _first_two(b, h, q_idx, kv_idx):
    return kv_idx < 2


def _numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        d = np.zeros_like(x)
        d[i] = eps
        g[i] = (f(x + d) - f(x - d)) / (2 * eps)
    return g


def test_flex_api_on_every_backend(backend):
    """The flex functions by name and signature: a block mask of ``and_masks``
    / ``or_masks``, a ``score_mod`` indexing a captured array, grouped heads
    (``enable_gqa``), ``return_lse``; ``create_mask``; flex's block fields."""
    q, k, v = _inputs(backend)
    slopes = backend.asarray(SLOPES, "float32")
    mask_mod = flex.and_masks(_causal, flex.or_masks(_near, _first_two))

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def alibi_np(score, b, h, q_idx, kv_idx):
        return score + SLOPES[h] * (kv_idx - q_idx)

    def mask_np(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx <= 3) | (kv_idx < 2))

    block = flex.create_block_mask(mask_mod, B_, None, T, T, device="cpu", BLOCK_SIZE=4)
    assert block.shape == (B_, 1, T, T) and block.BLOCK_SIZE == (4, 4)
    dense = oracle.allowed_keys(B_, 1, T, T, mask_mod=mask_np)
    seen = _block_states(dense, 4)
    np.testing.assert_array_equal(block.to_dense(), seen)
    # (flex's: the share of the scores outside computed blocks, each counted whole)
    assert block.sparsity() == pytest.approx(100 * (1 - seen.sum() * 16 / (B_ * T * T)))
    np.testing.assert_array_equal(block.kv_num_blocks + block.full_kv_num_blocks, seen.sum(-1))
    assert block.full_kv_num_blocks.sum() == 0  # (causal: no block is full)
    np.testing.assert_array_equal(block.kv_indices[0, 0, 2], [0, 1, 2])

    with pytest.raises(ValueError, match="enable_gqa"):
        flex.flex_attention(q, k, v, block_mask=block)
    out, lse = flex.flex_attention(
        q, k, v, score_mod=alibi, block_mask=block, enable_gqa=True, return_lse=True
    )
    want, _, want_lse = oracle.attention(
        *_np(backend, q, k, v), mask_mod=mask_np, score_mod=alibi_np, return_lse=True
    )
    assert tuple(out.shape) == (B_, H, T, D) and tuple(lse.shape) == (B_, H, T)
    np.testing.assert_allclose(backend.to_numpy(out), want, rtol=3e-5, atol=3e-5)
    np.testing.assert_allclose(backend.to_numpy(lse), want_lse, rtol=3e-5, atol=3e-5)

    got = flex.create_mask(mask_mod, B_, 1, T, T, device="cpu", backend=backend)
    np.testing.assert_array_equal(backend.to_numpy(got), dense)
    everything = flex.create_block_mask(flex.noop_mask, 1, 1, T, T, device="cpu", BLOCK_SIZE=4)
    assert everything.sparsity() == pytest.approx(100 * (1 - 9 * 16 / (T * T)))  # (flex's: < 0)
    out = flex.flex_attention(q, k, v, block_mask=everything, scale=0.3, enable_gqa=True)
    want, _ = oracle.attention(*_np(backend, q, k, v), scale=0.3)
    np.testing.assert_allclose(backend.to_numpy(out), want, rtol=3e-5, atol=3e-5)


@pytest.mark.grid(rows={"path": ("fused", "full")})  # (JAX: the paths it takes itself)
@pytest.mark.parametrize("path", PATHS)
def test_lse_and_sinks_every_path(backend, path):
    """``return_lse`` and ``sinks`` on every path (a kernel path declines and
    another gives the log-sum-exp), with lengths, causal, a ``mask_mod`` and
    a row that sees no key (lse ``-inf``; with sinks, the sink)."""
    dtype = "float64" if "float64" in backend.float_dtypes else "float32"
    tol = 1e-10 if dtype == "float64" else 3e-5
    q, k, v = _inputs(backend, dtype, nq=7)
    lens = np.array([9, 0])
    sinks = backend.asarray(SINKS, dtype)
    for forms, ref in (
        ({"causal": True}, {"causal": True}),
        ({"mask_mod": _near, "valid_lens": backend.asarray(lens)}, None),
    ):
        ref = ref or {"mask_mod": _near, "valid_lens": lens}
        m = make_mask(backend, B_, H, 7, T, dtype=dtype, **forms)
        out, _, lse, _ = attend(backend, q, k, v, m, path=path, chunk_size=3, lse=True)
        qn, kn, vn = _np(backend, q, k, v)
        want, _, want_lse = oracle.attention(qn, kn, vn, return_lse=True, **ref)
        assert tuple(lse.shape) == (B_, H, 7, 1)
        np.testing.assert_allclose(backend.to_numpy(out), want, rtol=tol, atol=tol)
        np.testing.assert_allclose(backend.to_numpy(lse)[..., 0], want_lse, rtol=tol, atol=tol)
        out, lse = add_sinks(backend, out, lse, sinks)
        want, _, want_lse = oracle.attention(qn, kn, vn, sinks=SINKS, return_lse=True, **ref)
        np.testing.assert_allclose(backend.to_numpy(out), want, rtol=tol, atol=tol)
        np.testing.assert_allclose(backend.to_numpy(lse)[..., 0], want_lse, rtol=tol, atol=tol)
    assert np.isneginf(want_lse[1] - SINKS[:, None]).sum() == 0  # (row with no key: the sink)


@pytest.mark.grid
def test_sinks_and_lse_gradients(backend, grid_paths):
    """Gradients of ``sum(out * R) + sum(lse * S)`` with sinks, to the
    queries, keys, values and sinks, on every path, against central
    differences of the float64 oracle; a row that sees no key gives finite ones."""
    if not supports(backend, Autodiff):
        pytest.skip(f"the {backend.name} backend has no autodiff")
    dtype = "float64" if "float64" in backend.float_dtypes else "float32"
    tol = 1e-6 if dtype == "float64" else 3e-4
    q, k, v = _inputs(backend, dtype, nq=5, nk=6)
    lens = np.array([4, 0])
    rng = np.random.default_rng(3)
    R, S = rng.normal(size=(B_, H, 5, D)), rng.normal(size=(B_, H, 5))

    def loss_np(qn, kn, vn, sinks):
        out, _, lse = oracle.attention(
            qn, kn, vn, valid_lens=lens, causal=True, sinks=sinks, return_lse=True
        )
        return (out * R).sum() + (lse * S).sum()

    args = _np(backend, q, k, v) + [SINKS]
    want = []
    for i, x in enumerate(args):
        want.append(_numeric_grad(lambda y, i=i: loss_np(*args[:i], y, *args[i + 1 :]), x))
    dummy = am.DotProductAttention(0.0, backend=backend, dtype=dtype)
    Rb, Sb = backend.asarray(R, dtype), backend.asarray(S, dtype)
    for path in grid_paths(("full", "chunked", "tiled")):

        def f(module, q, k, v, sinks, path=path):
            m = make_mask(backend, B_, H, 5, 6, valid_lens=backend.asarray(lens), causal=True)
            out, _, lse, _ = attend(backend, q, k, v, m, path=path, chunk_size=2, lse=True)
            out, lse = add_sinks(backend, out, lse, sinks)
            total = backend.sum((out * Rb).reshape((-1,)), 0)
            return total + backend.sum((lse[..., 0] * Sb).reshape((-1,)), 0)

        sinks = backend.asarray(SINKS, dtype)
        _, _, grads = backend.gradients(f, dummy, q, k, v, sinks)
        for name, g, w in zip(("queries", "keys", "values", "sinks"), grads, want):
            g = backend.to_numpy(g).astype(np.float64)
            assert np.isfinite(g).all(), (path, name)
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"{path} d{name}")


def test_sinks_and_lse_through_the_api(backend):
    """``attention(sinks=, lse=True)``, 3-D and 4-D, and a
    wrong-shaped ``sinks`` named in the error."""
    q, k, v = _inputs(backend, kv=H)
    sinks = backend.asarray(SINKS, "float32")
    out, _, lse, _ = am.attention(q, k, v, causal=True, sinks=sinks, lse=True)
    want, _, want_lse = oracle.attention(
        *_np(backend, q, k, v), causal=True, sinks=SINKS, return_lse=True
    )
    np.testing.assert_allclose(backend.to_numpy(out), want, rtol=3e-5, atol=3e-5)
    np.testing.assert_allclose(backend.to_numpy(lse), want_lse, rtol=3e-5, atol=3e-5)
    out, _, lse, _ = am.attention(q[:, 0], k[:, 0], v[:, 0], lse=True)
    want, _, want_lse = oracle.attention(
        *_np(backend, q[:, :1], k[:, :1], v[:, :1]), return_lse=True
    )
    assert tuple(lse.shape) == (B_, T)
    np.testing.assert_allclose(backend.to_numpy(lse), want_lse[:, 0], rtol=3e-5, atol=3e-5)
    # (the earlier spelling: a tuple, with a DeprecationWarning naming the new one)
    with pytest.warns(DeprecationWarning, match=r"attention\(\.\.\., lse=True\)"):
        old_out, old_lse = am.dot_product_attention(q[:, 0], k[:, 0], v[:, 0], return_lse=True)
    np.testing.assert_array_equal(backend.to_numpy(old_lse), backend.to_numpy(lse))
    np.testing.assert_array_equal(backend.to_numpy(old_out), backend.to_numpy(out))
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
        am.dot_product_attention(q, k, v, sinks=sinks[:2])


def test_lse_traced_paths_jax():
    """Under ``jax.jit`` with traced lengths (the traced tiles) and traced
    segment ids (the block-sparse path's conds), the log-sum-exp agrees."""
    jax = pytest.importorskip("jax")
    B = am.get_backend("jax")
    q, k, v = _inputs(B, nq=300, nk=300, kv=H)
    lens = np.array([120, 0])
    ids = np.zeros((B_, 300), np.int32)
    ids[:, 100:] = 1
    ids[1, 250:] = -1

    @jax.jit
    def by_lengths(q, k, v, lens):
        done = am.attention(q, k, v, lens, causal=True, lse=True)
        return done.output, done.lse  # (arrays out of jit; the path is the host's)

    @jax.jit
    def by_segments(q, k, v, ids):
        done = am.attention(q, k, v, segment_ids=ids, causal=True, lse=True)
        return done.output, done.lse

    qn, kn, vn = _np(B, q, k, v)
    for fn, arg, ref in (
        (by_lengths, lens, {"valid_lens": lens, "causal": True}),
        (by_segments, ids, {"segment_ids": ids, "causal": True}),
    ):
        out, lse = fn(q, k, v, B.asarray(arg))
        want, _, want_lse = oracle.attention(qn, kn, vn, return_lse=True, **ref)
        np.testing.assert_allclose(np.asarray(out), want, rtol=3e-5, atol=3e-5)
        np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("what", ["bias_table", "alibi_slopes"])
def test_gradients_to_what_score_mod_captures(backend, what):
    """A learnable relative-position bias table, or ALiBi slopes, captured
    by a ``score_mod`` and passed as an input of the differentiated
    function, gets its gradient on every path: equal to central differences
    of the float64 oracle, and the same bits on a second run."""
    if not supports(backend, Autodiff):
        pytest.skip(f"the {backend.name} backend has no autodiff")
    dtype = "float64" if "float64" in backend.float_dtypes else "float32"
    tol = 1e-6 if dtype == "float64" else 3e-4
    q, k, v = _inputs(backend, dtype, kv=H, nq=6, nk=6)
    rng = np.random.default_rng(4)
    R = rng.normal(size=(B_, H, 6, D))
    if what == "bias_table":  # table[h, q - k + 5]
        param_np = rng.normal(size=(H, 11))

        def mod_np(table):
            return lambda s, b, h, qi, ki: s + table[h, qi - ki + 5]
    else:
        param_np = SLOPES.copy()

        def mod_np(slopes):
            return lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)

    def loss_np(param):
        out, _ = oracle.attention(*_np(backend, q, k, v), causal=True, score_mod=mod_np(param))
        return (out * R).sum()

    want = _numeric_grad(loss_np, param_np)
    dummy = am.DotProductAttention(0.0, backend=backend, dtype=dtype)
    Rb = backend.asarray(R, dtype)
    for path in ("full", "chunked", "tiled"):

        def f(module, param, path=path):
            if what == "bias_table":
                mod = lambda s, b, h, qi, ki: s + param[h, qi - ki + 5]  # noqa: E731
            else:
                mod = lambda s, b, h, qi, ki: s + param[h] * (ki - qi)  # noqa: E731
            m = make_mask(backend, B_, H, 6, 6, dtype=dtype, causal=True, score_mod=mod)
            out, _, _, _ = attend(backend, q, k, v, m, path=path, chunk_size=2)
            return backend.sum((out * Rb).reshape((-1,)), 0)

        runs = [
            backend.to_numpy(backend.gradients(f, dummy, backend.asarray(param_np, dtype))[2][0])
            for _ in range(2)
        ]
        np.testing.assert_array_equal(runs[0], runs[1], err_msg=f"{path}: not deterministic")
        np.testing.assert_allclose(runs[0], want, rtol=tol, atol=tol, err_msg=path)


def test_flex_compiled_and_backward_torch():
    """``torch.compile(flex_attention, fullgraph=True)`` with a block mask
    and a ``score_mod``, forward and backward on CPU, against the oracle
    (forward) and eager (gradients, which flex cannot give on CPU)."""
    torch = pytest.importorskip("torch")
    B = am.get_backend("torch")
    q, k, v = (x.requires_grad_() for x in _inputs(B, kv=H))
    table = torch.tensor(np.random.default_rng(5).normal(size=(H, 2 * T - 1)), dtype=torch.float32)
    table.requires_grad_()

    def rel(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + T - 1]

    block = flex.create_block_mask(_causal, 1, 1, T, T, device="cpu", BLOCK_SIZE=4)
    compiled = torch.compile(flex.flex_attention, fullgraph=True)
    got = compiled(q, k, v, score_mod=rel, block_mask=block)
    tn = table.detach().numpy().astype(np.float64)
    want, _ = oracle.attention(
        *_np(B, q.detach(), k.detach(), v.detach()),
        causal=True,
        score_mod=lambda s, b, h, qi, ki: s + tn[h, qi - ki + T - 1],
    )
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=3e-5, atol=3e-5)
    got.square().sum().backward()
    compiled_grads = [x.grad.clone() for x in (q, k, v, table)]
    for x in (q, k, v, table):
        x.grad = None
    flex.flex_attention(q, k, v, score_mod=rel, block_mask=block).square().sum().backward()
    for a, x in zip(compiled_grads, (q, k, v, table)):
        np.testing.assert_allclose(a.numpy(), x.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_causal_block_mask_takes_the_causal_kernel(backend):
    """A block mask that is exactly causal (its block states, and every
    element of its partial blocks) runs as ``causal=True`` would, on the
    framework's causal kernel where it has one (torch SDPA's ``is_causal``)
    instead of the block-sparse path; one element off causal's pattern, or
    fewer queries than keys, keeps the function. Answers the oracle's."""
    n = 1024
    rng = np.random.default_rng(5)
    q, k, v = (backend.asarray(rng.normal(size=(B_, n, D)), "float32") for _ in "qkv")

    def almost(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ~((q_idx == 9) & (kv_idx == 3))

    def almost_np(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ~((q_idx == 9) & (kv_idx == 3))

    blocks = {
        fn: flex.create_block_mask(fn, B_, None, n, n, BLOCK_SIZE=32, backend=backend)
        for fn in (_causal, almost)
    }
    assert blocks[_causal].causal and not blocks[almost].causal
    m = am.DotProductAttention(0.0, backend=backend).eval()
    m(q, k, v, causal=True)
    causal_path = m.last_path
    for fn, same in ((_causal, _causal), (almost, almost_np)):
        out = m(q, k, v, mask_mod=blocks[fn])
        if opt(backend).fused_causal:  # (elsewhere causal=True runs the block-sparse path too)
            assert (m.last_path == causal_path) == (fn is _causal), m.last_path
        want, _ = oracle.attention(*(x[:, None] for x in _np(backend, q, k, v)), mask_mod=same)
        np.testing.assert_allclose(backend.to_numpy(out), want[:, 0], rtol=3e-5, atol=3e-5)
    fewer = backend.asarray(backend.to_numpy(q)[:, : n - 8], "float32")
    out = m(fewer, k, v, mask_mod=blocks[_causal])  # (q_idx from 0: top-left, not causal=)
    inputs = (x[:, None] for x in _np(backend, fewer, k, v))
    want, _ = oracle.attention(*inputs, mask_mod=_causal)
    np.testing.assert_allclose(backend.to_numpy(out), want[:, 0], rtol=3e-5, atol=3e-5)
    if backend.name == "torch":  # (torch's own BlockMask, converted)
        tf = pytest.importorskip("torch.nn.attention.flex_attention")
        theirs = tf.create_block_mask(_causal, B_, None, n, n, device="cpu", BLOCK_SIZE=32)
        assert flex.as_block_mask(theirs).causal


def test_same_answers_as_torch_flex_attention():
    """One small case against torch's own ``flex_attention`` (compiled on
    CPU: its first call takes ~30 s): document + causal masking and a
    ``score_mod``; our block fields equal torch's; a torch ``BlockMask`` is
    accepted (its function and block states)."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("torch.nn.attention.flex_attention")
    n = 256
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 8, generator=gen) for _ in range(3))
    doc = torch.zeros(2, n, dtype=torch.int64)
    doc[:, 100:] = 1
    doc[1, 200:] = 2

    def doc_causal(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)

    def slope(score, b, h, q_idx, kv_idx):
        return score + 0.1 * (h + 1) * (kv_idx - q_idx)

    theirs = tf.create_block_mask(doc_causal, 2, None, n, n, device="cpu")
    ours = flex.create_block_mask(doc_causal, 2, None, n, n, device="cpu")
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        np.testing.assert_array_equal(getattr(ours, field), getattr(theirs, field).numpy())
    np.testing.assert_array_equal(ours.to_dense(), theirs.to_dense().numpy())
    assert ours.sparsity() == pytest.approx(theirs.sparsity())
    assert ours.shape == tuple(theirs.shape)
    want = torch.compile(tf.flex_attention)(q, k, v, score_mod=slope, block_mask=theirs)
    for block in (ours, theirs):
        got = flex.flex_attention(q, k, v, score_mod=slope, block_mask=block)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def _block_states(dense, block):
    """flex's (batch, heads, Q blocks, K blocks) int32 of a dense mask: 1 where
    a block (past the end: padded with False) has a key seen."""
    b, h, nq, nk = dense.shape
    pq, pk = -nq % block, -nk % block
    tiles = np.pad(dense, ((0, 0), (0, 0), (0, pq), (0, pk)))
    return tiles.reshape(b, h, (nq + pq) // block, block, -1, block).any((3, 5)).astype(np.int32)


def test_functions_written_for_their_framework(monkeypatch):
    """Functions that call their framework (``torch.abs``, a tensor's
    ``.abs()``, ``jnp.abs``) and capture no array of it run on it: the
    framework they name, else that of ``device=``, else torch where it is
    imported (flex's functions are torch's). Block states and ``create_mask``
    against the oracle's dense mask."""
    import jax.numpy as jnp
    import torch

    from attention_multi import config

    monkeypatch.setitem(config._state, "backend", None)
    monkeypatch.delenv("ATTENTION_MULTI_BACKEND", raising=False)
    n = 40

    def dilated(b, h, q_idx, kv_idx):
        diff = torch.abs(q_idx - kv_idx)
        return (diff <= 8) & (diff % 2 == 0)

    def dilated_jax(b, h, q_idx, kv_idx):
        diff = jnp.abs(q_idx - kv_idx)
        return (diff <= 8) & (diff % 2 == 0)

    def near(b, h, q_idx, kv_idx):  # (names no framework: a tensor's method)
        return (q_idx // 8 - kv_idx // 8).abs() <= 1

    def dilated_np(b, h, q_idx, kv_idx):
        diff = np.abs(q_idx - kv_idx)
        return (diff <= 8) & (diff % 2 == 0)

    def near_np(b, h, q_idx, kv_idx):
        return np.abs(q_idx // 8 - kv_idx // 8) <= 1

    cases = [
        (dilated, dilated_np, "cpu", torch.Tensor),
        (dilated_jax, dilated_np, "cpu", type(jnp.zeros(1))),
        (near, near_np, torch.device("cpu"), torch.Tensor),
        (near, near_np, "cpu", torch.Tensor),
    ]
    for fn, same, device, kind in cases:
        dense = oracle.allowed_keys(1, 1, n, n, mask_mod=same)
        block = flex.create_block_mask(fn, None, None, n, n, device=device, BLOCK_SIZE=16)
        np.testing.assert_array_equal(block.to_dense(), _block_states(dense, 16))
        got = flex.create_mask(fn, None, None, n, n, device=device)
        assert isinstance(got, kind), (fn.__name__, type(got))
        np.testing.assert_array_equal(np.asarray(got), dense)
    slopes = torch.tensor([0.5, 0.25])

    def alibi(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx) * torch.exp2(-(h + 1.0))

    scores = flex.create_mask(alibi, None, 2, 8, 8, device="cpu")
    want = slopes.numpy()[:, None, None] * (np.arange(8)[None] - np.arange(8)[:, None])
    np.testing.assert_allclose(scores.numpy()[0], want, rtol=1e-6)


def test_create_mask_checks_the_function(backend):
    """``create_mask`` checks what a ``mask_mod`` returns as the attention
    calls do: None (a missing return) or a float is a TypeError, a shape that
    does not broadcast to (B, H, Q, K) a ValueError naming the shapes."""

    def no_return(b, h, q_idx, kv_idx):
        q_idx <= kv_idx  # noqa: B015 (the bug under test)

    def floats(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) * 1.0

    def short(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx)[..., :3]

    args = (2, 1, 6, 6)
    with pytest.raises(TypeError, match=r"mask_mod returned None.*\(2, 1, 6, 6\)"):
        flex.create_mask(no_return, *args, backend=backend)
    with pytest.raises(TypeError, match="mask_mod must return booleans"):
        flex.create_mask(floats, *args, backend=backend)
    with pytest.raises(ValueError, match=r"mask_mod failed.*\(2, 1, 6, 6\)"):
        flex.create_mask(short, *args, backend=backend)


def test_numpy_captured_inside_block_masks_and_combinations(backend):
    """A NumPy array captured by a function inside ``and_masks``/``or_masks``
    or a ``BlockMask`` is converted to the call's backend as a captured one
    is (int64 ids beside int32 indices included), eager and under
    ``jax.jit``; against the oracle."""
    n = 150
    ids = np.zeros((B_, n), np.int64)
    ids[:, 60:] = 1
    ids[1, 110:] = 2
    prefix_len = np.array([10, 70])

    def same_doc(b, h, q_idx, kv_idx):
        return ids[b, q_idx] == ids[b, kv_idx]

    def prefix(b, h, q_idx, kv_idx):
        return kv_idx <= prefix_len[b]

    rng = np.random.default_rng(3)
    q, k, v = (backend.asarray(rng.normal(size=(B_, 2, n, D)), "float32") for _ in "qkv")
    cases = [
        (
            flex.and_masks(same_doc, _causal),
            lambda b, h, qi, ki: (ids[b, qi] == ids[b, ki]) & (ki <= qi),
        ),
        (flex.or_masks(prefix, _causal), lambda b, h, qi, ki: (ki <= prefix_len[b]) | (ki <= qi)),
    ]
    for fn, same in cases:
        want, _ = oracle.attention(*_np(backend, q, k, v), mask_mod=same)
        block = flex.create_block_mask(fn, B_, None, n, n, BLOCK_SIZE=32, backend="numpy")
        for mask in (fn, block):
            out = (
                flex.flex_attention(q, k, v, block_mask=block)
                if mask is block
                else (am.dot_product_attention(q, k, v, mask_mod=fn))
            )
            np.testing.assert_allclose(backend.to_numpy(out), want, rtol=3e-5, atol=3e-5)
        if backend.name == "jax":
            import jax

            jitted = jax.jit(lambda q, k, v, m=block: flex.flex_attention(q, k, v, block_mask=m))
            out = jitted(q, k, v)
            np.testing.assert_allclose(backend.to_numpy(out), want, rtol=3e-5, atol=3e-5)


def test_block_mask_fields_and_heads_as_torch():
    """Where Q or K is not a multiple of the block, flex pads with masked
    positions: a block past the end is never full; our fields and
    ``sparsity()`` (in scores, each computed block whole) equal torch's. A
    block mask of other heads than the call's is refused, as torch's."""
    import torch
    from torch.nn.attention import flex_attention as tf

    for nq, nk, size in ((100, 256, 32), (200, 300, (32, 64)), (256, 256, 64)):
        theirs = tf.create_block_mask(_causal, 1, 1, nq, nk, device="cpu", BLOCK_SIZE=size)
        ours = flex.create_block_mask(_causal, 1, 1, nq, nk, device="cpu", BLOCK_SIZE=size)
        fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
        fields += ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
        for field in fields:
            np.testing.assert_array_equal(getattr(ours, field), getattr(theirs, field).numpy())
        np.testing.assert_array_equal(ours.to_dense(), theirs.to_dense().numpy())
        assert ours.sparsity() == pytest.approx(theirs.sparsity())
        assert ours.numel() == theirs.numel() and ours.seq_lengths == tuple(theirs.seq_lengths)
        assert ours.to("cpu") is ours
    four = flex.create_block_mask(_causal, 1, 4, 64, 64, device="cpu", BLOCK_SIZE=32)
    q = torch.randn(1, 2, 64, 8)
    with pytest.raises(ValueError, match="built for batch 1, 4 heads.*2 query heads"):
        flex.flex_attention(q, q, q, block_mask=four)


def test_block_masks_under_torch_compile_as_the_first_call():
    """Under ``torch.compile(fullgraph=True)`` as the first call: a torch
    ``BlockMask`` (its function, no host states while traced) and
    ``create_block_mask`` inside the compiled function (every block
    partial) give the oracle's answers."""
    import torch
    from torch.nn.attention import flex_attention as tf

    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 20)

    n = 64
    theirs = tf.create_block_mask(window, None, None, n, n, device="cpu", BLOCK_SIZE=32)
    q, k, v = (
        torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)
    )
    want, _ = oracle.attention(*(x.double().numpy() for x in (q, k, v)), mask_mod=window)

    def inside(q, k, v):
        block = flex.create_block_mask(window, None, None, n, n, device="cpu", BLOCK_SIZE=32)
        return flex.flex_attention(q, k, v, block_mask=block)

    given = torch.compile(
        lambda q, k, v: flex.flex_attention(q, k, v, block_mask=theirs), fullgraph=True
    )
    for f in (given, torch.compile(inside, fullgraph=True)):
        np.testing.assert_allclose(f(q, k, v).numpy(), want, rtol=3e-5, atol=3e-5)


def test_mxnet_nd_arrays_are_named():
    """An ``mx.nd`` array is refused with the way to convert it."""
    mx = pytest.importorskip("mxnet")
    q = mx.nd.zeros((1, 2, 4, 8))
    with pytest.raises(TypeError, match=r"got NDArray; .*as_np_ndarray\(\)"):
        flex.flex_attention(q, q, q)


def test_reused_block_mask_evaluates_its_function_once(backend, capsys):
    """A BlockMask reused across calls keeps its function's values where a
    call computed with them: the function runs again only when what it
    captures changed (an array bound anew or written in place). Every path
    that reads the values, against the oracle after each change."""
    n = 150
    ids = np.zeros(n, np.int32)
    ids[60:] = 1
    doc = backend.asarray(ids, "int32")
    calls = []

    def document(b, h, q_idx, kv_idx):
        print("evaluated")  # (counted from the output: a captured counter would be a change)
        return doc[q_idx] == doc[kv_idx]

    def count():
        calls.extend(capsys.readouterr().out.split())
        return len(calls)

    rng = np.random.default_rng(5)
    q, k, v = (backend.asarray(rng.normal(size=(B_, n, D)), "float32") for _ in "qkv")
    block = flex.create_block_mask(document, 1, None, n, n, BLOCK_SIZE=32)

    def check(ids):
        # (the changes below keep every full and every empty block as they were)
        qn, kn, vn = (x[:, None] for x in _np(backend, q, k, v))
        want, _ = oracle.attention(qn, kn, vn, mask_mod=lambda b, h, i, j: ids[i] == ids[j])
        want = want[:, 0]
        before, outs = count(), {}
        for path in ("full", "tiled"):
            attention = am.DotProductAttention(0.0, path=path, backend=backend)
            outs[path] = attention, attention(q, k, v, mask_mod=block)
            assert attention.last_path == path
            np.testing.assert_allclose(backend.to_numpy(outs[path][1]), want, rtol=3e-5, atol=3e-5)
        evaluated = count()
        assert evaluated > before  # (captures changed since the last call, or none yet)
        for attention, out in outs.values():
            again = attention(q, k, v, mask_mod=block)
            np.testing.assert_array_equal(backend.to_numpy(again), backend.to_numpy(out))
        assert count() == evaluated  # (the same captures, holding the same: nothing evaluated)

    check(ids)
    ids = ids.copy()
    ids[61] = 5
    doc = backend.asarray(ids, "int32")  # (bound anew)
    check(ids)
    try:
        doc[62] = 7  # (written in place, where the framework can)
    except TypeError:
        return
    ids[62] = 7
    check(ids)


def test_block_mask_values_made_in_inference_mode_are_not_kept():
    """torch: a block mask's values made under ``inference_mode`` are not
    kept, so a later call under autograd (which saves the mask for backward)
    runs on every path: the oracle's answers, and gradients."""
    import torch

    n = 150
    ids = np.zeros(n, np.int32)
    ids[60:] = 1
    doc = torch.tensor(ids)

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    block = flex.create_block_mask(document, 1, None, n, n, BLOCK_SIZE=32)
    q = torch.tensor(np.random.default_rng(6).normal(size=(B_, n, D)), dtype=torch.float32)
    qn = q.double().numpy()[:, None]
    want, _ = oracle.attention(qn, qn, qn, mask_mod=lambda b, h, i, j: ids[i] == ids[j])
    for path in ("full", "tiled", "chunked"):
        attention = am.DotProductAttention(0.0, path=path, backend="torch")
        with torch.inference_mode():
            attention(q, q, q, mask_mod=block)
        x = q.clone().requires_grad_(True)
        out = attention(x, x, x, mask_mod=block)
        out.sum().backward()
        np.testing.assert_allclose(out.detach().numpy(), want[:, 0], rtol=3e-5, atol=3e-5)
        assert x.grad is not None and bool(torch.isfinite(x.grad).all())


def test_reused_block_mask_sees_every_change_torch(capsys):
    """torch writes that its version counter misses (``.data``, a NumPy view,
    a fused optimizer's step), keyword-only defaults, a NumPy array captured:
    a reused BlockMask sees each change; a function that reads a class or
    draws random numbers is evaluated on every call. Against the oracle."""
    import torch

    n, rng = 128, np.random.default_rng(7)
    q = torch.tensor(rng.normal(size=(1, 2, n, D)), dtype=torch.float32)
    qn = q.double().numpy()

    def check(block, ids, evaluated_again):
        for _ in range(2):
            capsys.readouterr()
            out = flex.flex_attention(q, q, q, block_mask=block)
            ran = capsys.readouterr().out.count("evaluated")
        want, _ = oracle.attention(qn, qn, qn, mask_mod=lambda b, h, i, j: ids[i] == ids[j])
        np.testing.assert_allclose(out.numpy(), want, rtol=3e-5, atol=3e-5)
        assert (ran > 0) == evaluated_again

    start = np.zeros(n, np.int32)
    start[50:] = 1
    doc, held = torch.tensor(start), start.copy()
    param = torch.nn.Parameter(torch.tensor(start, dtype=torch.float32))

    def by_tensor(b, h, q_idx, kv_idx):
        print("evaluated")
        return doc[q_idx] == doc[kv_idx]

    def by_param(b, h, q_idx, kv_idx):
        print("evaluated")
        return param[q_idx] == param[kv_idx]

    def by_keyword(b, h, q_idx, kv_idx, *, ids=doc):
        print("evaluated")
        return ids[q_idx] == ids[kv_idx]

    def by_numpy(b, h, q_idx, kv_idx):
        print("evaluated")
        return torch.as_tensor(held)[q_idx] == torch.as_tensor(held)[kv_idx]

    # (each change: positions 40..60 only, inside partial blocks of 32)
    for fn, changed, write in (
        (by_tensor, doc, lambda: doc.data.__setitem__(slice(40, 45), 7)),
        (by_tensor, doc, lambda: doc.numpy().__setitem__(slice(45, 50), 7)),
        (by_keyword, doc, lambda: doc.__setitem__(slice(55, 60), 7)),
        (by_numpy, held, lambda: held.__setitem__(slice(40, 45), 7)),
    ):
        doc[:], held[:] = torch.tensor(start), start
        block = flex.create_block_mask(fn, 1, None, n, n, BLOCK_SIZE=32)
        check(block, start, False)
        write()
        check(block, np.array(changed, copy=True), False)
    block = flex.create_block_mask(by_param, 1, None, n, n, BLOCK_SIZE=32)
    check(block, param.detach().numpy().copy(), False)
    optimizer = torch.optim.AdamW([param], lr=1.0, weight_decay=0.0, fused=True)
    param.grad = torch.zeros_like(param)
    param.grad[40:45] = -1.0  # (a fused step: the version counter stays)
    optimizer.step()
    check(block, param.detach().numpy().copy(), False)

    class Settings:
        ids = doc

    def by_class(b, h, q_idx, kv_idx):
        print("evaluated")
        return Settings.ids[q_idx] == Settings.ids[kv_idx]

    def by_chance(b, h, q_idx, kv_idx):
        print("evaluated")
        return (torch.rand(()) < 2) & (doc[q_idx] == doc[kv_idx])

    for fn in (by_class, by_chance):
        block = flex.create_block_mask(fn, 1, None, n, n, BLOCK_SIZE=32)
        check(block, doc.numpy().copy(), True)
