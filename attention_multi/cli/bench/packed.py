"""The "packed and programmable" table: documents packed into rows, causal
within each document (``segment_ids`` + ``causal``), against the peers.

- torch forward: ours (block states computed in the call) against
  ``flex_attention`` compiled with a prebuilt ``BlockMask``;
- torch forward+backward: ours against SDPA with the dense boolean mask;
- NumPy, JAX (``jit``), MXNet forward: ours against their dense-mask
  attention (``jax.nn.dot_product_attention(mask=)``; NumPy and MXNet:
  ``dot_product_attention(mask=)`` with the dense mask, their one kernel);
- JAX: the time to compile the jitted call, and eagerly the first call at a
  length not seen before (T=300), against the same of theirs;
- the same mask as a ``mask_mod`` lambda against the built-in form.

Each row states the share of the scores ours computes (blocks not empty).
"""

import numpy as np

from .speed import format_calls
from .timing import compare, torch_calls

PACKED = {"batch": 4, "length": 4096, "heads": 8, "head_size": 64, "docs": (64, 1024)}


def packed_ids(batch, length, low, high, seed=0):
    """(batch, length) segment ids: documents of lengths uniform in
    [low, high] filling each row (the last one cut)."""
    import attention_multi as am

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < length:
            lengths.append(int(rng.integers(low, high + 1)))
        lengths[-1] -= sum(lengths) - length
        rows.append(lengths)
    return am.segments_from_lengths(rows, length)


def _dense(ids):
    t = ids.shape[1]
    return (ids[:, :, None] == ids[:, None, :]) & np.tril(np.ones((t, t), bool))


def run_packed(backends_wanted, seconds, shape=None):
    """Rows ``(backend, measured, against, ours_s, theirs_s, ratio, fraction, err,
    calls)``: ``calls`` the parallel regions of torch's pool per call, ours and
    theirs (None where not counted)."""
    import attention_multi as am
    from attention_multi import backends
    from attention_multi.core import make_mask
    from attention_multi.core.mask import computed_fraction, host_table
    from attention_multi.core.paths.blocked import pick_block

    p = dict(PACKED, **(shape or {}))
    B, T, H, d = p["batch"], p["length"], p["heads"], p["head_size"]
    ids = packed_ids(B, T, *p["docs"])
    rng = np.random.default_rng(0)
    qn, kn, vn = (rng.standard_normal((B, H, T, d), dtype=np.float32) for _ in range(3))
    npm = make_mask(backends.load("numpy"), B, H, T, T, segment_ids=ids, causal=True)
    fraction = computed_fraction(
        npm, host_table(npm, *pick_block(npm, False)), *pick_block(npm, False)
    )
    rows = []

    def row(name, what, against, ours, theirs, sync=lambda x: x):
        a, b = ours(), theirs()
        err = float(np.abs(np.asarray(sync(a), np.float64) - np.asarray(sync(b))).max())
        t_ours, t_theirs, _ = compare(ours, theirs, seconds, sync)
        calls = (torch_calls(ours), torch_calls(theirs)) if name == "torch" else (None, None)
        rows.append(
            (name, what, against, t_ours, t_theirs, t_ours / t_theirs, fraction, err, calls)
        )

    def build_row(name, what, against, build, call):
        """The time to build a block classification against one call (the
        issue's target: at most 5%); no output to compare."""
        t_ours, t_theirs, _ = compare(build, call, seconds, lambda x: x)
        rows.append(
            (name, what, against, t_ours, t_theirs, t_ours / t_theirs, fraction, None, (None, None))
        )

    if "torch" in backends_wanted:
        import torch
        from torch.nn.attention import flex_attention as flex

        q, k, v = (torch.tensor(x) for x in (qn, kn, vn))
        seg = torch.tensor(ids)

        def doc_causal(b, h, q_idx, kv_idx):
            return (seg[b, q_idx] == seg[b, kv_idx]) & (kv_idx <= q_idx)

        block = flex.create_block_mask(doc_causal, B, None, T, T, device="cpu")
        compiled = torch.compile(flex.flex_attention)

        def ours():
            return am.dot_product_attention(q, k, v, segment_ids=seg, causal=True)

        row(
            "torch",
            "forward",
            "flex_attention, compiled, prebuilt BlockMask",
            ours,
            lambda: compiled(q, k, v, block_mask=block),
            lambda x: x.detach().numpy(),
        )

        def states():  # what a call with segment_ids= classifies first
            m = make_mask(am.get_backend("torch"), B, H, T, T, segment_ids=seg, causal=True)
            return host_table(m, *pick_block(m, False))

        build_row("torch", "block states of segment_ids=", "one call (forward)", states, ours)
        lambda_mask = make_mask(am.get_backend("torch"), B, H, T, T, mask_mod=doc_causal)
        built = pick_block(lambda_mask, False)

        def prebuilt():  # (the blocks a call with the lambda uses)
            return am.block_mask(doc_causal, B, 1, T, T, block=built, backend="torch")

        build_row(
            "torch",
            f"am.block_mask of the lambda (block {built[0]}x{built[1]})",
            "one call (forward)",
            prebuilt,
            ours,
        )
        for what, mod in (("", doc_causal), (" as a prebuilt BlockMask", prebuilt())):
            row(
                "torch",
                "forward, mask_mod lambda" + what,
                "the same with segment_ids=",
                lambda mod=mod: am.dot_product_attention(q, k, v, mask_mod=mod),
                ours,
                lambda x: x.detach().numpy(),
            )
        dense = torch.tensor(_dense(ids)[:, None])
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

        def train(f):
            def step():
                for t in (qg, kg, vg):
                    t.grad = None
                out = f()
                out.sum().backward()
                return out

            return step

        row(
            "torch",
            "forward+backward",
            "SDPA, dense boolean mask",
            train(lambda: am.dot_product_attention(qg, kg, vg, segment_ids=seg, causal=True)),
            train(
                lambda: torch.nn.functional.scaled_dot_product_attention(
                    qg, kg, vg, attn_mask=dense
                )
            ),
            lambda x: x.detach().numpy(),
        )
    if "jax" in backends_wanted:
        import jax
        import jax.numpy as jnp

        q, k, v = (jnp.asarray(x) for x in (qn, kn, vn))
        seg, dense = jnp.asarray(ids), jnp.asarray(_dense(ids)[:, None])
        ours = jax.jit(
            lambda q, k, v, s: am.dot_product_attention(q, k, v, segment_ids=s, causal=True)
        )
        theirs = jax.jit(
            lambda q, k, v, m: jnp.swapaxes(
                jax.nn.dot_product_attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), mask=m),
                1,
                2,
            )
        )
        row(
            "jax",
            "forward (jit)",
            "jax.nn.dot_product_attention, dense mask",
            lambda: ours(q, k, v, seg),
            lambda: theirs(q, k, v, dense),
            lambda x: np.asarray(x.block_until_ready()),
        )
        rows.append(_jax_compile_row(q, k, v, seg, dense, fraction))
        rows.append(_jax_first_call_row(p))
    for name in ("numpy", "mxnet"):
        if name not in backends_wanted:
            continue
        Bk = backends.load(name)
        q, k, v = (Bk.asarray(x) for x in (qn, kn, vn))
        seg, dense = Bk.asarray(ids), Bk.asarray(_dense(ids)[:, None])
        row(
            name,
            "forward",
            "its dense-mask attention (mask=)",
            lambda q=q, k=k, v=v, s=seg: am.dot_product_attention(
                q, k, v, segment_ids=s, causal=True
            ),
            lambda q=q, k=k, v=v, m=dense: am.dot_product_attention(q, k, v, mask=m),
            Bk.to_numpy,
        )
    return rows


