"""``attention-multi conform --impl NAME``: grade an attention implementation
against the float64 oracle on a generated grid of cases.

``NAME`` is an adapter (``adapters.ADAPTERS``: the frameworks' own attention,
ours on each backend, and torch's and ours exported to ONNX Runtime) or
``module:function``, a user's function with the signature documented in
``attention_multi.testing.conformance``, handed the arrays of ``--framework``
(numpy, torch, jax, mxnet; by default the one its module imports) and graded
with its gradients where the framework has autodiff. The grid is that module's
``conformance_cases`` (``--quick``: about 70 cases). Expected differences are
data (``expected/<NAME>.txt``, see ``expected.py``).

Exit status: 0 every case agrees (expected differences and "not supported"
included); 1 some case differs or unexpectedly agrees; 2 bad arguments (an
unknown NAME, a package the adapter needs is missing, no case selected); 3
``--json``/``--markdown`` cannot be written (checked before anything runs).
Files: ``adapters.py``, ``expected.py``, ``run.py`` (the runner and tables).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from ...files import atomic_write, check_writable
from ...testing import frameworks
from ...testing.conformance import DTYPES, conformance_cases, select
from . import expected
from .adapters import ADAPTERS, UserFunction, load_function
from .run import as_json, counts, exit_status, markdown, run_grid

__all__ = ["ADAPTERS", "add_arguments", "main"]

EXIT_CANNOT_WRITE = 3


def add_arguments(parser):
    parser.add_argument(
        "--impl",
        required=True,
        metavar="NAME",
        help=f"one of {', '.join(ADAPTERS)}, or module:function (a function of yours: "
        "see docs/guide/conformance.md)",
    )
    parser.add_argument(
        "--framework",
        choices=frameworks.FRAMEWORKS,
        help="with --impl module:function: the arrays it takes (default: the framework "
        "its module imports, numpy when none); its gradients are graded too",
    )
    parser.add_argument("--quick", action="store_true", help="about 70 cases instead of 552")
    parser.add_argument(
        "--cases",
        metavar="PATTERN",
        action="append",
        help="only the case ids matching this fnmatch pattern (repeatable), "
        "e.g. 'window/*' or '*/float16'",
    )
    parser.add_argument(
        "--dtypes",
        default=",".join(DTYPES),
        help="comma-separated subset of %(default)s",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    parser.add_argument("--markdown", type=Path, metavar="FILE", help="write the table as Markdown")
    parser.epilog = (
        "exit status: 0 every case agrees (expected differences count as agreeing); 1 some "
        "case differs or unexpectedly agrees; 2 bad arguments or a missing package; "
        f"{EXIT_CANNOT_WRITE} --json/--markdown cannot be written"
    )
    return parser


def _fail(message):
    print(f"attention-multi conform: error: {message}", file=sys.stderr)
    return 2


def adapter_for(name, framework=None):
    """(adapter, None) or (None, error message)."""
    if name in ADAPTERS and framework is not None:
        return None, f"--framework {framework}: only with --impl module:function"
    if name in ADAPTERS:
        adapter = ADAPTERS[name]()
        why = adapter.missing()
        if why:
            return None, f"--impl {name}: {why}"
        return adapter, None
    if ":" not in name:
        return (
            None,
            f"--impl {name!r}: unknown; choose from {', '.join(ADAPTERS)} or module:function",
        )
    try:
        function = load_function(name)
        framework = framework or frameworks.detect(function)
        frameworks.get(framework)
    except ValueError as exc:
        return None, f"--impl {name}: {exc}" if not str(exc).startswith("--impl") else str(exc)
    except ImportError as exc:
        return None, f"--impl {name} --framework {framework}: {exc}"
    return UserFunction(name, function, framework), None


def main(args):
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        return _fail(f"--dtypes {args.dtypes!r}: expected a subset of {','.join(DTYPES)}")
    adapter, message = adapter_for(args.impl, args.framework)
    if adapter is None:
        return _fail(message)
    try:
        entries = expected.load(adapter.name) if args.impl in ADAPTERS else []
    except (ValueError, KeyError, OSError) as exc:
        return _fail(f"expected differences of {adapter.name}: {exc}")
    cases = conformance_cases(quick=args.quick, dtypes=dtypes)
    if args.quick and adapter.quick_patterns:
        cases = select(cases, list(adapter.quick_patterns))
    if args.cases:
        cases = select(cases, args.cases)
    if not cases:
        return _fail(f"--cases {' '.join(args.cases)}: no case matches")
    for path in (args.json, args.markdown):
        if path is not None:
            check_writable(path)  # now, not after the grid has run

    rows = run_grid(adapter, cases, entries)
    command = f"attention-multi conform --impl {args.impl}"
    if isinstance(adapter, UserFunction):
        command += f" --framework {adapter.framework}"
    command += " --quick" if args.quick else ""
    lines = markdown(adapter, rows, command)
    print("\n".join(lines))
    if args.markdown is not None:
        with atomic_write(args.markdown, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    if args.json is not None:
        data = as_json(adapter, rows, command)
        for c in data["cases"]:
            e = c["max_error"]
            c["max_error"] = e if e is None or math.isfinite(e) else str(e)
        with atomic_write(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    total = counts(rows)
    print(
        f"conform {adapter.name}: " + ", ".join(f"{n} {s}" for s, n in total.items() if n),
        file=sys.stderr,
    )
    return exit_status(rows)
