"""Run ``attention-multi`` with a fault injected into one writer; the tests of
``tests/test_cli_files.py`` run it in a subprocess::

    python tests/faults.py FAULT WRITER COMMAND [ARGS...]

WRITER is the writer to break, part-way through its file: ``npz`` (port
--to numpy: after the first array's first half), ``torch`` (port --to torch:
after half of the file), ``png`` (report: half of the first figure), ``json``
(bench --json: half of the file), ``fsync`` (any writer: its data is all in
the temporary file, which is not renamed yet).

FAULT: ``enospc`` raises ``OSError(ENOSPC)``, as a full disk does; ``hang``
prints ``FAULT: writing`` and sleeps, for the test to kill or interrupt it.
"""

import errno
import io
import os
import signal
import sys
import time

import numpy as np

MARKER = "FAULT: writing"


def fault(kind, f=None):
    """Part-way through a write into ``f`` (flushed, so that its bytes are on disk)."""
    if f is not None:
        f.flush()
    if kind == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    print(MARKER, flush=True)
    # Killed or interrupted long before. Short sleeps: SIGINT may be handled by
    # another thread (torch's, OpenMP's), and then only a sleep that ends lets
    # the main thread raise KeyboardInterrupt (one long one ran past the test's
    # 60 s under load).
    for _ in range(1200):
        time.sleep(0.1)
    raise SystemExit("faults.py: not killed")


def half_then_fault(kind, produce, binary=True):
    """A writer ``(obj, f)`` that writes half of what ``produce(obj, buffer)``
    writes, then faults."""

    def write(obj, f, *args, **kwargs):
        buffer = io.BytesIO() if binary else io.StringIO()
        produce(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        fault(kind, f)

    return write


def inject(kind, writer):
    if writer == "npz":
        write_array = np.lib.format.write_array
        np.lib.format.write_array = lambda f, a, *r, **k: half_then_fault(
            kind, lambda a, b: write_array(b, a, *r, **k)
        )(a, f)
    elif writer == "torch":
        import torch

        torch.save = half_then_fault(kind, torch.save)
    elif writer == "png":
        from matplotlib.figure import Figure

        savefig = Figure.savefig
        write = half_then_fault(kind, lambda fig, buffer, **k: savefig(fig, buffer, **k))
        Figure.savefig = lambda fig, f, **k: write(fig, f, **k)
    elif writer == "json":
        import json

        json.dump = half_then_fault(kind, json.dump, binary=False)
    elif writer == "fsync":
        fsync = os.fsync
        os.fsync = lambda fd: (fault(kind), fsync(fd))
    else:
        raise SystemExit(f"faults.py: unknown writer {writer!r}")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if inherited ignored
    os.environ.setdefault("MPLBACKEND", "Agg")
    kind, writer, *argv = sys.argv[1:]
    inject(kind, writer)
    from attention_multi.cli import main

    raise SystemExit(main(argv))
