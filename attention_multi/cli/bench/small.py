"""The small-calls table: where d2l calls attention (the seeds' two examples,
a chapter-11 training batch, d2l's Transformer encoder reading the weights
after every block), ours against the seeds' code of the same framework, as
medians of per-pair ratios of interleaved calls in one process.

The seeds' code on NumPy and JAX is seed 000's d2l PyTorch code written in
NumPy and in ``jax.numpy`` (under ``jax.jit``, as ours); on MXNet it is seed
004's (``d2l_mxnet``); on torch ``d2l_torch``; on TensorFlow d2l's own TF
edition (``d2l_tensorflow``).
"""

import itertools
import math
import statistics
import time

import numpy as np

TARGET = 1.10  # every small call: ours / the seeds' code
ENCODER_TARGET = 1.05  # d2l's encoder with our attention, weights read after each block

# case -> (queries shape, keys shape, values shape, valid_lens, module)
DOT = ((2, 1, 2), (2, 10, 2), (2, 10, 4), [2, 6])
MHA = dict(sizes=(100, 100, 100, 100, 5), queries=(2, 4, 100), keys=(2, 6, 100), lens=[3, 2])
BATCH = dict(hiddens=32, heads=4, batch=64, steps=10, draws=8)  # draws: lengths, one per step
ENCODER = dict(vocab=200, hiddens=64, ffn=64, heads=4, blocks=2, batch=16, steps=64)


def pair_ratio(ours, theirs, seconds, sync=lambda x: x):
    """``(median ours, median theirs, median of per-pair ratios, pairs)``:
    each pair runs one call of each side back to back, the order alternating."""
    for f in (ours, theirs, ours, theirs):
        sync(f())
    times, ratios = ([], []), []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end or i < 20:
        pair = [0.0, 0.0]
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            f = (ours, theirs)[side]
            t0 = time.perf_counter()
            sync(f())
            pair[side] = time.perf_counter() - t0
        times[0].append(pair[0])
        times[1].append(pair[1])
        ratios.append(pair[0] / pair[1])
        i += 1
    return statistics.median(times[0]), statistics.median(times[1]), statistics.median(ratios), i


def _rng(seed=0):
    return np.random.default_rng(seed)


def _inputs():
    rng = _rng()
    dot = [rng.standard_normal(s).astype(np.float32) for s in DOT[:3]]
    mha = [rng.standard_normal(MHA[n]).astype(np.float32) for n in ("queries", "keys")]
    b, t, h = BATCH["batch"], BATCH["steps"], BATCH["hiddens"]
    x = rng.standard_normal((b, t, h)).astype(np.float32)
    lens = [rng.integers(1, t + 1, b).astype(np.int64) for _ in range(BATCH["draws"])]
    return dot, mha, x, lens


def _per_step(call, draws):
    """``call(lengths)`` with the next of ``draws`` at each call, round and
    round: a training loop's batches, each with its own lengths (a module may
    keep what it made from the last lengths it saw; one fixed batch would
    measure only that)."""
    it = itertools.cycle(draws)
    return lambda: call(next(it))


# ---- the seeds' code in NumPy and in jax.numpy ----------------------------------


