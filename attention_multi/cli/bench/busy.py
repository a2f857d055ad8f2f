"""The busy-machine table: the large-batch and packed rows measured again
with one CPU-bound process beside them (a busy loop the bench starts and
stops), each against the same row measured idle. Every framework call is a
parallel region that waits for the threads the OS has descheduled, so a
path of many calls loses on a busy machine what it wins on an idle one."""

import contextlib
import subprocess
import sys
import time

BUSY_OVER_IDLE = 1.3
"""The target: each ratio busy at most this times the same ratio idle."""

BUSY_TARGETS = {"torch-dot-sdpa": 1.0, "torch-mha-nn": 1.0, "torch-dot-seed": 1.0}
"""Rows whose busy ratio has a target of its own (at most this)."""


@contextlib.contextmanager
def one_busy_process():
    """One CPU-bound Python process beside this one while the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # (running before the timing starts)
        yield
    finally:
        proc.kill()
        proc.wait()


def busy_rows(speed_idle, speed_busy, packed_idle, packed_busy):
    """One dict per row measured both ways: its idle and busy ratios."""
    rows = []
    busy = {(r[0], r[3]): r for r in speed_busy}
    for r in speed_idle:
        other = busy.get((r[0], r[3]))
        if other is not None:
            rows.append(_pair(r[0], f"{r[1]} {r[2]}", r[5], r[3], r[6] / r[7], other[6] / other[7]))
    busy = {(r[0], r[1]): r for r in packed_busy}
    for r in packed_idle:
        other = busy.get((r[0], r[1]))
        if other is not None and r[7] is not None:  # (timed calls, not block builds)
            rows.append(_pair(None, f"{r[0]} packed {r[1]}", r[2], None, r[5], other[5]))
    return rows


def _pair(key, what, against, shape, idle, busy):
    target = BUSY_TARGETS.get(key)
    met = busy <= BUSY_OVER_IDLE * idle and (target is None or busy <= target)
    return {
        "key": key,
        "measured": what,
        "against": against,
        "shape": shape,
        "idle_ratio": idle,
        "busy_ratio": busy,
        "busy_over_idle": busy / idle,
        "target": target,
        "met": met,
    }


def busy_table(rows):
    lines = [
        "| Measured | Against | Shape | Idle ratio | Busy ratio | Busy / idle | Target | Met |",
        "|---|---|---|---:|---:|---:|---|:-:|",
    ]
    for r in rows:
        target = f"≤ {BUSY_OVER_IDLE:.1f}x idle" + (
            f", ≤ {r['target']:.2f}x" if r["target"] is not None else ""
        )
        shape = "-" if r["shape"] is None else "×".join(map(str, r["shape"]))
        lines.append(
            f"| {r['measured']} | {r['against']} | {shape} "
            f"| {r['idle_ratio']:.2f}x | {r['busy_ratio']:.2f}x "
            f"| {r['busy_over_idle']:.2f}x | {target} | {'yes' if r['met'] else 'NO'} |"
        )
    return "\n".join(lines)
