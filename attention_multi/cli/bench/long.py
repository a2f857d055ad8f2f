"""The long sequence: MultiHeadAttention at T=16384, one subprocess per path."""

import json
import math
import os
import tempfile
import time

import numpy as np

from .timing import peak_rss_mib, rss_now_mib, run_child

LONG = dict(batch=1, heads=8, head_size=64, length=16384)
RSS_LIMIT_MIB = 2048


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
    before = rss_now_mib() or peak_rss_mib()
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
                "peak_rss_mib": peak_rss_mib(),
            }
        )
    )


def run_long(backends_, length, threads):
    configs = [(b, p) for b in ("numpy", "torch") if b in backends_ for p in ("auto", "chunked")]
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
            result, error = run_child(__name__, "long_child", spec)
            if error:
                results.append({"backend": backend, "path": path, "length": length, "error": error})
                continue
            out = np.load(spec["out"])
            if results and "out" in results[0]:
                result["max_abs_diff"] = float(np.abs(out - results[0]["out"]).max())
            result["out"] = out
            results.append(result)
    for r in results:
        r.pop("out", None)
    return results


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
