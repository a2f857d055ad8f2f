"""Blocks of one shape on a framework that compiles each new shape (JAX,
``core/paths/fixed_blocks.py``): under ``jax.jit`` the block-sparse path is
a scan over blocks of queries, each a scan over blocks of keys at traced
offsets, so its program does not grow with the length; eagerly, one compiled
kernel per block shape serves every length. Against the float64 oracle,
forward and gradient, with the last block of each axis overlapping the one
before it."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle
from attention_multi.core import attend, make_mask

jax = pytest.importorskip("jax")
jnp = jax.numpy

BATCH, HEADS, D = 2, 2, 8


def _equations(jaxpr):
    """How many equations ``jaxpr`` holds, nested ones included."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _equations(inner)
    return total


def _packed(T, seed=0):
    """(BATCH, T) segment ids: documents of 20 to 200 positions, padding at the end."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(BATCH):
        lengths = []
        while sum(lengths) < T - 10:
            lengths.append(int(rng.integers(20, 200)))
        lengths[-1] -= sum(lengths) - (T - 10)
        rows.append(lengths)
    return np.asarray(am.segments_from_lengths(rows, T))


def _inputs(nq, nk, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((BATCH, HEADS, n, D)).astype(np.float32) for n in (nq, nk, nk)]


def test_jitted_program_does_not_grow_with_the_length():
    """Structural: the jaxpr of the jitted block-sparse path (segment ids as
    an argument, causal), forward and gradient, holds as many equations at
    T=1024 as at T=256 (8 and 2 blocks of 128), and at T=1100 as at T=300
    (blocks overlapping at the end); it held one step per block."""

    def count(T, grad):
        q, k, v = (jnp.asarray(x) for x in _inputs(T, T))
        seg = jnp.asarray(_packed(T))

        def f(q, k, v, s):
            return am.dot_product_attention(q, k, v, segment_ids=s, causal=True)

        def loss(q, k, v, s):
            return (f(q, k, v, s) ** 2).sum()

        fn = jax.grad(loss, argnums=(0, 1, 2)) if grad else f
        return _equations(jax.make_jaxpr(fn)(q, k, v, seg).jaxpr)

    for grad in (False, True):
        assert count(256, grad) == count(1024, grad), grad
        assert count(300, grad) == count(1100, grad), grad


def _traced_case(name, nq, nk):
    """(form built inside the jitted function from its array arguments,
    the arrays, the oracle's keywords)."""
    rng = np.random.default_rng(4)
    ids = np.sort(rng.integers(-1, 3, size=(BATCH, nk)), axis=1).astype(np.int32)
    lens = rng.integers(0, nk + 1, size=(BATCH, nq)).astype(np.int32)
    allowed = rng.random((BATCH, 1, nq, nk)) < 0.7
    bias = rng.standard_normal((1, HEADS, nq, nk)).astype(np.float32)
    if name == "segments-lens-window":
        arrays = {"segment_ids": ids, "valid_lens": lens}
        return arrays, {"causal": True, "window": (5, 2)}
    if name == "mask-bias":
        return {"mask": allowed, "bias": bias}, {}
    if name == "segments-mods":  # (the functions see traced offsets)

        def sink_window(b, h, q, k):
            return ((k <= q + 3) & (q - k <= 6)) | (k < 2)

        def alibi(s, b, h, q, k):
            return s + 0.25 * (h + 1) * (k - q)

        pair = (ids[:, nk - nq :], ids)  # (functions count query 0 as 0: ids of both)
        return {"segment_ids": pair}, {"mask_mod": sink_window, "score_mod": alibi}
    raise ValueError(name)


def _each(fn, x):
    """``fn`` of an array, or of each array of a pair."""
    return tuple(fn(a) for a in x) if isinstance(x, tuple) else fn(x)


def _oracle_keywords(arrays, fixed):
    want = {n: _each(np.asarray, x) for n, x in arrays.items()}
    return {**want, **fixed}


@pytest.mark.parametrize("name", ["segments-lens-window", "mask-bias", "segments-mods"])
def test_jitted_blocks_at_traced_offsets(name):
    """Every form cut at traced offsets (``Mask.block_at``), blocks of 4
    over 11 queries and 14 keys (the last of each overlapping): forward
    and log-sum-exp, and the gradient where the oracle has a formula for it."""
    B = am.get_backend("jax")
    nq, nk = 11, 14
    arrays, fixed = _traced_case(name, nq, nk)
    q, k, v = _inputs(nq, nk, seed=1)
    g = np.random.default_rng(2).standard_normal((BATCH, HEADS, nq, D))

    def out(q, k, v, arrays):
        mask = make_mask(B, BATCH, HEADS, nq, nk, **arrays, **fixed)
        got, _, _, taken = attend(B, q, k, v, mask, path="tiled", chunk_size=4)
        assert taken.family == "tiled"  # (the tiles, or the blocks with a programmable form)
        return got

    def with_lse(q, k, v, arrays):
        mask = make_mask(B, BATCH, HEADS, nq, nk, **arrays, **fixed)
        got, _, lse, _ = attend(B, q, k, v, mask, path="tiled", chunk_size=4, lse=True)
        return got, lse

    jarrays = {n: _each(jnp.asarray, x) for n, x in arrays.items()}
    got = jax.jit(out)(q, k, v, jarrays)
    keywords = _oracle_keywords(arrays, fixed)
    if "score_mod" in keywords:
        keywords["score_mod"] = lambda s, b, h, q, k: s + 0.25 * (h + 1) * (k - q)
    want, _, want_lse = oracle.attention(q, k, v, return_lse=True, **keywords)
    np.testing.assert_allclose(np.asarray(got), want, rtol=3e-5, atol=3e-5)
    got, lse = jax.jit(with_lse)(q, k, v, jarrays)
    np.testing.assert_allclose(np.asarray(got), want, rtol=3e-5, atol=3e-5)
    np.testing.assert_allclose(
        np.asarray(lse).reshape(want_lse.shape), want_lse, rtol=3e-5, atol=3e-5
    )
    if "score_mod" in keywords:
        return

    def loss(q, k, v, arrays):
        return (out(q, k, v, arrays) * jnp.asarray(g, jnp.float32)).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, jarrays)
    wants = oracle.attention_gradients(q, k, v, g, **keywords)[:3]
    for n, a, b in zip("qkv", grads, wants):
        np.testing.assert_allclose(np.asarray(a), b, rtol=2e-4, atol=2e-5, err_msg=n)


