"""Peak memory under autograd: each case in a subprocess of its own."""

import json
import time

import numpy as np

from .timing import peak_rss_mib, random_lens, rss_now_mib, run_child

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
    # (issue 24: jitted, the way JAX trains; the lengths built inside the function)
    "jax-mha-jit-grad-lens": (
        "jax.jit(jax.grad) through MultiHeadAttention, valid_lens",
        dict(batch=1, heads=8, head_size=32, length=8192),
        1.5 * 1024,
    ),
    "jax-mha-jit-grad": (
        "jax.jit(jax.grad) through MultiHeadAttention, no lengths",
        dict(batch=1, heads=8, head_size=32, length=8192),
        1.5 * 1024,
    ),
    # (issue 24: the torch equivalent, compiled)
    "torch-mha-compile-grad-lens": (
        "torch.compile(MultiHeadAttention) forward+backward, valid_lens",
        dict(batch=1, heads=8, head_size=32, length=8192),
        1.5 * 1024,
    ),
    "torch-mha-compile-grad": (
        "torch.compile(MultiHeadAttention) forward+backward, no lengths",
        dict(batch=1, heads=8, head_size=32, length=8192),
        1.5 * 1024,
    ),
}


def memory_child(name):
    """Run one autograd memory case (in a subprocess); print a JSON line."""
    import attention_multi as am

    what, shape, _ = MEMORY[name]
    rng = np.random.default_rng(0)
    before = rss_now_mib() or peak_rss_mib()
    t0 = time.perf_counter()
    if name == "torch-additive-grad":
        import torch

        b, nq, nk, h = (shape[k] for k in ("batch", "queries", "keys", "hiddens"))
        m = am.AdditiveAttention(64, 64, h, 0.0, backend="torch")
        q = torch.from_numpy(rng.standard_normal((b, nq, 64), dtype=np.float32))
        kv = torch.from_numpy(rng.standard_normal((b, nk, 64), dtype=np.float32))
        lens = torch.from_numpy(random_lens(b, nk))
        q.requires_grad_(True)
        m(q, kv, kv, lens).sum().backward()
        grad = float(q.grad.abs().sum())
        taken = m.last_path
    elif name.startswith("torch-mha-compile"):
        import torch

        T, heads = shape["length"], shape["heads"]
        E = heads * shape["head_size"]
        m = am.MultiHeadAttention(E, E, E, E, heads, 0.0, backend="torch").eval()
        x = torch.from_numpy(rng.standard_normal((shape["batch"], T, E), dtype=np.float32))
        lens = None if name.endswith("grad") else torch.tensor([T - T // 8])
        compiled = torch.compile(m)
        compiled(x, x, x, lens).square().sum().backward()
        grad = float(sum(p.grad.abs().sum() for p in m.parameters()))
        taken = m.last_path
    else:
        import jax

        B = am.get_backend("jax")
        T, heads = shape["length"], shape["heads"]
        E = heads * shape["head_size"]
        m = am.MultiHeadAttention(E, E, E, E, heads, 0.0, backend="jax").eval()
        x = B.asarray(rng.standard_normal((shape["batch"], T, E), dtype=np.float32))
        jitted = name.startswith("jax-mha-jit")
        lens = None if name == "jax-mha-jit-grad" else np.array([T - T // 8], dtype=np.int32)

        paths = []

        def loss(module):
            out = module(x, x, x, jax.numpy.asarray(lens) if jitted and lens is not None else lens)
            paths.append(module.last_path)  # (module is a traced copy here)
            return (out**2).sum()

        grads = (jax.jit(jax.grad(loss)) if jitted else jax.grad(loss))(m)
        jax.block_until_ready(grads)
        grad = float(sum(abs(g).sum() for g in grads.named_arrays().values()))
        taken = paths[0]
    print(
        json.dumps(
            {
                "case": name,
                "seconds": time.perf_counter() - t0,
                "taken": taken,
                "rss_before_mib": before,
                "peak_rss_mib": peak_rss_mib(),
                "grad_abs_sum": grad,
            }
        )
    )


def run_memory(names):
    results = []
    for name in names:
        result, error = run_child(__name__, "memory_child", name)
        results.append({"case": name, "error": error} if error else result)
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
