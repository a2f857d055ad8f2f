"""Markdown tables from one ``attention-multi bench --json`` run, for the
performance guide, so that its figures are never edited by hand::

    attention-multi bench --json run.json
    python -m attention_multi.cli.bench.render run.json docs/guide/performance.md

Every section of the JSON that is a list of rows becomes one table, whatever
its rows hold: the columns are the rows' keys in the order they first appear
(a row given as a list takes its section's names from ``LIST_COLUMNS``), times
(keys ending in ``_s``) each in the unit that suits it, a ratio of ``ours_s`` to
``theirs_s`` added where a row has both and no ``ratio``. The run's date,
load average, machine and versions head the tables. With a page, the text
between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` is replaced
(the page is written whole or not at all); without one, the tables are printed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from ...files import atomic_write

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

# The bench's sections, in the order the guide shows them; any other list the
# JSON holds follows under its own name.
TITLES = {
    "rows": "Ours against the framework's own attention",
    "small": "Small calls, at d2l's sizes (against the seeds' code)",
    "packed": "Packed and programmable",
    "memory": "Peak memory under autograd",
    "long": "A long sequence",
    "ring": "Ring attention",
    "flex": "The flex API against torch's compiled flex_attention",
    "busy": "A busy machine: the same rows beside one CPU-bound process",
    "tiling": "What tiles of SDPA calls can reach here (plain torch, no code of ours)",
    "ring_balance": "Ring balance: contiguous against zigzag (causal), per participant",
}
# Rows the bench writes as lists instead of objects.
LIST_COLUMNS = {
    "packed": [
        "backend",
        "measured",
        "against",
        "ours_s",
        "theirs_s",
        "ratio",
        "scores_computed",
        "max_abs_diff",
        "parallel_regions",
    ],
}
LIST_COLUMNS["flex"] = LIST_COLUMNS["packed"]  # printed by the same packed_table
HIDDEN = {"key"}  # internal identifiers, repeated in readable columns
NAMES = {
    "ours_s": "ours",
    "theirs_s": "theirs",
    "max_abs_diff": "max abs diff",
    "peak_rss_mib": "peak RSS (MiB)",
    "rss_before_mib": "RSS before (MiB)",
    "scores_m": "scores computed (M)",
    "tiles_s": "tiles",
    "one_call_s": "one call",
}


def describe(machine: dict[str, Any], threads: Any) -> str:
    """The sentence that heads the tables: when, how loaded, on what."""
    loads = [  # load_average, or load_average_start, _end...: each the (1, 5, 15) minutes'
        f"{key.removeprefix('load_average').strip('_') or 'load'} "
        + ", ".join(f"{x:.2f}" for x in value)
        for key, value in machine.items()
        if key.startswith("load_average") and value
    ]
    versions = machine.get("versions") or {}
    return (
        f"Measured on {machine.get('date', 'an unrecorded date')}, "
        f"load average (1, 5, 15 min) {'; '.join(loads) if loads else 'not recorded'}; "
        f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores "
        f"({machine.get('platform', '?')}), torch threads {threads}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + (f"; NumPy BLAS {machine['numpy_blas']}" if machine.get("numpy_blas") else "")
        + "."
    )


def seconds(value: float) -> str:
    """A time in the unit that suits it: µs, ms or s."""
    for unit, scale in (("µs", 1e6), ("ms", 1e3)):
        if abs(value) * scale < 1000:
            return f"{number(value * scale)} {unit}"
    return f"{number(value)} s"


def number(x: float) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "NaN"
    if isinstance(x, int) or float(x).is_integer() and abs(x) >= 1:
        return f"{x:.0f}" if abs(x) >= 1 else str(x)
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def cell(key: str, value: Any) -> str:
    """One value as table text."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, (int, float)):
        if "ratio" in key.split("_") or "_over_" in key:
            return f"{value:.2f}x"
        if key.endswith("_s"):
            return seconds(value)
        if key.endswith("_mib"):
            return f"{value:.0f}"
        if key == "scores_computed" and value <= 1:
            return f"{value:.1%}"
        if key == "max_abs_diff" or key.endswith("_diff"):
            return f"{value:.1e}"
        return number(value)
    if isinstance(value, list):
        return ", ".join(cell(key, v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={cell(k, v)}" for k, v in value.items())
    return str(value).replace("|", "\\|").replace("\n", " ")


def participants(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ring balance's runs (a layout, its participants, their steps) as a
    row per participant: its scores, calls, compute per step, waits and time."""
    out = []
    for run in rows:
        for rank in run.get("ranks", []):
            steps = rank.get("steps", [])
            out.append(
                {
                    "layout": run.get("layout"),
                    "length": run.get("length"),
                    "processes": run.get("size"),
                    "participant": rank.get("rank"),
                    "scores_m": sum(s["scores"] for s in steps) / 1e6,
                    "calls": sum(s["calls"] for s in steps),
                    "compute_per_step_s": [s["compute_s"] for s in steps],
                    "exchange_waits_s": sum(s["exchange_s"] for s in steps),
                    "time_s": rank.get("seconds"),
                }
            )
    return out


def as_dicts(section: str, rows: list[Any]) -> list[dict[str, Any]]:
    if section == "ring_balance":
        rows = participants(rows)
    names = LIST_COLUMNS.get(section, [])
    out = []
    for row in rows:
        if isinstance(row, dict):
            out.append(dict(row))
        else:
            row = list(row)
            keys = names if len(names) == len(row) else [f"column {i + 1}" for i in range(len(row))]
            out.append(dict(zip(keys, row)))
    for i, row in enumerate(out):  # the ratio of the times, where the bench left it out
        ours, theirs = row.get("ours_s"), row.get("theirs_s")
        if "ratio" not in row and isinstance(ours, (int, float)) and theirs:
            keys = list(row)
            at = keys.index("theirs_s") + 1
            out[i] = dict([*row.items()][:at] + [("ratio", ours / theirs)] + [*row.items()][at:])
    return out


def table(section: str, rows: list[Any]) -> list[str]:
    """A section's rows as Markdown lines, every key of every row a column."""
    dicts = as_dicts(section, rows)
    columns: list[str] = []
    for row in dicts:
        columns += [k for k in row if k not in columns and k not in HIDDEN]

    def title(key: str) -> str:
        return NAMES.get(key, key.removesuffix("_s").replace("_", " "))

    lines = ["| " + " | ".join(title(k) for k in columns) + " |"]
    lines.append("|" + "".join("---|" for _ in columns))
    for row in dicts:
        cells = [cell(k, row.get(k)) for k in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render(run: dict[str, Any]) -> str:
    """The Markdown of a run: the heading sentence, then a table per section."""
    lines = [describe(run.get("machine", {}), run.get("torch_threads", "?")), ""]
    sections = [k for k in TITLES if run.get(k)]
    sections += [k for k, v in run.items() if k not in TITLES and isinstance(v, list) and v]
    for section in sections:
        lines += [f"### {TITLES.get(section, section)}", "", *table(section, run[section]), ""]
    if not sections:
        lines += ["(The run measured nothing.)", ""]
    return "\n".join(lines)


def replace_between_markers(page: str, text: str) -> str:
    if page.count(BEGIN) != 1 or page.count(END) != 1 or page.index(BEGIN) > page.index(END):
        raise ValueError(f"the page needs one {BEGIN} line and one {END} line after it")
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{text.rstrip()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2) or argv[0].startswith("-"):
        print(
            "usage: python -m attention_multi.cli.bench.render RUN.json [PAGE.md]",
            file=sys.stderr,
        )
        return 2
    try:
        run = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"render: cannot read {argv[0]}: {exc}", file=sys.stderr)
        return 1
    text = render(run)
    if len(argv) == 1:
        print(text)
        return 0
    page = Path(argv[1])
    try:
        new = replace_between_markers(page.read_text(encoding="utf-8"), text)
    except (OSError, ValueError) as exc:
        print(f"render: {page}: {exc}", file=sys.stderr)
        return 1
    with atomic_write(page, "w", encoding="utf-8") as f:
        f.write(new)
    print(f"render: wrote the tables of {argv[0]} into {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
