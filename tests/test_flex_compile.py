"""``torch.compile(fullgraph=True)`` with every mask form at a length where
the tiled and block-sparse paths run (T=256: before c5330e8 their
``fewer_threads``, a ``cached_property``, broke dynamo with its lock), one
graph for three calls of one shape (no recompile), and the answers the
float64 oracle gives. ``aot_eager`` traces as inductor does without
generating code (T = 64 ... 4096 with inductor: measured in issue 62's note).
The first stack only: torch is the same release on both."""

import numpy as np
import pytest

import attention_multi as am
from attention_multi import flex
from attention_multi import reference as oracle

torch = pytest.importorskip("torch")
from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

B, H, T, D = 2, 2, 256, 16
DOC = np.repeat(np.arange(4), T // 4)
LENS = np.array([T // 3, T])
RNG = np.random.default_rng(0)
BOOL = RNG.random((B, 1, T, T)) > 0.3
BIAS = 0.1 * RNG.standard_normal((1, H, T, T))
CAUSAL = np.tril(np.ones((T, T), bool))
SAME_DOC = (DOC[:, None] == DOC[None, :]) & CAUSAL
BLOCK0 = np.zeros((T, T), bool)
BLOCK0[:, :128] = True  # (the tables below: key block 0 only)


def _doc_causal(doc):
    return lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j)


def _forms():
    """name -> (call of (q, k, v), the allowed (B|1, H|1, T, T) keys, bias, softcap)."""
    doc, lens = torch.tensor(DOC), torch.tensor(LENS)
    ids = torch.stack([doc, doc])
    boolean, bias = torch.tensor(BOOL), torch.tensor(BIAS, dtype=torch.float32)
    ours = flex.create_block_mask(_doc_causal(doc), None, None, T, T, device="cpu")
    theirs = create_block_mask(_doc_causal(doc), None, None, T, T, device="cpu")
    n = T // 128
    tables = TorchBlockMask.from_kv_blocks(
        torch.ones(1, 1, n, dtype=torch.int32), torch.zeros(1, 1, n, n, dtype=torch.int32)
    )
    by_lens = np.arange(T)[None, :] < LENS[:, None]
    window = CAUSAL & (np.arange(T)[:, None] - np.arange(T)[None, :] <= 32)

    def softcap(s, b, h, i, j):
        return 20 * torch.tanh(s / 20)

    dpa, fa = am.dot_product_attention, flex.flex_attention
    return {
        "valid_lens": (lambda q, k, v: dpa(q, k, v, valid_lens=lens), by_lens[:, None, None]),
        "causal": (lambda q, k, v: dpa(q, k, v, causal=True), CAUSAL),
        "window": (lambda q, k, v: dpa(q, k, v, causal=True, window=(32, 0)), window),
        "mask": (lambda q, k, v: dpa(q, k, v, mask=boolean), BOOL),
        "bias": (lambda q, k, v: dpa(q, k, v, bias=bias), None),
        "segment_ids": (lambda q, k, v: dpa(q, k, v, segment_ids=ids, causal=True), SAME_DOC),
        "mask_mod": (lambda q, k, v: dpa(q, k, v, mask_mod=_doc_causal(doc)), SAME_DOC),
        "score_mod": (lambda q, k, v: fa(q, k, v, score_mod=softcap), None),
        "our BlockMask": (lambda q, k, v: fa(q, k, v, block_mask=ours), SAME_DOC),
        "torch's BlockMask": (lambda q, k, v: fa(q, k, v, block_mask=theirs), SAME_DOC),
        "torch's block tables": (lambda q, k, v: fa(q, k, v, block_mask=tables), BLOCK0),
    }


@pytest.mark.parametrize("form", list(_forms()))
def test_fullgraph_every_form_one_graph_oracle(form):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    call, allowed = _forms()[form]
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(3))
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    outs = [compiled(*(torch.tensor(x) for x in (q, k, v))) for _ in range(3)]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # (no recompile)
    bias = BIAS if form == "bias" else None
    if form == "score_mod":  # (softcap: the oracle's scores by hand)
        s = np.einsum("bhqd,bhkd->bhqk", q, k).astype(np.float64) / np.sqrt(D)
        w = np.exp(20 * np.tanh(s / 20))
        want = np.einsum("bhqk,bhkd->bhqd", w / w.sum(-1, keepdims=True), v)
    else:
        mask = None if allowed is None else np.broadcast_to(allowed, (B, H, T, T))
        want, _ = oracle.attention(q, k, v, mask=mask, bias=bias)
    for out in outs:
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=2e-5)
