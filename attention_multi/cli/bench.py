"""``attention-multi bench``: this library against each framework's own attention.

Float32, d2l-style padding (1-D ``valid_lens`` uniform in [T/4, T]). Forward
inference with modules in eval mode, and training (forward+backward, dropout
0.1) for torch; each call including the module's input checks. Every
comparison runs in one process, interleaving bursts of calls of the two
sides, and reports their medians, the ratio of the medians and the path
ours took. The long-sequence case and the peak-memory cases under autograd
run in subprocesses and report their peak RSS (``ru_maxrss``). The ring case
runs ``ring_attention`` over P torch processes (gloo, on this machine's CPU,
each with 1/P of the threads) against ``dot_product_attention`` in one
process, and reports each process's peak RSS and time.

Baselines:
- ``torch.nn.functional.scaled_dot_product_attention`` in its fastest form:
  4-D (B, heads, T, d) inputs and a broadcast (B, 1, 1, T) boolean mask;
- ``torch.nn.MultiheadAttention`` with ``need_weights=False`` and
  ``key_padding_mask``;
- ``jax.nn.dot_product_attention`` with ``key_value_seq_lengths``, jitted;
- the seeds' hand-written d2l code: PyTorch (seed 000: ``masked_softmax``,
  ``sequence_mask``, ``DotProductAttention`` with ``torch.bmm``) and MXNet
  (seed 004: ``DotProductAttention`` with ``npx.batch_dot``; its
  ``masked_softmax`` there is PyTorch code, so d2l's MXNet ``masked_softmax``
  with ``npx.sequence_mask`` is used).
"""

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from ..files import atomic_write, check_writable

EXIT_CANNOT_WRITE = 1
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
MEMORY = {  # autograd cases: (what, shape, peak RSS target in MiB)
    "torch-additive-grad": (
        "AdditiveAttention forward+backward, torch",
        dict(batch=4, queries=1024, keys=1024, hiddens=128),
        1.2 * 1024,
    ),
    "jax-mha-grad": (
        "jax.grad through MultiHeadAttention",
        dict(batch=1, heads=8, head_size=64, length=8192),
        1.5 * 1024,
    ),
}
DOT_SHAPES = {"small": (4, 128, 64), "medium": (16, 512, 64), "large": (16, 1024, 64)}
MHA_SHAPES = {"small": (2, 64, 64, 4), "medium": (8, 256, 256, 8), "large": (8, 512, 512, 8)}
LONG = dict(batch=1, heads=8, head_size=64, length=16384)
RSS_LIMIT_MIB = 2048
RING = dict(batch=1, heads=8, head_size=64, length=8192)
RING_BUDGET = 512 * 2**20  # memory_budget of ring_attention (the default): 32 MiB
# of scores per block of queries. (Smaller blocks, below glibc's 32 MiB
# ceiling for its dynamic mmap threshold, come from the heap, which then
# fragments: 4 MiB blocks at T=8192 in one process peaked at 6 GiB RSS.)


def add_arguments(parser):
    parser.add_argument(
        "--quick",
        action="store_true",
        help="medium shapes only, shorter timing, long case at T=4096",
    )
    parser.add_argument(
        "--backends",
        default="numpy,torch,jax,mxnet",
        help="comma-separated backends to measure (default: all installed)",
    )
    parser.add_argument(
        "--shapes",
        default=None,
        help="comma-separated from small,medium,large (default: all; --quick: medium)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="timing budget per comparison (default 3; --quick 1)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: the number of cores)",
    )
    parser.add_argument(
        "--long-length",
        type=int,
        default=None,
        help=f"T of the long-sequence case (default {LONG['length']}; --quick 4096; 0 skips it)",
    )
    parser.add_argument(
        "--ring-length",
        type=int,
        default=None,
        help=f"T of the ring-attention case (default {RING['length']}; --quick 2048; 0 skips it)",
    )
    parser.add_argument(
        "--ring-processes",
        default="1,2,4",
        help="comma-separated process counts of the ring case "
        "(default 1,2,4; T must be a multiple of 16 times each)",
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the peak-memory cases under autograd"
    )
    parser.add_argument(
        "--json",
        default=None,
        help="also write the results here (checked before the timing "
        "starts; written whole or not at all)",
    )
    parser.epilog = (
        f"exit status: 0 measured; {EXIT_CANNOT_WRITE} --json cannot be written; 2 bad arguments"
    )