def test_eager_kernel_is_reused_by_a_new_length():
    """Eager, the block-sparse path's kernel is compiled once per block
    shape: a call at a new length (blocks of 128, the last overlapping)
    compiles no kernel again, and each answer is the oracle's."""
    from attention_multi.core.paths import blocked, online
    from attention_multi.core.paths.call import Call, Options

    B = am.get_backend("jax")
    sizes = []
    for T in (300, 330):
        q, k, v = _inputs(T, T, seed=T)
        ids = _packed(T, seed=T)
        mask = make_mask(B, BATCH, HEADS, T, T, segment_ids=jnp.asarray(ids), causal=True)
        call = Call(B, *(jnp.asarray(x) for x in (q, k, v)), mask, D**-0.5, Options(path="tiled"))
        got = blocked.run(call, blocked.plan(call)).output
        want, _ = oracle.attention(q, k, v, segment_ids=ids, causal=True)
        np.testing.assert_allclose(np.asarray(got), want, rtol=3e-5, atol=3e-5)
        sizes.append(online.compiled_step(B, "float32")._cache_size())
    assert sizes[0] >= 1
    assert sizes[1] == sizes[0]


def _compilations(fn):
    """``fn()`` and how many programs JAX compiled for it."""
    import logging

    messages = []

    class Count(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Compiling "):
                messages.append(record)

    log, handler = logging.getLogger("jax"), Count()
    log.addHandler(handler)
    try:
        with jax.log_compiles():
            out = fn()
            jax.block_until_ready(out[0])
    finally:
        log.removeHandler(handler)
    return out, len(messages)


@pytest.mark.parametrize("form", ["segment_ids", "mask_mod"])
def test_first_eager_call_compiles_few_programs(form):
    """Eager, the first block-sparse call at a new shape compiles the
    function's operations once per grid it needs, not the index grids (made
    on the host) nor a dense mask for the keys no query sees (the block
    states' evaluation tells them, or one sum checks the keys are finite):
    22 programs with a mask function and 29 with segment ids here, where
    42 and 42 were (JAX 0.6.2 and 0.10.2). The answer is the oracle's."""
    T, d = 293, 5  # (shapes no other test of this file compiles)
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((BATCH, HEADS, T, d)).astype(np.float32) for _ in "qkv")
    ids = _packed(T, seed=7)
    window = 90

    def local(b, h, i, j):
        return (j <= i) & (i - j < window)

    forms = {"segment_ids": jnp.asarray(ids), "causal": True}
    same = {"segment_ids": ids, "causal": True}
    if form == "mask_mod":
        forms = same = {"mask_mod": local}
    B = am.get_backend("jax")
    mask = make_mask(B, BATCH, HEADS, T, T, **forms)
    args = [jnp.asarray(x) for x in (q, k, v)]
    (got, _, _, taken), count = _compilations(lambda: attend(B, *args, mask, path="tiled"))
    assert taken == "blocked"
    want, _ = oracle.attention(q, k, v, **same)
    np.testing.assert_allclose(np.asarray(got), want, rtol=3e-5, atol=3e-5)
    assert count <= 34, count


