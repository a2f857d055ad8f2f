"""``attention-multi ARGS`` in the test's own process: the same parser, the
same exit codes and the same stdout and stderr as ``python -m
attention_multi``, without the 2-4 s a fresh interpreter spends importing the
frameworks. Tests that need a process of their own (a fault injected by
tests/faults.py, a kill or an interrupt, the entry point itself) use a
subprocess; this is for the rest."""

import contextlib
import io
import os
import subprocess


def run_in_process(*args, cwd=None):
    """A ``subprocess.CompletedProcess`` as ``subprocess.run(..., text=True)``
    would give it: ``returncode``, ``stdout``, ``stderr``. An exception the
    command does not handle propagates (a traceback is a failure either way)."""
    from attention_multi.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    before = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's --help and usage errors
                code = exc.code if isinstance(exc.code, int) else (exc.code is not None)
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(argv, int(code or 0), out.getvalue(), err.getvalue())
