"""Running an adapter over the grid, and the outcome as a table and JSON."""

from __future__ import annotations

import importlib.metadata
import sys
import time
from collections import Counter

from ...testing.conformance import Case, Result
from . import expected as expected_differences
from .adapters import Adapter

# Final statuses, in the tables' order; the first two and "not supported" count as agreeing.
STATUSES = ("agrees", "expected difference", "differs", "unexpectedly agrees", "not supported")
FAILING = ("differs", "unexpectedly agrees")


def run_one(adapter: Adapter, case: Case) -> Result:
    """The raw result of one case: agrees, differs, not supported or error."""
    return adapter.result(case)


def run_grid(adapter, cases, entries, progress=True):
    """[(case, raw Result, final status, expected reason or None)]."""
    rows, start, last = [], time.perf_counter(), 0.0
    for n, case in enumerate(cases, 1):
        result = run_one(adapter, case)
        reason = expected_differences.reason_for(case.id, entries)
        if result.status == "not supported":
            status = "not supported"
        elif result.status == "agrees":
            status = "unexpectedly agrees" if reason else "agrees"
        else:
            status = "expected difference" if reason else "differs"
        rows.append((case, result, status, reason))
        now = time.perf_counter() - start
        if progress and (now - last > 2 or n == len(cases)):
            last = now
            print(
                f"conform {adapter.name}: {n}/{len(cases)} cases, {now:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    return rows


def counts(rows) -> dict[str, int]:
    found = Counter(status for _, _, status, _ in rows)
    return {s: found.get(s, 0) for s in STATUSES}


def exit_status(rows) -> int:
    return 1 if any(status in FAILING for _, _, status, _ in rows) else 0


def versions(adapter) -> list[str]:
    out = [f"Python {sys.version.split()[0]}"]
    for dist in dict.fromkeys(("numpy", *adapter.needs)):
        try:
            out.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _error(x):
    return "" if x is None else f"{x:.1e}"


def table(header, rows):
    from ..report.render import table as render

    return render(header, rows)


def family_table(rows):
    """Per family: how many cases in each status."""
    families = list(dict.fromkeys(case.family for case, _, _, _ in rows))
    lines = []
    for family in families:
        found = Counter(status for case, _, status, _ in rows if case.family == family)
        lines.append([family, *(found.get(s, 0) or "" for s in STATUSES)])
    return table(["family", *STATUSES], lines)


def markdown(adapter, rows, command):
    total = counts(rows)
    lines = [
        f"# attention-multi conform: {adapter.name}",
        "",
        f"`{command}`: {adapter.title}, graded against the float64 oracle "
        "(`attention_multi.reference`).",
        "",
        "- " + "; ".join(versions(adapter)),
        "- " + ", ".join(f"{n} {s}" for s, n in total.items()) + f" (of {len(rows)} cases)",
        "",
        *family_table(rows),
        "",
    ]
    differ = [r for r in rows if r[2] in ("differs", "expected difference", "unexpectedly agrees")]
    if differ:
        body = []
        for case, result, status, reason in differ:
            atol, rtol = case.tolerance(case.grad)
            body.append(
                [
                    case.id,
                    status,
                    _error(result.error) or "-",
                    f"{atol:g}+{rtol:g}\\|ref\\|",  # (escaped: a cell of a Markdown table)
                    (reason or result.detail).replace("|", "/"),
                ]
            )
        lines += [
            "## Differences",
            "",
            *table(["case", "status", "max error", "tolerance", "why"], body),
            "",
        ]
    named = [r for r in rows if r[0].reports]
    if named:
        lines += [
            "## Named regression cases",
            "",
            "The peers' public bugs as cases: does this implementation have them?",
            "",
            *table(
                ["case", "status", "max error", "upstream reports"],
                [
                    [case.id, status, _error(result.error) or "-", " ".join(case.reports)]
                    for case, result, status, _ in named
                ],
            ),
            "",
        ]
    unsupported = Counter(r[1].detail for r in rows if r[2] == "not supported")
    if unsupported:
        lines += ["## Not supported", ""]
        lines += [f"- {n} cases: {why}" for why, n in unsupported.most_common()]
        lines.append("")
    return lines


def as_json(adapter, rows, command):
    return {
        "command": command,
        "impl": adapter.name,
        "title": adapter.title,
        "versions": versions(adapter),
        "counts": counts(rows),
        "exit_status": exit_status(rows),
        # cases per family, and per keyword they pass (a form in any combination)
        "families": dict(Counter(case.family for case, _, _, _ in rows)),
        "forms": dict(Counter(n for case, _, _, _ in rows for n in case.forms())),
        "cases": [
            {
                "id": case.id,
                "family": case.family,
                "dtype": case.dtype,
                "grad": case.grad,
                "status": status,
                "raw": result.status,
                "max_error": result.error,
                "tolerance": list(case.tolerance(case.grad)),
                "detail": result.detail,
                "expected_reason": reason,
                **({"reports": list(case.reports)} if case.reports else {}),
            }
            for case, result, status, reason in rows
        ],
    }