def _jax_compile_row(q, k, v, seg, dense, fraction, runs=3):
    """Tracing and compiling ``jax.jit`` of ours (block-sparse: a scan of
    blocks, so it does not grow with T) against theirs, a new function each
    time (nothing cached), medians of interleaved runs."""
    import time

    import jax
    import jax.numpy as jnp

    import attention_multi as am

    def ours():
        f = jax.jit(
            lambda q, k, v, s: am.dot_product_attention(q, k, v, segment_ids=s, causal=True)
        )
        return f.lower(q, k, v, seg).compile()

    def theirs():
        f = jax.jit(
            lambda q, k, v, m: jax.nn.dot_product_attention(
                *(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), mask=m
            )
        )
        return f.lower(q, k, v, dense).compile()

    times = {ours: [], theirs: []}
    for _ in range(runs):
        for fn, got in times.items():
            start = time.perf_counter()
            fn()
            got.append(time.perf_counter() - start)
    a, b = (float(np.median(t)) for t in times.values())
    what, against = "compile (jit)", "jax.nn.dot_product_attention, dense mask"
    return ("jax", what, against, a, b, a / b, fraction, None, (None, None))


def _jax_first_call_row(p, length=300):
    """Eager, the first call at a length not seen before (T=300): ours
    (block-sparse, its block kernel compiled once per block shape, reused)
    against ``jax.nn.dot_product_attention`` with the dense mask (compiled
    per shape, op by op)."""
    import time

    import jax
    import jax.numpy as jnp

    import attention_multi as am
    from attention_multi import backends
    from attention_multi.core import attend, make_mask
    from attention_multi.core.mask import computed_fraction, host_table
    from attention_multi.core.paths.blocked import pick_block

    B, H, d = p["batch"], p["heads"], p["head_size"]
    ids = np.asarray(packed_ids(B, length, 16, 128))
    npm = make_mask(backends.load("numpy"), B, H, length, length, segment_ids=ids, causal=True)
    block = pick_block(npm, False, True)
    fraction = computed_fraction(npm, host_table(npm, *block), *block)
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((B, H, length, d), np.float32)) for _ in range(3))
    xp = am.get_backend("jax")
    start = time.perf_counter()
    mask = make_mask(xp, B, H, length, length, segment_ids=jnp.asarray(ids), causal=True)
    out, _, _, taken = attend(xp, q, k, v, mask)
    out.block_until_ready()
    a = time.perf_counter() - start
    dense = jnp.asarray(_dense(ids)[:, None])
    start = time.perf_counter()
    swap = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    theirs = jnp.swapaxes(jax.nn.dot_product_attention(*swap, mask=dense), 1, 2)
    theirs.block_until_ready()
    b = time.perf_counter() - start
    err = float(np.abs(np.asarray(out, np.float64) - np.asarray(theirs)).max())
    what = f"eager, first call at T={length} (a new shape), {taken} path, max diff {err:.1e}"
    against = "jax.nn.dot_product_attention, dense mask, first call"
    # (no error column: a one-off, not timed calls, so the busy table leaves it out)
    return ("jax", what, against, a, b, a / b, fraction, None, (None, None))


