"""torch on a GPU: ours against the framework's own op, medians of interleaved
runs in one process (tests/gpu/run.sh). usage: speed_torch.py [cuda|cpu]
(cpu: small shapes, to check the script on a machine without a GPU)."""

import sys
import time

import gpu_timing  # (beside this script)
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as tflex

import attention_multi as am
from attention_multi import flex as amflex

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
small = dev == "cpu"
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)


def row(title, fns, base):
    gpu_timing.row(title, fns, base, lambda out: sync())


def err(a, b):
    return float((a.double() - b.double()).abs().max())


B, H, T, D = (16, 8, 512, 64) if not small else (2, 2, 64, 16)


def padding_and_causal(dtype):
    """DotProductAttention's large batch: valid_lens against SDPA with the padding mask."""
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=dtype) for _ in range(3))
    lens = torch.randint(T // 4, T + 1, (B,), device=dev)
    pad = (torch.arange(T, device=dev)[None, :] < lens[:, None])[:, None, None, :]

    def ours():
        return am.dot_product_attention(q, k, v, valid_lens=lens)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=pad)

    def ours_causal():
        return am.dot_product_attention(q, k, v, causal=True)

    def sdpa_causal():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    print(f"  max |ours - sdpa| {dtype}: {err(ours(), sdpa()):.2e}")
    row(f"valid_lens B={B} H={H} T={T} d={D} {dtype}", {"ours": ours, "sdpa": sdpa}, "sdpa")
    print(f"  max |ours - sdpa| causal {dtype}: {err(ours_causal(), sdpa_causal()):.2e}")
    row(f"causal {dtype}", {"ours": ours_causal, "sdpa": sdpa_causal}, "sdpa")


def modules():
    """MultiHeadAttention against nn.MultiheadAttention, float32."""
    E, heads = (512, 8) if not small else (32, 2)
    X = torch.randn(B, T, E, device=dev)
    mine = am.MultiHeadAttention(E, E, E, E, heads, 0.0, backend="torch", device=dev).eval()
    theirs = torch.nn.MultiheadAttention(E, heads, batch_first=True, bias=False, device=dev)
    theirs.eval()
    lens = torch.randint(T // 4, T + 1, (B,), device=dev)
    kpm = torch.arange(T, device=dev)[None, :] >= lens[:, None]
    with torch.no_grad():
        row(
            f"MHA B={B} T={T} E={E} valid_lens",
            {
                "ours": lambda: mine(X, X, X, lens),
                "nn.MHA": lambda: theirs(X, X, X, key_padding_mask=kpm, need_weights=False),
            },
            "nn.MHA",
        )


def flex():
    """Packed documents: ours (eager) against torch's compiled flex_attention."""
    Bf, Hf, Tf, Df = (1, 8, 8192, 64) if not small else (1, 2, 256, 16)
    docs = torch.repeat_interleave(torch.arange(16, device=dev), Tf // 16)

    def doc_causal(b, h, qi, ki):
        return (docs[qi] == docs[ki]) & (qi >= ki)

    q, k, v = (torch.randn(Bf, Hf, Tf, Df, device=dev, dtype=torch.bfloat16) for _ in range(3))
    t0 = time.perf_counter()
    theirs_mask = tflex.create_block_mask(doc_causal, Bf, None, Tf, Tf, device=dev)
    sync()
    t1 = time.perf_counter()
    ours_mask = amflex.create_block_mask(doc_causal, Bf, None, Tf, Tf, device=dev)
    sync()
    ours_s = time.perf_counter() - t1
    print(f"create_block_mask first call: torch {t1 - t0:.3f} s, ours {ours_s:.3f} s")
    compiled = torch.compile(tflex.flex_attention)
    t0 = time.perf_counter()
    ref = compiled(q, k, v, block_mask=theirs_mask)
    sync()
    print(f"torch compiled flex first call {time.perf_counter() - t0:.1f} s")
    got = amflex.flex_attention(q, k, v, block_mask=ours_mask)
    print(f"  max |ours - torch flex| bf16 doc-causal: {err(got, ref):.2e}")
    ids = docs[None]
    row(
        f"flex doc-causal B={Bf} H={Hf} T={Tf} d={Df} bf16",
        {
            "ours eager": lambda: amflex.flex_attention(q, k, v, block_mask=ours_mask),
            "ours segment_ids": lambda: am.dot_product_attention(
                q, k, v, segment_ids=ids, causal=True
            ),
            "torch compiled": lambda: compiled(q, k, v, block_mask=theirs_mask),
        },
        "torch compiled",
    )
    row(
        "create_block_mask",
        {
            "ours": lambda: amflex.create_block_mask(doc_causal, Bf, None, Tf, Tf, device=dev),
            "torch": lambda: tflex.create_block_mask(doc_causal, Bf, None, Tf, Tf, device=dev),
        },
        "torch",
    )


def training():
    """Forward and backward, causal, bfloat16."""
    q, k, v = (
        torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    row(
        "fwd+bwd causal bf16",
        {
            "ours": lambda: am.dot_product_attention(q, k, v, causal=True).sum().backward(),
            "sdpa": lambda: (
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
            ),
        },
        "sdpa",
    )


torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    padding_and_causal(dtype)
modules()
flex()
training()