# -- baselines: the seeds' code, copied -------------------------------------------


def _seed_torch():
    """Seed 000 (d2l, PyTorch): masked_softmax, sequence_mask, DotProductAttention."""
    import torch
    from torch import nn

    def masked_softmax(X, valid_lens):
        if valid_lens is None:
            return nn.functional.softmax(X, dim=-1)
        else:
            shape = X.shape
            if valid_lens.dim() == 1:
                valid_lens = torch.repeat_interleave(valid_lens, shape[1])
            else:
                valid_lens = valid_lens.reshape(-1)
            X = sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
            return nn.functional.softmax(X.reshape(shape), dim=-1)

    def sequence_mask(X, valid_len, value=0):
        maxlen = X.size(1)
        mask = (
            torch.arange((maxlen), dtype=torch.float32, device=X.device)[None, :]
            < valid_len[:, None]
        )
        X[~mask] = value
        return X

    class DotProductAttention(nn.Module):
        def __init__(self, dropout, **kwargs):
            super().__init__(**kwargs)
            self.dropout = nn.Dropout(dropout)

        def forward(self, queries, keys, values, valid_lens=None):
            d = queries.shape[-1]
            scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
            self.attention_weights = masked_softmax(scores, valid_lens)
            return torch.bmm(self.dropout(self.attention_weights), values)

    return DotProductAttention


def _seed_mxnet():
    """Seed 004 (d2l, MXNet): DotProductAttention with npx.batch_dot, and d2l's
    MXNet masked_softmax (the seed's own is PyTorch code)."""
    from mxnet import gluon, npx

    nn = gluon.nn

    def masked_softmax(X, valid_lens):
        if valid_lens is None:
            return npx.softmax(X)
        else:
            shape = X.shape
            if valid_lens.ndim == 1:
                valid_lens = valid_lens.repeat(shape[1])
            else:
                valid_lens = valid_lens.reshape(-1)
            X = npx.sequence_mask(X.reshape(-1, shape[-1]), valid_lens, True, value=-1e6, axis=1)
            return npx.softmax(X).reshape(shape)

    class DotProductAttention(nn.Block):
        def __init__(self, dropout, **kwargs):
            super().__init__(**kwargs)
            self.dropout = nn.Dropout(dropout)

        def forward(self, queries, keys, values, valid_lens=None):
            d = queries.shape[-1]
            scores = npx.batch_dot(queries, keys, transpose_b=True) / math.sqrt(d)
            self.attention_weights = masked_softmax(scores, valid_lens)
            return npx.batch_dot(self.dropout(self.attention_weights), values)

    return DotProductAttention


# -- timing -----------------------------------------------------------------------


def compare(ours, baseline, seconds, sync=lambda x: x, burst=5):
    """Median seconds of ``ours()`` and ``baseline()``, in interleaved bursts.

    Each round runs a burst of calls of one side, then of the other (the
    order alternating); the first call of a burst is not timed, so that
    worker threads that one framework leaves spinning do not count against
    the other.
    """
    for f in (ours, baseline, ours, baseline):
        sync(f())
    start = time.perf_counter()
    sync(ours())
    sync(baseline())
    pair = max(time.perf_counter() - start, 1e-6)
    rounds = int(min(80, max(3, seconds / pair / (burst + 1))))
    times = ([], [])
    for i in range(rounds):
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            f = (ours, baseline)[side]
            sync(f())
            for _ in range(burst):
                t0 = time.perf_counter()
                sync(f())
                times[side].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1]), len(times[0])


