"""Timing and measuring, shared by every table of the bench: interleaved
medians, the inputs, peak memory, and the subprocesses that measure it."""

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np


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


def rng_inputs(shape, n=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(n)]


def random_lens(batch, length, seed=1):
    """d2l-style padding: lengths uniform in [T/4, T]."""
    rng = np.random.default_rng(seed)
    return rng.integers(length // 4, length + 1, batch).astype(np.int32)


def train_step(f, *tensors):
    """A forward+backward call: ``f()``'s sum backpropagated, grads cleared."""

    def step():
        for t in tensors:
            t.grad = None
        out = f()
        out.sum().backward()
        return out

    return step


def peak_rss_mib():
    """This process's peak resident set size (ru_maxrss), MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rss_now_mib():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def child_env():
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )


def run_child(module, function, arg, env=None):
    """``module.function(arg)`` in a fresh Python process (its own peak RSS);
    returns ``(the last JSON line it printed or None, its stderr's last line)``."""
    code = f"import json, sys\nfrom {module} import {function}\n{function}(json.loads(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(arg)],
        env=env or child_env(),
        capture_output=True,
        text=True,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return None, (proc.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(lines[-1]), None


# Operations that only relabel memory (views, metadata): not counted as calls.
_NO_WORK = {
    "aten::alias",
    "aten::as_strided",
    "aten::detach",
    "aten::expand",
    "aten::lift_fresh",
    "aten::permute",
    "aten::reshape",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::select",
    "aten::slice",
    "aten::split",
    "aten::split_with_sizes",
    "aten::squeeze",
    "aten::t",
    "aten::transpose",
    "aten::unbind",
    "aten::unsqueeze",
    "aten::view",
}


GRAIN = 32768
"""torch's ``at::internal::GRAIN_SIZE``: an operation on fewer elements runs
on the calling thread, without a parallel region."""


def torch_calls(f):
    """The parallel regions one call of ``f`` asks of torch's CPU pool: its
    operations at the top of torch's profiler tree that do work (views
    excepted) on at least ``GRAIN`` elements. Each waits for descheduled
    threads on a busy machine. A compiled region counts as one."""
    from torch.profiler import ProfilerActivity, profile

    # (torch 2.13's profiler writes two lines to stderr per run below Kineto's level 6)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    f()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        f()
    events = prof.events()
    compiled = sum(e.name.startswith("Torch-Compiled Region") for e in events)
    return compiled + sum(
        e.name.startswith("aten::")
        and e.name not in _NO_WORK
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        and max((int(np.prod(s)) for s in e.input_shapes if s), default=0) >= GRAIN
        for e in events
    )
