"""torch 2.13's FlexAttention API, keyword for keyword (issue 62, items 4-6):
``return_aux``, ``AuxRequest``/``AuxOutput``, ``create_block_mask``'s keywords,
``BlockMask.from_kv_blocks`` and torch's BlockMask methods, compared with
torch's own objects (its ``create_block_mask`` runs on CPU); user functions
that need scalar indices or raise; the small items (install hint, ``info``,
the report's error cells)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings

import numpy as np
import pytest

import attention_multi as am
from attention_multi import flex
from attention_multi import reference as oracle

torch = pytest.importorskip("torch")
tf = pytest.importorskip("torch.nn.attention.flex_attention")


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(
    "name", ["flex_attention", "create_block_mask", "create_mask", "and_masks", "or_masks"]
)
def test_signatures_are_torchs(name):
    """Every parameter of torch's function, in its order, kind and default, is
    ours; ours may only add keyword-only ones after them."""
    theirs, ours = _params(getattr(tf, name)), _params(getattr(flex, name))
    assert ours[: len(theirs)] == theirs
    assert all(kind == inspect.Parameter.KEYWORD_ONLY for _, _, kind in ours[len(theirs) :])


def test_helpers_signatures_are_torchs():
    assert [p[:2] for p in _params(flex.noop_mask)] == [p[:2] for p in _params(tf.noop_mask)]
    for method in ("as_tuple", "to_string", "numel", "sparsity", "to_dense", "to"):
        theirs = _params(getattr(tf.BlockMask, method))
        assert _params(getattr(flex.BlockMask, method)) == theirs, method
    theirs = _params(tf.BlockMask.from_kv_blocks)
    assert _params(flex.BlockMask.from_kv_blocks) == theirs
    assert flex.AuxRequest._fields == tf.AuxRequest._fields == ("lse", "max_scores")
    assert flex.AuxOutput._fields == tf.AuxOutput._fields
    assert flex.AuxRequest() == (False, False)


def _close_to_torch(ours, theirs):
    """Our BlockMask's fields, as torch's ``as_tuple`` lists them, equal torch's."""
    for i, (x, y) in enumerate(zip(ours.as_tuple(), theirs.as_tuple(), strict=True)):
        if isinstance(y, torch.Tensor):
            np.testing.assert_array_equal(np.asarray(x), y.numpy(), err_msg=f"field {i}")
        elif not callable(y):
            assert x == y, (i, x, y)


@pytest.mark.parametrize("separate", [True, False])
def test_create_block_mask_as_torchs(separate):
    """The tables, sparsity, dense blocks, picture and slices of our block
    mask are torch's, with full blocks listed apart or (``separate_full_blocks
    =False``) as partial ones, ``full_*`` None; ragged lengths."""
    args = (causal, 2, 3, 200, 136)
    kw = {"device": "cpu", "BLOCK_SIZE": (64, 32), "separate_full_blocks": separate}
    ours, theirs = flex.create_block_mask(*args, **kw), tf.create_block_mask(*args, **kw)
    _close_to_torch(ours, theirs)
    assert (ours.full_kv_num_blocks is None) == (not separate)
    assert ours.shape == theirs.shape and ours.numel() == theirs.numel()
    assert ours.sparsity() == pytest.approx(theirs.sparsity())
    np.testing.assert_array_equal(ours.to_dense(), theirs.to_dense().numpy())
    assert str(ours) == str(theirs)
    assert ours.to_string(grid_size=-1, limit=2) == theirs.to_string(grid_size=-1, limit=2)
    for index in (1, (0, 2), (slice(0, 2), slice(1, 3)), (-1, slice(None), torch.tensor([2]))):
        _close_to_torch(ours[index], theirs[index])
        assert ours[index].shape == theirs[index].shape
    with pytest.raises(RuntimeError, match="Cannot use mask_mod from a sliced BlockMask"):
        ours[0].mask_mod(0, 0, 0, 0)


