"""What both timing scripts print: medians of interleaved runs, and each
one's ratio against the framework's own op."""

import statistics
import time


def row(title, fns, base, finish, reps=20, inner=5):
    """Time ``fns`` (name -> function) interleaved and print a line of their
    medians and ratios to ``base``; ``finish(out)`` waits for the device."""
    for f in fns.values():
        finish(f())
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            finish(None)
            t = time.perf_counter()
            for _ in range(inner):
                out = f()
            finish(out)
            times[k].append((time.perf_counter() - t) / inner)
    t = {k: statistics.median(v) for k, v in times.items()}
    parts = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items())
    ratios = ", ".join(f"{k}/{base} {t[k] / t[base]:.2f}x" for k in t if k != base)
    print(f"{title}: {parts}; {ratios}", flush=True)
