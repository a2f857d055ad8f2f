"""Ring attention: P torch processes against one."""

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from .timing import child_env, peak_rss_mib, rss_now_mib

RING = dict(batch=1, heads=8, head_size=64, length=8192)
RING_BUDGET = 512 * 2**20  # memory_budget of ring_attention (the default): 32 MiB
# of scores per block of queries. (Smaller blocks, below glibc's 32 MiB
# ceiling for its dynamic mmap threshold, come from the heap, which then
# fragments: 4 MiB blocks at T=8192 in one process peaked at 6 GiB RSS.)


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
    before = rss_now_mib() or peak_rss_mib()
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
                "peak_rss_mib": peak_rss_mib(),
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
    "from attention_multi.cli.bench.ring import ring_child\n"
    "ring_child(json.loads(sys.argv[1]))"
)


def run_ring(length, sizes, threads):
    """One process, then P = each of ``sizes``: per configuration the
    slowest process's time, the largest peak RSS and the max abs difference of
    the gathered output from one process's."""
    import socket

    env = child_env()
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


BALANCE = dict(batch=1, heads=8, head_size=64, length=16384, processes=4)


def balance_child(spec):
    """One process of the balance case: causal ring attention, forward, in
    ``spec["layout"]``; prints a JSON line with its step log."""
    import torch
    import torch.distributed as dist

    import attention_multi as am

    rank, size, T = spec["rank"], spec["size"], spec["length"]
    torch.set_num_threads(spec["threads"])
    shape = (BALANCE["batch"], BALANCE["heads"], T // size, BALANCE["head_size"])
    q, k, v = (
        torch.from_numpy(np.random.default_rng((rank, i)).standard_normal(shape, np.float32))
        for i in range(3)
    )  # (the values do not change the work: each process draws its own part)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    dist.barrier()
    log = []
    t0 = time.perf_counter()
    with torch.no_grad():
        am.ring_attention(
            q, k, v, causal=True, layout=spec["layout"], memory_budget=RING_BUDGET, step_log=log
        )
    seconds = time.perf_counter() - t0
    dist.barrier()
    wall = time.perf_counter() - t0
    print(json.dumps({"rank": rank, "seconds": seconds, "wall": wall, "steps": log}))
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(0)  # (torch 2.13 CPU workers that ran SDPA may abort at teardown)


_BALANCE_CHILD = (
    "import json, sys\n"
    "from attention_multi.cli.bench.ring import balance_child\n"
    "balance_child(json.loads(sys.argv[1]))"
)


def run_balance(length, size, threads):
    """Per layout (contiguous, zigzag): each participant's step log and time."""
    import socket

    env = child_env()
    results = []
    for layout in ("contiguous", "zigzag"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        spec = {"size": size, "length": length, "port": port, "layout": layout}
        spec["threads"] = max(1, threads // size)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _BALANCE_CHILD, json.dumps(dict(spec, rank=r))],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(size)
        ]
        outputs = [p.communicate() for p in procs]
        lines = [[ln for ln in out.splitlines() if ln.startswith("{")] for out, _ in outputs]
        if any(p.returncode for p in procs) or not all(lines):
            err = next((e for (_, e), p in zip(outputs, procs) if p.returncode), "?")
            results.append({"layout": layout, "error": (err.strip().splitlines() or ["?"])[-1]})
            continue
        ranks = sorted((json.loads(ln[-1]) for ln in lines), key=lambda r: r["rank"])
        results.append({"layout": layout, "length": length, "size": size, "ranks": ranks})
    return results


def balance_table(results):
    lines = [
        "| Layout | Participant | Scores computed (M) | x mean | Calls | "
        "Compute per step (s) | Exchange waits (s) | Time (s) |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    walls = {}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['layout']} | failed: {r['error']} | | | | | | |")
            continue
        scores = [sum(s["scores"] for s in p["steps"]) for p in r["ranks"]]
        mean = sum(scores) / len(scores)
        walls[r["layout"]] = max(p["wall"] for p in r["ranks"])
        for p, n in zip(r["ranks"], scores):
            steps = ", ".join(f"{s['compute_s']:.2f}" for s in p["steps"])
            waits = sum(s["exchange_s"] for s in p["steps"])
            calls = sum(s["calls"] for s in p["steps"])
            lines.append(
                f"| {r['layout']} | {p['rank']} | {n / 1e6:.0f} | {n / mean:.2f} | {calls} | "
                f"{steps} | {waits:.2f} | {p['seconds']:.2f} |"
            )
    if len(walls) == 2:
        lines.append(
            f"\nWall time of the ring (slowest participant): contiguous "
            f"{walls['contiguous']:.2f} s, zigzag {walls['zigzag']:.2f} s "
            f"(zigzag / contiguous = {walls['zigzag'] / walls['contiguous']:.2f})."
        )
    return "\n".join(lines)