def _rng_inputs(shape, n=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(n)]


def _lens(batch, length, seed=1):
    """d2l-style padding: lengths uniform in [T/4, T]."""
    rng = np.random.default_rng(seed)
    return rng.integers(length // 4, length + 1, batch).astype(np.int32)


# -- the comparisons ----------------------------------------------------------------


def bench_torch_dot(shape, seconds):
    import torch
    import torch.nn.functional as F

    import attention_multi as am

    B, T, d = shape
    q, k, v = (torch.from_numpy(x) for x in _rng_inputs(shape))
    lens = torch.from_numpy(_lens(B, T))
    ours = am.DotProductAttention(0.1, backend="torch").eval()
    q4, k4, v4 = q[:, None], k[:, None], v[:, None]
    seed = _seed_torch()(0.1).eval()

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
            )
        )
    return rows


def bench_torch_mha(shape, seconds):
    import torch

    import attention_multi as am

    B, T, E, h = shape
    x = torch.from_numpy(_rng_inputs((B, T, E), 1)[0])
    lens = torch.from_numpy(_lens(B, T))
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
            )
        ]


def _train_step(f, *tensors):
    """A forward+backward call: ``f()``'s sum backpropagated, grads cleared."""

    def step():
        for t in tensors:
            t.grad = None
        out = f()
        out.sum().backward()
        return out

    return step


def bench_torch_dot_train(shape, seconds):
    import torch
    import torch.nn.functional as F

    import attention_multi as am

    B, T, d = shape
    q, k, v = (torch.from_numpy(x).requires_grad_(True) for x in _rng_inputs(shape))
    lens = torch.from_numpy(_lens(B, T))
    ours = am.DotProductAttention(0.1, backend="torch").train()

    def sdpa():
        mask = (torch.arange(T) < lens[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(
            q[:, None], k[:, None], v[:, None], attn_mask=mask, dropout_p=0.1
        )[:, 0]

    ours(q, k, v, lens)
    return [
        (
            "torch-dot-train",
            "torch",
            "DotProductAttention, train fwd+bwd, dropout 0.1",
            shape,
            ours.last_path,
            "SDPA, dropout_p=0.1 + mask",
            *compare(
                _train_step(lambda: ours(q, k, v, lens), q, k, v),
                _train_step(sdpa, q, k, v),
                seconds,
            ),
            float("nan"),
        )
    ]


def bench_torch_mha_train(shape, seconds):
    import torch

    import attention_multi as am

    B, T, E, h = shape
    x = torch.from_numpy(_rng_inputs((B, T, E), 1)[0])
    lens = torch.from_numpy(_lens(B, T))
    ours = am.MultiHeadAttention(E, E, E, E, h, 0.1, backend="torch").train()
    mha = torch.nn.MultiheadAttention(E, h, dropout=0.1, bias=False, batch_first=True).train()
    padding = torch.arange(T)[None, :] >= lens[:, None]
    ours(x, x, x, lens)
    return [
        (
            "torch-mha-train",
            "torch",
            "MultiHeadAttention, train fwd+bwd, dropout 0.1",
            shape,
            ours.last_path,
            "nn.MultiheadAttention, dropout 0.1",
            *compare(
                _train_step(lambda: ours(x, x, x, lens), *ours.parameters()),
                _train_step(
                    lambda: mha(x, x, x, key_padding_mask=padding, need_weights=False)[0],
                    *mha.parameters(),
                ),
                seconds,
            ),
            float("nan"),
        )
    ]


def bench_jax_dot(shape, seconds):
    import jax
    import jax.numpy as jnp

    import attention_multi as am

    B, T, d = shape
    q, k, v = (jnp.asarray(x) for x in _rng_inputs(shape))
    lens = jnp.asarray(_lens(B, T))
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
        )
    ]