def test_separate_full_blocks_false_lists_partial_blocks():
    """``separate_full_blocks=False``: no block is full (the function answers
    on every computed block), ``full_*`` None, the same answer."""

    def band(b, h, q_idx, kv_idx):
        return kv_idx < q_idx + 40

    ours = flex.create_block_mask(band, None, None, 128, 128, BLOCK_SIZE=32)
    lists = flex.create_block_mask(
        band, None, None, 128, 128, BLOCK_SIZE=32, separate_full_blocks=False
    )
    assert ours.states.max() == 2 and lists.states.max() == 1  # (FULL=2, PARTIAL=1)
    assert lists.full_kv_num_blocks is None and lists.full_q_indices is None and not lists.all_full
    q = torch.randn(1, 2, 128, 8, dtype=torch.float64)
    want, _ = oracle.attention(q.numpy(), q.numpy(), q.numpy(), mask_mod=band)
    for bm in (ours, lists):
        np.testing.assert_allclose(
            flex.flex_attention(q, q, q, block_mask=bm).numpy(), want, atol=1e-12
        )


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_from_kv_blocks_binds(kind):
    """The issue's example with our ``from_kv_blocks`` (tables as torch or
    NumPy arrays): key block 0 only, whatever the function says; partial and
    full tables together, as torch's (its fields equal)."""
    T, bs = 512, 128
    n = T // bs
    counts, indices = (
        torch.ones(1, 1, n, dtype=torch.int32),
        torch.zeros(1, 1, n, n, dtype=torch.int32),
    )
    full_counts, full_indices = torch.zeros(1, 1, n, dtype=torch.int32), indices.clone()
    full_counts[..., 2] = 1
    full_indices[..., 2, 0] = 3  # (query block 2 sees key block 3 whole)
    tables = [counts, indices, full_counts, full_indices]
    given = tables if kind == "torch" else [t.numpy() for t in tables]
    ours = flex.BlockMask.from_kv_blocks(*given, BLOCK_SIZE=bs)
    theirs = tf.BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=bs)
    _close_to_torch(ours, theirs)
    assert ours.binding and ours.sparsity() == pytest.approx(theirs.sparsity())
    q, k, v = (torch.randn(1, 2, T, 16, dtype=torch.float64) for _ in range(3))
    seen = np.zeros((T, T), bool)
    seen[:, :bs] = True
    seen[2 * bs : 3 * bs, 3 * bs :] = True
    want, _ = oracle.attention(q.numpy(), k.numpy(), v.numpy(), mask=seen)
    for x in (q, k, v):
        x.requires_grad_(True)
    got = flex.flex_attention(q, k, v, block_mask=ours)
    np.testing.assert_allclose(got.detach().numpy(), want, atol=1e-10)
    got.sum().backward()
    qs, ks, vs = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=torch.tensor(seen))
    ref.sum().backward()
    for a, b in ((q, qs), (k, ks), (v, vs)):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), atol=1e-10)
    # (a 2-D table: torch's shape keeps its axes)
    flat = flex.BlockMask.from_kv_blocks(counts[0, 0], indices[0, 0], BLOCK_SIZE=bs)
    assert (
        flat.shape == tf.BlockMask.from_kv_blocks(counts[0, 0], indices[0, 0], BLOCK_SIZE=bs).shape
    )


