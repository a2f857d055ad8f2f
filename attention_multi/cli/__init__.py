"""The ``attention-multi`` command: ``info``, ``report``, ``bench``, ``conform`` and ``port``.

The tools sit on top of the library and import it; the library never imports them.
"""

import argparse
import os
import sys
import textwrap

from attention_multi import backends

from ..config import BACKEND_ENV, get_backend
from ..files import WriteError
from . import bench, conform, port, report

EXIT_INTERRUPTED = 130  # the shell's 128 + SIGINT


def _info(args):
    """Print the installed backends and the devices each can use."""
    for name in backends.BACKEND_NAMES:
        if name not in backends.available_backends():
            print(f"{name:6s}  not installed ({backends.install_hint(name)})")
            continue
        try:
            B = get_backend(name)
        except ImportError as exc:
            print(f"{name:6s}  unusable: {exc}")
            continue
        devices = ["cpu"]
        try:
            backends.devices.native_device(B, "cuda")
            devices.append("cuda")
        except ValueError:
            pass
        print(f"{name:6s}  devices: {', '.join(devices)}")
    return _info_default()


def _info_default():
    """The default backend's line: ``ATTENTION_MULTI_BACKEND`` flagged (exit 1)
    when it names no backend, or one that does not load."""
    name = os.environ.get(BACKEND_ENV, "").strip()
    if not name:
        return 0
    try:
        chosen = backends.load(name)
    except (ValueError, ImportError) as exc:
        print(f"{BACKEND_ENV}={name!r}: {exc}")
        return 1
    print(f"default  {chosen.name} (from {BACKEND_ENV}={name!r})")
    return 0


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, without breaking a word (``key=value,...`` examples) across lines."""

    def _split_lines(self, text, width):
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)


COMMANDS = {
    "info": (None, "list installed backends and devices", None, _info),
    "report": (
        report,
        "check every mechanism on every backend against a float64 "
        "reference; write report.md and figures",
        "Run every mechanism (the seeds' examples included) on every installed backend "
        "and device, compare each result with an independent float64 reference, print "
        "the table and write report.md with the heatmaps to --out.",
        report.main,
    ),
    "bench": (
        bench,
        "time attention against each framework's own; peak memory",
        "Time the attention modules against each framework's own attention (forward, "
        "forward and backward), peak memory, long sequences, and ring attention over "
        "several processes.",
        bench.main,
    ),
    "conform": (
        conform,
        "grade an attention implementation (a framework's, ours, yours) against the oracle",
        "Run a generated grid of attention cases (every mask form, empty rows, NaN and "
        "inf in padding, four dtypes, gradients) through one implementation and grade "
        "each against the float64 oracle.",
        conform.main,
    ),
    "port": (
        port,
        "convert an MXNet Gluon .params file to PyTorch or NumPy",
        "Convert an MXNet Gluon .params file (block.save_parameters) to a PyTorch "
        "state_dict or a NumPy archive; MXNet is not needed.",
        port.main,
    ),
}


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="attention-multi",
        description="d2l attention mechanisms on NumPy, PyTorch, JAX and MXNet.",
        epilog="attention-multi COMMAND --help describes each command.",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for name, (module, help_text, description, _) in COMMANDS.items():
        command = sub.add_parser(
            name, help=help_text, description=description, formatter_class=HelpFormatter
        )
        if module is not None:
            module.add_arguments(command)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:  # no command: say what there is, rather than guess one
        parser.print_help(sys.stderr)
        return 2
    name = args.command
    module, _, _, run = COMMANDS[name]
    try:
        return run(args)
    except WriteError as exc:  # every command's files go through atomic_write
        print(f"attention-multi {name}: error: {exc}", file=sys.stderr)
        return module.EXIT_CANNOT_WRITE
    except KeyboardInterrupt:  # atomic_write has removed its partial file
        print(f"attention-multi {name}: interrupted; no partial file was left", file=sys.stderr)
        return EXIT_INTERRUPTED