def bench_mxnet_dot(shape, seconds):
    import attention_multi as am
    import backends

    backends.get_backend("mxnet")  # sets NumPy mode before the seed's code runs
    from mxnet import np as mnp
    from mxnet import npx

    B, T, d = shape
    q, k, v = (mnp.array(x) for x in _rng_inputs(shape))
    lens = mnp.array(_lens(B, T))
    ours = am.DotProductAttention(0.1, backend="mxnet").eval()
    seed = _seed_mxnet()(0.1)
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
        )
    ]


def bench_numpy_dot(shape, seconds):
    import torch
    import torch.nn.functional as F

    import attention_multi as am

    B, T, d = shape
    q, k, v = _rng_inputs(shape)
    lens = _lens(B, T)
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


# -- the long-sequence case, one subprocess per configuration ---------------------


def _peak_rss_mib():
    """This process's peak resident set size (ru_maxrss), MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rss_now_mib():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def long_child(spec):
    """Run one long case (in a subprocess); print a JSON line with the results."""
    backend, path, T, out_file, threads = (
        spec[k] for k in ("backend", "path", "length", "out", "threads")
    )
    import attention_multi as am
    import backends

    if backend == "torch":
        import torch

        torch.set_num_threads(threads)
    B = backends.get_backend(backend)
    E, h = LONG["heads"] * LONG["head_size"], LONG["heads"]
    rng = np.random.default_rng(0)
    x = B.asarray(rng.standard_normal((LONG["batch"], T, E), dtype=np.float32))
    lens = B.asarray(np.array([T - T // 8], dtype=np.int32))
    m = am.MultiHeadAttention(E, E, E, E, h, 0.0, backend=backend, path=path).eval()
    bound = 1 / math.sqrt(E)
    am.set_params(
        m,
        {
            n: rng.uniform(-bound, bound, (E, E)).astype(np.float32)
            for n in ("W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight")
        },
    )
    before = _rss_now_mib() or _peak_rss_mib()
    t0 = time.perf_counter()
    if backend == "torch":
        with torch.inference_mode():
            out = m(x, x, x, lens)
    else:
        out = m(x, x, x, lens)
    seconds = time.perf_counter() - t0
    np.save(out_file, B.to_numpy(out))
    print(
        json.dumps(
            {
                "backend": backend,
                "path": path,
                "taken": m.last_path,
                "length": T,
                "seconds": seconds,
                "rss_before_mib": before,
                "peak_rss_mib": _peak_rss_mib(),
            }
        )
    )


def memory_child(name):
    """Run one autograd memory case (in a subprocess); print a JSON line."""
    import attention_multi as am

    what, shape, _ = MEMORY[name]
    rng = np.random.default_rng(0)
    before = _rss_now_mib() or _peak_rss_mib()
    t0 = time.perf_counter()
    if name == "torch-additive-grad":
        import torch

        b, nq, nk, h = (shape[k] for k in ("batch", "queries", "keys", "hiddens"))
        m = am.AdditiveAttention(64, 64, h, 0.0, backend="torch")
        q = torch.from_numpy(rng.standard_normal((b, nq, 64), dtype=np.float32))
        kv = torch.from_numpy(rng.standard_normal((b, nk, 64), dtype=np.float32))
        lens = torch.from_numpy(_lens(b, nk))
        q.requires_grad_(True)
        m(q, kv, kv, lens).sum().backward()
        grad = float(q.grad.abs().sum())
        taken = m.last_path
    else:
        import jax

        import backends

        B = backends.get_backend("jax")
        T, heads = shape["length"], shape["heads"]
        E = heads * shape["head_size"]
        m = am.MultiHeadAttention(E, E, E, E, heads, 0.0, backend="jax").eval()
        x = B.asarray(rng.standard_normal((shape["batch"], T, E), dtype=np.float32))
        lens = np.array([T - T // 8], dtype=np.int32)

        paths = []

        def loss(module):
            out = module(x, x, x, lens)
            paths.append(module.last_path)  # (module is a traced copy here)
            return (out**2).sum()

        grads = jax.grad(loss)(m)
        grad = float(sum(abs(g).sum() for g in grads.named_arrays().values()))
        taken = paths[0]
    print(
        json.dumps(
            {
                "case": name,
                "seconds": time.perf_counter() - t0,
                "taken": taken,
                "rss_before_mib": before,
                "peak_rss_mib": _peak_rss_mib(),
                "grad_abs_sum": grad,
            }
        )
    )


def run_memory(names):
    results = []
    for name in names:
        proc = subprocess.run(
            [sys.executable, "-c", _MEMORY_CHILD, name],
            env=_child_env(),
            capture_output=True,
            text=True,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            results.append({"case": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
        else:
            results.append(json.loads(lines[-1]))
    return results


def memory_table(results):
    lines = [
        "| Case | Shape | Path | Time (s) | Peak RSS (MiB) | Target (MiB) | Met |",
        "|---|---|---|---:|---:|---:|:-:|",
    ]
    for r in results:
        what, shape, target = MEMORY[r["case"]]
        shape_text = " ".join(f"{k}={v}" for k, v in shape.items())
        if "error" in r:
            lines.append(
                f"| {what} | {shape_text} | failed: {r['error']} | | | {target:.0f} | NO |"
            )
            continue
        lines.append(
            f"| {what} | {shape_text} | {r['taken']} | {r['seconds']:.1f} | "
            f"{r['peak_rss_mib']:.0f} | {target:.0f} | "
            f"{'yes' if r['peak_rss_mib'] <= target else 'NO'} |"
        )
    return "\n".join(lines)


def _child_env():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )


_MEMORY_CHILD = (
    "import sys\nfrom attention_multi.cli.bench import memory_child\nmemory_child(sys.argv[1])"
)
_LONG_CHILD = (
    "import json, sys\n"
    "from attention_multi.cli.bench import long_child\n"
    "long_child(json.loads(sys.argv[1]))"
)


def run_long(backends_, length, threads):
    configs = [(b, p) for b in ("numpy", "torch") if b in backends_ for p in ("auto", "chunked")]
    env = _child_env()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend, path in configs:
            spec = {
                "backend": backend,
                "path": path,
                "length": length,
                "out": os.path.join(tmp, f"{backend}-{path}.npy"),
                "threads": threads,
            }
            proc = subprocess.run(
                [sys.executable, "-c", _LONG_CHILD, json.dumps(spec)],
                env=env,
                capture_output=True,
                text=True,
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode or not lines:
                results.append(
                    {
                        "backend": backend,
                        "path": path,
                        "length": length,
                        "error": (proc.stderr.strip().splitlines() or ["?"])[-1],
                    }
                )
                continue
            result = json.loads(lines[-1])
            out = np.load(spec["out"])
            if results and "out" in results[0]:
                result["max_abs_diff"] = float(np.abs(out - results[0]["out"]).max())
            result["out"] = out
            results.append(result)
    for r in results:
        r.pop("out", None)
    return results


# -- ring attention: P torch processes against one ------------------------------------


def ring_child(spec):
    """One process of the ring case (``size`` 0: one process, the whole
    sequence through ``dot_product_attention``); prints a JSON line."""
    import torch
    import torch.distributed as dist

    import attention_multi as am

    rank, size, T, threads = (spec[k] for k in ("rank", "size", "length", "threads"))
    torch.set_num_threads(threads)
    b, h, d = RING["batch"], RING["heads"], RING["head_size"]
    # each process draws only its shard: pieces of T/16 steps, each from its own seed
    piece = max(1, T // 16)
    first, stop = (rank * (T // size), (rank + 1) * (T // size)) if size else (0, T)

    def draw(which):
        return torch.cat(
            [
                torch.from_numpy(
                    np.random.default_rng((which, j)).standard_normal(
                        (b, h, piece, d), dtype=np.float32
                    )
                )
                for j in range(first // piece, stop // piece)
            ],
            2,
        )

    q, k, v = draw(0), draw(1), draw(2)
    lens = torch.tensor([T - T // 8] * b)
    if size:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        dist.init_process_group("gloo", rank=rank, world_size=size)
        dist.barrier()
    before = _rss_now_mib() or _peak_rss_mib()
    t0 = time.perf_counter()
    with torch.no_grad():
        if size:
            out = am.ring_attention(q, k, v, lens, memory_budget=RING_BUDGET)
        else:
            out = am.dot_product_attention(q, k, v, lens)
    seconds = time.perf_counter() - t0
    np.save(spec["out"], out.numpy())
    print(
        json.dumps(
            {
                "size": size,
                "rank": rank,
                "length": T,
                "seconds": seconds,
                "rss_before_mib": before,
                "peak_rss_mib": _peak_rss_mib(),
            }
        )
    )
    sys.stdout.flush()
    if size:
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)  # (torch 2.13 CPU workers that ran SDPA may abort at teardown)


_RING_CHILD = (
    "import json, sys\n"
    "from attention_multi.cli.bench import ring_child\n"
    "ring_child(json.loads(sys.argv[1]))"
)


def run_ring(length, sizes, threads):
    """One process, then P = each of ``sizes``: per configuration the
    slowest process's time, the largest peak RSS and the max abs difference of
    the gathered output from one process's."""
    import socket

    env = _child_env()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        reference = None
        for size in [0] + list(sizes):
            if size and length % (16 * size):
                results.append(
                    {
                        "size": size,
                        "length": length,
                        "error": f"T={length} is not a multiple of 16 * {size}",
                    }
                )
                continue
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            procs = []
            for rank in range(max(1, size)):
                spec = {
                    "rank": rank,
                    "size": size,
                    "length": length,
                    "port": port,
                    "threads": max(1, threads // max(1, size)),
                    "out": os.path.join(tmp, f"{size}-{rank}.npy"),
                }
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _RING_CHILD, json.dumps(spec)],
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                )
            outputs = [p.communicate() for p in procs]
            lines = [[ln for ln in out.splitlines() if ln.startswith("{")] for out, _ in outputs]
            if any(p.returncode for p in procs) or not all(lines):
                err = next((e for (_, e), p in zip(outputs, procs) if p.returncode), "?")
                results.append(
                    {
                        "size": size,
                        "length": length,
                        "error": (err.strip().splitlines() or ["?"])[-1],
                    }
                )
                continue
            ranks = [json.loads(ln[-1]) for ln in lines]
            out = np.concatenate(
                [np.load(os.path.join(tmp, f"{size}-{r}.npy")) for r in range(max(1, size))], axis=2
            )
            result = {
                "size": size,
                "length": length,
                "seconds": max(r["seconds"] for r in ranks),
                "peak_rss_mib": [r["peak_rss_mib"] for r in ranks],
                "rss_before_mib": [r["rss_before_mib"] for r in ranks],
            }
            if reference is None:
                reference = out
            else:
                result["max_abs_diff"] = float(np.abs(out - reference).max())
            results.append(result)
    return results


