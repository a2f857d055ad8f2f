"""The ring's numerics against world size: ``python -m
attention_multi.cli.bench.ring_numerics [--length T] [--processes 1,2,4,8]``.

Ring attention (causal) over P torch processes (gloo, this machine's CPU),
each layout, in float32 and bfloat16, forward and backward; beside it
``dot_product_attention`` in one process. Per row, the max abs error of the
output and of the gradients of queries, keys and values against the float64
oracle (``attention_multi.reference``) on the same inputs (those of the row's
dtype, as float64), and the largest magnitude of each (the errors' scale).
Prints a Markdown table; ``--json`` writes the rows too.

``--packed``: instead, packed documents (lengths uniform in [256, 4096],
causal within each, ``segment_ids``) over the largest P, float32, each layout,
against ``dot_product_attention(..., segment_ids=...)`` in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np

CASE = dict(batch=1, heads=2, head_size=64, length=4096)
DTYPES = ("float32", "bfloat16")
LAYOUTS = ("contiguous", "zigzag")
KEYS = ("out", "dq", "dk", "dv")


DOCS = (256, 4096)  # --packed: document lengths, uniform


def documents(length):
    """(1, T) segment ids of documents of lengths uniform in ``DOCS``."""
    from ... import segments_from_lengths

    rng, lengths = np.random.default_rng(1), []
    while sum(lengths) < length:
        lengths.append(int(rng.integers(DOCS[0], DOCS[1] + 1)))
    lengths[-1] -= sum(lengths) - length
    return segments_from_lengths(lengths, length)


def inputs(length):
    """q, k, v and the output's cotangent (batch, heads, T, d), float32."""
    rng = np.random.default_rng(0)
    shape = (CASE["batch"], CASE["heads"], length, CASE["head_size"])
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]


def child(spec):
    """One process: every layout and dtype; writes its parts of the outputs
    and gradients (``size`` 0: the whole sequence through
    ``dot_product_attention``)."""
    import torch
    import torch.distributed as dist

    import attention_multi as am

    rank, size = spec["rank"], spec["size"]
    torch.set_num_threads(1)
    if size:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        dist.init_process_group("gloo", rank=rank, world_size=size)
    whole = [torch.from_numpy(x) for x in inputs(spec["length"])]
    forms = {"causal": True}
    if spec.get("packed"):
        forms["segment_ids"] = torch.from_numpy(documents(spec["length"]))
    result = {}
    for dtype in ("float32",) if spec.get("packed") else DTYPES:
        for layout in LAYOUTS if size else ("-",):
            xs = [x.to(getattr(torch, dtype)) for x in whole]
            if size:
                xs = [am.ring_shard(x, rank, size, layout=layout) for x in xs]
            q, k, v = (x.clone().requires_grad_() for x in xs[:3])
            if size:
                out = am.ring_attention(q, k, v, layout=layout, **forms)
            else:
                out = am.dot_product_attention(q, k, v, **forms)
            (out.float() * xs[3].float()).sum().backward()
            for key, x in zip(KEYS, (out, q.grad, k.grad, v.grad)):
                result[f"{dtype}.{layout}.{key}"] = x.detach().float().numpy()
    np.savez(os.path.join(spec["out"], f"{size}-{rank}.npz"), **result)
    sys.stdout.flush()
    if size:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)  # (torch CPU workers that ran SDPA may abort at teardown)


_CHILD = (
    "import json, sys\n"
    "from attention_multi.cli.bench.ring_numerics import child\n"
    "child(json.loads(sys.argv[1]))"
)


def oracle(length, dtype):
    """The float64 oracle's output and gradients on the row's inputs."""
    import torch

    from ... import reference

    xs = [torch.from_numpy(x).to(getattr(torch, dtype)).double().numpy() for x in inputs(length)]
    out, _ = reference.attention(*xs[:3], causal=True)
    dq, dk, dv, _ = reference.attention_gradients(*xs, causal=True)
    return dict(zip(KEYS, (out, dq, dk, dv)))


