"""Peer parity: our masking forms against the frameworks' own attention where
they have the same feature: torch ``F.scaled_dot_product_attention`` and
``nn.MultiheadAttention``, ``jax.nn.dot_product_attention``. Each case prints
its max error (``pytest -s``)."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import reference as oracle

B, H, Q, K, D = 2, 4, 5, 7, 8


def _report(name, got, want, tol):
    err = float(np.abs(_np(got) - _np(want)).max())
    print(f"peer {name}: max error {err:.3g}")
    assert err <= tol, (name, err)


def _np(x):
    x = x.detach() if hasattr(x, "detach") else x
    return np.asarray(x, np.float64)


def _every_path(name, q, k, v, want, tol, **forms):
    """Ours on each path (the public call may take the peer's own kernel)
    against the peer's output."""
    from attention_multi.core import attend, make_mask
    from attention_multi.core.checks import backend_of

    Bk = backend_of(q=q)
    m = make_mask(
        Bk, q.shape[0], q.shape[1], q.shape[2], k.shape[2], dtype=Bk.dtype_name(q), **forms
    )
    for path in ("full", "chunked", "tiled"):
        out, _, _, taken = attend(Bk, q, k, v, m, path=path, chunk_size=3)
        assert taken == path
        _report(f"{name} [{path} path]", out, want, tol)


def _data(seed=0, kv=H, q=Q, k=K):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(B, H, q, D)),
        rng.normal(size=(B, kv, k, D)),
        rng.normal(size=(B, kv, k, D)),
        rng,
    )


def _some_mask(rng, shape):
    m = rng.random(shape) < 0.6
    m[..., 0] = True  # every row sees a key (SDPA gives NaN otherwise)
    return m


# -- torch --------------------------------------------------------------------------------


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_sdpa(torch, dtype):
    F = torch.nn.functional
    tol = 2e-6 if dtype == "float32" else 1e-12
    q, k, v, rng = _data()
    t = [torch.tensor(x, dtype=getattr(torch, dtype)) for x in (q, k, v)]
    mask = _some_mask(rng, (B, 1, Q, K))
    bias = rng.normal(size=(B, H, Q, K))
    tm, tb = torch.tensor(mask), torch.tensor(bias, dtype=getattr(torch, dtype))
    _report(
        f"torch sdpa attn_mask bool {dtype}",
        am.dot_product_attention(*t, mask=tm),
        F.scaled_dot_product_attention(*t, attn_mask=tm),
        tol,
    )
    _report(
        f"torch sdpa attn_mask float {dtype}",
        am.dot_product_attention(*t, bias=tb),
        F.scaled_dot_product_attention(*t, attn_mask=tb),
        tol,
    )
    want = F.scaled_dot_product_attention(*t, attn_mask=tb.masked_fill(~tm, float("-inf")))
    _report(
        f"torch sdpa mask+bias {dtype}", am.dot_product_attention(*t, mask=tm, bias=tb), want, tol
    )
    _every_path(f"torch sdpa mask+bias {dtype}", *t, want, tol, mask=tm, bias=tb)
    sq = [x[:, :, :K] for x in t]
    sq[0] = torch.tensor(_data(1, q=K)[0], dtype=getattr(torch, dtype))
    _report(
        f"torch sdpa is_causal (Q == K) {dtype}",
        am.dot_product_attention(*sq, causal=True),
        F.scaled_dot_product_attention(*sq, is_causal=True),
        tol,
    )
    # Q < K: ours is bottom-right; torch's is_causal is top-left, so compare
    # with its explicit bottom-right mask
    bottom_right = torch.ones(Q, K, dtype=torch.bool).tril(diagonal=K - Q)
    want = F.scaled_dot_product_attention(*t, attn_mask=bottom_right)
    _report(
        f"torch sdpa causal bottom-right {dtype}",
        am.dot_product_attention(*t, causal=True),
        want,
        tol,
    )
    _every_path(f"torch sdpa causal bottom-right {dtype}", *t, want, tol, causal=True)
    q, k, v, rng = _data(2, kv=2)
    g = [torch.tensor(x, dtype=getattr(torch, dtype)) for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*g, attn_mask=tm, enable_gqa=True)
    _report(f"torch sdpa enable_gqa {dtype}", am.dot_product_attention(*g, mask=tm), want, tol)
    _every_path(f"torch sdpa enable_gqa {dtype}", *g, want, tol, mask=tm)