def _seed_functions(xp):
    """Seed 000's masked_softmax, DotProductAttention and MultiHeadAttention
    (forward, eval) in ``xp`` (numpy or jax.numpy), weights as arguments."""

    def masked_softmax(X, valid_lens):
        if valid_lens is None:
            e = xp.exp(X - X.max(-1, keepdims=True))
            return e / e.sum(-1, keepdims=True)
        shape = X.shape
        if valid_lens.ndim == 1:
            valid_lens = xp.repeat(valid_lens, shape[1])
        else:
            valid_lens = valid_lens.reshape(-1)
        X = X.reshape(-1, shape[-1])
        mask = xp.arange(shape[-1])[None, :] < valid_lens[:, None]
        X = xp.where(mask, X, -1e6).reshape(shape)
        e = xp.exp(X - X.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def dot(q, k, v, valid_lens):
        scores = xp.matmul(q, xp.swapaxes(k, 1, 2)) / math.sqrt(q.shape[-1])
        return xp.matmul(masked_softmax(scores, valid_lens), v)

    def heads(x, h):
        x = x.reshape(x.shape[0], x.shape[1], h, -1).transpose(0, 2, 1, 3)
        return x.reshape(-1, x.shape[2], x.shape[3])

    def mha(p, h, q, k, v, valid_lens):
        q, k, v = (heads(x @ p[n].T, h) for x, n in ((q, "W_q"), (k, "W_k"), (v, "W_v")))
        if valid_lens is not None:
            valid_lens = xp.repeat(valid_lens, h, axis=0)
        out = dot(q, k, v, valid_lens)
        out = out.reshape(-1, h, out.shape[1], out.shape[2]).transpose(0, 2, 1, 3)
        return out.reshape(out.shape[0], out.shape[1], -1) @ p["W_o"].T

    return dot, mha


def _weights(module, xp):
    import attention_multi as am

    return {n.split(".")[0]: xp.asarray(w) for n, w in am.get_params(module).items()}


def _row(backend, case, mode, result):
    ours, theirs, ratio, pairs = result
    target = ENCODER_TARGET if case == "encoder" else TARGET
    return dict(
        backend=backend,
        case=case,
        mode=mode,
        ours_s=ours,
        theirs_s=theirs,
        ratio=ratio,
        pairs=pairs,
        target=target,
        met=ratio <= target,
    )


def bench_numpy(seconds):
    import attention_multi as am

    (q, k, v), (mq, mk), x, lens = _inputs()
    dot, mha = _seed_functions(np)
    ours = am.DotProductAttention(0.5, backend="numpy").eval()
    dl = np.array(DOT[3])
    rows = [
        _row(
            "numpy",
            "dot",
            "eval",
            pair_ratio(lambda: ours(q, k, v, dl), lambda: dot(q, k, v, dl), seconds),
        )
    ]
    m = am.MultiHeadAttention(*MHA["sizes"], 0.5, backend="numpy").eval()
    p, ml = _weights(m, np), np.array(MHA["lens"])
    h = MHA["sizes"][-1]
    rows.append(
        _row(
            "numpy",
            "mha",
            "eval",
            pair_ratio(lambda: m(mq, mk, mk, ml), lambda: mha(p, h, mq, mk, mk, ml), seconds),
        )
    )
    hid, heads = BATCH["hiddens"], BATCH["heads"]
    mb = am.MultiHeadAttention(hid, hid, hid, hid, heads, 0.1, backend="numpy").eval()
    pb = _weights(mb, np)
    rows.append(
        _row(
            "numpy",
            "batch",
            "eval",
            pair_ratio(
                _per_step(lambda d: mb(x, x, x, d), lens),
                _per_step(lambda d: mha(pb, heads, x, x, x, d), lens),
                seconds,
            ),
        )
    )
    return rows


def bench_torch(seconds):
    import torch

    import attention_multi as am

    from . import d2l_torch

    (q, k, v), (mq, mk), x, lens = (
        [torch.from_numpy(a) for a in group] if isinstance(group, list) else torch.from_numpy(group)
        for group in _inputs()
    )
    rows = []
    ours = am.DotProductAttention(0.5, backend="torch").eval()
    seed = d2l_torch.DotProductAttention(0.5).eval()
    dl = torch.tensor(DOT[3])
    with torch.no_grad():
        rows.append(
            _row(
                "torch",
                "dot",
                "eval",
                pair_ratio(lambda: ours(q, k, v, dl), lambda: seed(q, k, v, dl), seconds),
            )
        )
        m = am.MultiHeadAttention(*MHA["sizes"], 0.5, backend="torch").eval()
        sm = d2l_torch.MultiHeadAttention(MHA["sizes"][3], MHA["sizes"][4], 0.5).eval()
        ml = torch.tensor(MHA["lens"])
        sm(mq, mk, mk, ml)
        rows.append(
            _row(
                "torch",
                "mha",
                "eval",
                pair_ratio(lambda: m(mq, mk, mk, ml), lambda: sm(mq, mk, mk, ml), seconds),
            )
        )
        hid, heads = BATCH["hiddens"], BATCH["heads"]
        mb = am.MultiHeadAttention(hid, hid, hid, hid, heads, 0.1, backend="torch")
        sb = d2l_torch.MultiHeadAttention(hid, heads, 0.1)
        sb(x, x, x, lens[0])
        mb.eval(), sb.eval()
        rows.append(
            _row(
                "torch",
                "batch",
                "eval",
                pair_ratio(
                    _per_step(lambda d: mb(x, x, x, d), lens),
                    _per_step(lambda d: sb(x, x, x, d), lens),
                    seconds,
                ),
            )
        )
    mb.train(), sb.train()

    def step(module):
        def run(lens):
            for p in module.parameters():
                p.grad = None
            out = module(x, x, x, lens)
            out.sum().backward()
            return out

        return _per_step(run, lens)

    rows.append(_row("torch", "batch", "train", pair_ratio(step(mb), step(sb), seconds)))
    return rows


def bench_torch_encoder(seconds):
    """d2l's TransformerEncoder with d2l's attention and with ours in every
    block, the weights read after every block as d2l does."""
    import torch

    from . import d2l_torch

    e = ENCODER
    torch.manual_seed(0)
    nets = {}
    for name in ("d2l", "am"):
        nets[name] = d2l_torch.TransformerEncoder(
            e["vocab"], e["hiddens"], e["ffn"], e["heads"], e["blocks"], 0.1, attention=name
        ).eval()
    rng = _rng(1)
    tokens = torch.from_numpy(rng.integers(0, e["vocab"], (e["batch"], e["steps"])))
    lens = torch.from_numpy(rng.integers(e["steps"] // 4, e["steps"] + 1, e["batch"]))

    def forward(net, read):
        def run():
            X = net.pos_encoding(net.embedding(tokens) * math.sqrt(net.num_hiddens))
            weights = []
            for blk in net.blks:
                X = blk(X, lens)
                if read:
                    weights.append(blk.attention.attention.attention_weights)
            return X

        return run

    for name in ("d2l", "am"):
        forward(nets[name], True)()
    rows = []
    with torch.no_grad():
        rows.append(
            _row(
                "torch",
                "encoder",
                "eval, weights read",
                pair_ratio(forward(nets["am"], True), forward(nets["d2l"], True), seconds),
            )
        )
        rows.append(
            _row(
                "torch",
                "encoder",
                "eval, never read",
                pair_ratio(forward(nets["am"], False), forward(nets["d2l"], False), seconds),
            )
        )
    rows.append(
        _row(
            "torch",
            "encoder",
            "eval with grad, weights read",
            pair_ratio(forward(nets["am"], True), forward(nets["d2l"], True), seconds),
        )
    )
    return rows


def bench_jax(seconds):
    import jax
    import jax.numpy as jnp

    import attention_multi as am

    (q, k, v), (mq, mk), x, lens = (
        [jnp.asarray(a) for a in group] if isinstance(group, list) else jnp.asarray(group)
        for group in _inputs()
    )
    dot, mha = _seed_functions(jnp)
    sync = jax.block_until_ready
    rows = []
    ours = am.DotProductAttention(0.5, backend="jax").eval()
    dl = jnp.asarray(DOT[3])
    call = jax.jit(lambda m, *a: m(*a))
    seed_dot = jax.jit(dot)
    rows.append(
        _row(
            "jax",
            "dot",
            "eval",
            pair_ratio(
                lambda: call(ours, q, k, v, dl), lambda: seed_dot(q, k, v, dl), seconds, sync
            ),
        )
    )
    m = am.MultiHeadAttention(*MHA["sizes"], 0.5, backend="jax").eval()
    p, ml, h = _weights(m, jnp), jnp.asarray(MHA["lens"]), MHA["sizes"][-1]
    seed_mha = jax.jit(mha, static_argnums=1)
    rows.append(
        _row(
            "jax",
            "mha",
            "eval",
            pair_ratio(
                lambda: call(m, mq, mk, mk, ml),
                lambda: seed_mha(p, h, mq, mk, mk, ml),
                seconds,
                sync,
            ),
        )
    )
    hid, heads = BATCH["hiddens"], BATCH["heads"]
    mb = am.MultiHeadAttention(hid, hid, hid, hid, heads, 0.1, backend="jax").eval()
    pb = _weights(mb, jnp)
    rows.append(
        _row(
            "jax",
            "batch",
            "eval",
            pair_ratio(
                _per_step(lambda d: call(mb, x, x, x, d), lens),
                _per_step(lambda d: seed_mha(pb, heads, x, x, x, d), lens),
                seconds,
                sync,
            ),
        )
    )
    ours_grad = jax.jit(jax.grad(lambda m, x, lens: m(x, x, x, lens).sum()))
    seed_grad = jax.jit(jax.grad(lambda p, x, lens: mha(p, heads, x, x, x, lens).sum()))
    rows.append(
        _row(
            "jax",
            "batch",
            "train",
            pair_ratio(
                _per_step(lambda d: ours_grad(mb, x, d), lens),
                _per_step(lambda d: seed_grad(pb, x, d), lens),
                seconds,
                sync,
            ),
        )
    )
    return rows


def bench_mxnet(seconds):
    import attention_multi as am

    am.get_backend("mxnet")  # (it makes MXNet importable on numpy 1.26, then imports it)
    from mxnet import np as mnp
    from mxnet import npx

    from . import d2l_mxnet

    npx.set_np()
    (q, k, v), (mq, mk), x, lens = (
        [mnp.array(a) for a in group] if isinstance(group, list) else mnp.array(group)
        for group in _inputs()
    )
    sync = lambda out: out.wait_to_read()  # noqa: E731
    rows = []
    ours = am.DotProductAttention(0.5, backend="mxnet").eval()
    seed = d2l_mxnet.DotProductAttention(0.5)
    seed.initialize()
    dl = mnp.array(DOT[3], dtype="float32")
    rows.append(
        _row(
            "mxnet",
            "dot",
            "eval",
            pair_ratio(lambda: ours(q, k, v, dl), lambda: seed(q, k, v, dl), seconds, sync),
        )
    )
    m = am.MultiHeadAttention(*MHA["sizes"], 0.5, backend="mxnet").eval()
    sm = d2l_mxnet.MultiHeadAttention(MHA["sizes"][3], MHA["sizes"][4], 0.5)
    sm.initialize()
    ml = mnp.array(MHA["lens"], dtype="float32")
    rows.append(
        _row(
            "mxnet",
            "mha",
            "eval",
            pair_ratio(lambda: m(mq, mk, mk, ml), lambda: sm(mq, mk, mk, ml), seconds, sync),
        )
    )
    hid, heads = BATCH["hiddens"], BATCH["heads"]
    mb = am.MultiHeadAttention(hid, hid, hid, hid, heads, 0.1, backend="mxnet").eval()
    sb = d2l_mxnet.MultiHeadAttention(hid, heads, 0.1)
    sb.initialize()
    bl = [a.astype("float32") for a in lens]
    rows.append(
        _row(
            "mxnet",
            "batch",
            "eval",
            pair_ratio(
                _per_step(lambda d: mb(x, x, x, d), bl),
                _per_step(lambda d: sb(x, x, x, d), bl),
                seconds,
                sync,
            ),
        )
    )
    return rows


def bench_tensorflow(seconds):
    """Ours against d2l's TensorFlow edition (``d2l_tensorflow``), eager, as d2l runs it."""
    import tensorflow as tf

    import attention_multi as am

    from . import d2l_tensorflow

    (q, k, v), (mq, mk), x, lens = (
        [tf.constant(a) for a in group] if isinstance(group, list) else tf.constant(group)
        for group in _inputs()
    )
    rows = []
    ours = am.DotProductAttention(0.5, backend="tensorflow").eval()
    seed = d2l_tensorflow.DotProductAttention(0.5)
    dl = tf.constant(DOT[3], dtype=tf.float32)
    rows.append(
        _row(
            "tensorflow",
            "dot",
            "eval",
            pair_ratio(
                lambda: ours(q, k, v, dl), lambda: seed(q, k, v, dl, training=False), seconds
            ),
        )
    )
    size, heads = MHA["sizes"][3], MHA["sizes"][4]
    m = am.MultiHeadAttention(*MHA["sizes"], 0.5, backend="tensorflow").eval()
    sm = d2l_tensorflow.MultiHeadAttention(size, size, size, size, heads, 0.5)
    ml = tf.constant(MHA["lens"], dtype=tf.float32)
    rows.append(
        _row(
            "tensorflow",
            "mha",
            "eval",
            pair_ratio(
                lambda: m(mq, mk, mk, ml), lambda: sm(mq, mk, mk, ml, training=False), seconds
            ),
        )
    )
    hid, heads = BATCH["hiddens"], BATCH["heads"]
    mb = am.MultiHeadAttention(hid, hid, hid, hid, heads, 0.1, backend="tensorflow").eval()
    sb = d2l_tensorflow.MultiHeadAttention(hid, hid, hid, hid, heads, 0.1)
    bl = [tf.cast(a, tf.float32) for a in lens]
    rows.append(
        _row(
            "tensorflow",
            "batch",
            "eval",
            pair_ratio(
                _per_step(lambda d: mb(x, x, x, d), bl),
                _per_step(lambda d: sb(x, x, x, d, training=False), bl),
                seconds,
            ),
        )
    )
    return rows


BENCHES = {
    "numpy": bench_numpy,
    "torch": bench_torch,
    "jax": bench_jax,
    "mxnet": bench_mxnet,
    "tensorflow": bench_tensorflow,
}
CASES = {
    "dot": "`DotProductAttention`, the seeds' example",  # DOT
    "mha": "`MultiHeadAttention(100, 100, 100, 100, 5)`, the seeds' example",  # MHA
    "batch": "`MultiHeadAttention`, chapter-11 batch",  # BATCH
    "encoder": "d2l's `TransformerEncoder`, ours in every block",  # ENCODER
}


def run_small(backends_, seconds):
    rows = []
    for name in backends_:
        rows.extend(BENCHES[name](seconds))
        if name == "torch":
            rows.extend(bench_torch_encoder(seconds))
    return rows


def small_table(rows):
    lines = [
        "| Backend | Call | Mode | Ours | Theirs | Ratio (median of pairs) | Overhead | Target "
        "| Met |",
        "|---|---|---|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in rows:
        target = r["target"]
        own = r["case"] == "encoder" or r["backend"] == "tensorflow"  # (d2l's TF edition)
        against = "d2l's own" if own else "seeds'"
        lines.append(
            f"| {r['backend']} | {CASES[r['case']]} | {r['mode']} "
            f"| {r['ours_s'] * 1e6:.0f} µs | {r['theirs_s'] * 1e6:.0f} µs ({against}) "
            f"| {r['ratio']:.2f}x | {(r['ours_s'] - r['theirs_s']) * 1e6:+.0f} µs "
            f"| ≤ {target:.2f}x | {'yes' if r['met'] else 'NO'} |"
        )
    return "\n".join(lines)