def test_eager_chunked_steps_are_one_compiled_call():
    """Eager, each online-softmax step of the chunked path is one call of the
    step compiled per block shape: a call at a new length with blocks of the
    same shape compiles no step again; with a mask function and with segment
    ids, each answer the oracle's."""
    from attention_multi.core.paths import online

    B = am.get_backend("jax")
    step = online.compiled_step(B, "float32")
    sizes = [step._cache_size()]
    for T in (192, 256, 320):
        q, k, v = _inputs(T, T, seed=T)
        ids = _packed(T, seed=T)
        doc = jnp.asarray(ids)
        forms = (
            ({"segment_ids": doc}, {"segment_ids": ids}),
            (
                {"mask_mod": lambda b, h, i, j, d=doc: d[b, i] == d[b, j]},
                {"mask_mod": lambda b, h, i, j, d=ids: d[b, i] == d[b, j]},
            ),
        )
        for form, same in forms:
            mask = make_mask(B, BATCH, HEADS, T, T, **form)
            args = (jnp.asarray(x) for x in (q, k, v))
            got, _, _, taken = attend(B, *args, mask, path="chunked", chunk_size=64)
            assert taken == "chunked"
            want, _ = oracle.attention(q, k, v, **same)
            np.testing.assert_allclose(np.asarray(got), want, rtol=3e-5, atol=3e-5)
        sizes.append(step._cache_size())
    assert sizes[1] > sizes[0] and sizes[2] == sizes[3], sizes


def test_block_mask_of_a_traced_function_says_so():
    """A ``mask_mod`` whose answers are traced (it captures an array of a
    ``jax.jit`` trace) has no block states to build: ``block_mask`` says why
    and what to do; passed as ``mask_mod=`` it still gives the oracle's answer."""
    T = 96
    q, k, v = _inputs(T, T)
    ids = _packed(T)

    def build(doc):
        mod = lambda b, h, i, j: doc[b, i] == doc[b, j]  # noqa: E731
        return am.block_mask(mod, BATCH, 1, T, T, block=32, backend="jax")

    with pytest.raises(ValueError, match="traced.*outside the trace"):
        jax.jit(build)(jnp.asarray(ids))

    def out(doc):
        mod = lambda b, h, i, j: doc[b, i] == doc[b, j]  # noqa: E731
        args = (jnp.asarray(x) for x in (q, k, v))
        return am.dot_product_attention(*args, mask_mod=mod)

    want, _ = oracle.attention(q, k, v, mask_mod=lambda b, h, i, j: ids[b, i] == ids[b, j])
    got = jax.jit(out)(jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(got), want, rtol=3e-5, atol=3e-5)


def test_jitted_gradient_holds_one_row_of_blocks():
    """The compiled gradient's temporaries grow with T, not T**2 or T**3:
    each row of blocks is recomputed in the backward pass from its start,
    and its blocks of keys are cut outside the cond (through the cond, the
    whole keys and values were kept per step: 9.4 GB at B=4, T=2048)."""

    def temporaries(T):
        q, k, v = (jnp.asarray(x[:1, :1]) for x in _inputs(T, T))
        seg = jnp.asarray(_packed(T)[:1])

        def loss(q, k, v, s):
            return (am.dot_product_attention(q, k, v, segment_ids=s, causal=True) ** 2).sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, seg).compile()
        return grad.memory_analysis().temp_size_in_bytes

    small, large = temporaries(512), temporaries(2048)
    assert large < 8 * small, (small, large)


def test_jitted_blocks_keep_nan_of_unseen_keys_out():
    """NaN in the keys and values of padding (segment -1, seen by nobody)
    stays out of the output and the gradients under ``jax.jit``: each block
    zeroes the keys none of its queries sees (``rules.guard_block``), with no
    mask of the whole call."""
    B = am.get_backend("jax")
    T = 13
    ids = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, -1, -1, -1, -1]] * BATCH, np.int32)
    q, k, v = _inputs(T, T, seed=3)
    k[:, :, -2:] = np.nan
    v[:, :, -3:] = np.nan

    def loss(q, k, v, s):
        mask = make_mask(B, BATCH, HEADS, T, T, segment_ids=s, causal=True)
        out = attend(B, q, k, v, mask, path="tiled", chunk_size=4)[0]
        return (out**2).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v, jnp.asarray(ids)
    )
    want, _ = oracle.attention(q, np.nan_to_num(k), np.nan_to_num(v), segment_ids=ids, causal=True)
    np.testing.assert_allclose(np.asarray(out), want, rtol=3e-5, atol=3e-5)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