def test_torch_multihead_attention(torch):
    """nn.MultiheadAttention with key_padding_mask and attn_mask (True = masked
    there: ours is its negation), its weights copied into ours."""
    torch.manual_seed(0)
    E, heads = 8, 2
    peer = torch.nn.MultiheadAttention(E, heads, bias=True, batch_first=True).double().eval()
    w, b = peer.in_proj_weight.detach().numpy(), peer.in_proj_bias.detach().numpy()
    params = {
        "W_o.weight": peer.out_proj.weight.detach().numpy(),
        "W_o.bias": peer.out_proj.bias.detach().numpy(),
    }
    for i, c in enumerate("qkv"):
        params[f"W_{c}.weight"], params[f"W_{c}.bias"] = (
            w[i * E : (i + 1) * E],
            b[i * E : (i + 1) * E],
        )
    mine = am.set_params(
        am.MultiHeadAttention(E, E, E, E, heads, 0.0, bias=True, backend="torch", dtype="float64"),
        params,
    )
    rng = np.random.default_rng(3)
    x = torch.tensor(rng.normal(size=(B, Q, E)))
    mem = torch.tensor(rng.normal(size=(B, K, E)))
    padding = torch.tensor([[False] * K, [False] * 4 + [True] * 3])  # True = ignore
    attn = torch.tensor(rng.random((Q, K)) < 0.3)
    attn[:, 0] = False
    want, weights = peer(
        x, mem, mem, key_padding_mask=padding, attn_mask=attn, average_attn_weights=False
    )
    got = mine(x, mem, mem, mask=~padding[:, None, :] & ~attn[None])
    _report(
        "torch nn.MultiheadAttention key_padding_mask+attn_mask", got.detach(), want.detach(), 1e-12
    )
    _report(
        "torch nn.MultiheadAttention weights",
        mine.attention_weights.detach(),
        weights.detach().reshape(B * heads, Q, K),
        1e-12,
    )
    lens = torch.tensor([K, 4])  # d2l's valid_lens = the same padding
    _report(
        "torch nn.MultiheadAttention key_padding_mask vs valid_lens",
        mine(x, mem, mem, lens).detach(),
        peer(x, mem, mem, key_padding_mask=padding)[0].detach(),
        1e-12,
    )
    causal = torch.ones(Q, Q, dtype=torch.bool).triu(1)  # True = masked
    _report(
        "torch nn.MultiheadAttention is_causal",
        mine(x, x, x, causal=True).detach(),
        peer(x, x, x, attn_mask=causal, is_causal=True)[0].detach(),
        1e-12,
    )


# -- jax -------------------------------------------------------------------------------------


def _jax_layout(x):  # ours (batch, heads, n, d) -> jax's (batch, n, heads, d)
    return np.swapaxes(x, 1, 2)


def test_jax_dot_product_attention():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    peer = jax.nn.dot_product_attention
    q, k, v, rng = _data(4)
    a = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    p = [jnp.asarray(_jax_layout(x), jnp.float32) for x in (q, k, v)]

    def ours(*args, **kw):
        return _jax_layout(np.asarray(am.dot_product_attention(*args, **kw)))

    mask = _some_mask(rng, (B, 1, Q, K))
    bias = rng.normal(size=(B, H, Q, K)).astype(np.float32)
    want = peer(*p, mask=jnp.asarray(mask))
    _report("jax mask", ours(*a, mask=jnp.asarray(mask)), want, 2e-6)
    _every_path("jax mask", *a, _jax_layout(np.asarray(want)), 2e-6, mask=jnp.asarray(mask))
    want = peer(*p, bias=jnp.asarray(bias))
    _report("jax bias", ours(*a, bias=jnp.asarray(bias)), want, 2e-6)
    _every_path("jax bias", *a, _jax_layout(np.asarray(want)), 2e-6, bias=jnp.asarray(bias))
    lens = np.array([7, 3])
    _report(
        "jax key_value_seq_lengths",
        ours(*a, jnp.asarray(lens)),
        peer(*p, key_value_seq_lengths=jnp.asarray(lens, jnp.int32)),
        2e-6,
    )
    sq = [x[:, :, :Q] for x in a]
    _report(
        "jax is_causal (Q == K)",
        ours(*sq, causal=True),
        peer(*[x[:, :Q] for x in p], is_causal=True),
        2e-6,
    )
    # jax 0.6.2 ignores local_window_size unless another mask is given: give one
    full = jnp.ones((B, 1, Q, Q), bool)
    _report(
        "jax local_window_size (3, 1) with a mask",
        ours(*sq, window=(3, 1)),
        peer(*[x[:, :Q] for x in p], mask=full, local_window_size=(3, 1)),
        2e-6,
    )
    want, _ = oracle.attention(q, k, v, window=(2, 0))
    _report(
        "jax window (2, 0), K > Q, vs the oracle", ours(*a, window=(2, 0)), _jax_layout(want), 2e-6
    )
    q, k, v, rng = _data(5, kv=2)
    g = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    _report(
        "jax grouped-query heads",
        ours(*g, mask=jnp.asarray(mask)),
        peer(
            *[jnp.asarray(_jax_layout(x), jnp.float32) for x in (q, k, v)], mask=jnp.asarray(mask)
        ),
        2e-6,
    )
