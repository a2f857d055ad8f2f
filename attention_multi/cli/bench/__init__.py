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

The package: this file parses the arguments and runs the tables; ``speed``,
``memory``, ``long``, ``ring``, ``packed``, ``small``, ``busy`` and ``tiling``
(what tiles of SDPA calls can reach, torch alone) are the tables, each
measuring in ``timing``'s way; ``d2l_torch`` and ``d2l_mxnet`` are d2l's own code, the
baselines (the tests use the same copies).
"""

import json
import os
import sys
import time

from ...config import get_backend
from ...files import atomic_write, check_writable
from ..arguments import (
    backend_names,
    nonnegative_int,
    one_of,
    positive_float,
    positive_int,
    positive_ints,
)
from .busy import busy_rows, busy_table, one_busy_process
from .environment import blas_note, machine
from .integrations import INTEGRATIONS, integrations_table, run_integrations
from .integrations import with_busy as integrations_with_busy
from .long import LONG, long_table, run_long
from .memory import MEMORY, memory_table, run_memory
from .packed import PACKED, packed_table, run_flex, run_packed
from .ring import (
    BALANCE,
    RING,
    RING_BUDGET,
    balance_table,
    ring_table,
    run_balance,
    run_ring,
)
from .small import run_small, small_table
from .speed import BENCHES, DOT_SHAPES, MHA_SHAPES, table
from .tiling import tiling_rows, tiling_table, with_busy
from .timing import rss_now_mib

EXIT_CANNOT_WRITE = 1


def _load_average():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def add_arguments(parser):
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run: medium shapes only, 0.5 s per comparison, the long case "
        "at T=2048; no ring, memory or packed tables (--ring-length and --packed-batch "
        "bring theirs back)",
    )
    parser.add_argument(
        "--backends",
        type=backend_names,
        default="numpy,torch,jax,mxnet",
        help="comma-separated backends to measure (default: all installed)",
    )
    parser.add_argument(
        "--shapes",
        type=one_of(list(DOT_SHAPES), "shape"),
        default=None,
        help="comma-separated from small,medium,large (default: all; --quick: medium)",
    )
    parser.add_argument(
        "--seconds",
        type=positive_float,
        default=None,
        help="timing budget per comparison (default 3; --quick 0.5)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch intra-op threads (default: the number of cores)",
    )
    parser.add_argument(
        "--long-length",
        type=nonnegative_int,
        default=None,
        help=f"T of the long-sequence case (default {LONG['length']}; --quick 2048; 0 skips it)",
    )
    parser.add_argument(
        "--ring-length",
        type=nonnegative_int,
        default=None,
        help=f"T of the ring-attention case (default {RING['length']}; --quick 0; 0 skips it)",
    )
    parser.add_argument(
        "--ring-processes",
        type=positive_ints,
        default="1,2,4",
        help="comma-separated process counts of the ring case "
        "(default 1,2,4; T must be a multiple of 16 times each)",
    )
    parser.add_argument(
        "--ring-balance-length",
        type=nonnegative_int,
        default=None,
        help=f"T of the ring's balance case: causal, contiguous against zigzag, over "
        f"{BALANCE['processes']} processes (default {BALANCE['length']}; --quick 4096; "
        "0 skips it)",
    )
    parser.add_argument(
        "--packed-batch",
        type=nonnegative_int,
        default=None,
        help=f"batch of the packed-documents table (default {PACKED['batch']}; --quick 0; "
        "with --shapes 0; 0 skips it)",
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the peak-memory cases under autograd"
    )
    parser.add_argument(
        "--no-small", action="store_true", help="skip the small-calls table (d2l's sizes)"
    )
    parser.add_argument(
        "--no-integrations",
        action="store_true",
        help="skip the integrations table (a transformers Llama-style model against sdpa "
        "and eager, a flax MultiHeadAttention under jit(grad); where they are installed)",
    )
    parser.add_argument(
        "--no-busy",
        action="store_true",
        help="skip the busy-machine table (the large-batch and packed rows again, "
        "beside one CPU-bound process)",
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


def main(args):
    from attention_multi import backends

    wanted = args.backends
    available = backends.available_backends()
    shapes = args.shapes or (["medium"] if args.quick else list(DOT_SHAPES))
    ring_length = (
        args.ring_length if args.ring_length is not None else (0 if args.quick else RING["length"])
    )
    uneven = [n for n in args.ring_processes if ring_length % (16 * n)]
    if ring_length and uneven:  # the ring splits T into 16-position blocks per process
        print(
            f"attention-multi bench: error: --ring-length {ring_length} is not a multiple "
            f"of 16 times each of --ring-processes {','.join(map(str, args.ring_processes))} "
            f"(not of {', '.join(str(16 * n) for n in uneven)})",
            file=sys.stderr,
        )
        return 2
    seconds = args.seconds or (0.5 if args.quick else 3.0)
    length = (
        args.long_length
        if args.long_length is not None
        else (2048 if args.quick else LONG["length"])
    )
    if args.json:
        check_writable(args.json)  # now, not after minutes of timing
    info = machine()
    info["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
    info["load_average_start"] = _load_average()
    threads = args.threads or os.cpu_count()
    long_results = []
    if length:  # first: Linux carries the parent's RSS over into a child's
        # ru_maxrss, so spawn the children while this process is small
        print(f"  long case T={length} ...", file=sys.stderr, flush=True)
        launcher_rss = rss_now_mib()
        long_results = run_long([n for n in wanted if n in available], length, threads)
    ring_results = []
    if ring_length and "torch" in wanted and "torch" in available:
        sizes = args.ring_processes
        print(
            f"  ring attention T={ring_length}, processes {sizes} ...", file=sys.stderr, flush=True
        )
        ring_results = run_ring(ring_length, sizes, threads)
    balance_length = (
        args.ring_balance_length
        if args.ring_balance_length is not None
        else (4096 if args.quick else BALANCE["length"])
    )
    balance_results = []
    if balance_length and "torch" in wanted and "torch" in available:
        size = BALANCE["processes"]
        print(
            f"  ring balance T={balance_length}, {size} processes ...", file=sys.stderr, flush=True
        )
        balance_results = run_balance(balance_length, size, threads)
    memory_results = []
    if not (args.no_memory or args.quick):
        cases = [c for c in MEMORY if c.split("-")[0] in wanted and c.split("-")[0] in available]
        print(f"  memory under autograd: {', '.join(cases)} ...", file=sys.stderr, flush=True)
        memory_results = run_memory(cases)
    usable = []
    for name in wanted:
        if name not in available:
            print(f"skipping {name}: not installed", file=sys.stderr)
            continue
        try:
            get_backend(name)
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
            for kind, bench in BENCHES.get(name, ()):  # (a backend with no large-batch row)
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
    if blas_note(info):
        print(blas_note(info))
    print(
        "Float32, random valid_lens (1-D, uniform in [T/4, T]); forward inference in "
        "eval mode unless the row says train (forward+backward, dropout 0.1); medians "
        "of interleaved bursts of calls.\n"
    )
    print(table(rows))
    small_rows = []
    if not args.no_small:
        print("  small calls ...", file=sys.stderr, flush=True)
        small_rows = run_small(usable, seconds)
        print(
            "\nSmall calls, where d2l calls attention: ours against the seeds' code of the "
            "same framework (NumPy and JAX: seed 000 written in NumPy and in jax.numpy "
            "under jit), medians of per-pair ratios of interleaved calls; overhead = "
            "ours - theirs per call.\n"
        )
        print(small_table(small_rows))
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
    if balance_results:
        print(
            f"\nRing balance: causal, B={BALANCE['batch']}, {BALANCE['heads']} heads, head "
            f"size {BALANCE['head_size']}, T={balance_length}, float32, forward, over "
            f"{BALANCE['processes']} torch processes (gloo) with {threads}/P threads each; "
            f"per participant the scores it computed (its chunks of keys that a local "
            f"query sees), its kernel calls, the compute time of each step, the time it "
            f"waited on the exchanges, and its time.\n"
        )
        print(balance_table(balance_results))
    packed_batch = (
        args.packed_batch
        if args.packed_batch is not None
        else (0 if args.shapes or args.quick else PACKED["batch"])
    )
    packed_rows = []
    if packed_batch:
        print("  packed documents ...", file=sys.stderr, flush=True)
        packed_rows = run_packed(usable, seconds, {"batch": packed_batch})
        print(
            f"\nPacked and programmable: B={packed_batch}, T={PACKED['length']}, "
            f"{PACKED['heads']} heads, d={PACKED['head_size']}, documents of lengths uniform "
            f"in {list(PACKED['docs'])} filling each row, causal within documents "
            f"(segment_ids= + causal=True), float32.\n"
        )
        print(packed_table(packed_rows))
    flex_rows = []
    if packed_batch and "torch" in usable:
        print("  flex API ...", file=sys.stderr, flush=True)
        flex_rows = run_flex(seconds, block_batch=packed_batch)
        print(
            "\nThe flex API (attention_multi.flex, eager, its BlockMask of blocks 128) against "
            "torch's flex_attention compiled with its BlockMask, float32 forward, at one "
            "sequence and at the packed size; create_block_mask of the document mask "
            "(documents as above), H=None and one block mask per head.\n"
        )
        print(packed_table(flex_rows))
    large = [s for s in shapes if s != "small"]
    tiling_results = []
    if "torch" in usable and large:
        print("  what tiles of SDPA calls can reach ...", file=sys.stderr, flush=True)
        for shape_name in large:
            tiling_results += tiling_rows(DOT_SHAPES[shape_name], seconds)
    integration_rows = []
    if not (args.no_integrations or args.quick):
        print("  integrations: transformers, flax ...", file=sys.stderr, flush=True)
        integration_rows = run_integrations(seconds)
    busy_results = []
    if not args.no_busy and (large or packed_rows):
        print(
            "  busy machine: the large-batch and packed rows beside one CPU-bound process ...",
            file=sys.stderr,
            flush=True,
        )
        speed_busy = []
        with one_busy_process():
            for shape_name in large:
                for name in usable:
                    for kind, bench in BENCHES.get(name, ()):  # (a backend with no large-batch row)
                        shape = (DOT_SHAPES if kind == "dot" else MHA_SHAPES)[shape_name]
                        speed_busy.extend(bench(shape, seconds))
            packed_busy = (
                run_packed(usable, seconds, {"batch": packed_batch}) if packed_rows else []
            )
            tiling_busy = [
                r for n in large if tiling_results for r in tiling_rows(DOT_SHAPES[n], seconds)
            ]
            integrations_busy = run_integrations(seconds) if integration_rows else []
        tiling_results = with_busy(tiling_results, tiling_busy)
        integration_rows = integrations_with_busy(integration_rows, integrations_busy)
        busy_results = busy_rows(rows, speed_busy, packed_rows, packed_busy)
        print(
            "\nA busy machine: the ratios above again with one CPU-bound process beside "
            "this one (a busy loop the bench starts and stops); each row's ratio busy "
            "against idle.\n"
        )
        print(busy_table(busy_results))
    if tiling_results:
        print(
            "\nWhat tiles of SDPA calls can reach here: plain torch, SDPA over groups of the "
            "batch elements sorted by length (each over its longest element's keys) against "
            "one SDPA call with the padding mask; 'sorted': the elements already in that "
            "order (slices, no copies: the least any tiling takes), 'gathered': the batch's "
            "own order (rows copied out, outputs put back). No code of ours runs.\n"
        )
        print(tiling_table(tiling_results))
    if integration_rows:
        print(
            f"\nInside the models people run: a transformers Llama-style model (2 layers, "
            f"hidden {INTEGRATIONS['hidden']}, {INTEGRATIONS['heads']} heads, "
            f"{INTEGRATIONS['kv_heads']} kv heads), B={INTEGRATIONS['batch']}, right padding "
            f"(lengths uniform in [T/4, T]), float32, attn_implementation=register() against "
            f"sdpa and eager; the attention call alone with each one's mask; a flax nnx "
            f"MultiHeadAttention under jax.jit(jax.grad), padding mask, attention_fn= ours "
            f"against flax's default.\n"
        )
        print(integrations_table(integration_rows))
    info["load_average_end"] = _load_average()
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
                                    "timed_calls",
                                    "max_abs_diff",
                                    "parallel_regions",
                                ),
                                r,
                            )
                        )
                        for r in rows
                    ],
                    "small": small_rows,
                    "long": long_results,
                    "memory": memory_results,
                    "ring": ring_results,
                    "ring_balance": balance_results,
                    "packed": packed_rows,
                    "flex": flex_rows,
                    "busy": busy_results,
                    "tiling": tiling_results,
                    "integrations": integration_rows,
                },
                f,
                indent=1,
            )
    return 0