def launch(length, sizes, tmp, packed=False):
    """The parts each process wrote, per P (0: one process)."""
    from .timing import child_env

    env, runs = child_env(), {}
    for size in [0] + list(sizes):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        spec = {"size": size, "length": length, "port": port, "out": tmp, "packed": packed}
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, json.dumps(dict(spec, rank=r))], env=env
            )
            for r in range(max(1, size))
        ]
        if any(p.wait() for p in procs):
            raise RuntimeError(f"a process of the ring over {size} failed")
        parts = []
        for r in range(max(1, size)):
            with np.load(os.path.join(tmp, f"{size}-{r}.npz")) as f:
                parts.append({k: f[k] for k in f.files})
        runs[size] = parts
    return runs


def run_packed(length, size):
    """Rows: layout, and per output the max abs difference of the ring over
    ``size`` processes from one process, and the largest magnitude."""
    from ... import ring_gather

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = launch(length, [size], tmp, packed=True)
    one = runs[0][0]
    for layout in LAYOUTS:
        row = {"processes": size, "layout": layout}
        for key in KEYS:
            got = ring_gather([p[f"float32.{layout}.{key}"] for p in runs[size]], layout=layout)
            want = one[f"float32.-.{key}"]
            row[key] = float(np.abs(got - want).max())
            row[f"{key}_scale"] = float(np.abs(want).max())
        rows.append(row)
    return rows


def run(length, sizes):
    """Rows: processes (0: one process, dot_product_attention), layout,
    dtype, and per output its max abs error and largest magnitude."""
    from ... import ring_gather

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = launch(length, sizes, tmp)
        for dtype in DTYPES:
            want = oracle(length, dtype)
            for size, parts in runs.items():
                for layout in LAYOUTS if size else ("-",):
                    row = {"processes": max(1, size), "ring": bool(size), "layout": layout}
                    row["dtype"] = dtype
                    for key in KEYS:
                        got = [p[f"{dtype}.{layout}.{key}"] for p in parts]
                        whole = ring_gather(got, layout=layout) if size else got[0]
                        row[key] = float(np.abs(whole - want[key]).max())
                        row[f"{key}_scale"] = float(np.abs(want[key]).max())
                    rows.append(row)
    return rows


def table(rows):
    lines = [
        "| Computation | Processes | Layout | dtype | out | dq | dk | dv |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        what = "ring_attention" if r["ring"] else "dot_product_attention"
        errors = " | ".join(f"{r[k]:.1e}" for k in KEYS)
        lines.append(f"| {what} | {r['processes']} | {r['layout']} | {r['dtype']} | {errors} |")
    scale = rows[0]
    lines.append(
        "\nLargest magnitudes (float32 oracle): "
        + ", ".join(f"{k} {scale[k + '_scale']:.2f}" for k in KEYS)
    )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=CASE["length"])
    parser.add_argument("--processes", default="1,2,4,8")
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.processes.split(",")]
    bad = [n for n in sizes if args.length % (2 * n)]
    if bad:
        parser.error(f"--length must be a multiple of 2 P for each P (not of {bad})")
    if args.packed:
        rows = run_packed(args.length, max(sizes))
        print(
            f"Packed documents (lengths uniform in {list(DOCS)}, causal within each), B="
            f"{CASE['batch']}, {CASE['heads']} heads, d={CASE['head_size']}, T={args.length}, "
            f"float32: ring_attention over {max(sizes)} processes against "
            f"dot_product_attention in one process, max abs difference (largest magnitude).\n"
        )
        print("| Layout | out | dq | dk | dv |\n|---|---:|---:|---:|---:|")
        for r in rows:
            cells = " | ".join(f"{r[k]:.1e} ({r[k + '_scale']:.1f})" for k in KEYS)
            print(f"| {r['layout']} | {cells} |")
    else:
        rows = run(args.length, sizes)
        print(
            f"Causal attention, B={CASE['batch']}, {CASE['heads']} heads, d={CASE['head_size']}, "
            f"T={args.length}, inputs and output cotangent standard normal; max abs error "
            f"against the float64 oracle on the same inputs.\n"
        )
        print(table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
