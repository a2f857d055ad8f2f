"""The masks and score functions of a public FlexAttention collection
(meta-pytorch/attention-gym), written here from their definitions (not its
code), run through ``attention_multi.flex`` as its scripts would with the
import changed: each agrees with the float64 oracle forward, and backward
with torch's eager SDPA on the dense mask (float64 autograd); one test
compares with torch's own compiled ``flex_attention`` (forward: its only
CPU mode) within 1e-5. Small shapes: T = 64, two heads."""

from __future__ import annotations

import numpy as np
import pytest

from attention_multi import flex
from attention_multi import reference as oracle

torch = pytest.importorskip("torch")
tf = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, T, D = 2, 2, 64, 8
LENGTHS = [20, 13, 31]  # (packed documents)
OFFSETS = torch.tensor(np.cumsum([0, *LENGTHS]), dtype=torch.int64)
DOC = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(w):
    return flex.and_masks(lambda b, h, q, kv: q - kv <= w, causal)


def prefix_lm(n):
    return flex.or_masks(lambda b, h, q, kv: kv < n, causal)


def document(inner):
    def doc_mask(b, h, q_idx, kv_idx):
        same = DOC[q_idx] == DOC[kv_idx]
        q_at, kv_at = q_idx - OFFSETS[DOC[q_idx]], kv_idx - OFFSETS[DOC[kv_idx]]
        return same & inner(b, h, q_at, kv_at)

    return doc_mask


def dilated(window, dilation):
    def mask(b, h, q_idx, kv_idx):
        d = (q_idx - kv_idx).abs()
        return (d <= window) & (d % dilation == 0)

    return mask