def ring_table(results):
    lines = [
        "| Processes | Computation | Time (s) | Peak RSS per process (MiB) | "
        "RSS before the call (MiB) | Max abs diff vs one process |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        what = "dot_product_attention" if r["size"] == 0 else "ring_attention"
        procs = max(1, r["size"])
        if "error" in r:
            lines.append(f"| {procs} | {what} | failed: {r['error']} | | | |")
            continue
        diff = r.get("max_abs_diff")
        lines.append(
            f"| {procs} | {what} | {r['seconds']:.2f} | "
            f"{max(r['peak_rss_mib']):.0f} | {max(r['rss_before_mib']):.0f} | "
            f"{'-' if diff is None else f'{diff:.1e}'} |"
        )
    return "\n".join(lines)


# -- report -------------------------------------------------------------------------


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for name in ("torch", "jax", "mxnet"):
        if name in sys.modules:
            versions[name] = getattr(sys.modules[name], "__version__", "?")
    from backends.numpy_threads import blas_config

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "versions": versions,
        "numpy_blas": blas_config() or "not OpenBLAS",
    }


def _blas_note(info):
    """A hint when NumPy's OpenBLAS runs old kernels on an AVX-512 CPU."""
    config = info["numpy_blas"]
    try:
        with open("/proc/cpuinfo") as f:
            avx512 = " avx512f " in f.read()
    except OSError:
        return ""
    if avx512 and any(
        f" {core} " in f" {config} "
        for core in ("Prescott", "Core2", "Nehalem", "Sandybridge", "Haswell")
    ):
        return (
            "Note: NumPy's OpenBLAS does not recognize this CPU and runs "
            "pre-AVX-512 kernels; OPENBLAS_CORETYPE=SkylakeX in the environment "
            "makes NumPy's matrix products several times faster."
        )
    return ""


