"""The speed tables: ours against each framework's own attention and the
seeds' d2l code, at three shapes, forward (eval) and, on torch, training."""

import numpy as np

from .timing import compare, random_lens, rng_inputs, torch_calls, train_step

TARGETS = {  # (row key) -> largest acceptable ratio; None: must be faster (< 1)
    "torch-dot-sdpa": 0.85,
    "torch-dot-seed": None,
    "torch-mha-nn": 1.10,
    "torch-dot-train": 1.0,
    "torch-mha-train": 1.0,
    "jax-dot-jit": 0.90,
    "mxnet-dot-seed": 0.70,
    "numpy-dot-sdpa": 2.0,
}

DOT_SHAPES = {"small": (4, 128, 64), "medium": (16, 512, 64), "large": (16, 1024, 64)}
MHA_SHAPES = {"small": (2, 64, 64, 4), "medium": (8, 256, 256, 8), "large": (8, 512, 512, 8)}


def bench_torch_dot(shape, seconds):
    import torch
    import torch.nn.functional as F

    import attention_multi as am

    from . import d2l_torch

    B, T, d = shape
    q, k, v = (torch.from_numpy(x) for x in rng_inputs(shape))
    lens = torch.from_numpy(random_lens(B, T))
    ours = am.DotProductAttention(0.1, backend="torch").eval()
    q4, k4, v4 = q[:, None], k[:, None], v[:, None]
    seed = d2l_torch.DotProductAttention(0.1).eval()

    def sdpa():
        mask = (torch.arange(T) < lens[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask)

    rows = []
    with torch.inference_mode():
        ref = sdpa()[:, 0]
        check = float((ours(q, k, v, lens) - ref).abs().max())
        path = ours.last_path
        rows.append(
            (
                "torch-dot-sdpa",
                "torch",
                "DotProductAttention",
                shape,
                path,
                "SDPA 4-D + (B,1,1,T) mask",
                *compare(lambda: ours(q, k, v, lens), sdpa, seconds),
                check,
                (torch_calls(lambda: ours(q, k, v, lens)), torch_calls(sdpa)),
            )
        )
        rows.append(
            (
                "torch-dot-seed",
                "torch",
                "DotProductAttention",
                shape,
                path,
                "seed 000 d2l PyTorch",
                *compare(lambda: ours(q, k, v, lens), lambda: seed(q, k, v, lens), seconds),
                check,
                (
                    torch_calls(lambda: ours(q, k, v, lens)),
                    torch_calls(lambda: seed(q, k, v, lens)),
                ),
            )
        )
    return rows


def bench_torch_mha(shape, seconds):
    import torch

    import attention_multi as am

    B, T, E, h = shape
    x = torch.from_numpy(rng_inputs((B, T, E), 1)[0])
    lens = torch.from_numpy(random_lens(B, T))
    ours = am.MultiHeadAttention(E, E, E, E, h, 0.1, backend="torch").eval()
    mha = torch.nn.MultiheadAttention(E, h, dropout=0.1, bias=False, batch_first=True).eval()
    p = {n: t.detach() for n, t in ours.named_parameters()}
    with torch.no_grad():  # the same weights on both sides
        mha.in_proj_weight.copy_(torch.cat([p["W_q.weight"], p["W_k.weight"], p["W_v.weight"]]))
        mha.out_proj.weight.copy_(p["W_o.weight"])

    def nn_mha():
        padding = torch.arange(T)[None, :] >= lens[:, None]
        return mha(x, x, x, key_padding_mask=padding, need_weights=False)[0]

    with torch.inference_mode():
        check = float((ours(x, x, x, lens) - nn_mha()).abs().max())
        return [
            (
                "torch-mha-nn",
                "torch",
                "MultiHeadAttention",
                shape,
                ours.last_path,
                "nn.MultiheadAttention",
                *compare(lambda: ours(x, x, x, lens), nn_mha, seconds),
                check,
                (torch_calls(lambda: ours(x, x, x, lens)), torch_calls(nn_mha)),
            )
        ]


def bench_torch_dot_train(shape, seconds):
    import torch
    import torch.nn.functional as F

    import attention_multi as am

    B, T, d = shape
    q, k, v = (torch.from_numpy(x).requires_grad_(True) for x in rng_inputs(shape))
    lens = torch.from_numpy(random_lens(B, T))
    ours = am.DotProductAttention(0.1, backend="torch").train()

    def sdpa():
        mask = (torch.arange(T) < lens[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(
            q[:, None], k[:, None], v[:, None], attn_mask=mask, dropout_p=0.1
        )[:, 0]

    ours(q, k, v, lens)
    ours_step, sdpa_step = (
        train_step(lambda: ours(q, k, v, lens), q, k, v),
        train_step(sdpa, q, k, v),
    )
    return [
        (
            "torch-dot-train",
            "torch",
            "DotProductAttention, train fwd+bwd, dropout 0.1",
            shape,
            ours.last_path,
            "SDPA, dropout_p=0.1 + mask",
            *compare(ours_step, sdpa_step, seconds),
            float("nan"),
            (torch_calls(ours_step), torch_calls(sdpa_step)),
        )
    ]


def bench_torch_mha_train(shape, seconds):
    import torch

    import attention_multi as am

    B, T, E, h = shape
    x = torch.from_numpy(rng_inputs((B, T, E), 1)[0])
    lens = torch.from_numpy(random_lens(B, T))
    ours = am.MultiHeadAttention(E, E, E, E, h, 0.1, backend="torch").train()
    mha = torch.nn.MultiheadAttention(E, h, dropout=0.1, bias=False, batch_first=True).train()
    padding = torch.arange(T)[None, :] >= lens[:, None]
    ours(x, x, x, lens)
    ours_step = train_step(lambda: ours(x, x, x, lens), *ours.parameters())
    mha_step = train_step(
        lambda: mha(x, x, x, key_padding_mask=padding, need_weights=False)[0], *mha.parameters()
    )
    return [
        (
            "torch-mha-train",
            "torch",
            "MultiHeadAttention, train fwd+bwd, dropout 0.1",
            shape,
            ours.last_path,
            "nn.MultiheadAttention, dropout 0.1",
            *compare(ours_step, mha_step, seconds),
            float("nan"),
            (torch_calls(ours_step), torch_calls(mha_step)),
        )
    ]


def bench_jax_dot(shape, seconds):
    import jax
    import jax.numpy as jnp

    import attention_multi as am

    B, T, d = shape
    q, k, v = (jnp.asarray(x) for x in rng_inputs(shape))
    lens = jnp.asarray(random_lens(B, T))
    ours = am.DotProductAttention(0.1, backend="jax").eval()
    call = jax.jit(lambda m, q, k, v, lens: m(q, k, v, lens))
    dpa = jax.jit(
        lambda q, k, v, lens: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lens)
    )
    q4, k4, v4 = (x[:, :, None, :] for x in (q, k, v))
    ref = dpa(q4, k4, v4, lens)[:, :, 0]
    check = float(jnp.abs(call(ours, q, k, v, lens) - ref).max())
    taken = []  # the path of the traced call (the module is a traced copy there)
    jax.make_jaxpr(lambda m, *a: taken.append(m(*a) is not None and m.last_path))(
        ours, q, k, v, lens
    )
    return [
        (
            "jax-dot-jit",
            "jax",
            "DotProductAttention (jit)",
            shape,
            taken[0],
            "jax.nn.dot_product_attention (jit)",
            *compare(
                lambda: call(ours, q, k, v, lens),
                lambda: dpa(q4, k4, v4, lens),
                seconds,
                sync=lambda x: x.block_until_ready(),
            ),
            check,
            (1, 1),  # (one compiled executable each)
        )
    ]


def bench_mxnet_dot(shape, seconds):
    import attention_multi as am

    am.get_backend("mxnet")  # sets NumPy mode before the seed's code runs
    from mxnet import np as mnp
    from mxnet import npx

    from . import d2l_mxnet

    B, T, d = shape
    q, k, v = (mnp.array(x) for x in rng_inputs(shape))
    lens = mnp.array(random_lens(B, T))
    ours = am.DotProductAttention(0.1, backend="mxnet").eval()
    seed = d2l_mxnet.DotProductAttention(0.1)
    seed.initialize()

    def sync(x):
        npx.waitall()
        return x

    check = float(mnp.abs(ours(q, k, v, lens) - seed(q, k, v, lens.astype("float32"))).max())
    flens = lens.astype("float32")  # npx.sequence_mask wants the data's dtype
    return [
        (
            "mxnet-dot-seed",
            "mxnet",
            "DotProductAttention",
            shape,
            ours.last_path,
            "seed 004 d2l MXNet (npx.batch_dot)",
            *compare(lambda: ours(q, k, v, lens), lambda: seed(q, k, v, flens), seconds, sync=sync),
            check,
            (None, None),
        )
    ]


def bench_numpy_dot(shape, seconds):
    import torch
    import torch.nn.functional as F

    import attention_multi as am

    B, T, d = shape
    q, k, v = rng_inputs(shape)
    lens = random_lens(B, T)
    ours = am.DotProductAttention(0.1, backend="numpy").eval()
    q4, k4, v4 = (torch.from_numpy(x)[:, None] for x in (q, k, v))
    tlens = torch.from_numpy(lens)

    def sdpa():
        mask = (torch.arange(T) < tlens[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask)

    with torch.inference_mode():
        check = float(np.abs(ours(q, k, v, lens) - sdpa()[:, 0].numpy()).max())
        return [
            (
                "numpy-dot-sdpa",
                "numpy",
                "DotProductAttention",
                shape,
                ours.last_path,
                "torch SDPA 4-D + mask",
                *compare(lambda: ours(q, k, v, lens), sdpa, seconds),
                check,
                (None, torch_calls(sdpa)),
            )
        ]


BENCHES = {
    "torch": [
        ("dot", bench_torch_dot),
        ("mha", bench_torch_mha),
        ("dot", bench_torch_dot_train),
        ("mha", bench_torch_mha_train),
    ],
    "jax": [("dot", bench_jax_dot)],
    "mxnet": [("dot", bench_mxnet_dot)],
    "numpy": [("dot", bench_numpy_dot)],
}


def _fmt_shape(key, shape):
    if len(shape) == 3:
        return "B={} T={} d={}".format(*shape)
    return "B={} T={} E={} h={}".format(*shape)


def format_calls(calls):
    """``ours / theirs`` parallel regions per call ("–" where not counted)."""
    return " / ".join("–" if c is None else str(c) for c in calls)


def table(rows):
    lines = [
        "| Measured | Shape | Path | Against | Ours (ms) | Theirs (ms) | Ratio | Target | Met "
        "| Calls |",
        "|---|---|---|---|---:|---:|---:|---:|:-:|---:|",
    ]
    for key, backend, what, shape, path, against, ours, theirs, _, _, calls in rows:
        ratio = ours / theirs
        target, met = TARGETS[key], "-"
        if shape in (DOT_SHAPES["medium"], MHA_SHAPES["medium"]):  # the targets' shapes
            met = "yes" if (ratio < 1 if target is None else ratio <= target) else "NO"
            target = "< 1x" if target is None else f"<= {target:.2f}x"
        else:
            target = "-"
        lines.append(
            f"| {backend} {what} | {_fmt_shape(key, shape)} | {path} | {against} | "
            f"{ours * 1e3:.2f} | {theirs * 1e3:.2f} | {ratio:.2f}x | "
            f"{target} | {met} | {format_calls(calls)} |"
        )
    return "\n".join(lines)
