"""Peer parity of the programmable forms: the same ``mask_mod``/``score_mod``
through torch's ``flex_attention`` (compiled, CPU; one compilation for every
case: the cases differ only in the values of tensors the functions close
over), and ``segment_ids`` against ``jax.nn.dot_product_attention`` and
torch SDPA given the equivalent dense mask. Each case prints its max error
(``pytest -s``)."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import segments_from_lengths

B, H, T, D = 2, 4, 256, 16
LENGTHS = [[40, 100, 70, 46], [128, 60, 68]]


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(B, H, T, D)).astype(np.float32) for _ in range(3)]


def _report(name, got, want, tol):
    err = float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())
    print(f"peer {name}: max error {err:.3g}")
    assert err <= tol, (name, err)


def test_flex_attention_parity():
    torch = pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    doc = torch.tensor(segments_from_lengths(LENGTHS, T), dtype=torch.int32)
    # the control tensors of one function pair that expresses every case
    ctl = {
        n: torch.zeros((), dtype=torch.int32)
        for n in ("use_doc", "prefix", "window", "sinks", "alibi")
    }
    cap = torch.zeros(())
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(H)])

    def mask_mod(b, h, q_idx, kv_idx):
        same = (doc[b, q_idx] == doc[b, kv_idx]) | (ctl["use_doc"] == 0)
        causal = (kv_idx <= q_idx) | (kv_idx < ctl["prefix"])
        near = (q_idx - kv_idx <= ctl["window"]) | (kv_idx < ctl["sinks"])
        return same & causal & near

    def score_mod(score, b, h, q_idx, kv_idx):
        score = score + ctl["alibi"] * slopes[h] * (kv_idx - q_idx)
        return torch.where(cap > 0, cap * torch.tanh(score / torch.clamp(cap, min=1e-6)), score)

    compiled = torch.compile(flex.flex_attention)
    q, k, v = (torch.tensor(x) for x in _data())
    cases = {
        "document masking": dict(use_doc=1, window=T),
        "prefix-LM": dict(prefix=64, window=T),
        "sliding window with sink tokens": dict(window=32, sinks=4),
        "ALiBi": dict(alibi=1, window=T),
        "soft-capping": dict(window=T, cap=5.0),
    }
    for name, values in cases.items():
        for n, t in ctl.items():
            t.fill_(values.get(n, 0))
        cap.fill_(values.get("cap", 0.0))
        block = flex.create_block_mask(mask_mod, B, None, T, T, device="cpu")
        want = compiled(q, k, v, score_mod=score_mod, block_mask=block)
        got = am.dot_product_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
        _report(f"flex_attention {name}", got, want, 1e-5)
        built = am.block_mask(mask_mod, B, 1, T, T, block=128, backend="torch")
        got = am.dot_product_attention(q, k, v, mask_mod=built, score_mod=score_mod)
        _report(f"flex_attention {name} (our BlockMask)", got, want, 1e-5)


def _dense(ids, causal):
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
    if causal:
        same = same & np.tril(np.ones((T, T), bool))
    return same


@pytest.mark.parametrize("causal", [False, True])
def test_segments_against_sdpa(causal):
    torch = pytest.importorskip("torch")
    ids = segments_from_lengths([[40, 100, 70], [128, 60, 68]], T)  # row 0 ends with padding
    dense = _dense(ids, causal)
    dense[~dense.any(-1)] = True  # (SDPA gives NaN on empty rows; ours gives zeros)
    q, k, v = (torch.tensor(x) for x in _data(1))
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.tensor(dense[:, None])
    ).numpy()
    rows = ids >= 0
    got = am.dot_product_attention(q, k, v, segment_ids=torch.tensor(ids), causal=causal)
    got = got.numpy()
    _report(
        "torch SDPA segment_ids",
        got[rows[:, None].repeat(H, 1)],
        want[rows[:, None].repeat(H, 1)],
        1e-5,
    )
    assert (got[~rows[:, None].repeat(H, 1)] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_segments_against_jax(causal):
    jax = pytest.importorskip("jax")
    ids = segments_from_lengths([[40, 100, 70], [128, 60, 68]], T)
    dense = _dense(ids, causal)
    dense[~dense.any(-1)] = True
    q, k, v = (jax.numpy.asarray(x.transpose(0, 2, 1, 3)) for x in _data(2))  # (B, T, H, D)
    want = jax.nn.dot_product_attention(q, k, v, mask=jax.numpy.asarray(dense[:, None]))
    want = np.asarray(want).transpose(0, 2, 1, 3)
    qh, kh, vh = (jax.numpy.transpose(x, (0, 2, 1, 3)) for x in (q, k, v))
    got = np.asarray(
        am.dot_product_attention(qh, kh, vh, segment_ids=jax.numpy.asarray(ids), causal=causal)
    )
    rows = np.repeat((ids >= 0)[:, None], H, 1)
    _report("jax.nn.dot_product_attention segment_ids", got[rows], want[rows], 1e-5)
    assert (got[~rows] == 0).all()