def _fmt_shape(key, shape):
    if len(shape) == 3:
        return "B={} T={} d={}".format(*shape)
    return "B={} T={} E={} h={}".format(*shape)


def table(rows):
    lines = [
        "| Measured | Shape | Path | Against | Ours (ms) | Theirs (ms) | Ratio | Target | Met |",
        "|---|---|---|---|---:|---:|---:|---:|:-:|",
    ]
    for key, backend, what, shape, path, against, ours, theirs, _, _ in rows:
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
            f"{target} | {met} |"
        )
    return "\n".join(lines)


def long_table(results):
    lines = [
        "| Backend | path= | Path taken | T | Time (s) | Peak RSS (MiB) | "
        "RSS before the call (MiB) | max abs diff vs first row | Under 2 GiB |",
        "|---|---|---|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(
                f"| {r['backend']} | {r['path']} | failed: {r['error']} | "
                f"{r['length']} | | | | | NO |"
            )
            continue
        diff = r.get("max_abs_diff")
        lines.append(
            f"| {r['backend']} | {r['path']} | {r['taken']} | {r['length']} | "
            f"{r['seconds']:.1f} | {r['peak_rss_mib']:.0f} | "
            f"{r['rss_before_mib']:.0f} | {'-' if diff is None else f'{diff:.1e}'} | "
            f"{'yes' if r['peak_rss_mib'] < RSS_LIMIT_MIB else 'NO'} |"
        )
    return "\n".join(lines)