def packed_table(rows):
    head = (
        "backend",
        "measured",
        "against",
        "ours ms",
        "theirs ms",
        "ratio",
        "scores computed",
        "max |diff|",
        "calls",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, what, against, a, b, r, f, e, calls in rows:
        lines.append(
            f"| {name} | {what} | {against} | {a * 1e3:.1f} | {b * 1e3:.1f} | {r:.2f}x "
            f"| {f:.1%} | {'–' if e is None else f'{e:.1e}'} | {format_calls(calls)} |"
        )
    return "\n".join(lines)


FLEX = {"batch": 1, "heads": 4, "length": 1024, "head_size": 64, "window": 256}


def run_flex(seconds, block_batch=4, block_length=4096):
    """Rows as ``run_packed``'s: ``attention_multi.flex.flex_attention``
    (eager, our BlockMask) against torch's ``flex_attention`` compiled (its
    BlockMask), forward, for causal, sliding-window and document masks, at
    ``FLEX``'s shape and at the packed size (``block_batch``,
    ``PACKED``'s heads, ``block_length``); then ``create_block_mask`` of the
    document mask, ours against torch's, at the packed size, with ``H=None``
    and with one block mask per head."""
    import torch
    from torch.nn.attention import flex_attention as theirs

    from attention_multi import flex as ours

    w = FLEX["window"]
    compiled = torch.compile(theirs.flex_attention)
    shapes = [
        tuple(FLEX[n] for n in ("batch", "heads", "length", "head_size")),
        (block_batch, PACKED["heads"], block_length, PACKED["head_size"]),
    ]
    rows = []
    for B, H, T, d in shapes:
        rng = np.random.default_rng(0)
        q, k, v = (torch.tensor(rng.standard_normal((B, H, T, d), dtype=np.float32)) for _ in "qkv")
        masks = flex_masks(torch.tensor(packed_ids(B, T, *PACKED["docs"])), w)
        for name, mod in zip(("causal", f"sliding window {w}", "document"), masks):
            mine = ours.create_block_mask(mod, B, None, T, T, device="cpu")
            their = theirs.create_block_mask(mod, B, None, T, T, device="cpu")
            a = ours.flex_attention(q, k, v, block_mask=mine)
            b = compiled(q, k, v, block_mask=their)
            err = float((a - b).abs().max())

            def mine_call(mine=mine, q=q, k=k, v=v):
                return ours.flex_attention(q, k, v, block_mask=mine)

            def their_call(their=their, q=q, k=k, v=v):
                return compiled(q, k, v, block_mask=their)

            burst = 5 if T <= 1024 else 1  # (a packed-size call: 0.2-2 s)
            t_ours, t_theirs, _ = compare(mine_call, their_call, seconds, burst=burst)
            rows.append(
                (
                    "torch",
                    f"flex_attention forward, {name} (B={B}, H={H}, T={T}, d={d})",
                    "torch flex_attention, compiled",
                    t_ours,
                    t_theirs,
                    t_ours / t_theirs,
                    1 - mine.sparsity() / 100,
                    err,
                    (torch_calls(mine_call), torch_calls(their_call)),
                )
            )
    seg = torch.tensor(packed_ids(block_batch, block_length, *PACKED["docs"]))
    document = flex_masks(seg, w)[2]
    for heads in (None, PACKED["heads"]):
        args = (document, block_batch, heads, block_length, block_length)
        t_ours, t_theirs, _ = compare(
            lambda args=args: ours.create_block_mask(*args, device="cpu"),
            lambda args=args: theirs.create_block_mask(*args, device="cpu"),
            seconds,
            burst=1,
        )
        mine = ours.create_block_mask(*args, device="cpu")
        same = mine.to_dense() == theirs.create_block_mask(*args, device="cpu").to_dense().numpy()
        rows.append(
            (
                "torch",
                f"create_block_mask, document (B={block_batch}, H={heads}, T={block_length})",
                "torch create_block_mask",
                t_ours,
                t_theirs,
                t_ours / t_theirs,
                1 - mine.sparsity() / 100,
                float(not same.all()),
                (None, None),
            )
        )
    return rows


def flex_masks(seg, window):
    """Causal, sliding-window and document (``seg``: (B, T) segment ids) mask functions."""

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def sliding(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= window)

    def document(b, h, q_idx, kv_idx):
        return (seg[b, q_idx] == seg[b, kv_idx]) & (kv_idx <= q_idx)

    return causal, sliding, document