def test_assigned_mask_mod_and_seq_lengths():
    """torch's decoding pattern: a sliced mask given a new function and lengths."""
    T = 256
    base = flex.create_block_mask(causal, 1, 1, T, T, BLOCK_SIZE=64)
    row = base[:, :, torch.tensor([3])]
    offset = 200

    def shifted(b, h, q_idx, kv_idx):
        return base.mask_mod(b, h, q_idx + offset, kv_idx)

    row.mask_mod, row.seq_lengths = shifted, (1, T)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, T, 8)
    got = flex.flex_attention(q, k, k, block_mask=row)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, : offset + 1], k[:, :, : offset + 1]
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_return_aux(backend):
    """``return_aux`` gives ``(out, AuxOutput)``: ``lse`` as ``return_lse``'s,
    ``max_scores`` each row's largest scaled score after ``score_mod`` (the
    oracle's), ``-inf`` for a row that sees nothing; torch's own
    ``AuxRequest`` is taken; ``return_lse`` warns once (FutureWarning, as
    torch's); both at once are refused, as torch's."""
    rng = np.random.default_rng(0)
    dtype = "float64" if "float64" in backend.float_dtypes else "float32"
    qn, kn, vn = (rng.standard_normal((2, 2, 6, 4)) for _ in range(3))
    q, k, v = (backend.asarray(x.astype(dtype)) for x in (qn, kn, vn))

    def mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx != 2)

    def soft(score, b, h, q_idx, kv_idx):
        return score * 0.5 + h

    bm = flex.create_block_mask(mask, None, None, 6, 6, BLOCK_SIZE=2, backend=backend)
    out, aux = flex.flex_attention(
        q,
        k,
        v,
        score_mod=soft,
        block_mask=bm,
        return_aux=flex.AuxRequest(lse=True, max_scores=True),
    )
    grid = np.ix_(range(2), range(2), range(6), range(6))
    seen = mask(*grid)
    s = soft(np.einsum("bhqd,bhkd->bhqk", qn, kn) / 2.0, *grid)
    want_max = np.where(seen, s, -np.inf).max(-1)
    want, _, want_lse = oracle.attention(qn, kn, vn, mask_mod=mask, score_mod=soft, return_lse=True)
    tol = 1e-10 if dtype == "float64" else 2e-5
    np.testing.assert_allclose(backend.to_numpy(out), want, atol=tol)
    np.testing.assert_allclose(backend.to_numpy(aux.lse), want_lse.reshape(2, 2, 6), atol=tol)
    np.testing.assert_allclose(backend.to_numpy(aux.max_scores), want_max, atol=tol)
    assert np.isneginf(backend.to_numpy(aux.max_scores)[:, :, 2]).all()
    out2, aux2 = flex.flex_attention(q, k, v, block_mask=bm, return_aux=tf.AuxRequest(lse=True))
    assert aux2.max_scores is None and aux2.lse is not None
    with pytest.raises(ValueError, match="Cannot specify both return_lse and return_aux"):
        flex.flex_attention(q, k, v, return_lse=True, return_aux=flex.AuxRequest(lse=True))
    flex._WARNED.discard("return_lse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, lse = flex.flex_attention(q, k, v, block_mask=bm, return_lse=True)
        flex.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert [w.category for w in caught] == [FutureWarning]
    np.testing.assert_array_equal(backend.to_numpy(lse), backend.to_numpy(aux2.lse))


def test_create_block_mask_keywords():
    """Keywords that tune torch's GPU backward are taken and change nothing;
    ``dq_kv_order`` must be a bool and ``_compile`` warns, as torch's."""
    plain = flex.create_block_mask(causal, 1, 1, 128, 128, BLOCK_SIZE=32)
    tuned = flex.create_block_mask(
        causal, 1, 1, 128, 128, BLOCK_SIZE=32, compute_dq_write_order=True, dq_kv_order=False
    )
    np.testing.assert_array_equal(plain.states, tuned.states)
    with pytest.raises(ValueError, match="dq_kv_order must be a bool"):
        flex.create_block_mask(causal, 1, 1, 128, 128, dq_kv_order=None)
    with pytest.warns(DeprecationWarning, match="_compile"):
        flex.create_block_mask(causal, 1, 1, 128, 128, _compile=True)


# -- user functions, round two ---------------------------------------------------------


def _mla(xp_dot, qr, kr, heads):
    def mla_rope(score, b, h, q_idx, kv_idx):
        return score + 0.5 * xp_dot(qr[b, h, q_idx], kr[b, h // heads, kv_idx])

    return mla_rope


def test_scalar_score_mod_eager_and_compiled():
    """DeepSeek MLA's rope mod (``torch.dot`` of two rows: scalar indices)
    forward and backward against the oracle, eager and under
    ``torch.compile(fullgraph=True)`` (where a failing op ends dynamo's
    trace: the function is evaluated per element from the start)."""
    B, H, T, D, R = 1, 2, 16, 8, 4
    rng = np.random.default_rng(1)
    qr, kr = rng.standard_normal((B, H, T, R)), rng.standard_normal((B, 1, T, R))
    qn, kn, vn = (rng.standard_normal((B, H, T, D)) for _ in range(3))
    rope = np.einsum("bhqr,bkr->bhqk", qr, kr[:, 0])
    want, _ = oracle.attention(qn, kn, vn, causal=True, bias=0.5 * rope)
    mod = _mla(torch.dot, torch.tensor(qr), torch.tensor(kr), H)
    bm = flex.create_block_mask(causal, None, None, T, T, BLOCK_SIZE=8)
    q, k, v = (torch.tensor(x, requires_grad=True) for x in (qn, kn, vn))
    got = flex.flex_attention(q, k, v, score_mod=mod, block_mask=bm)
    np.testing.assert_allclose(got.detach().numpy(), want, atol=1e-10)
    got.square().sum().backward()
    grads = oracle.attention_gradients(qn, kn, vn, 2 * want, causal=True, bias=0.5 * rope)
    for x, g in zip((q, k, v), grads[:3]):
        np.testing.assert_allclose(x.grad.numpy(), g, atol=1e-9)
    q32, k32, v32 = (torch.tensor(x, dtype=torch.float32) for x in (qn, kn, vn))
    mod32 = _mla(
        torch.dot, torch.tensor(qr, dtype=torch.float32), torch.tensor(kr, dtype=torch.float32), H
    )
    torch._dynamo.reset()  # (earlier tests compiled flex_attention: no automatic dynamic shapes)
    compiled = torch.compile(flex.flex_attention, fullgraph=True, dynamic=False)
    out = compiled(q32, k32, v32, score_mod=mod32, block_mask=bm)
    np.testing.assert_allclose(out.numpy(), want, atol=2e-5)


def test_scalar_score_mod_jax():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    B, H, T, D, R = 1, 2, 8, 4, 3
    rng = np.random.default_rng(2)
    qr, kr = rng.standard_normal((B, H, T, R)), rng.standard_normal((B, 1, T, R))
    qn, kn, vn = (rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(3))
    want, _ = oracle.attention(qn, kn, vn, bias=0.5 * np.einsum("bhqr,bkr->bhqk", qr, kr[:, 0]))
    mod = _mla(jnp.dot, jnp.asarray(qr, jnp.float32), jnp.asarray(kr, jnp.float32), H)
    for run in (
        flex.flex_attention,
        jax.jit(lambda q, k, v: flex.flex_attention(q, k, v, score_mod=mod)),
    ):
        args = (jnp.asarray(qn), jnp.asarray(kn), jnp.asarray(vn))
        got = run(*args, score_mod=mod) if run is flex.flex_attention else run(*args)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


class _Mine(Exception):
    pass


def test_user_exception_reaches_the_user(backend):
    """A function that raises: its own exception (type and message) reaches
    the caller, with a note naming the function and the shapes."""

    def raises(b, h, q_idx, kv_idx):
        raise _Mine("my own")

    x = backend.asarray(np.ones((1, 2, 8, 4), "float32"))
    with pytest.raises(_Mine, match="my own") as caught:
        am.dot_product_attention(x, x, x, mask_mod=raises)
    assert any("mask_mod failed on arguments of shapes" in n for n in caught.value.__notes__)
    with pytest.raises(_Mine) as caught:
        flex.flex_attention(x, x, x, score_mod=lambda s, b, h, i, j: raises(b, h, i, j))
    assert any("score_mod" in n and "(1, 2, 8, 8)" in n for n in caught.value.__notes__)


# -- small items -------------------------------------------------------------------------


def test_install_hint_works_from_a_checkout():
    """The hint names the checkout's install (the package is on no index)."""
    from attention_multi import backends

    hint = backends.install_hint("torch")
    assert hint.startswith("pip install '.[torch]'") and "attention-multi[" not in hint


def test_info_flags_an_unknown_backend(tmp_path):
    env = {"ATTENTION_MULTI_BACKEND": "tensorflw", "PATH": "", "HOME": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "attention_multi", "info"], capture_output=True, text=True, env=env
    )
    assert run.returncode == 1
    assert "ATTENTION_MULTI_BACKEND='tensorflw': unknown backend" in run.stdout


def test_report_error_cell_ends_at_the_error():
    from attention_multi.cli.report.run import error_text

    class MXNetError(Exception):
        pass

    exc = MXNetError(
        'Traceback (most recent call last):\n  File "../src/operator/x.cc", line 144\n'
        "MXNetError: Check failed: src.Size() == dst->Size() (6 vs. 7)"
    )
    assert error_text(exc) == "MXNetError: Check failed: src.Size() == dst->Size() (6 vs. 7)"
    assert error_text(ValueError("plain")) == "ValueError: plain"


def test_mxnet_function_building_its_own_arrays():
    """A ``mask_mod`` that builds MXNet arrays in its body runs on an MXNet
    call and on a NumPy one (its answer taken as the call's arrays), with the
    oracle's answer; the block mask is evaluated on MXNet (the framework it
    names)."""
    mx = pytest.importorskip("mxnet")
    seg = np.array([[0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1]])

    def same(b, h, i, j):
        return mx.np.array(seg)[b, i] == mx.np.array(seg)[b, j]

    rng = np.random.default_rng(3)
    qn = rng.standard_normal((2, 1, 8, 4)).astype(np.float32)
    want, _ = oracle.attention(qn, qn, qn, mask_mod=lambda b, h, i, j: seg[b, i] == seg[b, j])
    for x in (qn, mx.np.array(qn)):
        got = am.dot_product_attention(x, x, x, mask_mod=same)
        bm = flex.create_block_mask(same, 2, None, 8, 8, BLOCK_SIZE=4)
        again = flex.flex_attention(x, x, x, block_mask=bm)
        for y in (got, again):
            np.testing.assert_allclose(am.get_backend(y).to_numpy(y), want, atol=2e-6)