def main(args):
    import backends

    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    available = backends.available_backends()
    shapes = (
        args.shapes.split(",") if args.shapes else ["medium"] if args.quick else list(DOT_SHAPES)
    )
    seconds = args.seconds or (1.0 if args.quick else 3.0)
    length = (
        args.long_length
        if args.long_length is not None
        else (4096 if args.quick else LONG["length"])
    )
    if args.json:
        check_writable(args.json)  # now, not after minutes of timing
    info = machine()
    threads = args.threads or os.cpu_count()
    long_results = []
    if length:  # first: Linux carries the parent's RSS over into a child's
        # ru_maxrss, so spawn the children while this process is small
        print(f"  long case T={length} ...", file=sys.stderr, flush=True)
        launcher_rss = _rss_now_mib()
        long_results = run_long([n for n in wanted if n in available], length, threads)
    ring_length = (
        args.ring_length
        if args.ring_length is not None
        else (2048 if args.quick else RING["length"])
    )
    ring_results = []
    if ring_length and "torch" in wanted and "torch" in available:
        sizes = [int(n) for n in args.ring_processes.split(",") if n.strip()]
        print(
            f"  ring attention T={ring_length}, processes {sizes} ...", file=sys.stderr, flush=True
        )
        ring_results = run_ring(ring_length, sizes, threads)
    memory_results = []
    if not args.no_memory:
        cases = [c for c in MEMORY if c.split("-")[0] in wanted and c.split("-")[0] in available]
        print(f"  memory under autograd: {', '.join(cases)} ...", file=sys.stderr, flush=True)
        memory_results = run_memory(cases)
    usable = []
    for name in wanted:
        if name not in available:
            print(f"skipping {name}: not installed", file=sys.stderr)
            continue
        try:
            backends.get_backend(name)
        except ImportError as exc:
            print(f"skipping {name}: {exc}", file=sys.stderr)
            continue
        usable.append(name)
    if any(name in usable for name in ("torch", "numpy")):
        import torch  # every torch baseline; MXNet's import leaves torch 1 thread

        torch.set_num_threads(threads)
    rows = []
    for shape_name in shapes:
        for name in usable:
            for kind, bench in BENCHES[name]:
                shape = (DOT_SHAPES if kind == "dot" else MHA_SHAPES)[shape_name]
                print(f"  {name} {kind} {shape_name} ...", file=sys.stderr, flush=True)
                rows.extend(bench(shape, seconds))
    info["versions"] = machine()["versions"]
    print(
        f"Machine: {info['cpu']}, {info['cores']} cores ({info['platform']}); "
        f"torch threads: {threads}"
    )
    print("Versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(
        f"NumPy BLAS: {info['numpy_blas']}"
        + (
            f" (OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']})"
            if os.environ.get("OPENBLAS_CORETYPE")
            else ""
        )
    )
    if _blas_note(info):
        print(_blas_note(info))
    print(
        "Float32, random valid_lens (1-D, uniform in [T/4, T]); forward inference in "
        "eval mode unless the row says train (forward+backward, dropout 0.1); medians "
        "of interleaved bursts of calls.\n"
    )
    print(table(rows))
    if memory_results:
        print(
            "\nPeak memory under autograd (forward+backward), one subprocess each, peak "
            "RSS from its ru_maxrss:\n"
        )
        print(memory_table(memory_results))
    if length:
        print(
            f"\nLong sequence: MultiHeadAttention, B={LONG['batch']}, "
            f"{LONG['heads']} heads, head size {LONG['head_size']}, T={length}, "
            f"valid_lens=[T - T/8], float32 (materialized scores: "
            f"{LONG['heads'] * length * length * 4 / 2**30:.1f} GiB); one subprocess "
            f"each (launched while this process had {launcher_rss or 0:.0f} MiB "
            f"resident), peak RSS from its ru_maxrss.\n"
        )
        print(long_table(long_results))
    if ring_results:
        print(
            f"\nRing attention: B={RING['batch']}, {RING['heads']} heads, head size "
            f"{RING['head_size']}, T={ring_length}, valid_lens=[T - T/8], float32, "
            f"forward, memory_budget={RING_BUDGET // 2**20} MiB; torch processes "
            f"with gloo on this machine, each with "
            f"{threads}/P threads; time of the slowest process, peak RSS "
            f"(ru_maxrss) of the largest.\n"
        )
        print(ring_table(ring_results))
    if args.json:
        with atomic_write(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "machine": info,
                    "torch_threads": threads,
                    "rows": [
                        dict(
                            zip(
                                (
                                    "key",
                                    "backend",
                                    "measured",
                                    "shape",
                                    "path",
                                    "against",
                                    "ours_s",
                                    "theirs_s",
                                    "calls",
                                    "max_abs_diff",
                                ),
                                r,
                            )
                        )
                        for r in rows
                    ],
                    "long": long_results,
                    "memory": memory_results,
                    "ring": ring_results,
                },
                f,
                indent=1,
            )
    return 0
