"""The report's section on the frameworks' own attention: the conform command's
adapters (torch SDPA and nn.MultiheadAttention, jax.nn.dot_product_attention,
MXNet's length softmax, d2l's code when the ``d2l`` package is installed) on
the seeds' cases and the quick grid's float32 cases, graded by the same oracle.

Informative: the report's exit status stays that of our own backends.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from ...testing.conformance import make_case
from ..conform.adapters import ADAPTERS
from ..conform.run import run_one

# adapter -> the --backends entry whose framework it needs
FRAMEWORKS = {
    "torch-sdpa": "torch",
    "torch-mha": "torch",
    "jax": "jax",
    "mxnet-softmax": "mxnet",
    "d2l": "torch",
}


def seed_cases(inputs):
    """The seeds' cases as conformance cases (one head), float32."""
    i = inputs["float32"]

    def heads(x):
        return x[:, None]

    return [
        make_case(
            "seed/DotProductAttention example (valid_lens [2, 6])",
            "seed",
            "float32",
            heads(i["dot_q"]),
            heads(i["seed_keys"]),
            heads(i["seed_values"]),
            valid_lens=i["seed_lens"],
        ),
        make_case(
            "seed/valid_lens (B, Q), an empty row",
            "seed",
            "float32",
            heads(i["q"]),
            heads(i["k"]),
            heads(i["v"]),
            valid_lens=i["lens2"],
        ),
    ]


def cases(inputs):
    from ...testing.conformance import conformance_cases

    grid = [c for c in conformance_cases(quick=True, dtypes=("float32",)) if not c.grad]
    return seed_cases(inputs) + grid


def run(backend_names, inputs):
    """(labels, {label: {case id: cell text}}, case ids, notes) for the frameworks
    whose backend is among ``backend_names``."""
    chosen, notes = [], []
    for name, needs in FRAMEWORKS.items():
        if needs not in backend_names:
            continue
        adapter = ADAPTERS[name]()
        why = adapter.missing()
        if why:
            notes.append(f"- {name} ({adapter.title}): not run, {why}")
        else:
            chosen.append(adapter)
    all_cases = cases(inputs)
    cells, titles, errors = {}, [], []
    for adapter in chosen:
        start = time.perf_counter()
        results = {c.id: run_one(adapter, c) for c in all_cases}
        cells[adapter.name] = {i: cell(r) for i, r in results.items()}
        errors += [
            f"- {adapter.name} raises on {i}: {last_line(r.detail.removeprefix('raises '))}"
            for i, r in results.items()
            if r.status == "error"
        ]
        print(
            f"report: {adapter.name}: {len(all_cases)} cases, {time.perf_counter() - start:.2f} s",
            file=sys.stderr,
            flush=True,
        )
        titles.append(f"- {adapter.name}: {adapter.title}")
    notes = titles + notes + errors
    return [a.name for a in chosen], cells, [c.id for c in all_cases], notes


def last_line(detail):
    """A traceback's last line (the error), else the detail as it is."""
    lines = [line.strip() for line in detail.strip().splitlines() if line.strip()]
    return lines[-1] if lines and detail.lstrip().startswith("Traceback") else detail


def verdict(labels, cells):
    """One line: each framework's count of agreeing, differing, not supported
    and raising cases."""
    if not labels:
        return "none was run."
    parts = []
    for label in labels:
        texts = list(cells[label].values())
        counts = {
            "agree": sum(t.endswith(" ok") for t in texts),
            "differ": sum(t.endswith("DIFFERS") for t in texts),
            "n/s": texts.count("n/s"),
            "raise": texts.count("raises"),
        }
        parts.append(f"{label} " + ", ".join(f"{n} {what}" for what, n in counts.items() if n))
    return "; ".join(parts) + f" (of {len(texts)} cases each)."


def cell(result):
    if result.status == "not supported":
        return "n/s"
    if result.status == "error":
        return "raises"
    err = "NaN" if result.error is not None and np.isnan(result.error) else f"{result.error:.1e}"
    return f"{err} {'ok' if result.status == 'agrees' else 'DIFFERS'}"


def markdown(labels, cells, ids, notes, table):
    lines = [
        "## The frameworks' own attention",
        "",
        "The `attention-multi conform` adapters on the seeds' cases and the quick grid's "
        "float32 forward cases, graded by the same oracle (float32 tolerance: atol 2e-5, "
        "rtol 1e-5). n/s: the API cannot express the case; raises: it raised an error. "
        "Informative: these rows do not change the exit status. "
        "`attention-multi conform --impl NAME` runs the whole grid.",
        "",
        *notes,
        "",
    ]
    if labels:
        rows = [[i, *(cells[label][i] for label in labels)] for i in ids]
        lines += [*table(["case", *labels], rows), ""]
    return lines