def natten(width, height, kw, kh):
    def mask(b, h, q_idx, kv_idx):
        qx, qy = q_idx // width, q_idx % width
        kx, ky = kv_idx // width, kv_idx % width
        cx = qx.clamp(kw // 2, (width - 1) - kw // 2)
        cy = qy.clamp(kh // 2, (height - 1) - kh // 2)
        return ((cx - kx).abs() <= kw // 2) & ((cy - ky).abs() <= kh // 2)

    return mask


def shared_prefix(prefix_of):
    prefix_of = torch.tensor(prefix_of)

    def mask(b, h, q_idx, kv_idx):
        doc = DOC[q_idx]
        start, prefix = OFFSETS[doc], prefix_of[doc]
        own = (kv_idx >= start) & causal(b, h, q_idx, kv_idx)
        shared = (doc != prefix) & (kv_idx >= OFFSETS[prefix]) & (kv_idx < OFFSETS[prefix + 1])
        return own | shared

    return mask


def global_window(w, marks):
    is_global = torch.zeros(T, dtype=torch.bool)
    is_global[marks] = True
    return flex.or_masks(
        lambda b, h, q, kv: (q - kv).abs() <= w, lambda b, h, q, kv: is_global[q] | is_global[kv]
    )


def block_diffusion(n, size):
    def mask(b, h, q_idx, kv_idx):
        qn, kn = q_idx < n, kv_idx < n
        qb, kb = (q_idx % n) // size, (kv_idx % n) // size
        diagonal = (qb == kb) & (qn == kn)
        offset = (qb > kb) & qn & ~kn
        block_causal = (qb >= kb) & ~qn & ~kn
        return diagonal | offset | block_causal

    return mask


def flamingo(intervals, tokens):
    intervals = torch.tensor(intervals)
    image = torch.repeat_interleave(torch.arange(len(intervals)), tokens)

    def mask(b, h, q_idx, kv_idx):  # (interval[0]: scalar indices, FlexAttention's vmap)
        interval = intervals[image[kv_idx]]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    return mask


def vsa_topk(topk, tile):
    def mask(b, h, q_idx, kv_idx):
        picked = topk[b, h, q_idx // tile]
        return (picked == (kv_idx // tile).unsqueeze(-1)).any(dim=-1)

    return mask


TOPK = torch.stack([torch.randperm(4)[:2] for _ in range(B * H * 4)]).reshape(B, H, 4, 2)

MASKS = {
    "causal": causal,
    "sliding_window": sliding_window(7),
    "prefix_lm": prefix_lm(10),
    "document_causal": document(causal),
    "document": document(flex.noop_mask),
    "dilated_sliding": dilated(12, 3),
    "natten": natten(8, 8, 3, 3),
    "shared_prefix": shared_prefix([0, 0, 2]),
    "global_sliding": global_window(3, [0, 33]),
    "block_diffusion": block_diffusion(32, 8),
    "flamingo": flamingo([[0, 20], [10, 64]], 32),
    "vsa_topk": vsa_topk(TOPK, 16),
}


def alibi(score, b, h, q_idx, kv_idx):
    return score + (kv_idx - q_idx) * torch.exp2(-((h + 1) * 8.0 / H))


def softcap(score, b, h, q_idx, kv_idx):
    return 5.0 * torch.tanh(score / 5.0)


REL = torch.randn(2 * T - 1, dtype=torch.float64)


def relative(score, b, h, q_idx, kv_idx):
    return score + REL[q_idx - kv_idx + T - 1]


QR, KR = torch.randn(B, H, T, 4, dtype=torch.float64), torch.randn(B, 1, T, 4, dtype=torch.float64)


def mla_rope(score, b, h, q_idx, kv_idx):  # (torch.dot: scalar indices)
    return score + 0.5 * torch.dot(QR[b, h, q_idx], KR[b, h // H, kv_idx])


SCORES = {"alibi": alibi, "tanh_softcap": softcap, "relative": relative, "mla_rope": mla_rope}


def _grid():
    return (
        torch.arange(B).view(B, 1, 1, 1),
        torch.arange(H).view(1, H, 1, 1),
        torch.arange(T).view(1, 1, T, 1),
        torch.arange(T).view(1, 1, 1, T),
    )


def _dense_mask(mask_mod):
    """The function's (B, H, T, T) booleans, element by element (torch.vmap, its definition)."""
    b, h, q, kv = (x.expand(B, H, T, T).reshape(-1) for x in _grid())
    return torch.vmap(mask_mod)(b, h, q, kv).reshape(B, H, T, T)


def _dense_scores(score_mod, s):
    b, h, q, kv = (x.expand(B, H, T, T).reshape(-1) for x in _grid())
    return torch.vmap(score_mod)(s.reshape(-1), b, h, q, kv).reshape(B, H, T, T)


def _inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]


def _eager(q, k, v, mask=None, score_mod=None):
    """torch's eager attention on the dense mask and scores (float64), zeros for
    a row that sees nothing."""
    s = q @ k.transpose(-1, -2) / D**0.5
    if score_mod is not None:
        s = _dense_scores(score_mod, s)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v


@pytest.mark.parametrize("name", sorted(MASKS))
def test_gym_mask(name):
    """Each mask through ``create_block_mask`` and ``flex_attention``: the
    oracle's output on the dense mask, gradients as torch's eager attention."""
    mask_mod = MASKS[name]
    dense = _dense_mask(mask_mod)
    bm = flex.create_block_mask(mask_mod, B, H, T, T, device="cpu", BLOCK_SIZE=16)
    theirs = tf.create_block_mask(mask_mod, B, H, T, T, device="cpu", BLOCK_SIZE=16)
    np.testing.assert_array_equal(bm.to_dense(), theirs.to_dense().numpy())
    q, k, v = _inputs()
    out = flex.flex_attention(q, k, v, block_mask=bm)
    want, _ = oracle.attention(*(x.detach().numpy() for x in (q, k, v)), mask=dense.numpy())
    np.testing.assert_allclose(out.detach().numpy(), want, atol=1e-12)
    probe = torch.randn(out.shape, dtype=torch.float64)
    got = torch.autograd.grad((out * probe).sum(), (q, k, v))
    ref = torch.autograd.grad((_eager(q, k, v, dense) * probe).sum(), (q, k, v))
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-11)


@pytest.mark.parametrize("name", sorted(SCORES))
def test_gym_score_mod(name):
    """Each score function (with the document-causal block mask): the oracle's
    output, gradients as torch's eager attention's (the captured table's too)."""
    score_mod, mask_mod = SCORES[name], MASKS["document_causal"]
    dense = _dense_mask(mask_mod)
    bm = flex.create_block_mask(mask_mod, None, None, T, T, device="cpu", BLOCK_SIZE=16)
    q, k, v = _inputs(1)
    out = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    s = _dense_scores(score_mod, (q @ k.transpose(-1, -2) / D**0.5).detach())
    bias = (s - (q @ k.transpose(-1, -2)).detach() / D**0.5).numpy()
    if name == "tanh_softcap":
        want = _eager(q, k, v, dense, score_mod).detach().numpy()  # (not additive)
    else:
        want, _ = oracle.attention(
            *(x.detach().numpy() for x in (q, k, v)), mask=dense.numpy(), bias=bias
        )
    np.testing.assert_allclose(out.detach().numpy(), want, atol=1e-12)
    probe = torch.randn(out.shape, dtype=torch.float64)
    got = torch.autograd.grad((out * probe).sum(), (q, k, v))
    ref = torch.autograd.grad((_eager(q, k, v, dense, score_mod) * probe).sum(), (q, k, v))
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-11)


def test_gym_shared_prefix_split_with_return_aux():
    """The collection's shared-prefix example: a response attending to its
    prefix and to itself in two calls merged by their ``lse``
    (``return_aux=AuxRequest(lse=True)``) equals one causal call over the
    prefix and the response."""
    q, k, v = (torch.randn(1, 2, 9, 16, dtype=torch.float64) for _ in range(3))
    prefix, aux_req = slice(0, 3), flex.AuxRequest(lse=True)
    for response in (slice(3, 5), slice(5, 7), slice(7, 9)):
        rq, rk, rv = (x[:, :, response] for x in (q, k, v))
        pk, pv = k[:, :, prefix], v[:, :, prefix]
        n = rq.shape[2]
        bm = flex.create_block_mask(causal, 1, 1, n, n, device="cpu", BLOCK_SIZE=128)
        a, aux_a = flex.flex_attention(rq, pk, pv, return_aux=aux_req)
        b, aux_b = flex.flex_attention(rq, rk, rv, block_mask=bm, return_aux=aux_req)
        top = torch.maximum(aux_a.lse, aux_b.lse)
        wa, wb = (torch.exp(x.lse - top)[..., None] for x in (aux_a, aux_b))
        merged = (a * wa + b * wb) / (wa + wb)
        idx = list(range(3)) + list(range(response.start, response.stop))
        lq, lk, lv = (x[:, :, idx] for x in (q, k, v))
        m = len(idx)
        full = flex.create_block_mask(causal, 1, 1, m, m, device="cpu", BLOCK_SIZE=128)
        want, _ = flex.flex_attention(lq, lk, lv, block_mask=full, return_aux=aux_req)
        torch.testing.assert_close(merged, want[:, :, 3:], atol=1e-12, rtol=1e-12)


def test_gym_against_torch_compiled_flex():
    """torch's own compiled ``flex_attention`` (CPU: forward only) and ours
    agree within 1e-5 in float32: a causal block mask with ALiBi, a sliding
    window with a tanh soft-cap. (torch 2.13's CPU kernel fails to build for
    block masks whose function captures tensors or whose partial tables are
    empty: those are compared with the oracle above.)"""
    q, k, v = (x.detach().float() for x in _inputs(2))
    compiled = torch.compile(tf.flex_attention)
    cases = [
        (tf.create_block_mask(causal, None, None, T, T, device="cpu", BLOCK_SIZE=16), alibi),
        (tf.create_block_mask(sliding_window(9), None, None, T, T, device="cpu"), softcap),
    ]
    for bm, score_mod in cases:
        theirs = compiled(q, k, v, score_mod=score_mod, block_mask=bm)
        ours = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        mask_mod = bm.mask_mod
        own = flex.create_block_mask(mask_mod, None, None, T, T, device="cpu", BLOCK_SIZE=16)
        again = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=own)
        torch.testing.assert_close(again, theirs, atol=1e-5, rtol=1e-5)
