"""``attention-multi report``: every mechanism on every backend and device,
checked against the independent float64 reference (``attention_multi.reference``).

Prints, and writes to ``DIR/report.md``: the environment, one table per dtype
(rows: mechanisms; columns: backend/device; cells: max abs error and ok/FAIL),
and the forward time of each backend. With the ``plot`` extra it also writes
PNG heatmaps and the Nadaraya-Watson fit. Exit code: 0 when every cell passes,
1 when any cell fails, 2 when no backend could run (or bad arguments), 3 when
``--out`` cannot be written: it is created when its parent directory exists,
and checked before anything runs. Every file is written whole or not at all
(``attention_multi.files.atomic_write``).

Self-test: ``--plant BACKEND`` adds 1e-2 to that backend's results before they
are compared, so its cells must FAIL and the exit code must be 1 (report.md
says that the run was planted). The tests use it to prove that a disagreement
is caught.

A section grades the frameworks' own attention (``frameworks.py``: torch SDPA
and nn.MultiheadAttention, jax.nn.dot_product_attention, MXNet's length
softmax, d2l's code when installed) for the chosen backends' frameworks;
it does not change the exit status.

Files: ``cases.py`` (what is checked), ``run.py`` (running it on a backend),
``render.py`` (Markdown and figures), ``frameworks.py`` (the frameworks' own).
"""

import sys
import time
from pathlib import Path

from attention_multi import backends

from ...files import WriteError, atomic_write, check_writable, make_directory
from ..arguments import backend_names, device_names
from . import frameworks
from .cases import DTYPES, MECHANISMS, make_inputs, references, rounded
from .render import figures, markdown, summary, table
from .run import backend_state, device_state, error_text, run_cells, time_forward

__all__ = ["MECHANISMS", "add_arguments", "main"]

DEFAULT_OUT = "attention-multi-report"
EXIT_CANNOT_WRITE = 3


def add_arguments(parser):
    parser.add_argument(
        "--backends",
        type=backend_names,
        default=",".join(backends.BACKEND_NAMES),  # a string, so that argparse checks it too
        help="comma-separated, default: all (%(default)s)",
    )
    parser.add_argument(
        "--devices",
        type=device_names,
        default=["cpu", "cuda"],
        help="comma-separated, default: cpu,cuda (absent ones are listed, not failed)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(DEFAULT_OUT),
        help="directory for report.md and the PNGs, created if its "
        "parent exists (default: ./%(default)s)",
    )
    parser.add_argument(
        "--plant",
        metavar="BACKEND",
        type=backends.canonical_name,
        help="self-test: add 1e-2 to BACKEND's results, so that its cells must FAIL",
    )
    parser.epilog = (
        "exit status: 0 every cell passes; 1 a cell fails; 2 no backend "
        f"could run, or bad arguments; {EXIT_CANNOT_WRITE} --out cannot be "
        "created or written"
    )
    return parser


def find_pairs(names, devices):
    """([(Backend, device)] that can run, Markdown notes on every backend)."""
    notes, pairs = [], []
    for name in names:
        B, note = backend_state(name)
        if B is None:
            notes.append(f"- {name}: {note}")
            continue
        found = []
        for device in devices:
            native, note = device_state(B, device)
            found.append(note or f"{device} ({native})")
            if native is not None:
                pairs.append((B, device))
        notes.append(f"- {name}: " + "; ".join(found))
    return pairs, notes


def main(args):
    if args.plant and args.plant not in args.backends:
        print(
            f"attention-multi report: --plant {args.plant} is not among --backends "
            f"{','.join(args.backends)}",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    make_directory(out)
    check_writable(out / "report.md")  # now, not after every backend has run
    inputs = {d: rounded(make_inputs(), d) for d in DTYPES}
    refs = references(inputs)
    pairs, notes = find_pairs(args.backends, args.devices)

    cells, timings = {}, {}
    for B, device in pairs:
        label = f"{B.name}/{device}"
        print(f"report: running {label} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        cells[label] = run_cells(B, device, inputs, refs, B.name == args.plant)
        try:
            timings[label] = f"{time_forward(B, device) * 1e3:.2f} ms"
        except Exception as exc:
            timings[label] = f"ERROR {error_text(exc)}"
        failed = sum(not ok for _, ok, _ in cells[label].values())
        print(
            f"report: {label}: {len(cells[label])} cells, {failed} failed, "
            f"{time.perf_counter() - start:.2f} s",
            file=sys.stderr,
            flush=True,
        )

    command = (
        f"attention-multi report --backends {','.join(args.backends)} "
        f"--devices {','.join(args.devices)}"
    )
    lines = markdown(command, notes, cells, timings, args.plant)
    theirs = frameworks.run(args.backends, inputs)
    lines += frameworks.markdown(*theirs, table)
    print("\n".join(lines))

    lines += ["## Figures", ""]
    if pairs:
        trainer = next((p for p in pairs if backends.supports(p[0], backends.Autodiff)), None)
        try:
            lines += figures(out, *pairs[0], inputs, trainer)
        except WriteError:  # --out itself fails: exit EXIT_CANNOT_WRITE
            raise
        except Exception as exc:  # figures are extras; parity decides the exit code
            lines += [f"Figures failed: {type(exc).__name__}: {exc}"]
        print(
            lines[-1]
            if lines[-1].startswith("Figures")
            else f"Figures: {', '.join(sorted(p.name for p in out.glob('*.png')))}"
        )
    with atomic_write(out / "report.md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"Wrote {out / 'report.md'}")
    failed, total, sentence = summary(cells)
    print(f"\nVerdict, ours: {sentence}")  # the last lines, where a reader looks
    print(
        "Verdict, the frameworks' own attention (informative, not in the exit status): "
        + frameworks.verdict(*theirs[:2])
    )
    return 1 if failed else 2 if not total else 0
